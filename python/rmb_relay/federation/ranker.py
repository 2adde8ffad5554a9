"""The ranker: in which order to try a twin's relays (spec/rmb.md §3.4, decision 5).

A twin lists one or more relay domains. A failed POST to a domain (transport error, timeout, or
any status that is neither 202 nor 4xx) is one *failure* recorded at the time it happened.
Failures older than the window (`--ranker-period`, rmb-rs's default 3600 s) are forgotten, so a
domain that stopped failing climbs back: ranks heal without anyone resetting them.

Order: failure rate in the window (failures per hour, as rmb-rs) ascending. Where live evidence
ties (most often: no failures at all, right after a start), the *priors* decide: per-domain
failure rates an operator feeds in with `--ranker-priors` (the analytics plane computes them
from route records). Remaining ties are shuffled, so equal relays share the load instead of the
first one taking all of it.

Live failures come first because they are about now; a prior is history from another process
and must not keep a relay that works today behind one that is failing today.

Time comes from an injected monotonic clock (`clock.py`), so tests move it by hand.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Mapping

from rmb_relay.clock import NS, Clock, monotonic_clock
from rmb_relay.errors import ConfigError

#: rmb-rs's `--ranker-period` default
DEFAULT_RANKER_PERIOD = 3600
#: failures remembered per domain: a bound on memory for a domain that fails thousands of
#: times a second; beyond it the rate is "very bad" anyway and the oldest are dropped
MAX_FAILURES_KEPT = 100_000


class Ranker:
    """Failure timestamps per domain within a sliding window; see the module docstring."""

    def __init__(
        self,
        period: float = DEFAULT_RANKER_PERIOD,
        *,
        priors: Mapping[str, float] | None = None,
        clock: Clock = monotonic_clock,
        rng: random.Random | None = None,
    ) -> None:
        if not period > 0:
            raise ConfigError("--ranker-period must be a positive number of seconds")
        self.period_ns = int(period * NS)
        self.clock = clock
        self.priors: dict[str, float] = dict(priors or {})
        self._rng = rng or random.Random()
        self._failures: dict[str, deque[int]] = {}

    def downvote(self, domain: str) -> None:
        """Record one failure of `domain`, now."""
        failures = self._failures.get(domain)
        if failures is None:
            failures = self._failures[domain] = deque(maxlen=MAX_FAILURES_KEPT)
        failures.append(self.clock())

    def failures(self, domain: str) -> int:
        """Failures of `domain` within the window (forgetting older ones)."""
        failures = self._failures.get(domain)
        if failures is None:
            return 0
        horizon = self.clock() - self.period_ns
        while failures and failures[0] <= horizon:
            failures.popleft()
        if not failures:
            del self._failures[domain]
            return 0
        return len(failures)

    def rate(self, domain: str) -> float:
        """Failures per hour within the window (rmb-rs's measure)."""
        return self.failures(domain) * 3600 * NS / self.period_ns

    def rank(self, domains: Iterable[str]) -> list[str]:
        """`domains` in the order to try them: fewest recent failures first, then the lowest
        prior failure rate, then at random."""
        shuffled = list(domains)
        self._rng.shuffle(shuffled)  # sort is stable: ties keep this random order
        priors = self.priors
        return sorted(shuffled, key=lambda d: (self.failures(d), priors.get(d, 0.0)))

    def snapshot(self) -> dict[str, tuple[int, float]]:
        """domain -> (failures in window, rate per hour), for every domain that has failures
        or a prior (what /metrics shows)."""
        domains = set(self._failures) | set(self.priors)
        return {d: (self.failures(d), self.rate(d)) for d in sorted(domains)}
