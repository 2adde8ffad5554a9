"""`--ranker-priors FILE`: per-domain failure rates learnt elsewhere (the analytics plane).

Two shapes, chosen by the file's content, not its name:

- JSON: one object `{"relay.example.com": 0.02, ...}` (domain -> failure rate);
- Parquet: a table with columns `domain` (string) and `failure_rate` (number), one row per
  domain; the analytics plane's `federation_priors` table names the domain column `remote`,
  which is taken too.

A rate is a non-negative finite number; what unit it is in does not matter to the ranker, which
only compares priors with each other (ranker.py). Anything else is a `ConfigError` naming the
file and the bad entry, raised at startup: a relay must not start with priors it misread.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rmb_relay.errors import ConfigError
from rmb_relay.twins import validate_domain

#: Parquet files start (and end) with these four bytes
PARQUET_MAGIC = b"PAR1"


def load_priors(path: str | Path) -> dict[str, float]:
    """domain -> prior failure rate, from a JSON or Parquet file; see the module docstring."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"--ranker-priors {path}: cannot read: {err.strerror}") from None
    pairs = _parquet_pairs(path) if data.startswith(PARQUET_MAGIC) else _json_pairs(path, data)
    priors: dict[str, float] = {}
    for domain, rate in pairs:
        if not isinstance(domain, str):
            raise ConfigError(f"--ranker-priors {path}: domain {domain!r} is not a string")
        try:
            validate_domain(domain)
        except ConfigError as err:
            raise ConfigError(f"--ranker-priors {path}: {err}") from None
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate):
            raise ConfigError(f"--ranker-priors {path}: rate of {domain} is not a number: {rate!r}")
        if rate < 0:
            raise ConfigError(f"--ranker-priors {path}: rate of {domain} is negative: {rate}")
        priors[domain] = float(rate)
    return priors


def _json_pairs(path: Path, data: bytes) -> list[tuple[object, object]]:
    try:
        parsed = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"--ranker-priors {path}: neither Parquet nor JSON: {err}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(
            f'--ranker-priors {path}: JSON must be an object {{"domain": rate, ...}}, '
            f"not {type(parsed).__name__}"
        )
    return list(parsed.items())


def _parquet_pairs(path: Path) -> list[tuple[object, object]]:
    import pyarrow.parquet as pq
    from pyarrow import ArrowException

    try:
        table = pq.read_table(path)
    except (ArrowException, OSError) as err:
        raise ConfigError(f"--ranker-priors {path}: unreadable Parquet: {err}") from None
    names = set(table.column_names)
    key = "domain" if "domain" in names or "remote" not in names else "remote"
    missing = {key, "failure_rate"} - names
    if missing:
        raise ConfigError(
            f"--ranker-priors {path}: Parquet table lacks column(s) {', '.join(sorted(missing))} "
            f"(has {', '.join(table.column_names)})"
        )
    domains = table.column(key).to_pylist()
    rates = table.column("failure_rate").to_pylist()
    return list(zip(domains, rates, strict=True))
