"""The training run of `make build`'s profile-guided build (PGO): the benchmarks' own load, short,
through real relays, with an instrumented Rust core on PYTHONPATH.

    PYTHONPATH=target/pgo/python RMB_BENCH_RESULTS=target/pgo/results \\
        .venv/bin/python -m bench.pgo_train

Why: at the rates that matter for latency (a request or a message per loop wakeup) the Rust
core runs with cold caches, and its cost there is set by the code's layout and branch order
more than by its instruction count. A profile of realistic load lets the compiler put the hot
paths together and the error paths aside. Measured on this 2-core host (interleaved A/B of the
same sources, plain and profile-guided): the tunnel's relay and connector each ~0.6-1 µs less
CPU per request at 13,000/s (~35.6 against ~36.3 µs), the RMB relay ~5-10% less per message
(`bench.scenarios rmb --quick`); docs/tunnel.md, "Profile-guided build".

The load covers every dialect's hot path in proportion to nothing in particular: the compiler
needs which branches are taken and which functions are hot, not exact ratios. Each step runs
the benchmark as a user would (`python -m bench.<name>`) with a timeout; its tables go to
$RMB_BENCH_RESULTS (bench/outdir.py), not into the tree. The Python generators, connectors and
targets load the instrumented core too, so the client side (rmb-load's and the connector's
codecs) is trained with the relay.

A step that fails stops the training with its output: a profile of half the load would quietly
make the untrained half slower.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import rmb_relay._core

STEPS: tuple[tuple[str, ...], ...] = (
    # RMB local routing and SBD forwarding: small and 1 KiB messages, 1 and 10 pairs
    ("scenarios", "rmb", "sbd", "--quick", "--cases", "1x64,10x1024"),
    # the tunnel with the JSON connector, then msgpack with an inline and a body-store body
    ("tunnel", "--seconds", "2", "--sizes", "1024", "--clients", "64",
     "--routes", "tunnel", "--target", "lean"),
    ("tunnel", "--msgpack", "--seconds", "2", "--sizes", "1024", "65536", "--clients", "64",
     "--routes", "tunnel", "--target", "lean"),
    # the 신경 gateway: metadata queries, broadcasts and queues (not the 1,000-client broadcast:
    # the same paths, a minute longer)
    ("singyeong", "--duration", "2", "--clients", "20",
     "--only", "send_eq,send_range,broadcast,queue"),
)  # fmt: skip
STEP_TIMEOUT = 300.0


def main() -> None:
    core = Path(rmb_relay._core.__file__ or "").resolve()
    staged = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    if not staged or not core.is_relative_to(Path(staged).resolve()):
        raise SystemExit(
            f"pgo_train: the core in use is {core}, not the instrumented one on PYTHONPATH "
            f"({staged or 'unset'}): run it through `make build`"
        )
    if not os.environ.get("RMB_BENCH_RESULTS"):
        raise SystemExit("pgo_train: set RMB_BENCH_RESULTS (the runs' tables stay out of the tree)")
    root = Path(__file__).resolve().parent.parent
    for name, *args in STEPS:
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", f"bench.{name}", *args],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT,
        )
        if done.returncode != 0:
            sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
            raise SystemExit(f"pgo_train: bench.{name} {' '.join(args)} failed ({done.returncode})")
        print(f"pgo_train: bench.{name} {' '.join(args)}: {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
