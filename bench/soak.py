"""Soak: the relay at 80% of its measured saturation for a long run with mixed dialects, Redis
stalled once and restarted once, reporting lost and duplicated messages and the relay's RSS
over time (JSON in bench/results/, and an SVG plot beside it). Issue 9, "a soak scenario".

    .venv/bin/python -m bench.soak                     # 10 minutes
    .venv/bin/python -m bench.soak --duration 60       # a short pass

What runs at once, against one relay process with `--redis` (and SBD without rate limits):
- `rmb-load rmb` (live RMB traffic between online twins) and `rmb-load sbd` (SBD forwards),
  each at 40% of the rate the relay reached in a short saturation run of that dialect alone
  (80% of saturation together);
- a mailbox stream: one twin sends numbered requests to an offline twin all along; at the end
  the offline twin logs in and every request the relay accepted (no error reply) must arrive,
  once. Accepted means stored in Redis: "lost" counts accepted requests that never arrive.
At 1/3 of the run Redis is stopped (SIGSTOP) for 8 s; at 2/3 it is restarted (SIGTERM, then
started again on the same port and data directory, append-only file on).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.redis_process import start_redis
from tests.rmb_fixtures import key_for

from rmb_relay.errors import ClientError
from rmb_relay.sdk import IncomingRequest, RmbClient
from rmb_relay.twins import Twin
from rmb_relay.twins.local import SqliteTwinDirectory

from .hardening import RelayProcess
from .outdir import RESULTS
from .scenarios import ROOT, commit, raise_fd_limit

MIB = 1 << 20
#: mailbox stream: requests per second to the offline twin
MAILBOX_RATE = 50
STALL_SECONDS = 8.0


class Redis:
    """The soak's redis-server, stalled (SIGSTOP) and restarted on the same port and directory
    mid-run; append-only, so the restart keeps what it acknowledged."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.server = start_redis(str(directory))
        self.port = self.server.port

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.server.process

    def start(self) -> None:
        self.server = start_redis(str(self.directory), self.port)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
        self.server.stop()


def load_cmd(
    dialect: str, url: str, rate: float, duration: float, out: Path, *extra: str
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rmb_relay.load.cli",
        dialect,
        "--url",
        url,
        "--pairs",
        "10",
        "--rate",
        str(rate),
        "--duration",
        str(duration),
        "--json",
        str(out),
        "--quiet",
        *extra,
    ]


def saturation(dialect: str, url: str, twins: Path, tmp: Path) -> float:
    out = tmp / f"sat-{dialect}.json"
    extra = ["--twins", f"sqlite:{twins}"] if dialect == "rmb" else []
    subprocess.run(load_cmd(dialect, url, 0, 5, out, *extra), check=True, cwd=ROOT)
    return float(json.loads(out.read_text())["throughput_msgs_per_s"])


#: the load runs in segments this long: rmb-load's sending links hear nothing back and trip the
#: client's 40 s silence keepalive in longer runs (also on b6942ff; a load-harness issue)
SEGMENT = 30.0


async def load_segments(
    dialect: str, url: str, rate: float, until: float, tmp: Path, twins: Path
) -> dict[str, int]:
    """Run `rmb-load` back to back until `until`; the counts summed over the segments."""
    total = {"segments": 0, "sent": 0, "delivered": 0, "lost": 0, "duplicated": 0}
    extra = ["--twins", f"sqlite:{twins}"] if dialect == "rmb" else []
    while (left := until - time.monotonic()) > 2:
        out = tmp / f"{dialect}-{total['segments']}.json"
        cmd = load_cmd(dialect, url, rate, min(SEGMENT, left), out, "--warmup", "0", *extra)
        process = await asyncio.create_subprocess_exec(
            *cmd, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL
        )
        await process.wait()
        result = json.loads(out.read_text())
        total["segments"] += 1
        for key in ("sent", "delivered", "lost", "duplicated"):
            total[key] += int(result[key])
    return total


async def mailbox_stream(url: str, until: float) -> dict[str, Any]:
    """Numbered requests to offline twin 3 until `until`; then twin 3 collects its mail."""
    sender = await RmbClient.connect(url, 1, key_for(1), reconnect=True)
    futures: dict[int, asyncio.Future[Any]] = {}
    number = 0
    while time.monotonic() < until:
        try:
            futures[number] = sender.send_request(3, "m", str(number).encode(), expiration=3600)
        except ClientError:  # between a lost link and its reconnect: refused, as it should be
            futures[number] = asyncio.get_running_loop().create_future()
            futures[number].set_result(None)
        number += 1
        await asyncio.sleep(1 / MAILBOX_RATE)
    await asyncio.sleep(10)  # errors from a stall arrive within its timeouts
    refused = {n for n, f in futures.items() if f.done() and not f.cancelled()}
    accepted = set(futures) - refused
    seen: list[int] = []
    done = asyncio.Event()

    def record(request: IncomingRequest) -> bytes:
        seen.append(int(request.data))
        if accepted <= set(seen):
            done.set()
        return b"ok"

    receiver = RmbClient(3, key_for(3))
    receiver.handle("m", record)
    await receiver.open(url)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), 120)
    for future in futures.values():
        future.cancel()
    await receiver.close()
    await sender.close()
    delivered = set(seen)
    return {
        "sent": number,
        "refused": len(refused),
        "accepted": len(accepted),
        "delivered": len(delivered & accepted),
        "lost": len(accepted - delivered),
        "duplicated": len(seen) - len(delivered),
        "delivered_although_refused": len(delivered & refused),
    }


async def soak(duration: float, tmp: Path) -> dict[str, Any]:
    twins = tmp / "twins.sqlite3"
    with SqliteTwinDirectory(twins) as directory:
        for twin_id in (1, 3):
            directory.add(Twin(twin_id, key_for(twin_id).public_key, frozenset({"r"}), None))
    (tmp / "redis").mkdir()
    redis = Redis(tmp / "redis")
    relay = RelayProcess(
        tmp,
        None,
        "--redis",
        f"redis://127.0.0.1:{redis.port}/0",
        "--sbd-disable-rate-limit",
        # the mailbox stream puts ~30,000 in one stream, above rmb-rs's cap of 10,000 that
        # drops the oldest by design (counted): the cap is lifted so every loss would show
        "--mailbox-max",
        "1000000",
    )
    events: list[tuple[float, str]] = []
    rss: list[tuple[float, float]] = []
    try:
        # the two dialects share the relay: together they make 80% of saturation
        rates = {d: 0.4 * saturation(d, relay.url, twins, tmp) for d in ("rmb", "sbd")}
        started = time.monotonic()
        until = started + duration
        loads = {
            d: asyncio.get_running_loop().create_task(
                load_segments(d, relay.url, rates[d], until, tmp, twins)
            )
            for d in rates
        }
        stream = asyncio.get_running_loop().create_task(mailbox_stream(relay.url, until))
        stalled = restarted = False
        while time.monotonic() < until + 1:
            now = time.monotonic() - started
            rss.append((round(now, 1), round(relay.rss() / MIB, 1)))
            if not stalled and now >= duration / 3:
                stalled = True
                assert redis.process is not None
                redis.process.send_signal(signal.SIGSTOP)
                events.append((round(now, 1), "redis stalled"))
                await asyncio.sleep(STALL_SECONDS)
                redis.process.send_signal(signal.SIGCONT)
                events.append((round(time.monotonic() - started, 1), "redis resumed"))
                continue
            if not restarted and now >= 2 * duration / 3:
                restarted = True
                redis.stop()
                events.append((round(now, 1), "redis stopped"))
                redis.start()
                events.append((round(time.monotonic() - started, 1), "redis restarted"))
            await asyncio.sleep(1)
        results = {d: await task for d, task in loads.items()}
        mailbox = await stream
        return {
            "commit": commit(),
            "duration_s": duration,
            "rates_msgs_per_s": {d: round(r) for d, r in rates.items()},
            "rmb": results["rmb"],
            "sbd": results["sbd"],
            "mailbox": mailbox,
            "events": events,
            "rss_mib": rss,
            "rss_max_mib": max(v for _, v in rss),
        }
    finally:
        relay.stop()
        redis.stop()


def svg(result: dict[str, Any]) -> str:
    """RSS over time as a small standalone SVG (no plotting library needed)."""
    points = result["rss_mib"]
    width, height, pad = 640, 240, 40
    t_max = max(t for t, _ in points) or 1
    r_max = max(result["rss_max_mib"], 1) * 1.2
    x = lambda t: pad + (width - 2 * pad) * t / t_max  # noqa: E731
    y = lambda r: height - pad - (height - 2 * pad) * r / r_max  # noqa: E731
    line = " ".join(f"{x(t):.1f},{y(r):.1f}" for t, r in points)
    marks = "".join(
        f'<line x1="{x(t):.1f}" y1="{pad}" x2="{x(t):.1f}" y2="{height - pad}" stroke="#c33" '
        f'stroke-dasharray="3"/><text x="{x(t) + 2:.1f}" y="{pad + 12 + 12 * (i % 4)}" '
        f'font-size="10" fill="#c33">{name}</text>'
        for i, (t, name) in enumerate(result["events"])
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
        f'<rect width="100%" height="100%" fill="white"/>'
        f'<text x="{pad}" y="20" font-size="12">relay RSS (MiB) over {t_max:.0f} s, soak at '
        f"{result['commit']}</text>"
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
        f'stroke="black"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>'
        f'<text x="4" y="{y(r_max / 1.2):.1f}" font-size="10">{r_max / 1.2:.0f}</text>'
        f'<text x="4" y="{height - pad}" font-size="10">0</text>'
        f'<text x="{width - pad - 20}" y="{height - pad + 14}" font-size="10">{t_max:.0f} s</text>'
        f'{marks}<polyline fill="none" stroke="#36c" stroke-width="1.5" points="{line}"/></svg>'
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    args = parser.parse_args()
    raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="rmb-soak-") as tmp:
        result = asyncio.run(soak(args.duration, Path(tmp)))
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"soak-{stamp}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / f"soak-{stamp}.svg").write_text(svg(result))
    shown = {k: v for k, v in result.items() if k != "rss_mib"}
    print(json.dumps(shown, indent=1))


if __name__ == "__main__":
    main()
