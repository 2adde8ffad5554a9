"""`rmb-analytics report`: one self-contained HTML page from a run's tables.

The tables are small (aggregates), so the report reads them with pyarrow and needs no Spark.
Plots are matplotlib PNGs embedded as data: URIs, styles are inline: the page is one file that
can be mailed, attached to a ticket or opened offline. A table that a run did not produce (no
federation traffic, no load samples) gets a one-line note instead of an empty plot.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from rmb_relay.analytics.inputs import InputError

Rows = list[dict[str, Any]]

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;background:#f6f7f9;
color:#1d2330}
header{background:#1d2330;color:#fff;padding:18px 32px}header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#b8c0d0}
main{max-width:1180px;margin:0 auto;padding:20px 32px 48px}
.cards{display:flex;gap:14px;flex-wrap:wrap;margin:8px 0 20px}
.card{background:#fff;border-radius:8px;padding:12px 18px;box-shadow:0 1px 3px #0002;
min-width:150px}
.card b{display:block;font-size:22px}.card span{color:#5b6475;font-size:12px}
section{background:#fff;border-radius:8px;box-shadow:0 1px 3px #0002;padding:16px 22px;
margin:0 0 18px}
h2{font-size:17px;margin:0 0 10px}p.note{color:#5b6475;margin:4px 0}
img{max-width:100%;height:auto}
table{border-collapse:collapse;font-size:13px;margin-top:8px}
th,td{padding:4px 10px;border-bottom:1px solid #e4e7ec;text-align:right}
th{background:#f0f2f5;font-weight:600}td:first-child,th:first-child{text-align:left}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:18px}
@media (max-width:900px){.grid{grid-template-columns:1fr}}
"""


def _table(output: Path, name: str) -> Rows | None:
    folder = output / name
    if not folder.exists():
        return None
    try:
        return pq.read_table(folder).to_pylist()  # type: ignore[no-any-return]
    except OSError as err:
        raise InputError(f"{folder}: not a table of rmb-analytics run ({err})") from None


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(figure)
    data = base64.b64encode(buffer.getvalue()).decode()
    return f'<img alt="" src="data:image/png;base64,{data}">'


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    return str(value)


def _html_table(rows: Rows, columns: Sequence[str], limit: int = 20) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(row.get(c)))}</td>" for c in columns) + "</tr>"
        for row in rows[:limit]
    )
    more = f'<p class="note">first {limit} of {len(rows)} rows</p>' if len(rows) > limit else ""
    return f"<table><tr>{head}</tr>{body}</table>{more}"


def _section(title: str, *parts: str) -> str:
    return f"<section><h2>{html.escape(title)}</h2>{''.join(parts)}</section>"


def _missing(what: str) -> str:
    return f'<p class="note">{html.escape(what)}</p>'


def _throughput(rows: Rows | None, window: int) -> str:
    import matplotlib.pyplot as plt

    if not rows:
        return _section("Throughput", _missing("no records in the range"))
    series: dict[str, dict[datetime, float]] = defaultdict(lambda: defaultdict(float))
    for row in rows:
        label = f"{row['dialect']} {row['route']} {row['outcome']}"
        series[label][row["window_start"]] += row["messages"] / window
    # windows without traffic are zeros, not a line drawn across the gap
    first = min(row["window_start"] for row in rows)
    last = max(row["window_start"] for row in rows)
    step = timedelta(seconds=window)
    every = [first + i * step for i in range(int((last - first) / step) + 1)]
    figure, axes = plt.subplots(figsize=(11, 3.6))
    for label, points in sorted(series.items()):
        for when in every:
            points.setdefault(when, 0.0)
        xs: list[Any] = sorted(points)
        marker = "o" if len(xs) < 3 else None  # one window is a point, not a line
        axes.plot(xs, [points[x] for x in xs], label=label, linewidth=1.4, marker=marker)
    axes.set_ylabel("messages / s")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _time_axis(axes, [r["window_start"] for r in rows], window)
    return _section(f"Throughput over time ({window} s windows)", _png(figure))


def _latency(cdf: Rows | None, table: Rows | None) -> str:
    import matplotlib.pyplot as plt

    if not cdf:
        return _section("Latency inside the relay", _missing("no timed records"))
    curves: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for row in cdf:
        curves[f"{row['dialect']} {row['route']}"].append((row["relay_us"], row["percentile"]))
    columns = ["dialect", "route", "messages", "p50_us", "p90_us", "p99_us", "max_us"]
    # a route whose every message left within the read that brought it (the hot path reads
    # the clock once per read) has nothing to draw: say so instead of a line at 0
    instant = sorted(label for label, points in curves.items() if not any(p[0] for p in points))
    note = (
        f"<p class=note>{html.escape(', '.join(instant))}: every message left the relay within "
        "the read that brought it in (recorded as 0 µs: the time is read once per read).</p>"
        if instant
        else ""
    )
    for label in instant:
        del curves[label]
    if not curves:
        return _section("Latency inside the relay", note, _html_table(table or [], columns))
    figure, axes = plt.subplots(figsize=(11, 3.6))
    for label, points in sorted(curves.items()):
        points.sort(key=lambda p: p[1])
        axes.step(
            [max(p[0], 0.5) for p in points],
            [p[1] / 100 for p in points],
            label=label,
            where="post",
        )
    axes.set_xscale("log")
    axes.set_xlabel("time inside the relay (µs, log scale; 0 drawn at 0.5)")
    axes.set_ylabel("fraction of messages")
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize=8)
    return _section("Latency CDF per route", _png(figure), note, _html_table(table or [], columns))


def _bars(rows: Rows, label: Any, value: str, title: str, color: str) -> str:
    import matplotlib.pyplot as plt

    rows = rows[:15]
    figure, axes = plt.subplots(figsize=(5.4, 0.32 * len(rows) + 0.9))
    axes.barh([label(r) for r in reversed(rows)], [r[value] for r in reversed(rows)], color=color)
    axes.set_xlabel(value)
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3, axis="x")
    return _png(figure)


def _talkers(rows: Rows | None) -> str:
    if not rows:
        return _section("Top talkers", _missing("no senders in the range"))
    plot = _bars(rows, lambda r: f"{r['dialect']}:{r['twin']}", "messages", "", "#3b6fd8")
    columns = ["rank", "dialect", "twin", "messages", "bytes", "share"]
    return _section("Top talkers", f'<div class="grid"><div>{plot}</div><div>'
                    f"{_html_table(rows, columns)}</div></div>")  # fmt: skip


def _drops(rows: Rows | None, abuse: Rows | None) -> str:
    if not rows:
        return _section("Drops and rate limits", _missing("nothing was dropped"))
    by_reason: dict[str, int] = defaultdict(int)
    for row in rows:
        by_reason[f"{row['dialect']}: {row['reason'] or row['outcome']}"] += row["messages"]
    ordered = [{"r": k, "messages": v} for k, v in sorted(by_reason.items(), key=lambda i: -i[1])]
    plot = _bars(ordered, lambda r: r["r"], "messages", "drops by reason", "#d8553b")
    abuse_columns = ["dialect", "twin", "messages", "rate_limited", "rejected", "refused_share"]
    abuse_html = (
        "<h3>Abuse candidates</h3>" + _html_table(abuse, abuse_columns)
        if abuse
        else _missing("no twin had rate-limited or rejected messages")
    )
    columns = ["dialect", "twin", "route", "outcome", "reason", "messages", "bytes"]
    return _section(
        "Drops and rate limits",
        f'<div class="grid"><div>{plot}</div><div>{abuse_html}</div></div>',
        _html_table(rows, columns),
    )


def _federation(rows: Rows | None, priors: Rows | None, window: int) -> str:
    import matplotlib.pyplot as plt

    if not rows:
        return _section("Federation health", _missing("no federation traffic in the range"))
    series: dict[str, list[tuple[datetime, float]]] = defaultdict(list)
    for row in rows:
        series[row["remote"]].append((row["window_start"], row["failure_rate"]))
    figure, axes = plt.subplots(figsize=(11, 3.2))
    for remote, points in sorted(series.items()):
        points.sort()
        when: list[Any] = [p[0] for p in points]
        axes.plot(when, [p[1] for p in points], marker="o", label=remote)
    axes.set_ylim(-0.02, 1.02)
    axes.set_ylabel("failure rate")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    _time_axis(axes, [r["window_start"] for r in rows], window)
    columns = ["remote", "attempts", "failures", "failure_rate"]
    return _section("Federation health", _png(figure), _html_table(priors or [], columns))


def _time_axis(axes: Any, times: list[datetime], window: int) -> None:
    """Concise UTC time labels over the windows shown (matplotlib's default range around a
    single point is years wide)."""
    import matplotlib.dates as mdates

    if times:
        pad = timedelta(seconds=window / 2)
        axes.set_xlim(min(times) - pad, max(times) + timedelta(seconds=window) + pad)
    locator = mdates.AutoDateLocator(minticks=3, maxticks=9)  # type: ignore[no-untyped-call]
    axes.xaxis.set_major_locator(locator)
    formatter = mdates.ConciseDateFormatter(locator)  # type: ignore[no-untyped-call]
    axes.xaxis.set_major_formatter(formatter)


def _mailbox(rows: Rows | None, window: int) -> str:
    import matplotlib.pyplot as plt

    if not rows:
        return _section("Mailbox", _missing("no mailbox traffic in the range"))
    figure, axes = plt.subplots(figsize=(11, 3.2))
    xs = [r["window_start"] for r in rows]
    marker = "o" if len(xs) < 3 else None
    axes.plot(xs, [r["backlog"] for r in rows], label="backlog", color="#1d2330", marker=marker)
    width = 0.8 * window / 86_400  # matplotlib dates are in days
    expired = [r["expired"] for r in rows]
    axes.bar(xs, expired, label="expired", color="#d8553b", width=width, align="edge")
    axes.set_ylabel("messages")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    _time_axis(axes, xs, window)
    lost = sum(r["expired"] for r in rows)
    lost_bytes = sum(r["expired_bytes"] for r in rows)
    note = _missing(f"expiry loss over the range: {lost:,} messages, {lost_bytes:,} bytes")
    columns = ["window_start", "queued", "delivered", "expired", "lost_full", "backlog"]
    return _section("Mailbox backlog and expiry", _png(figure), note, _html_table(rows, columns))


def _load(rows: Rows | None, window: int) -> str:
    import matplotlib.pyplot as plt

    if not rows:
        return ""
    figure, axes = plt.subplots(figsize=(11, 3.2))
    by_stream: dict[tuple[str, int], list[tuple[datetime, float]]] = defaultdict(list)
    for row in rows:
        by_stream[row["dialect"], row["pair"]].append((row["window_start"], row["p99_ms"]))
    for (dialect, pair), points in sorted(by_stream.items())[:10]:
        points.sort()
        at: list[Any] = [p[0] for p in points]
        axes.plot(at, [p[1] for p in points], label=f"{dialect} {pair}")
    axes.set_ylabel("p99 latency (ms)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, ncol=5)
    _time_axis(axes, [r["window_start"] for r in rows], window)
    columns = ["window_start", "dialect", "pair", "messages", "p50_ms", "p99_ms", "max_ms"]
    return _section("Load harness (rmb-load samples)", _png(figure), _html_table(rows, columns))


def _cards(summary: dict[str, Any], throughput: Rows | None, drops: Rows | None) -> str:
    total = sum(r["messages"] for r in throughput or [])
    moved = sum(r["bytes"] for r in throughput or [] if r["outcome"] in ("delivered", "queued"))
    dropped = sum(r["messages"] for r in drops or [])
    cards = [
        (f"{total:,}", "records (messages and drops)"),
        (f"{moved / 1e6:,.1f} MB", "bytes delivered or queued"),
        (f"{dropped:,}", "dropped, rate-limited or expired"),
        (f"{summary.get('samples', 0):,}", "rmb-load samples"),
    ]
    return '<div class="cards">' + "".join(
        f"<div class=card><b>{html.escape(v)}</b><span>{html.escape(k)}</span></div>"
        for v, k in cards
    ) + "</div>"  # fmt: skip


def _span(summary: dict[str, Any], throughput: Rows | None, window: int) -> str:
    """The time range the page covers: the run's --since/--until, else the first and last
    window that had traffic (so a reader sees when, and how long, without the plot)."""
    since, until = summary.get("since"), summary.get("until")
    if (since is None or until is None) and throughput:
        starts = [row["window_start"] for row in throughput]
        first, last = min(starts), max(starts) + timedelta(seconds=window)
        minutes = (last - first).total_seconds() / 60
        since = since or first.strftime("%Y-%m-%d %H:%M")
        until = until or last.strftime("%Y-%m-%d %H:%M")
        return f"{since} → {until} UTC ({minutes:,.0f} min of traffic)"
    return f"{since or 'start'} → {until or 'end'}"


def write_report(tables: Path, target: Path) -> None:
    """Read the tables of `rmb-analytics run --output TABLES` and write the HTML page."""
    import matplotlib

    matplotlib.use("Agg")
    summary_path = tables / "summary.json"
    if not summary_path.exists():
        raise InputError(f"{tables}: no summary.json; give the --output of `rmb-analytics run`")
    summary = json.loads(summary_path.read_text())
    window = int(summary.get("window_seconds", 60))
    read = {name: _table(tables, name) for name in summary.get("tables", {})}
    span = _span(summary, read.get("throughput"), window)
    body = [
        _cards(summary, read.get("throughput"), read.get("drop_reasons")),
        _throughput(read.get("throughput"), window),
        _latency(read.get("latency_cdf"), read.get("latency")),
        _talkers(read.get("top_talkers")),
        _drops(read.get("drop_reasons"), read.get("abuse_candidates")),
        _federation(read.get("federation_health"), read.get("federation_priors"), window),
        _mailbox(read.get("mailbox"), window),
        _load(read.get("load_latency"), window),
    ]
    timing = ", ".join(f"{k} {v:.1f} s" for k, v in summary.get("seconds", {}).items())
    page = (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        "<meta name=viewport content='width=device-width,initial-scale=1'>"
        f"<title>rmb-relay traffic report</title><style>{_STYLE}</style></head><body>"
        f"<header><h1>rmb-relay traffic report</h1><p>{html.escape(span)} · "
        f"{summary.get('records', 0):,} route records · {window} s windows</p></header>"
        f"<main>{''.join(body)}<p class=note>job times: {html.escape(timing)}</p></main>"
        "</body></html>"
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(page)
