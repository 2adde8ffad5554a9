"""`rmb-analytics run`: read route records (and rmb-load samples), run every job, write tables.

Output layout (`--output OUT`):

    OUT/<table>/part-*.parquet    one directory per job (jobs.py), Spark's Parquet
    OUT/priors.json               {remote domain: failure rate} for `rmb-relay --ranker-priors`
    OUT/summary.json              what was read, the range, each job's rows and seconds

The input is checked file by file before Spark starts (inputs.py), so bad input is one line.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rmb_relay.analytics.inputs import (
    InputError,
    Inputs,
    check_records,
    check_samples,
    overlaps,
)
from rmb_relay.analytics.jobs import RECORD_JOBS, SAMPLE_JOBS, Job
from rmb_relay.clock import Clock, monotonic_clock
from rmb_relay.telemetry.record_schema import SCHEMA, Layout

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: tables small enough to be written as one file (the others keep Spark's partitioning)
SINGLE_FILE = frozenset(
    {"top_talkers", "latency", "latency_cdf", "federation_priors", "mailbox", "abuse_candidates"}
)


@dataclass(slots=True)
class Plan:
    """What one run reads and writes."""

    records: Path | None
    output: Path
    samples: Path | None = None
    since: datetime | None = None
    until: datetime | None = None
    window: int = 60
    #: table names to make (None: all)
    jobs: frozenset[str] | None = None

    def selected(self, jobs: tuple[Job, ...]) -> list[Job]:
        return [job for job in jobs if self.jobs is None or job.name in self.jobs]


@dataclass(slots=True)
class Progress:
    """One line per step on stderr, with its duration: what moves between Spark's stage bars."""

    out: IO[str] = sys.stderr
    clock: Clock = monotonic_clock
    steps: int = 0
    done: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def step(self, name: str, detail: str, work: Callable[[], int]) -> int:
        self.done += 1
        print(f"[{self.done}/{self.steps}] {name}: {detail} ...", file=self.out, flush=True)
        start = self.clock()
        rows = work()
        seconds = (self.clock() - start) / 1e9
        self.timings[name] = round(seconds, 3)
        print(f"[{self.done}/{self.steps}] {name}: {rows} rows in {seconds:.1f} s", file=self.out)
        return rows


def _cut(frame: DataFrame, plan: Plan) -> DataFrame:
    """Keep [since, until); the hour partitions outside it are not even listed by Spark."""
    from pyspark.sql import functions as F

    if plan.since is not None:
        start = plan.since.replace(minute=0, second=0, microsecond=0)
        frame = frame.where(F.col("date") >= F.lit(start.date()))
        frame = frame.where(F.col("time") >= F.lit(plan.since))
    if plan.until is not None:
        last = plan.until - timedelta(microseconds=1)
        frame = frame.where(F.col("date") <= F.lit(last.date()))
        frame = frame.where(F.col("time") < F.lit(plan.until))
    return frame


def read_records(
    spark: SparkSession, root: Path, plan: Plan, found: Inputs | None = None
) -> DataFrame:
    """The route records under `root` as one DataFrame of the record schema (`SCHEMA`, plus
    the `date`/`hour` partition columns), cut to the plan's range: the one loader every job
    reads through. Files are read in groups of equal layout (`found`: the checked inputs; read
    from the footers when not given), each group's constant columns put back as literals and
    integer addresses cast to text, so version-1 and version-2 files read alike."""
    import functools

    from pyspark.sql import DataFrame

    found = found if found is not None else check_records(root)
    groups: dict[Layout, list[str]] = {}
    for path, layout in zip(found.files, found.layouts, strict=True):
        groups.setdefault(layout, []).append(str(path))
    frames = []
    for layout, paths in groups.items():
        reader = spark.read.option("basePath", str(root)) if root.is_dir() else spark.read
        frames.append(_as_schema(reader.parquet(*paths), layout))
    frame = functools.reduce(DataFrame.unionByName, frames)
    if "date" not in frame.columns:  # a single file or a flat folder: no partitions to prune
        from pyspark.sql import functions as F

        frame = frame.withColumn("date", F.to_date("time"))
    return _cut(frame, plan)


def _as_schema(frame: DataFrame, layout: Layout) -> DataFrame:
    """One group's columns as `SCHEMA` (and the partition columns Spark found)."""
    from pyspark.sql import functions as F

    constants = dict(layout.constants)
    columns = []
    for column in SCHEMA:
        name = column.name
        if name in constants:
            kind = _SPARK_TYPE[str(column.type)]
            columns.append(F.lit(constants[name]).cast(kind).alias(name))
        elif name in layout.integer:
            columns.append(F.col(name).cast("string").alias(name))
        else:
            columns.append(F.col(name))
    partitions = [name for name in frame.columns if name not in SCHEMA.names]
    return frame.select(*columns, *partitions)


#: Spark's names of the record schema's types that a constant column may have
_SPARK_TYPE = {"string": "string", "int64": "bigint", "double": "double"}


@dataclass(frozen=True, slots=True)
class Checked:
    """The plan's inputs, checked (before Spark starts)."""

    records: Inputs | None
    samples: Inputs | None


def check(plan: Plan) -> Checked:
    """Everything about the input that can be told without Spark; raises InputError."""
    if plan.records is None and plan.samples is None:
        raise InputError("nothing to read: give --input (route records) and/or --samples")
    if plan.since is not None and plan.until is not None and plan.since >= plan.until:
        raise InputError("--since must be before --until")
    if plan.jobs is not None:
        known = {job.name for job in RECORD_JOBS + SAMPLE_JOBS}
        unknown = sorted(plan.jobs - known)
        if unknown:
            raise InputError(
                f"--jobs: no such table {', '.join(unknown)} ({', '.join(sorted(known))})"
            )
    records = samples = None
    if plan.records is not None:
        records = check_records(plan.records)
        if not overlaps(records, plan.since, plan.until):
            raise InputError(f"{plan.records}: no route records between {_span(plan)}")
    if plan.samples is not None:
        samples = check_samples(plan.samples)
    return Checked(records, samples)


def _span(plan: Plan) -> str:
    since = plan.since.isoformat() if plan.since else "the start"
    until = plan.until.isoformat() if plan.until else "the end"
    return f"{since} and {until}"


def run(
    spark: SparkSession, plan: Plan, checked: Checked, progress: Progress | None = None
) -> dict[str, Any]:
    """Run the jobs the plan's inputs allow; returns the summary written to summary.json.
    Raises InputError for input the user must fix."""
    progress = progress or Progress()
    work: list[tuple[Job, DataFrame]] = []
    record_jobs, sample_jobs = plan.selected(RECORD_JOBS), plan.selected(SAMPLE_JOBS)
    progress.steps = (1 + len(record_jobs) if checked.records is not None else 0) + (
        len(sample_jobs) if checked.samples is not None else 0
    )
    summary: dict[str, Any] = {
        "since": plan.since.isoformat() if plan.since else None,
        "until": plan.until.isoformat() if plan.until else None,
        "window_seconds": plan.window,
        "tables": {},
    }
    if plan.records is not None and checked.records is not None:
        found = checked.records
        summary["record_files"] = len(found.files)
        summary["record_rows_in_files"] = found.rows
        records = read_records(spark, plan.records, plan, found).drop("date", "hour").cache()
        selected = progress.step(
            "records", f"{len(found.files)} files, {found.rows} rows", records.count
        )
        if selected == 0:
            raise InputError(f"{plan.records}: no route records between {_span(plan)}")
        summary["records"] = selected
        work += [(job, records) for job in record_jobs]
    if checked.samples is not None:
        samples = spark.read.parquet(*[str(path) for path in checked.samples.files])
        if plan.since is not None or plan.until is not None:
            samples = _cut_samples(samples, plan)
        summary["samples"] = checked.samples.rows
        work += [(job, samples) for job in sample_jobs]
    plan.output.mkdir(parents=True, exist_ok=True)
    for job, source in work:
        table = job.run(source, plan.window)
        rows = progress.step(job.name, job.question, functools.partial(_write, table, job, plan))
        summary["tables"][job.name] = rows
    if plan.records is not None and any(job.name == "federation_priors" for job in record_jobs):
        _write_priors(plan.output)
    summary["seconds"] = progress.timings
    (plan.output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _cut_samples(samples: DataFrame, plan: Plan) -> DataFrame:
    from pyspark.sql import functions as F

    ns = F.col("timestamp_ns")
    if plan.since is not None:
        samples = samples.where(ns >= F.lit(int(plan.since.timestamp() * 1e9)))
    if plan.until is not None:
        samples = samples.where(ns < F.lit(int(plan.until.timestamp() * 1e9)))
    return samples


def _write(table: DataFrame, job: Job, plan: Plan) -> int:
    target = plan.output / job.name
    if job.name in SINGLE_FILE:
        table = table.coalesce(1)
    table.write.mode("overwrite").parquet(str(target))
    import pyarrow.parquet as pq

    # count what was written from the footers: no second Spark pass over the data
    return sum(
        pq.read_metadata(part).num_rows
        for part in target.glob("*.parquet")
        if not part.name.startswith((".", "_"))
    )


def _write_priors(output: Path) -> None:
    """`{domain: failure_rate}` for `rmb-relay --ranker-priors FILE`."""
    import pyarrow.parquet as pq

    table = pq.read_table(output / "federation_priors")
    priors = {
        row["remote"]: round(float(row["failure_rate"]), 6)
        for row in table.to_pylist()
        if row["remote"] is not None
    }
    (output / "priors.json").write_text(json.dumps(priors, indent=2, sort_keys=True) + "\n")
