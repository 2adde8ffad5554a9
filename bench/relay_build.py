"""Which build of the relay a benchmark starts: this checkout's, or the one whose `python/`
directory (with its `_core` built beside it) `RMB_BENCH_RELAY_PYTHONPATH` names.

The second lets one sitting measure two builds of the relay with the same generator and the
same baselines, so that a before/after comparison measures the relay and not the harness
(a newer harness is faster than an older one). bench/README.md, "Reproducing", shows a run.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

from tests.processes import relay_env as _relay_env

ROOT = Path(__file__).resolve().parent.parent


def relay_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a relay's process (or a tunnel connector's): `base` (the process's
    own environment by default), with the other build's `python/` first on the path if one is
    named."""
    return _relay_env(base, variable="RMB_BENCH_RELAY_PYTHONPATH")


def relay_process(argv: list[str]) -> subprocess.Popen[str]:
    """A relay (or a baseline) started from this checkout in `relay_env`, its stdout piped
    (where it prints its banner when it listens), its stderr dropped."""
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        env=relay_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
