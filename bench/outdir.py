"""Where the benchmarks write their JSON results: bench/results/, or the directory named by
$RMB_BENCH_RESULTS. `make build`'s profile-guided training runs the benchmarks' own load
(bench/pgo_train.py) and sends their results there, so that a build leaves nothing in the tree."""

from __future__ import annotations

import os
from pathlib import Path

RESULTS = Path(os.environ.get("RMB_BENCH_RESULTS") or Path(__file__).parent / "results")
