"""Queries (spec §7, decisions 3-6): parsed and matched by the Rust core, the one
implementation (rust/dialects/singyeong/query.rs says what each operator means; index.rs
routes: match, `optional`, selector, `key` by rendezvous hashing, or one at random).

A query object has `application`, `restricted`, `key`, `droppable`, `optional`, `ops` and
`selector`; `ops` is a list (implicit AND) of conditions in the seed form
(`{"region": {"$eq": "eu"}}`) or the path form (`{"path": "/a/0", "op": "$gt", "to":
{"value": 1}}`). Every query a stranger sends is held to `QueryLimits` (issue 33): logical
operators nested, conditions in all, values in one `$in`/`$nin` list; beyond them the parse
fails with `QueryError.limit` set (op 3 `invalid query` naming the flag, a metric).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rmb_relay._core import SgQuery, SgQueryError

#: a parsed query (`raw`, `restricted`, `key`, `droppable`, `optional`, `exact`,
#: `matches(client)`); what else it asks the core reads itself
Query = SgQuery

__all__ = ["DEFAULT_LIMITS", "Query", "QueryError", "QueryLimits", "parse"]


class QueryError(ValueError):
    """A query the gateway cannot run; the message says why (sent back as op 3). `limit`:
    the bound a well-formed query broke ("depth", "ops", "list"), else None."""

    def __init__(self, message: str, limit: str | None = None) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True, slots=True)
class QueryLimits:
    """What one query may cost (flags `--sg-query-max-depth`, `-ops`, `-list`)."""

    max_depth: int = 32
    max_ops: int = 1024
    max_list: int = 1024


DEFAULT_LIMITS = QueryLimits()


def parse(raw: Any, limits: QueryLimits = DEFAULT_LIMITS) -> Query:
    """Parse a query object; raises QueryError with the reason."""
    try:
        return SgQuery(raw, limits.max_depth, limits.max_ops, limits.max_list)
    except SgQueryError as err:
        message, limit = err.args
        raise QueryError(message, limit) from None
    except (TypeError, RecursionError) as err:
        raise QueryError(f"a query must be made of JSON values: {err}") from None
