"""The fate of every message a sender was told was accepted.

Senders report each message they sent (`sent`), and what they heard back: the answer
(`answered`) or an error the relay or the receiver sent (`refused`). Receivers report each
delivery (`delivered`), so a message delivered twice is seen even when the sender hears one
answer. At the end (`report`), each message is:

- delivered once / delivered more than once: its answer came back (the receiver's count says
  how often it was delivered);
- refused: the sender was told it failed (an error envelope, a refusal it saw);
- not known: the sender was told the relay cannot say whether it was done (the tunnel's 504,
  a gateway timeout): not a refusal, so one that was delivered is no broken promise, and
  counted apart;
- silently lost: neither. The sender was never told, which is the one fate a relay must not
  allow for anything it accepted.

For one-way dialects (SBD, 신경 SEND and QUEUE) a message with no answer counts as delivered
when the receiver saw it (`one_way=True`), unless the sender was told otherwise: one refused
counts as refused even when it was delivered (and is counted in `refused_delivered`: the
refusal broke its promise, "not done"), one told not known as not known.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Fates:
    accepted: int
    delivered_once: int
    delivered_more: int
    refused: int
    lost: int
    #: the first few lost ids (for a failing test's message)
    lost_ids: tuple[str, ...] = ()
    refusals: tuple[str, ...] = ()
    #: refused, and yet delivered (the receiver saw it: the refusal did not mean "not done")
    refused_delivered: int = 0
    #: the reasons of those, with counts
    refused_delivered_why: tuple[str, ...] = ()
    #: told the outcome is not known, and of those, delivered
    unknown: int = 0
    unknown_delivered: int = 0

    def line(self) -> str:
        also = f" ({self.refused_delivered} of them delivered)" if self.refused_delivered else ""
        if self.unknown:
            also += f", told not known {self.unknown} ({self.unknown_delivered} delivered)"
        return (
            f"accepted {self.accepted}, delivered once {self.delivered_once}, twice or more "
            f"{self.delivered_more}, refused {self.refused}{also}, silently lost {self.lost}"
        )


@dataclass
class Checker:
    one_way: bool = False
    _sent: dict[str, float] = field(default_factory=dict)
    _answered: set[str] = field(default_factory=set)
    _refused: dict[str, str] = field(default_factory=dict)
    _unknown: set[str] = field(default_factory=set)
    _deliveries: Counter[str] = field(default_factory=Counter)
    _settled: asyncio.Event = field(default_factory=asyncio.Event)
    #: sent, fate not known yet
    _open: set[str] = field(default_factory=set)
    #: the last answers, newest last (what `answered_since` looks at)
    _recent: deque[str] = field(default_factory=lambda: deque(maxlen=64))
    _recent_deliveries: deque[str] = field(default_factory=lambda: deque(maxlen=64))

    def sent(self, message: str, at: float = 0.0) -> None:
        self._sent[message] = at
        self._open.add(message)
        self._settled.clear()

    def answered(self, message: str) -> None:
        self._answered.add(message)
        self._recent.append(message)
        self._known(message)

    def refused(self, message: str, why: str) -> None:
        self._refused.setdefault(message, why)
        self._known(message)

    def unknown(self, message: str) -> None:
        """The sender was told its fate is not known (see the module docstring)."""
        self._unknown.add(message)
        self._known(message)

    def delivered(self, message: str) -> None:
        self._deliveries[message] += 1
        self._recent_deliveries.append(message)
        if self.one_way:
            self._known(message)

    @property
    def delivered_count(self) -> int:
        return len(self._deliveries)

    def delivered_since(self, prefix: str, mark: int) -> bool:
        """`answered_since` for deliveries (one-way traffic)."""
        return any(int(m[len(prefix) :]) >= mark for m in self._recent_deliveries)

    @property
    def answered_count(self) -> int:
        return len(self._answered)

    def answered_since(self, prefix: str, mark: int) -> bool:
        """Whether a message numbered `mark` or later (ids `<prefix><n>`) was answered."""
        return any(int(m[len(prefix) :]) >= mark for m in self._recent)

    @property
    def outstanding(self) -> int:
        """Accepted messages whose fate is not known yet."""
        return len(self._open)

    def _known(self, message: str) -> None:
        self._open.discard(message)
        self._check_settled()

    def _check_settled(self) -> None:
        if not self._open:
            self._settled.set()

    async def settle(self, timeout: float) -> bool:
        """Wait until every accepted message has a known fate, at most `timeout` s (what is
        still unknown then counts as lost). True when all settled."""
        self._check_settled()
        try:
            await asyncio.wait_for(self._settled.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def report(self) -> Fates:
        once = more = refused = unknown = unknown_delivered = 0
        done_anyway: Counter[str] = Counter()
        lost: list[str] = []
        for message in self._sent:
            count = self._deliveries[message]
            # one way, only a delivery without a word to the sender is the delivered fate
            told = self.one_way and (message in self._refused or message in self._unknown)
            if message in self._answered or (self.one_way and count and not told):
                if count > 1:
                    more += 1
                else:
                    once += 1
            elif message in self._refused:
                refused += 1
                if count:
                    done_anyway[self._refused[message]] += 1
            elif message in self._unknown:
                unknown += 1
                unknown_delivered += count > 0
            else:
                lost.append(message)
        reasons = Counter(self._refused.values())
        return Fates(
            len(self._sent),
            once,
            more,
            refused,
            len(lost),
            tuple(lost[:10]),
            tuple(f"{why} x{n}" for why, n in reasons.most_common(5)),
            done_anyway.total(),
            tuple(f"{why} x{n}" for why, n in done_anyway.most_common(5)),
            unknown,
            unknown_delivered,
        )
