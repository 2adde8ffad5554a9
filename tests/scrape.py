"""Scraping a running relay's `GET /metrics` the way Prometheus does, for assertions on it.

The page is parsed with prometheus_client's own parsers, so a test that reads a number also
proves the page is valid exposition."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import http_exchange

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


@dataclass
class Page:
    status: int
    headers: dict[str, str]
    body: str
    #: family name (as prometheus_client names it: counters without `_total`) -> type
    types: dict[str, str]
    #: (sample name, sorted label pairs) -> value
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    def value(self, name: str, **labels: str) -> float:
        """The sample `name{labels}`; KeyError when the page does not have it."""
        return self.samples[(name, tuple(sorted(labels.items())))]

    def series(self, name: str) -> list[dict[str, str]]:
        """The label sets of every sample of `name`."""
        return [dict(labels) for sample, labels in self.samples if sample == name]


async def scrape(host: str, port: int, accept: str | None = None) -> Page:
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    if accept is not None:
        request += f"Accept: {accept}\r\n".encode()
    reply = await http_exchange(host, port, request + b"\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    text = body.decode()
    parse = openmetrics_families if accept == OPENMETRICS else text_string_to_metric_families
    types: dict[str, str] = {}
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    status = int(status_line.split(" ", 2)[1])
    # a refusal's body is not an exposition: the caller reads the status (no parse error
    # naming a word of it)
    for family in parse(text) if status == 200 else ():
        types[family.name] = family.type
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in samples, f"duplicate series {key}"
            samples[key] = sample.value
    return Page(status, headers, text, types, samples)
