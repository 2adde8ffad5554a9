"""What a `/monitor/connections` listing costs with many connections open: a relay process,
N idle RMB websocket connections (one twin, a session id each: every row has an identity), and
the listing asked REPEAT times per query, printed as the relay's own time (`took_ms`: select,
sort, page, rows) and the client's (request to parsed JSON).

    .venv/bin/python -m bench.monitoring              # 10,000 connections
    .venv/bin/python -m bench.monitoring --count 1000

Figures: docs/monitoring.md ("Costs").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import uvloop

from .scenarios import Relay, _open_idle, raise_fd_limit

QUERIES = (
    "sort=id&limit=100",
    "sort=msgs_in&limit=100",
    "sort=who&limit=100",
    "sort=idle&limit=100&dialect=rmb",
    "who=idle-77&limit=100",
    "limit=all",
)
REPEAT = 15


async def measure(relay: Relay, count: int, twins: Path) -> list[tuple[str, float, float, int]]:
    clients = await _open_idle(relay.url, count, twins, "rmb")
    rows = []
    try:
        base = relay.url.replace("ws://", "http://")
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            for query in QUERIES:
                took, wall = [], []
                size = 0
                for _ in range(REPEAT):
                    started = time.perf_counter()
                    answer = await http.get(f"/monitor/connections?{query}")
                    page = answer.json()
                    wall.append((time.perf_counter() - started) * 1000)
                    took.append(page["took_ms"])
                    size = len(answer.content)
                rows.append((query, statistics.median(took), statistics.median(wall), size))
    finally:
        for client in clients:
            client.transport.abort()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10_000, help="idle connections to open")
    args = parser.parse_args()
    raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="rmb-bench-") as tmp:
        twins = Path(tmp) / "twins.sqlite3"
        relay = Relay("rmb-relay", twins)
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                rows = runner.run(measure(relay, args.count, twins))
        finally:
            relay.stop()
    print(f"{args.count:,} idle RMB connections; medians of {REPEAT}")
    print(f"{'query':<36} {'relay ms':>9} {'client ms':>10} {'bytes':>10}")
    for query, took, wall, size in rows:
        print(f"{query:<36} {took:>9.1f} {wall:>10.1f} {size:>10,}")


if __name__ == "__main__":
    main()
