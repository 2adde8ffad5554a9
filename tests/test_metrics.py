"""telemetry/metrics.py: the registry's rules (names, shapes, bounded labels, shared families),
its exposition through prometheus_client, and docs/metrics.md against a relay built as
`rmb-relay serve` builds it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rmb_relay.commands import serve
from rmb_relay.telemetry.metrics import OTHER, Registry

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def parsed(registry: Registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(registry.render())
        for s in family.samples
    }


@pytest.mark.parametrize(
    ("kind", "name", "labels", "match"),
    [
        ("counter", "rmb_messages_total", (), "must be rmb_relay_"),
        ("counter", "rmb_relay_Messages_total", (), "must be rmb_relay_"),
        ("counter", "rmb_relay_messages", (), "end in _total"),
        ("gauge", "rmb_relay_depth_total", (), "end in _total"),
        ("counter", "rmb_relay_x_total", ("a-b",), "bad label name"),
        ("counter", "rmb_relay_x_total", ("__name",), "bad label name"),
        ("counter", "rmb_relay_x_total", ("a", "a"), "label named twice"),
    ],
)
def test_names_outside_the_scheme_are_refused(
    kind: str, name: str, labels: tuple[str, ...], match: str
) -> None:
    register = Registry().counter if kind == "counter" else Registry().gauge
    with pytest.raises(ValueError, match=match):
        register(name, "help", labels)


def test_a_name_registered_again_must_have_the_same_shape() -> None:
    registry = Registry()
    registry.counter("rmb_relay_x_total", "Xs", ("reason",), const={"dialect": "a"})
    registry.counter("rmb_relay_x_total", "Xs", ("dialect", "reason"))  # same shape: fine
    with pytest.raises(ValueError, match="different shapes"):
        registry.counter("rmb_relay_x_total", "Xs", ("reason",))
    with pytest.raises(ValueError, match="different shapes"):
        registry.counter("rmb_relay_x_total", "other help", ("dialect", "reason"))
    registry.gauge("rmb_relay_y", "Ys")
    with pytest.raises(ValueError, match="different shapes"):
        registry.gauge("rmb_relay_y", "Ys", ("dialect",))


def test_label_count_and_negative_increments_are_refused() -> None:
    registry = Registry()
    drops = registry.counter("rmb_relay_d_total", "D", ("reason",), const={"dialect": "a"})
    with pytest.raises(ValueError, match="takes 1 label values"):
        drops.inc(1, "a", "full")
    with pytest.raises(ValueError, match="takes 1 label values"):
        drops.inc()
    with pytest.raises(ValueError, match="only goes up"):
        drops.inc(-1, "full")


def test_families_fed_from_several_places_are_one_family_summed_by_labels() -> None:
    registry = Registry()
    hot = {"a": 3}
    mine = registry.counter("rmb_relay_dropped_total", "Dropped", ("dialect", "reason"))
    a = registry.counter("rmb_relay_dropped_total", "Dropped", ("reason",), const={"dialect": "a"})
    registry.counter_of(
        "rmb_relay_dropped_total",
        "Dropped",
        lambda: [(("full",), hot["a"])],
        ("reason",),
        const={"dialect": "a"},
    )
    mine.inc(1, "b", "closing")
    a.inc(2, "full")
    assert a.value("full") == 5  # counted here and read from the plain int
    assert registry.get("rmb_relay_dropped_total").value("b", "closing") == 1
    hot["a"] = 10
    assert parsed(registry) == {
        ("rmb_relay_dropped_total", (("dialect", "a"), ("reason", "full"))): 12.0,
        ("rmb_relay_dropped_total", (("dialect", "b"), ("reason", "closing"))): 1.0,
    }


def test_counters_without_free_labels_show_zero_before_the_first_event() -> None:
    registry = Registry()
    registry.counter("rmb_relay_logins_total", "Logins", const={"dialect": "a"})
    registry.counter("rmb_relay_plain_total", "Plain")
    registry.gauge("rmb_relay_level", "Level")
    registry.counter("rmb_relay_by_reason_total", "By reason", ("reason",))
    assert parsed(registry) == {
        ("rmb_relay_logins_total", (("dialect", "a"),)): 0.0,
        ("rmb_relay_plain_total", ()): 0.0,
        ("rmb_relay_level", ()): 0.0,
    }


def test_bounded_label_counts_values_outside_its_set_as_other() -> None:
    registry = Registry()
    requests = registry.counter(
        "rmb_relay_req_total", "Requests", ("method", "status"), allowed={"method": {"GET"}}
    )
    for method in ("GET", "get", "BREW", "X" * 1000):
        requests.inc(1, method, "200")
    assert requests.value("GET", "200") == 1
    assert requests.value(OTHER, "200") == 3
    assert requests.value("ANYTHING", "200") == 3  # looked up the way it is counted
    assert len(parsed(registry)) == 2
    with pytest.raises(ValueError, match="not one of its labels"):
        registry.counter("rmb_relay_z_total", "Z", ("status",), allowed={"method": {"GET"}})
    with pytest.raises(ValueError, match="bounded twice differently"):
        registry.counter(
            "rmb_relay_req_total", "Requests", ("method", "status"), allowed={"method": {"PUT"}}
        )


def test_gauges_set_inc_dec_and_read() -> None:
    registry = Registry()
    level = registry.gauge("rmb_relay_level", "Level", ("dialect",))
    level.set(5, "a")
    level.inc(2, "a")
    level.dec(4, "a")
    registry.gauge("rmb_relay_level", "Level", read=lambda: [((), 7)], const={"dialect": "b"})
    assert level.value("a") == 3
    assert level.value("b") == 7


def test_exposition_follows_the_accept_header() -> None:
    registry = Registry()
    registry.counter("rmb_relay_x_total", "X")
    body, content_type = registry.exposition(None)
    assert content_type.startswith("text/plain; version=0.0.4")
    assert b"rmb_relay_x_total 0.0" in body
    body, content_type = registry.exposition("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


# ---- docs/metrics.md against the relay -----------------------------------------------------


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (type, labels) from the first table of docs/metrics.md."""
    table = DOCS.read_text().split("## Renamed from")[0]
    rows = {}
    for line in table.splitlines():
        match = re.fullmatch(r"\| `(rmb_relay_\w+)` \| (\w+) \|\s*([\w, ]*?)\s*\| .+ \|", line)
        if match:
            name, kind, labels = match.groups()
            rows[name] = (kind, tuple(x.strip() for x in labels.split(",") if x.strip()))
    return rows


async def test_docs_table_matches_the_metrics_a_relay_registers(tmp_path: Path) -> None:
    args = serve.parser().parse_args(
        ["-l", "127.0.0.1:0", "--twins", f"sqlite:{tmp_path / 'twins.sqlite3'}"]
    )
    server, services = await serve.build_server(args)
    try:
        registry = server.registry
        registered = {
            name: (registry.get(name).kind, tuple(sorted(registry.get(name).labels)))
            for name in registry.names()
        }
        docs = {
            name: (kind, tuple(sorted(labels))) for name, (kind, labels) in documented().items()
        }
        assert registered == docs
        assert {d.name for d in server.dialects} >= {"rmb", "sbd"}
        # and the page a scrape gets parses, one HELP and TYPE per family
        families = list(text_string_to_metric_families(registry.render()))
        ours = {re.sub("_total$", "", n) for n in registered}
        upstream = {re.sub("_total$", "", n) for n in registry.upstream_names()}
        assert {f.name for f in families} == ours | upstream  # rmb-rs's: test_dropin_metrics
        assert all(f.documentation for f in families)
    finally:
        await services.close()
