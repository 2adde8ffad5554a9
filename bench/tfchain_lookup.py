"""Twin lookups against the devchain: cold (a `state_getStorage` round trip and the SCALE
decode), cached (the TTL cache in front), the failover time when a node dies or hangs, and
how long an `update_twin` takes to reach a relay's cache through its event.

    .venv/bin/python -m bench.tfchain_lookup            # ~30 s
    .venv/bin/python -m bench.tfchain_lookup --quick

Processes: `rmb-relay devchain` nodes on this machine (one twin file shared by all), the
client in this process on uvloop, as the relay runs it. Results are written to
bench/results/tfchain-<time>.json with the commit id.

Failover is measured from the moment the node is gone (SIGKILL returned / the hang began) to
the answer of the first lookup issued after it; with a killed node the client sees the
connection close and moves on at once, a node that hangs costs the per-attempt timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
from tests.peer_fixtures import mnemonic_for
from tests.tfchain_fixtures import bad_node, put_twin, start_devchain

from bench.outdir import RESULTS
from rmb_relay.identity import signing_key
from rmb_relay.twins.cache import CachedTwinDirectory
from rmb_relay.twins.chain import ChainCodec
from rmb_relay.twins.events import TwinEventListener
from rmb_relay.twins.substrate import SubstrateClient, SubstrateTwinDirectory

TWINS = 50


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_us": round(statistics.median(ordered) * 1e6, 1),
        "p99_us": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6, 1),
        "mean_us": round(statistics.fmean(ordered) * 1e6, 1),
    }


async def run(quick: bool) -> dict[str, Any]:
    rounds = 200 if quick else 2000
    with tempfile.TemporaryDirectory() as tmp:
        twins_file = Path(tmp) / "twins.sqlite3"
        nodes = [start_devchain(twins_file, block_time=0.5) for _ in range(3)]
        try:
            for twin in range(1, TWINS + 1):
                put_twin(nodes[0].url, twin, f"relay{twin}.example")
            codec = await ChainCodec.load_async()
            result: dict[str, Any] = {}

            # first lookup: connect + request (metadata already loaded)
            client = SubstrateClient([nodes[0].url])
            chain = SubstrateTwinDirectory(client, codec)
            started = time.perf_counter()
            await chain.get(1)
            result["first_lookup_with_connect_ms"] = round((time.perf_counter() - started) * 1e3, 2)

            cold = []
            for i in range(rounds):
                started = time.perf_counter()
                twin = await chain.get(1 + i % TWINS)
                cold.append(time.perf_counter() - started)
                assert twin is not None
            result["cold_lookup"] = percentiles(cold)

            cache = CachedTwinDirectory(chain, ttl=3600)
            for twin_id in range(1, TWINS + 1):
                await cache.get(twin_id)
            cached = []
            for i in range(rounds * 10):
                started = time.perf_counter()
                await cache.get(1 + i % TWINS)
                cached.append(time.perf_counter() - started)
            result["cached_lookup"] = percentiles(cached)

            # an update's way to the cache: submit, finalized, event read by the listener
            seen = asyncio.Event()

            async def on_block(_: int) -> None:
                if cache.peek(7)[1] is not None and "moved.example" in (
                    cache.peek(7)[1].relays or ()  # type: ignore[union-attr]
                ):
                    seen.set()

            listener = TwinEventListener(chain, cache, on_block=on_block)
            listener.start()
            started = time.perf_counter()
            await chain.update_twin(
                signing_key(mnemonic_for(7)), frozenset({"moved.example"}), None
            )
            finalized = time.perf_counter() - started
            await asyncio.wait_for(seen.wait(), 30)
            result["update_twin"] = {
                "submit_to_finalized_ms": round(finalized * 1e3, 2),
                "submit_to_cache_updated_ms": round((time.perf_counter() - started) * 1e3, 2),
                "devchain_block_time_s": 0.5,
            }
            await listener.close()
            await chain.close()

            # failover: node killed under an open connection
            client = SubstrateClient([nodes[1].url, nodes[2].url])
            chain = SubstrateTwinDirectory(client, codec)
            await chain.get(1)
            nodes[1].process.popen.send_signal(signal.SIGKILL)
            nodes[1].process.popen.wait()
            started = time.perf_counter()
            await chain.get(2)
            result["failover_killed_node_ms"] = round((time.perf_counter() - started) * 1e3, 2)
            assert client.current_url == nodes[2].url
            await chain.close()

            # failover: first node refuses connections
            client = SubstrateClient([nodes[1].url, nodes[2].url])
            chain = SubstrateTwinDirectory(client, codec)
            started = time.perf_counter()
            await chain.get(3)
            result["failover_down_node_first_ms"] = round((time.perf_counter() - started) * 1e3, 2)
            await chain.close()

            # failover: a node that accepts and never answers costs the per-attempt timeout
            async with bad_node("hang") as hang_url:
                for timeout in (1.0, 12.0) if not quick else (1.0,):
                    client = SubstrateClient([hang_url, nodes[2].url], timeout=timeout)
                    chain = SubstrateTwinDirectory(client, codec)
                    started = time.perf_counter()
                    await chain.get(4)
                    result[f"failover_hanging_node_timeout_{timeout:g}s_ms"] = round(
                        (time.perf_counter() - started) * 1e3, 2
                    )
                    await chain.close()
            return result
        finally:
            for node in nodes:
                node.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        result = runner.run(run(args.quick))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    record = {
        "commit": commit,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **result,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"tfchain-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
