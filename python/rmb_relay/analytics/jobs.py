"""The PySpark jobs: one function per output table, each a pure DataFrame transformation.

Every job takes the route records (already cut to `--since/--until`) and returns the table it
writes; docs/analytics.md describes each table's columns. Counts are `sum(weight)`: exact when
the relay recorded every message (weight 1), an estimate from `--records-sample` otherwise.
Latency percentiles use Spark's `percentile_approx` with `PERCENTILE_ACCURACY` (relative error
1/accuracy of the rank), which is far inside what a sample of records can tell anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

#: percentile_approx's accuracy: rank error at most 1/10,000 of the rows
PERCENTILE_ACCURACY = 10_000
#: rows of the top-talkers table
TOP_TALKERS = 20
#: outcomes that are drops (the message reached no one)
DROPS = ("rate-limited", "rejected", "expired")


@dataclass(frozen=True, slots=True)
class Job:
    """One output table: its name, what it answers, and how it is made."""

    name: str
    question: str
    run: Callable[[DataFrame, int], DataFrame]


def _messages() -> Column:
    return F.round(F.sum("weight")).cast("long").alias("messages")


def _bytes() -> Column:
    return F.round(F.sum(F.col("size") * F.col("weight"))).cast("long").alias("bytes")


def _window(seconds: int) -> Column:
    return F.window("time", f"{seconds} seconds").start.alias("window_start")


def throughput(records: DataFrame, window: int) -> DataFrame:
    return (
        records.groupBy(_window(window), "dialect", "route", "outcome")
        .agg(_messages(), _bytes())
        .orderBy("window_start", "dialect", "route", "outcome")
    )


def traffic_twin(records: DataFrame, window: int) -> DataFrame:
    """Sent counts what a twin handed to the relay, received what the relay handed to it."""
    moved = records.where(F.col("outcome").isin("delivered", "queued"))
    sent = (
        records.where(F.col("src").isNotNull())
        .groupBy(_window(window), "dialect", F.col("src").alias("twin"))
        .agg(
            _messages().alias("sent_messages"),
            _bytes().alias("sent_bytes"),
        )
    )
    received = (
        moved.where(F.col("dst").isNotNull() & (F.col("outcome") == "delivered"))
        .groupBy(_window(window), "dialect", F.col("dst").alias("twin"))
        .agg(_messages().alias("received_messages"), _bytes().alias("received_bytes"))
    )
    return (
        sent.join(received, ["window_start", "dialect", "twin"], "full_outer")
        .na.fill(0)
        .orderBy("window_start", "dialect", "twin")
    )


def traffic_pair(records: DataFrame, window: int) -> DataFrame:
    return (
        records.where(F.col("src").isNotNull() & F.col("dst").isNotNull())
        .groupBy(_window(window), "dialect", "src", "dst")
        .agg(_messages(), _bytes())
        .orderBy("window_start", "dialect", "src", "dst")
    )


def top_talkers(records: DataFrame, window: int) -> DataFrame:
    """The senders of the most messages over the whole range, with their share of it."""
    del window
    per_twin = (
        records.where(F.col("src").isNotNull())
        .groupBy("dialect", F.col("src").alias("twin"))
        .agg(_messages(), _bytes())
    )
    total = Window.partitionBy(F.lit(1))
    ranked = per_twin.withColumn(
        "share", F.col("messages") / F.sum("messages").over(total)
    ).withColumn("rank", F.row_number().over(total.orderBy(F.desc("messages"), "twin")))
    return ranked.where(F.col("rank") <= TOP_TALKERS).orderBy("rank")


def drop_reasons(records: DataFrame, window: int) -> DataFrame:
    del window
    return (
        records.where(F.col("outcome").isin(*DROPS))
        .groupBy("dialect", F.col("src").alias("twin"), "route", "outcome", "reason")
        .agg(_messages(), _bytes(), F.min("time").alias("first"), F.max("time").alias("last"))
        .orderBy(F.desc("messages"), "dialect", "twin", "reason")
    )


def abuse_candidates(records: DataFrame, window: int) -> DataFrame:
    """Senders with any rate-limited or rejected message, worst first: the twins to look at."""
    del window
    weight = F.col("weight")
    return (
        records.where(F.col("src").isNotNull())
        .groupBy("dialect", F.col("src").alias("twin"))
        .agg(
            _messages(),
            F.round(F.sum(F.when(F.col("outcome") == "rate-limited", weight).otherwise(0)))
            .cast("long")
            .alias("rate_limited"),
            F.round(F.sum(F.when(F.col("outcome") == "rejected", weight).otherwise(0)))
            .cast("long")
            .alias("rejected"),
        )
        .withColumn(
            "refused_share", (F.col("rate_limited") + F.col("rejected")) / F.col("messages")
        )
        .where((F.col("rate_limited") + F.col("rejected")) > 0)
        .orderBy(F.desc("rate_limited"), F.desc("rejected"), "twin")
    )


def latency(records: DataFrame, window: int) -> DataFrame:
    """Time inside the relay (microseconds) of messages that were delivered or queued."""
    del window
    quantiles = F.percentile_approx(
        "relay_us", F.array(F.lit(0.5), F.lit(0.9), F.lit(0.99)), PERCENTILE_ACCURACY
    )
    return (
        records.where(F.col("relay_us").isNotNull() & F.col("outcome").isin("delivered", "queued"))
        .groupBy("dialect", "route")
        .agg(_messages(), quantiles.alias("q"), F.max("relay_us").alias("max_us"))
        .select(
            "dialect",
            "route",
            "messages",
            F.col("q")[0].alias("p50_us"),
            F.col("q")[1].alias("p90_us"),
            F.col("q")[2].alias("p99_us"),
            "max_us",
        )
        .orderBy("dialect", "route")
    )


def latency_cdf(records: DataFrame, window: int) -> DataFrame:
    """Percentiles 1..100 per route and dialect: the points of the report's CDF plot."""
    del window
    points = [p / 100 for p in range(1, 101)]
    quantiles = F.percentile_approx(
        "relay_us", F.array(*[F.lit(p) for p in points]), PERCENTILE_ACCURACY
    )
    rows = (
        records.where(F.col("relay_us").isNotNull() & F.col("outcome").isin("delivered", "queued"))
        .groupBy("dialect", "route")
        .agg(quantiles.alias("q"))
    )
    return rows.select(
        "dialect", "route", F.posexplode("q").alias("percentile", "relay_us")
    ).withColumn("percentile", F.col("percentile") + 1)


def _federation_failures(records: DataFrame, *by: Column) -> DataFrame:
    """Attempts, failures and failure rate of federated sends, grouped `by` (then the remote)."""
    attempts = records.where((F.col("route") == "federation") & F.col("remote").isNotNull())
    failed = F.col("outcome") != "delivered"
    return (
        attempts.groupBy(*by, "remote")
        .agg(
            _messages().alias("attempts"),
            F.round(F.sum(F.when(failed, F.col("weight")).otherwise(0)))
            .cast("long")
            .alias("failures"),
        )
        .withColumn("failure_rate", F.col("failures") / F.col("attempts"))
    )


def federation_health(records: DataFrame, window: int) -> DataFrame:
    return _federation_failures(records, _window(window)).orderBy("window_start", "remote")


def federation_priors(records: DataFrame, window: int) -> DataFrame:
    """Failure rate per remote relay over the whole range: `priors.json` for the ranker."""
    del window
    return _federation_failures(records).orderBy("remote")


def mailbox(records: DataFrame, window: int) -> DataFrame:
    """Mailbox flow per window and the backlog it leaves (queued minus what left it)."""
    boxed = records.where(F.col("route") == "mailbox")
    weight = F.col("weight")

    def count(condition: Column, name: str) -> Column:
        return F.round(F.sum(F.when(condition, weight).otherwise(0))).cast("long").alias(name)

    outcome, reason = F.col("outcome"), F.col("reason")
    flows = boxed.groupBy(_window(window)).agg(
        count(outcome == "queued", "queued"),
        count(outcome == "delivered", "delivered"),
        count(outcome == "expired", "expired"),
        count((outcome == "rejected") & (reason == "mailbox full"), "lost_full"),
        F.round(F.sum(F.when(outcome == "expired", F.col("size") * weight).otherwise(0)))
        .cast("long")
        .alias("expired_bytes"),
    )
    running = Window.orderBy("window_start").rowsBetween(Window.unboundedPreceding, 0)
    change = F.col("queued") - F.col("delivered") - F.col("expired") - F.col("lost_full")
    return flows.withColumn("backlog", F.sum(change).over(running)).orderBy("window_start")


RECORD_JOBS: tuple[Job, ...] = (
    Job("throughput", "messages and bytes per window, dialect, route, outcome", throughput),
    Job("traffic_twin", "what each twin sent and received per window", traffic_twin),
    Job("traffic_pair", "messages and bytes per (source, destination) per window", traffic_pair),
    Job("top_talkers", f"the {TOP_TALKERS} busiest senders over the range", top_talkers),
    Job("drop_reasons", "drops by twin, route, outcome and reason", drop_reasons),
    Job("abuse_candidates", "senders with rate-limited or rejected messages", abuse_candidates),
    Job("latency", "time inside the relay: p50/p90/p99 per dialect and route", latency),
    Job("latency_cdf", "percentiles 1..100 per dialect and route", latency_cdf),
    Job("federation_health", "federation failure rate per remote per window", federation_health),
    Job("federation_priors", "failure rate per remote over the range", federation_priors),
    Job("mailbox", "mailbox queued/delivered/expired per window and backlog", mailbox),
)


def load_latency(samples: DataFrame, window: int) -> DataFrame:
    """`rmb-load --samples` of any dialect: latency per window, dialect and stream (pair,
    client, connection) in milliseconds (one-way for rmb, sbd and 신경, the round trip for the
    tunnel and the peer)."""
    quantiles = F.percentile_approx(
        F.col("latency_ns") / 1e6,
        F.array(F.lit(0.5), F.lit(0.9), F.lit(0.99), F.lit(0.999)),
        PERCENTILE_ACCURACY,
    )
    timed = samples.withColumn("time", F.expr("timestamp_micros(timestamp_ns div 1000)"))
    return (
        timed.groupBy(_window(window), "dialect", "pair")
        .agg(
            F.count("*").alias("messages"),
            F.sum("size").alias("bytes"),
            quantiles.alias("q"),
            (F.max("latency_ns") / 1e6).alias("max_ms"),
        )
        .select(
            "window_start",
            "dialect",
            "pair",
            "messages",
            "bytes",
            F.col("q")[0].alias("p50_ms"),
            F.col("q")[1].alias("p90_ms"),
            F.col("q")[2].alias("p99_ms"),
            F.col("q")[3].alias("p99_9_ms"),
            "max_ms",
        )
        .orderBy("window_start", "dialect", "pair")
    )


SAMPLE_JOBS: tuple[Job, ...] = (
    Job("load_latency", "rmb-load latency per window, dialect and stream", load_latency),
)
