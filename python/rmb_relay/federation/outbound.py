"""Outbound federation: from "this envelope is for a twin served elsewhere" to a 202 from one of
the twin's relays, or an error envelope to the sender (spec/rmb.md §3.3, decision 5).

Theory of operation
-------------------
`forward` only queues the raw bytes (`queue.py`): the sender's connection never waits for a
remote relay. A worker takes every item ready in the queue at once (up to `TAKE`) and, per
item:

1. read the routing fields (Rust scanner); an envelope whose deadline (timestamp + expiration)
   has passed is not posted: a request's sender gets "message has expired";
2. look the destination twin up (cached directory) for its relay domains;
3. try the domains in the ranker's order (`ranker.py`), one POST each (`sender.py`):
   202 -> done; 4xx -> permanent, the sender of a request gets
   "remote relay rejected permanently: <reason>"; anything else -> downvote, next domain;
4. all failed -> retry the whole round after a backoff (100 ms doubling to `max_backoff`, with
   jitter, never past the envelope's deadline), until it is accepted, refused, or expires.

The items a worker took go together, grouped by the relay they try next: one
`Sender.post_many` per relay (a batch to a relay that takes them, one POST per envelope
otherwise), the twin looked up and its relays ranked once per worker round rather than per
envelope, a failing relay downvoted once per round, and one `done_many` for the finished
ones. Per envelope this leaves a scan and a few dict operations: no task, future or wake-up
each, which is what bounded federated throughput on a busy host.

Errors go to the sender through the switch (its connection here, or its mailbox), as rmb-rs
pushes them to the sender's stream; responses and errors that fail are dropped and counted,
because rmb-rs never answers an answer.

Route records (`--records`): the worker writes an envelope's record when its outcome is known,
through the same channel as the rest of RMB (`switch.record_channel("rmb")`): `delivered` with
the remote relay that accepted it, `rejected` with the one that refused it (or none, when the
twin has no relays), `expired` with the one tried last. Queuing it is not an outcome, and the
twin's first relay is not necessarily the one that took it.

The wall clock (envelope deadlines) is injected; backoff delays are event-loop timers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rmb_relay._core import MSG_REQUEST, EnvelopeRouting, build_error_envelope, scan_envelope
from rmb_relay.clock import Clock, seconds, wall_clock
from rmb_relay.errors import EnvelopeError, MailboxUnavailable, TwinLookupError
from rmb_relay.federation import Federation
from rmb_relay.federation.batch import MAX_BATCH_ITEMS
from rmb_relay.federation.queue import Item, OutboundQueue
from rmb_relay.federation.sender import PostOutcome, PostResult, Sender

if TYPE_CHECKING:
    from rmb_relay.federation.ranker import Ranker
    from rmb_relay.switch import Switch
    from rmb_relay.twins import Twin, TwinDirectory

log = logging.getLogger("rmb_relay.federation")

#: relay error envelopes live this long (rmb-rs build_error_envelope)
ERROR_ENVELOPE_TTL = 300
#: first retry delay after a round in which every relay failed; doubles per round
FIRST_BACKOFF = 0.1
DEFAULT_MAX_BACKOFF = 5.0
#: longest an envelope is tried from when it was queued, whatever its own expiration says
#: (the sender chooses that: years would keep it in the queue, retried, for years); the
#: mailbox's default lifetime, as a twin's stream keeps nothing longer either
DEFAULT_MAX_TTL = 3600
#: tasks posting at once in one process (each remote is bounded by the sender too)
DEFAULT_WORKERS = 256
#: items a worker takes from the queue at once: those ready, never waiting for more
TAKE = MAX_BATCH_ITEMS


#: peer relays `FederationStats.peers` counts one by one; the rest are summed as OTHER_PEERS
#: (the domains come from the twins' records, which anyone may write)
MAX_PEERS_COUNTED = 1024
OTHER_PEERS = "(other)"


class FederationStats:
    """Plain ints bumped per message, read at scrape (metrics.py's hot-counter convention)."""

    __slots__ = ("accepted", "dropped", "expired", "failed_posts", "peers", "rejected", "retries")

    def __init__(self) -> None:
        self.accepted = 0
        self.rejected = 0
        self.expired = 0
        self.dropped = 0
        self.retries = 0
        self.failed_posts = 0
        #: relay domain -> [envelopes it accepted, posts to it that failed] (/monitor/federation),
        #: counted once per POST, not per envelope, then [rounds over a twin's relays that ended
        #: without delivery with it among them] (rmb-rs's federation_message_error)
        self.peers: dict[str, list[int]] = {}

    def peer(self, domain: str) -> list[int]:
        peers = self.peers
        counts = peers.get(domain)
        if counts is None:
            if len(peers) >= MAX_PEERS_COUNTED:
                domain = OTHER_PEERS
            counts = peers.setdefault(domain, [0, 0, 0])
        return counts

    def round_failed(self, relays: list[str]) -> None:
        """A round over a twin's relays ended without delivery: each of them counts it."""
        for domain in relays:
            self.peer(domain)[2] += 1


@dataclass(slots=True)
class _Round:
    """One item's round over its twin's relays."""

    item: Item
    env: EnvelopeRouting
    #: unix seconds after which it is not posted
    deadline: int
    #: the twin's relays in the ranker's order, and how many of them failed this round
    relays: list[str]
    tried: int = 0


class OutboundFederation(Federation):
    """See the module docstring."""

    def __init__(
        self,
        queue: OutboundQueue,
        sender: Sender,
        ranker: Ranker,
        directory: TwinDirectory,
        switch: Switch,
        *,
        workers: int = DEFAULT_WORKERS,
        max_backoff: float = DEFAULT_MAX_BACKOFF,
        max_ttl: int = DEFAULT_MAX_TTL,
        clock: Clock = wall_clock,
        rng: random.Random | None = None,
    ) -> None:
        self.queue = queue
        self.sender = sender
        self.ranker = ranker
        self.directory = directory
        self.switch = switch
        self.workers = workers
        self.max_backoff = max_backoff
        self.max_ttl = max_ttl
        self.clock = clock
        self.stats = FederationStats()
        self._rng = rng or random.Random()
        self._tasks: list[asyncio.Task[None]] = []
        self._telling: set[asyncio.Task[None]] = set()
        queue.on_unstored = self._unstored

    def start(self) -> None:
        """Start the workers and the queue's background work (idempotent)."""
        if self._tasks:
            return
        self.queue.start()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._work(), name=f"federation-worker-{n}")
            for n in range(self.workers)
        ]

    async def forward(self, envelope: bytes, twin: Twin) -> None:
        """Accept the envelope for delivery to one of `twin.relays`; FederationError when the
        queue cannot take it (full, or Redis down)."""
        self.start()
        records = self.switch.record_channel("rmb")
        # the time is the route record's (--records), the queue's age (/monitor/federation)
        # and where `_deadline` counts --federation-max-ttl from
        await self.queue.put(envelope, self.clock() if records is None else records.clock())

    def _unstored(self, envelopes: list[bytes], why: str) -> None:
        """Envelopes the queue took but could not keep: their senders hear it as if
        `forward` had failed."""
        task = asyncio.get_running_loop().create_task(self._tell_unstored(envelopes, why))
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)

    async def _tell_unstored(self, envelopes: list[bytes], why: str) -> None:
        now = seconds(self.clock())
        for data in envelopes:
            try:
                await self._fail(scan_envelope(data), why, now)
            except EnvelopeError:
                self.stats.dropped += 1
            except Exception:
                log.exception("telling a sender its envelope was not queued failed")

    # ---- the workers -------------------------------------------------------------------------

    async def _work(self) -> None:
        queue = self.queue
        while True:
            items = await queue.get_many(TAKE)
            try:
                await self.process_many(items)
            except Exception:  # each step catches its own; this is a bug in them
                log.exception("federating %d envelopes failed", len(items))
            # not kept while waiting for the next ones: every idle worker would hold its last
            # batch of envelopes (and the garbage collector would walk them all)
            del items

    async def process_many(self, items: list[Item]) -> None:
        """One round for each item: finished ones are done in the queue, the others are
        scheduled for a retry."""
        finished: list[Item] = []
        try:
            await self._rounds(items, finished)
        finally:
            if finished:
                await self.queue.done_many(finished)

    async def _rounds(self, items: list[Item], finished: list[Item]) -> None:
        """Items go to `finished`, or are scheduled for a retry (`_again`)."""
        rounds: list[_Round] = []
        orders: dict[int, list[str]] = {}  # per call: a twin's relays looked up and ranked once
        ranked: dict[frozenset[str], list[str]] = {}  # (the same relays, the same order)
        now = seconds(self.clock())
        for item in items:
            env: EnvelopeRouting | EnvelopeError
            try:
                env = scan_envelope(item.data)
            except EnvelopeError as err:
                env = err  # _prepare says why
            if not isinstance(env, EnvelopeError):
                order = orders.get(env.dest_twin)
                deadline = self._deadline(env, item)
                if order is not None and deadline > now:  # the usual case: nothing to await
                    rounds.append(_Round(item, env, deadline, order))
                    continue
            try:
                prepared = await self._prepare(item, env, now, orders, ranked)
            except Exception:
                log.exception("federating a queued envelope failed; dropped")
                self.stats.dropped += 1
                prepared = True
            if prepared is True:
                finished.append(item)
            elif prepared is not False:
                rounds.append(prepared)
        while rounds:
            rounds = await self._post(rounds, finished)

    async def _prepare(
        self,
        item: Item,
        env: EnvelopeRouting | EnvelopeError,
        now: int,
        orders: dict[int, list[str]],
        ranked: dict[frozenset[str], list[str]],
    ) -> _Round | bool:
        """The item's round (its relays in the ranker's order), or True when it is finished
        already, False when a retry is scheduled (the directory failed). `env` is the item's
        scan, or why it is not an envelope."""
        if isinstance(env, EnvelopeError):
            log.warning("dropping a queued federation entry that is not an envelope: %s", env)
            self.stats.dropped += 1
            return True
        deadline = self._deadline(env, item)
        if deadline <= now:
            self.stats.expired += 1
            self._record(env, item, "expired", "federation expired", item.remote)
            await self._fail(env, "message has expired", now)
            return True
        order = orders.get(env.dest_twin)
        if order is None:
            domains = await self._domains(env, item, now)
            if domains is None:
                return True
            if not domains:
                return self._again(item, deadline, now)
            order = ranked.get(domains)
            if order is None:
                order = ranked[domains] = self.ranker.rank(domains)
            orders[env.dest_twin] = order
        return _Round(item, env, deadline, order)

    def _deadline(self, env: EnvelopeRouting, item: Item) -> int:
        """Until when the envelope is tried (unix seconds): its own deadline, at most
        `max_ttl` after it was queued (`--federation-max-ttl`)."""
        own = env.timestamp + env.expiration
        if item.queued is None:
            return own
        return min(own, seconds(item.queued) + self.max_ttl)

    async def _post(self, rounds: list[_Round], finished: list[Item]) -> list[_Round]:
        """Post each round to its next relay (`Sender.post_many`: one batch per relay that
        takes them); returns the rounds to try on their next relay. A relay that failed is
        downvoted once per call, not once per envelope."""
        groups: dict[str, list[_Round]] = {}
        for rnd in rounds:
            domain = rnd.relays[rnd.tried]
            rnd.item.remote = domain  # the relay tried last, for an expiry's route record
            groups.setdefault(domain, []).append(rnd)
        posts = [self.sender.post_many(d, [r.item.data for r in g]) for d, g in groups.items()]
        answers: list[list[PostResult] | BaseException]
        if len(posts) == 1:
            try:
                answers = [await posts[0]]
            except Exception as err:
                answers = [err]
        else:
            answers = await asyncio.gather(*posts, return_exceptions=True)
        stats = self.stats
        again = []
        for (domain, group), results in zip(groups.items(), answers, strict=True):
            if isinstance(results, BaseException):  # the sender never raises: a bug
                log.error(
                    "posting to %s failed; %d envelopes dropped",
                    domain,
                    len(group),
                    exc_info=results,
                )
                stats.dropped += len(group)
                finished.extend(rnd.item for rnd in group)
                continue
            failed = False
            accepted_before = stats.accepted
            for rnd, result in zip(group, results, strict=True):
                if result.outcome is PostOutcome.ACCEPTED:  # the hot path, without a call
                    stats.accepted += 1
                    self._record(rnd.env, rnd.item, "delivered", None, domain)
                    finished.append(rnd.item)
                    continue
                try:
                    if await self._outcome(rnd.env, rnd.item, domain, result):
                        stats.round_failed(rnd.relays)  # refused for good
                        finished.append(rnd.item)
                        continue
                except Exception:
                    log.exception("federating envelope %s failed; dropped", rnd.env.uid)
                    stats.dropped += 1
                    finished.append(rnd.item)
                    continue
                failed = True
                rnd.tried += 1
                if rnd.tried < len(rnd.relays):
                    again.append(rnd)
                else:
                    stats.round_failed(rnd.relays)
                    self._again(rnd.item, rnd.deadline, seconds(self.clock()))
            peer = stats.peer(domain)
            peer[0] += stats.accepted - accepted_before
            if failed:
                peer[1] += 1
                self.ranker.downvote(domain)
        return again

    async def _outcome(
        self, env: EnvelopeRouting, item: Item, domain: str, result: PostResult
    ) -> bool:
        """Act on one relay's answer other than accepted (`_post` handles those itself: that
        is the path every envelope takes): True when the envelope is finished (refused for good
        and the sender told), False when that relay failed."""
        if result.outcome is PostOutcome.REJECTED:
            self.stats.rejected += 1
            log.info("relay %s refused envelope %s: %s", domain, env.uid, result.detail)
            self._record(env, item, "rejected", "remote rejected", domain)
            reason = f"remote relay rejected permanently: {result.detail}"
            await self._fail(env, reason, seconds(self.clock()))
            return True
        self.stats.failed_posts += 1
        log.debug("relay %s failed for envelope %s: %s", domain, env.uid, result.detail)
        return False

    async def _domains(self, env: EnvelopeRouting, item: Item, now: int) -> frozenset[str] | None:
        """The destination's relays; None when the envelope is finished (answered with an
        error), an empty set when the directory failed (try again later)."""
        try:
            twin = await self.directory.get(env.dest_twin)
        except TwinLookupError as err:
            log.warning("twin lookup for federation failed, will retry: %s", err)
            return frozenset()
        if twin is None:
            self._record(env, item, "rejected", "unknown twin", None)
            await self._fail(env, "unknown twin destination", now)
            return None
        if not twin.relays:
            self._record(env, item, "rejected", "no relay info", None)
            await self._fail(env, "relay info is not set for this twin", now)
            return None
        return twin.relays

    def _record(
        self, env: EnvelopeRouting, item: Item, outcome: str, reason: str | None, remote: str | None
    ) -> None:
        """The envelope's route record, now that its outcome is known (see the module doc)."""
        records = self.switch.record_channel("rmb")
        if records is not None:
            records.add(
                env.source_twin or None,
                env.dest_twin or None,
                len(item.data),
                "federation",
                outcome,
                reason,
                received=item.queued,
                remote=remote,
            )

    def _again(self, item: Item, deadline: int, now: int) -> bool:
        """Schedule the next round, or finish now if the deadline would pass first (the
        next round then reports the expiry)."""
        item.attempts += 1
        self.stats.retries += 1
        delay = min(FIRST_BACKOFF * 2 ** min(item.attempts - 1, 30), self.max_backoff)
        delay *= 0.75 + self._rng.random() / 2
        # wake up just after the deadline at the latest, to tell the sender it expired
        delay = max(0.0, min(delay, deadline - now + 0.05))
        self.queue.retry(item, delay)
        return False

    async def _fail(self, env: EnvelopeRouting, reason: str, now: int) -> None:
        """Tell the sender of a request why its envelope will not arrive."""
        if env.kind != MSG_REQUEST or env.source_twin == 0:
            self.stats.dropped += 1
            return
        sender = (env.source_twin, env.source_connection)
        error = build_error_envelope(env.uid, reason, now, *sender)
        deadline = self.switch.mailbox.deadline(now, ERROR_ENVELOPE_TTL)
        try:
            await self.switch.deliver(sender, error, deadline=deadline)
        except MailboxUnavailable as err:
            log.warning("could not store a federation error for %s: %s", sender, err)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.queue.close()
        for task in list(self._telling):
            with contextlib.suppress(Exception):
                await task
        await self.sender.close()
