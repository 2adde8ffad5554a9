"""The outbound federation path alone: CPU per envelope from `forward` to the remote's 202.

    .venv/bin/python -m bench.federation_outbound              # 100,000 envelopes of 1 KiB
    .venv/bin/python -m bench.federation_outbound --count 50000 --rounds 5

`bench.federation` measures the whole chain (generator, websocket in, slow path, outbound,
relay B, websocket out) on a host whose other work moves every figure; this one keeps only
the part `federation/` owns: an `OutboundFederation` (memory queue, real `Sender`) in this
process posting to a real relay B process (receivers offline: B stores in its mailbox), with
at most `--window` envelopes in flight. CPU per envelope is this process's own (the path plus
a small feeding loop) and relay B's, read from /proc; `--rounds` prints a median row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rmb_relay.federation.outbound import OutboundFederation
from rmb_relay.federation.queue import MemoryQueue
from rmb_relay.federation.ranker import Ranker
from rmb_relay.federation.sender import Sender
from rmb_relay.load.rmb import load_key
from rmb_relay.sdk import RmbClient
from rmb_relay.switch import Switch
from rmb_relay.twins import Twin
from rmb_relay.twins.cache import CachedTwinDirectory
from rmb_relay.twins.local import SqliteTwinDirectory

from .procstat import cpu_seconds, free_port

ROOT = Path(__file__).resolve().parent.parent
A, B = "127.0.0.2", "127.0.0.3"
SENDERS, RECEIVERS, PAIRS = 10_000, 20_000, 10


def provision(path: Path) -> None:
    directory = SqliteTwinDirectory(path)
    directory.add_many(
        [Twin(SENDERS + i, load_key(SENDERS + i).public_key, frozenset({A})) for i in range(PAIRS)]
        + [
            Twin(RECEIVERS + i, load_key(RECEIVERS + i).public_key, frozenset({B}))
            for i in range(PAIRS)
        ]
    )
    asyncio.run(directory.close())


def start_relay_b(twins: Path, port: int, mailbox_max: int) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "rmb_relay", "-l", f"{B}:{port}", "--twins", f"sqlite:{twins}"]
    command += ["-m", B, "--no-sbd", "--mailbox-max", str(mailbox_max)]
    relay_b = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert relay_b.stdout is not None
    relay_b.stdout.readline()
    return relay_b


async def one_round(
    twins: Path, port: int, relay_b: subprocess.Popen[str], args: argparse.Namespace
) -> dict[str, Any]:
    envelopes = [
        RmbClient(SENDERS + i, load_key(SENDERS + i)).request_envelope(
            RECEIVERS + i, "bench", b"x" * args.size, expiration=3600
        )[1]
        for i in range(PAIRS)
    ]
    directory = CachedTwinDirectory(SqliteTwinDirectory(twins))
    twin = await directory.get(RECEIVERS)
    assert twin is not None
    outbound = OutboundFederation(
        MemoryQueue(args.count + args.window),
        Sender(f"http://{{domain}}:{port}/"),
        Ranker(),
        directory,
        Switch(),
    )
    stats = outbound.stats
    # the counters have no event to wait on: polling them every 0.5-1 ms is the pacing
    try:
        # the first answer teaches the sender that B takes batches
        await outbound.forward(envelopes[0], twin)
        while stats.accepted < 1:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        cpu0, b0, wall0 = time.process_time(), cpu_seconds(relay_b.pid), time.perf_counter()
        sent = 0
        while sent < args.count:
            for _ in range(min(args.window - (sent + 1 - stats.accepted), args.count - sent)):
                await outbound.forward(envelopes[sent % PAIRS], twin)
                sent += 1
            await asyncio.sleep(0.0005)
        while stats.accepted < args.count + 1 and stats.failed_posts == 0:  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        b_cpu = cpu_seconds(relay_b.pid) - b0
        return {
            "envelopes_per_s": round(args.count / wall),
            "outbound_us_per_envelope": round(cpu / args.count * 1e6, 2),
            "relay_b_us_per_envelope": round(b_cpu / args.count * 1e6, 2),
            "batches": outbound.sender.batches,
            "failed_posts": stats.failed_posts,
        }
    finally:
        await outbound.close()
        await directory.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=1000, help="payload bytes per envelope")
    parser.add_argument("--window", type=int, default=2560, help="envelopes in flight at most")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    import uvloop

    rows = []
    with tempfile.TemporaryDirectory(prefix="rmb-fed-out-") as tmp:
        twins = Path(tmp) / "twins.sqlite3"
        provision(twins)
        for _ in range(args.rounds):
            port = free_port()
            relay_b = start_relay_b(twins, port, args.count + 10)
            try:
                rows.append(uvloop.run(one_round(twins, port, relay_b, args)))
            finally:
                relay_b.terminate()
                relay_b.wait(15)
            print(json.dumps(rows[-1]), flush=True)
    if len(rows) > 1:
        median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        print(json.dumps({"median_of": len(rows), **median}))


if __name__ == "__main__":
    main()
