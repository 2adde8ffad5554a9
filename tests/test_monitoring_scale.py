"""10,000 open connections page correctly: a relay process of its own (its descriptor limit
raised, as the test's), 10,000 idle TCP connections from the test, and the listing read by
cursor in pages of 100 and whole. Each connection is recognised by its address (`remote` is
the test socket's own port), so a row missed or listed twice shows."""

from __future__ import annotations

import resource
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from rmb_relay.monitoring.connections import MAX_PAGE
from tests.conftest import WAIT
from tests.relay_process import RelayProcess

CONNECTIONS = 10_000


def _raise_fd_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@pytest.fixture
def enough_descriptors() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < CONNECTIONS + 512:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is under {CONNECTIONS + 512}")
    _raise_fd_limit()
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_ten_thousand_connections_page_correctly(enough_descriptors: None) -> None:
    relay = RelayProcess(
        "--max-connections-per-ip",
        "1000000",
        "--http-idle-timeout",
        "3600",
        "--no-tunnel",
        preexec_fn=_raise_fd_limit,
    )
    sockets: list[socket.socket] = []
    try:
        for _ in range(CONNECTIONS):
            sockets.append(socket.create_connection(relay.address, timeout=WAIT))
        ports = {s.getsockname()[1] for s in sockets}
        base = f"http://{relay.address[0]}:{relay.port}"
        with httpx.Client(base_url=base, timeout=WAIT) as http:

            def listing(query: str) -> dict[str, object]:
                answer = http.get(f"/monitor/connections?{query}")
                assert answer.status_code == 200, answer.text
                return answer.json()  # type: ignore[no-any-return]

            # accepted by now? (connect returns once the kernel queued it; the relay accepts
            # as fast as it can: a bounded wait on the count it reports)
            deadline = time.monotonic() + 3 * WAIT
            while listing("limit=1")["total"] != CONNECTIONS + 1:  # (+ this client's)
                assert time.monotonic() < deadline, "the relay did not accept every connection"

            seen: list[int] = []
            took = []
            page = listing("sort=id&limit=100")
            while True:
                rows = page["connections"]
                assert isinstance(rows, list)
                assert len(rows) <= 100
                seen += [int(r["remote"].rsplit(":", 1)[1]) for r in rows]
                took.append(page["took_ms"])
                if page["next"] is None:
                    break
                page = listing(f"sort=id&limit=100&cursor={page['next']}")
            assert len(seen) == CONNECTIONS + 1
            assert len(set(seen)) == len(seen), "a connection was listed twice"
            assert ports <= set(seen), "a connection was missed"

            # `all` is as much as one answer may hold (MAX_PAGE rows): the rest is a page on
            everything = listing("limit=all&sort=idle")
            rows = everything["connections"]
            assert isinstance(rows, list)
            assert len(rows) == MAX_PAGE == CONNECTIONS
            rest = listing(f"limit=all&sort=idle&cursor={everything['next']}")["connections"]
            assert isinstance(rest, list)
            assert len(rest) == 1
            rows += rest
            assert {int(r["remote"].rsplit(":", 1)[1]) for r in rows} >= ports
            idle = [r["idle"] for r in rows]
            assert idle == sorted(idle, reverse=True)
            too_many = http.get(f"/monitor/connections?limit={MAX_PAGE + 1}")
            assert too_many.status_code == 400
            assert "limit: 1 to 10000 rows" in too_many.json()["error"]
            # (the figures are docs/monitoring.md's; printed for whoever runs it with -s)
            print(
                f"10,000 connections: page of 100 {sorted(took)[len(took) // 2]:.1f} ms "
                f"(median of {len(took)}), all {everything['took_ms']:.1f} ms"
            )
    finally:
        for s in sockets:
            s.close()
        relay.close()
