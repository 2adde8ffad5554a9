"""Building the kernel-floor C programs (`loopback_floor.c`, `tunnel_floor.c`, which share
`floor_net.h`) with the system's C compiler, into a temporary directory, at run time: they
measure this machine's kernel, so they are compiled on it rather than shipped."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def compiled(source: Path, *libs: str) -> Iterator[Path]:
    """The executable built from `source` (-O2 -pthread, then `libs`), removed afterwards;
    SystemExit naming the problem when there is no C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc/gcc) found: the floor benchmarks compile C")
    with tempfile.TemporaryDirectory(prefix=f"rmb-bench-{source.stem}-") as tmp:
        exe = Path(tmp) / source.stem
        subprocess.run(
            [compiler, "-O2", "-pthread", "-o", str(exe), str(source), *libs], check=True
        )
        yield exe
