"""Run a module under cProfile timed by the process's CPU clock, not the wall clock.

`python -m cProfile` charges a function with wall time: on a busy host a process preempted in
the middle of a `send()` shows that call as its largest item though it used little CPU there.
Timing with `time.process_time` counts only what the process itself spent, which is what an
optimisation can reduce. The profile is written on SIGTERM (how bench/tunnel.py stops its
parties) as well as at a normal exit.

    python -m bench.cpuprofile OUT.prof -m MODULE [ARGS...]
"""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys
import time
from types import FrameType


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit(__doc__)
    out, module = sys.argv[1], sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    profiler = cProfile.Profile(time.process_time)

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    profiler.enable()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        profiler.disable()
        profiler.dump_stats(out)


if __name__ == "__main__":
    main()
