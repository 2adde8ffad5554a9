"""One byte budget for every in-memory store that holds messages for someone who is not there.

Why: the RMB mailbox, the 신경 queues (dead letters included) and the tunnel's waiting
requests all keep bytes in the relay's own heap on behalf of a receiver that may never come.
Bounded only by counts (or not at all), one client fills the heap; bounded by bytes, the
sender of the message that does not fit hears a clear refusal and nothing already stored is
displaced (issues #12 and #13: "bad input gets a clear error and loses nothing").

A `ByteBudget` is books, not storage (sans-I/O, no clock): the store asks before it keeps a
message (`take` raises `BudgetExceeded` naming the limit hit, `try_take` answers a bool) and
gives the bytes back when the message leaves (`release`). Three limits, checked in this order:

| limit | bounds | why |
|---|---|---|
| `count` | items one key holds (`key_count`, optional) | sub-keys are the sender's choice |
| `key` | bytes held for one key (a twin, a queue, a tenant) | one backlog stops here |
| `total` | bytes held for all keys together | what the store may cost the heap |

A key's entry disappears when its bytes and count are back at zero, so the books are as large
as the set of keys with something held, never the set of keys ever seen.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Literal

from rmb_relay.errors import BudgetExceeded

__all__ = ["BudgetExceeded", "ByteBudget", "Limit"]

Limit = Literal["count", "key", "total"]


class ByteBudget:
    """Per-key and total byte limits, optionally a per-key item count (module docstring)."""

    __slots__ = ("_books", "held", "key_bytes", "key_count", "refused", "total_bytes")

    def __init__(self, *, key_bytes: int, total_bytes: int, key_count: int | None = None) -> None:
        if min(key_bytes, total_bytes) <= 0 or (key_count is not None and key_count <= 0):
            raise ValueError("budgets must be positive")
        self.key_bytes = key_bytes
        self.total_bytes = total_bytes
        self.key_count = key_count
        #: bytes held for all keys
        self.held = 0
        #: key -> [bytes, count]
        self._books: dict[Hashable, list[int]] = {}
        #: refusals by the limit that was hit, for metrics
        self.refused: dict[Limit, int] = {"count": 0, "key": 0, "total": 0}

    def check(self, key: Hashable, size: int, count: int = 0) -> Limit | None:
        """The limit that taking `size` bytes (and `count` items) for `key` would break."""
        books = self._books.get(key)
        key_held, key_items = books if books is not None else (0, 0)
        if count and self.key_count is not None and key_items + count > self.key_count:
            return "count"
        if key_held + size > self.key_bytes:
            return "key"
        if self.held + size > self.total_bytes:
            return "total"
        return None

    def take(self, key: Hashable, size: int, count: int = 0) -> None:
        """Charge `size` bytes (and `count` items) to `key`, or raise BudgetExceeded (and
        charge nothing) when a limit would be broken."""
        limit = self.check(key, size, count)
        if limit is not None:
            self.refused[limit] += 1
            if limit == "count":
                held, allowed, asked = self.count_of(key), self.key_count or 0, count
            elif limit == "key":
                held, allowed, asked = self.held_by(key), self.key_bytes, size
            else:
                held, allowed, asked = self.held, self.total_bytes, size
            raise BudgetExceeded(limit, key=key, size=asked, held=held, allowed=allowed)
        self._charge(key, size, count)

    def try_take(self, key: Hashable, size: int, count: int = 0) -> bool:
        """`take` as a bool: True when charged."""
        try:
            self.take(key, size, count)
        except BudgetExceeded:
            return False
        return True

    def charge(self, key: Hashable, size: int, count: int = 0) -> None:
        """Charge without checking: for bytes that are held already, whether they fit or not
        (a body file another relay wrote); `take` refuses the next thing that does not fit."""
        self._charge(key, size, count)

    def _charge(self, key: Hashable, size: int, count: int) -> None:
        books = self._books.get(key)
        if books is None:
            self._books[key] = [size, count]
        else:
            books[0] += size
            books[1] += count
        self.held += size

    def release(self, key: Hashable, size: int, count: int = 0) -> None:
        """Give back what `take` charged (in one go or in parts). Releasing more than is held
        is a bug of the caller: ValueError, and the books are left as they were."""
        books = self._books.get(key)
        if books is None or books[0] < size or books[1] < count:
            raise ValueError(f"releasing {size} bytes, {count} items of {key!r}: not held")
        books[0] -= size
        books[1] -= count
        self.held -= size
        if books[0] == 0 and books[1] == 0:
            del self._books[key]
            if not self._books:
                # a dict never shrinks by deleting: start over so a burst's table is freed too
                self._books = {}

    def held_by(self, key: Hashable) -> int:
        books = self._books.get(key)
        return books[0] if books is not None else 0

    def count_of(self, key: Hashable) -> int:
        books = self._books.get(key)
        return books[1] if books is not None else 0

    def holders(self) -> list[Hashable]:
        """Keys with something held (for per-key metrics)."""
        return list(self._books)

    def __len__(self) -> int:
        return len(self._books)
