"""Benchmark reporting: every group pairs the Rust core with a pure-Python baseline measured in
the same run, or (`..._measured` / `..._baseline`) some work with the same work without a
change; at the end a table of ratios is printed and saved under bench/results/."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import pytest

from .outdir import RESULTS


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    bench_session: Any = getattr(session.config, "_benchmarksession", None)
    if bench_session is None or not bench_session.benchmarks:
        return
    groups: dict[str, dict[str, float]] = {}
    for bench in bench_session.benchmarks:
        if bench.stats is None:
            continue
        groups.setdefault(bench.group or bench.name, {})[_kind(bench.name)] = bench.stats.median
    rows = []
    for group, timings in sorted(groups.items()):
        if "baseline" in timings:
            continue
        rust, python = timings.get("rust"), timings.get("python")
        ratio = python / rust if rust and python else None
        rows.append({"group": group, "rust_s": rust, "python_s": python, "ratio": ratio})
    lines = [
        "",
        "| benchmark | Rust core (median) | Python baseline (median) | speed-up |",
        "|---|---|---|---|",
    ]
    for row in rows:
        rust_text = f"{row['rust_s'] * 1e9:,.0f} ns" if row["rust_s"] else "-"
        py_text = f"{row['python_s'] * 1e9:,.0f} ns" if row["python_s"] else "-"
        ratio_text = f"{row['ratio']:.1f}x" if row["ratio"] else "-"
        lines.append(f"| {row['group']} | {rust_text} | {py_text} | {ratio_text} |")
    # groups measured against a baseline of the same code without (or before) a change
    against = [
        {"group": group, "measured_s": timings.get("measured"), "baseline_s": timings["baseline"]}
        for group, timings in sorted(groups.items())
        if "baseline" in timings
    ]
    if against:
        lines += [
            "",
            "| benchmark | measured (median) | baseline (median) | measured / baseline |",
            "|---|---|---|---|",
        ]
    for row in against:
        measured, baseline = row["measured_s"], row["baseline_s"]
        row["ratio"] = measured / baseline if measured else None
        lines.append(
            f"| {row['group']} | {_ns(measured)} | {_ns(baseline)} | "
            + (f"{row['ratio']:.3f}" if row["ratio"] else "-")
            + " |"
        )
    table = "\n".join(lines)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    (RESULTS / f"micro-{stamp}.json").write_text(
        json.dumps({"commit": _commit(), "time": stamp, "rows": rows + against}, indent=2) + "\n"
    )


def _kind(name: str) -> str:
    """A benchmark's column: `..._baseline` is its group's baseline (the same work without a
    change, or before it; the group then gets a measured / baseline ratio), otherwise Rust
    core or pure-Python baseline by name."""
    if name.endswith("_baseline"):
        return "baseline"
    if name.endswith("_measured"):
        return "measured"
    return "rust" if "rust" in name else "python"


def _ns(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e9:,.0f} ns"
