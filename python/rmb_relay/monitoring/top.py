"""`rmb-relay top --url URL`: the relay's monitoring views in a terminal, refreshed each second.

What it shows: the relay's totals and rates (messages and bytes in and out, CPU, memory,
connections per dialect, mailbox), the top connections by a sort key (switched with a key
press: `s` or Tab for the next key, `1`..`7` for one of them), the connections that are
congested, and the peer relays that fail. `q` or Ctrl-C leave (status 0) with the terminal as
it was. Drawn with rich in the terminal's alternate screen, sized to the terminal (80 columns
is enough), so it works over SSH. Per-connection rates are what changed between two refreshes
for the connections on screen in both.

It reads `/monitor/server`, `/monitor/connections` and `/monitor/federation` of the relay at
`--url` (the listener, or the ops listener of `--metrics-listen`), one request each per refresh.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import sys
import termios
import time
import tty
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

#: the sort keys, in the order `s` steps through them (and their digit keys)
SORT_KEYS = ("msgs_in", "msgs_out", "bytes_in", "bytes_out", "pending", "idle", "age")
#: seconds a request to the relay may take
TIMEOUT = 2.0
#: lines the summary, headings and footer take (the rest is for connection rows)
CHROME_LINES = 16


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--url",
        default="http://127.0.0.1:8080",
        help="the relay's listener (or its --metrics-listen address), e.g. http://host:8080",
    )
    p.add_argument(
        "--sort", choices=SORT_KEYS, default="msgs_in", help="the first sort key (default: msgs_in)"
    )
    p.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refreshes (default: 1)"
    )
    p.add_argument("--once", action="store_true", help="print one screen and exit (no keys)")
    return p


def fetch(base: str, path: str) -> Any:
    with urllib.request.urlopen(base.rstrip("/") + path, timeout=TIMEOUT) as answer:
        return json.load(answer)


def human(n: float, unit: str = "") -> str:
    """1234567 -> 1.2M (an 80-column screen has no room for digits)."""
    for suffix in ("", "k", "M", "G", "T"):
        if abs(n) < 1000:
            text = f"{n:.0f}" if suffix == "" or abs(n) >= 100 else f"{n:.1f}"
            return f"{text}{suffix}{unit}"
        n /= 1000
    return f"{n:.0f}P{unit}"


def seconds(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


@dataclass
class Screen:
    """What one refresh draws, and what the next one needs of it (per-connection rates)."""

    sort: str
    previous: dict[int, tuple[float, int, int]] = field(default_factory=dict)
    error: str | None = None

    def rows(self, height: int) -> int:
        return max(3, height - CHROME_LINES)

    def render(
        self,
        summary: dict[str, Any],
        top: dict[str, Any],
        congested: dict[str, Any],
        federation: dict[str, Any],
        now: float,
    ) -> Group:
        parts: list[Any] = [self._header(summary)]
        parts.append(self._connections(top["connections"], now, f"top by {self.sort}"))
        if congested["connections"]:
            parts.append(
                self._connections(
                    congested["connections"], now, f"congested ({congested['total']})", rates=False
                )
            )
        failing = [p for p in federation.get("peers", []) if p["window_failures"] or p["failed"]]
        if failing:
            parts.append(self._peers(failing))
        parts.append(
            Text(
                "q quit  s/Tab next sort  1-7 sort: "
                + " ".join(f"{i}={k}" for i, k in enumerate(SORT_KEYS, 1)),
                style="dim",
                overflow="ellipsis",
                no_wrap=True,
            )
        )
        return Group(*parts)

    def _header(self, s: dict[str, Any]) -> Table:
        conns = s["connections"]
        rates = s["rates"]
        totals = s["totals"]
        dialects = " ".join(f"{d} {n}" for d, n in sorted(conns["by_dialect"].items()) if n)
        mailbox = s.get("mailbox") or {}
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True)
        grid.add_row(
            Text(
                f"rmb-relay {s['version']}  up {seconds(s['uptime'])}  "
                f"cpu {s['cpu'] * 100:.0f}%  rss {human(s['rss_bytes'], 'B')}  pid {s['pid']}",
                style="bold",
            )
        )
        grid.add_row(
            f"conns {conns['total']} ({dialects or 'none'})  congested {conns['congested']}  "
            f"paused {conns['paused']}"
        )
        grid.add_row(
            f"in  {human(rates['msgs_in_per_s'])} msg/s {human(rates['bytes_in_per_s'], 'B')}/s"
            f"  total {human(totals['msgs_in'])} msg {human(totals['bytes_in'], 'B')}"
        )
        grid.add_row(
            f"out {human(rates['msgs_out_per_s'])} msg/s {human(rates['bytes_out_per_s'], 'B')}/s"
            f"  total {human(totals['msgs_out'])} msg {human(totals['bytes_out'], 'B')}"
        )
        budgets = "  ".join(
            f"{b['name']} {b['share'] * 100:.0f}%"
            for b in s["budgets"]
            if b.get("share") is not None and b["share"] >= 0.01
        )
        grid.add_row(
            f"mailbox {mailbox.get('messages', 0)} msg {human(mailbox.get('bytes', 0), 'B')}"
            + (f"  {budgets}" if budgets else "")
        )
        if self.error:
            grid.add_row(Text(self.error, style="bold red"))
        return grid

    def _connections(
        self, rows: list[dict[str, Any]], now: float, title: str, *, rates: bool = True
    ) -> Table:
        table = Table(
            title=title,
            title_justify="left",
            box=None,
            pad_edge=False,
            expand=False,
            padding=(0, 1),
        )
        table.add_column("ID", justify="right", no_wrap=True)
        table.add_column("DIAL", no_wrap=True, max_width=5)
        table.add_column("WHO", no_wrap=True, overflow="ellipsis", max_width=20)
        table.add_column("IN/s", justify="right", no_wrap=True)
        table.add_column("OUT/s", justify="right", no_wrap=True)
        table.add_column("MSG IN", justify="right", no_wrap=True)
        table.add_column("MSG OUT", justify="right", no_wrap=True)
        table.add_column("PEND", justify="right", no_wrap=True)
        table.add_column("IDLE", justify="right", no_wrap=True)
        table.add_column("", no_wrap=True)
        seen: dict[int, tuple[float, int, int]] = {}
        for r in rows:
            conn_id = r["id"]
            in_rate = out_rate = ""
            before = self.previous.get(conn_id)
            if before is not None and now > before[0]:
                elapsed = now - before[0]
                in_rate = human((r["msgs_in"] - before[1]) / elapsed)
                out_rate = human((r["msgs_out"] - before[2]) / elapsed)
            seen[conn_id] = (now, r["msgs_in"], r["msgs_out"])
            flags = ("C" if r["congested"] else "") + ("P" if r["paused"] else "")
            table.add_row(
                str(conn_id),
                r["dialect"],
                r["who"] or r["remote"],
                in_rate,
                out_rate,
                human(r["msgs_in"]),
                human(r["msgs_out"]),
                human(r["pending"], "B") if r["pending"] else "0",
                seconds(r["idle"]),
                Text(flags, style="bold red") if flags else "",
            )
        if rates:
            self.previous = seen
        return table

    @staticmethod
    def _peers(peers: list[dict[str, Any]]) -> Table:
        table = Table(title="failing peer relays", title_justify="left", box=None, pad_edge=False)
        table.add_column("RELAY", no_wrap=True, overflow="ellipsis", max_width=40)
        table.add_column("OK", justify="right")
        table.add_column("FAILED", justify="right")
        table.add_column("SCORE", justify="right")
        for p in peers[:5]:
            table.add_row(p["relay"], str(p["accepted"]), str(p["failed"]), f"{p['score']:.0f}")
        return table


def snapshot(url: str, screen: Screen, limit: int) -> tuple[Any, Any, Any, Any]:
    summary = fetch(url, "/monitor/server")
    top = fetch(url, f"/monitor/connections?sort={screen.sort}&limit={limit}")
    congested = fetch(url, "/monitor/connections?congested=1&sort=pending&limit=5")
    federation = fetch(url, "/monitor/federation")
    return summary, top, congested, federation


@contextlib.contextmanager
def keys_unbuffered() -> Iterator[bool]:
    """stdin in cbreak mode (keys one by one, Ctrl-C still a signal) while inside; restored
    whatever happens. Yields whether there is a terminal to read keys from."""
    fd = sys.stdin.fileno() if sys.stdin.isatty() else None
    if fd is None:
        yield False
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def read_key(timeout: float) -> str | None:
    ready, _, _ = select.select([sys.stdin], [], [], max(0.0, timeout))
    if not ready:
        return None
    data = os.read(sys.stdin.fileno(), 16)
    return data.decode(errors="replace")[:1] if data else "q"


def next_sort(current: str, key: str) -> str:
    if key in ("s", "\t"):
        return SORT_KEYS[(SORT_KEYS.index(current) + 1) % len(SORT_KEYS)]
    if key.isdigit() and 1 <= int(key) <= len(SORT_KEYS):
        return SORT_KEYS[int(key) - 1]
    return current


def draw(console: Console, url: str, screen: Screen, placeholder: Any) -> Any:
    try:
        data = snapshot(url, screen, screen.rows(console.height))
    except (OSError, ValueError, KeyError, urllib.error.URLError) as err:
        screen.error = f"{url}: {err}"
        return (
            Group(Text(screen.error, style="bold red"), placeholder)
            if placeholder
            else Text(screen.error, style="bold red")
        )
    screen.error = None
    return screen.render(*data, now=time.monotonic())


def run(args: argparse.Namespace) -> int:
    console = Console()
    screen = Screen(args.sort)
    if args.once:
        console.print(draw(console, args.url, screen, None))
        return 0 if screen.error is None else 1
    last: Any = None
    try:
        with (
            keys_unbuffered() as keys,
            Live(Text("connecting..."), console=console, screen=True, auto_refresh=False) as live,
        ):
            while True:
                last = draw(console, args.url, screen, last)
                live.update(last, refresh=True)
                due = time.monotonic() + args.interval
                while True:
                    left = due - time.monotonic()
                    if left <= 0:
                        break
                    if not keys:
                        time.sleep(left)
                        break
                    key = read_key(left)
                    if key is None:
                        continue
                    if key in ("q", "Q"):
                        return 0
                    sort = next_sort(screen.sort, key)
                    if sort != screen.sort:
                        screen.sort = sort
                        screen.previous = {}
                        break  # redraw at once in the new order
    except KeyboardInterrupt:
        return 0


def main(argv: Sequence[str], prog: str = "rmb-relay top") -> int:
    return run(parser(prog).parse_args(argv))
