"""One POST of one envelope to one remote relay, and the HTTP client behind it.

rmb-rs semantics (spec/rmb.md §3.3, decision 5): `POST <url of domain>` with the raw envelope
bytes as the body. 202 is the only success; any 4xx is permanent (the remote will never take
this envelope: its destination is offline with fail-fast, not the remote's, badly signed...);
anything else (5xx, 200, a redirect, a refused or reset connection, a timeout) says nothing
about the envelope, only about the remote, so the caller downvotes it and tries another.

The client is one aiohttp session (a maintained async HTTP client) whose connector keeps a
keep-alive pool per remote host, at most `concurrency` connections each; a semaphore per remote
bounds the requests in flight to the same number, so one slow remote cannot take every
connection or every worker. TLS is verified: the system's CAs, or `--federation-ca` (a PEM
bundle) for private networks and tests. There is no switch to turn verification off.

A remote that announces batches (`batch.py`) gets them: `post_many` parks the envelopes in the
remote's pending list, and up to `pipeline` batch tasks per remote post whatever is pending,
one batch after another, and hand each caller its envelopes' own answers. Nothing waits for a
batch to fill: an idle remote gets a batch at once, a busy one gets the envelopes that arrived
while the previous batches were in flight. Few batches in flight (4) rather than `concurrency`
keep them big: on a busy relay the work per envelope, not the round trip, is what costs.
"""

from __future__ import annotations

import asyncio
import enum
import ssl
from collections import deque
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

from rmb_relay import __version__
from rmb_relay.errors import ConfigError, EnvelopeError
from rmb_relay.federation.batch import (
    ALL_ACCEPTED,
    BATCH_HEADER,
    BATCH_TYPE,
    FRAME,
    MAX_BATCH_ITEMS,
    ORIGIN_HEADER,
    decode_statuses,
    encode_batch,
)
from rmb_relay.lazy_errors import aiohttp_client_error

if TYPE_CHECKING:
    # imported on the first POST (`Sender._client`), not at startup: aiohttp costs ~11 MB of
    # RSS, and most relays never federate a message (bench/README.md "Idle connections")
    import aiohttp

#: rmb-rs: per-request timeout 3 s, connect 2 s
DEFAULT_TIMEOUT = 3.0
CONNECT_TIMEOUT = 2.0
#: requests in flight (and pooled connections) per remote relay
DEFAULT_CONCURRENCY = 32
#: batches in flight to one remote at once (at most `concurrency`)
DEFAULT_PIPELINE = 4
#: rmb-rs keeps idle pooled connections 300 s
KEEPALIVE_SECONDS = 300.0
#: decision 5: `{domain}` in the template is replaced by the bare relay domain
DEFAULT_URL_TEMPLATE = "https://{domain}/"
#: bytes of a refusal's body kept for the error text (the sender sees it)
MAX_REASON = 200


class PostOutcome(enum.Enum):
    ACCEPTED = "accepted"
    REJECTED = "rejected"  # 4xx: permanent, do not try other relays
    FAILED = "failed"  # downvote and try the next relay


@dataclass(frozen=True, slots=True)
class PostResult:
    outcome: PostOutcome
    #: what happened, for logs and (when rejected) the sender's error envelope
    detail: str = ""


def check_url_template(template: str) -> str:
    """The template must make an http(s) URL out of `{domain}`; raises ConfigError."""
    if not template.startswith(("http://", "https://")):
        raise ConfigError(f"--federation-url-template {template!r} must start with http(s)://")
    if "{domain}" not in template:
        raise ConfigError(f"--federation-url-template {template!r} must contain {{domain}}")
    try:
        template.format(domain="relay.example")
    except (KeyError, IndexError, ValueError) as err:
        raise ConfigError(
            f"--federation-url-template {template!r}: only {{domain}} may be substituted ({err})"
        ) from None
    return template


def client_tls(cafile: str | None) -> ssl.SSLContext:
    """A verifying TLS context: the system's CAs, or those in `cafile`."""
    try:
        return ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(f"--federation-ca {cafile}: cannot load CA bundle: {err}") from None


class Sender:
    """POSTs envelopes to remote relays; see the module docstring. Create and close it on the
    event loop that uses it."""

    def __init__(
        self,
        url_template: str = DEFAULT_URL_TEMPLATE,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        concurrency: int = DEFAULT_CONCURRENCY,
        pipeline: int = DEFAULT_PIPELINE,
        cafile: str | None = None,
        origin: str | None = None,
    ) -> None:
        if concurrency < 1:
            raise ConfigError("--federation-concurrency must be at least 1")
        if not timeout > 0:
            raise ConfigError("--federation-timeout must be a positive number of seconds")
        self.url_template = check_url_template(url_template)
        self.concurrency = concurrency
        #: this relay's domain, sent with every POST (`inbound.ORIGIN_HEADER`): the receiving
        #: relay's route records name it
        self.origin = origin
        # the system's CA store is loaded by the first POST (parsing it costs ~1.2 MB of RSS a
        # relay that never federates does not pay); an operator's bundle is loaded now, so a
        # bad one is a startup error
        self._tls = None if cafile is None else client_tls(cafile)
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._urls: dict[str, str] = {}
        #: batches in flight to one remote at most: while they are, what arrives waits and
        #: goes in the next batch (bigger batches, less per-request work on both sides)
        self.pipeline = min(concurrency, pipeline)
        #: remotes that take batches -> their body limit (learnt from their answers)
        self.batch_max: dict[str, int] = {}
        #: per remote: groups of envelopes not all taken into a batch yet, in arrival order
        self._pending: dict[str, deque[_Group]] = {}
        self._batchers: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: batches posted (for the benchmark and tests: did batching happen)
        self.batches = 0

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            import aiohttp

            connector = aiohttp.TCPConnector(
                limit=0,
                limit_per_host=self.concurrency,
                keepalive_timeout=KEEPALIVE_SECONDS,
                ssl=self._tls or client_tls(None),
            )
            headers = {"User-Agent": f"rmb-relay/{__version__}"}
            if self.origin is not None:
                headers[ORIGIN_HEADER] = self.origin
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(
                    total=self._timeout, connect=min(CONNECT_TIMEOUT, self._timeout)
                ),
                headers=headers,
                auto_decompress=False,
            )
        return self._session

    def url(self, domain: str) -> str:
        url = self._urls.get(domain)
        if url is None:
            url = self._urls[domain] = self.url_template.format(domain=domain)
        return url

    async def post_many(self, domain: str, envelopes: list[bytes]) -> list[PostResult]:
        """One attempt for each envelope, answers in order: in batches to a remote that takes
        them, else one POST each (concurrently, within the remote's bound). Never raises for
        anything the remote or the network does."""
        limit = self.batch_max.get(domain)
        if limit is None or not envelopes:
            if len(envelopes) == 1:
                return [await self._post_one(domain, envelopes[0])]
            return list(await asyncio.gather(*(self._post_one(domain, e) for e in envelopes)))
        if max(map(len, envelopes)) + FRAME > limit:  # rare: some only fit a POST of their own
            results: list[PostResult] = [_ACCEPTED] * len(envelopes)
            fit = [i for i, e in enumerate(envelopes) if len(e) + FRAME <= limit]
            alone = [i for i, e in enumerate(envelopes) if len(e) + FRAME > limit]
            batched = await self._post_batched(domain, [envelopes[i] for i in fit])
            for index, result in zip(fit, batched, strict=True):
                results[index] = result
            for index in alone:
                results[index] = await self._post_one(domain, envelopes[index])
            return results
        return await self._post_batched(domain, envelopes)

    async def _post_batched(self, domain: str, envelopes: list[bytes]) -> list[PostResult]:
        """Queue the envelopes for the remote's batches and wait for their answers."""
        if not envelopes:
            return []
        loop = self._loop
        if loop is None:
            # kept: get_running_loop() costs a getpid syscall (~0.3 us on this VM)
            loop = self._loop = asyncio.get_running_loop()
        group = _Group(envelopes, loop.create_future())
        pending = self._pending.get(domain)
        if pending is None:
            pending = self._pending[domain] = deque()
        pending.append(group)
        if self._batchers.get(domain, 0) < self.pipeline:
            self._batchers[domain] = self._batchers.get(domain, 0) + 1
            task = loop.create_task(self._batcher(domain))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await group.future
        return group.results

    async def _post_one(self, domain: str, envelope: bytes) -> PostResult:
        """A single POST of one envelope, within the remote's bound."""
        slots = self._slots.get(domain)
        if slots is None:
            slots = self._slots[domain] = asyncio.Semaphore(self.concurrency)
        async with slots:
            try:
                async with self._client().post(
                    self.url(domain),
                    data=envelope,
                    headers={"Content-Type": "application/octet-stream"},
                ) as response:
                    status = response.status
                    self._learn(domain, response.headers.get(BATCH_HEADER))
                    body = await response.content.read(MAX_REASON)
            except (aiohttp_client_error(), OSError) as err:
                return PostResult(PostOutcome.FAILED, f"{type(err).__name__}: {err}")
            except TimeoutError:
                return PostResult(PostOutcome.FAILED, "timed out")
        return _result(status, body.decode("utf-8", "replace").strip())

    def _learn(self, domain: str, announced: str | None) -> None:
        """Batch from now on if the remote announced it (and stop if it no longer does)."""
        if announced is None:
            self.batch_max.pop(domain, None)
            return
        try:
            limit = int(announced)
        except ValueError:
            return
        if limit > 0:
            self.batch_max[domain] = limit

    # ---- batches -------------------------------------------------------------------------

    async def _batcher(self, domain: str) -> None:
        """Post what is pending for `domain`, batch after batch, until nothing is. A batch
        takes whole runs of a group's envelopes (slices, not one envelope at a time)."""
        pending = self._pending[domain]
        try:
            while pending:
                limit = self.batch_max.get(domain)
                if limit is None:  # the remote stopped taking batches: one POST each
                    group = pending[0]
                    start = group.taken
                    group.taken += 1
                    if group.taken == len(group.envelopes):
                        pending.popleft()
                    group.settle(start, [await self._post_one(domain, group.envelopes[start])])
                    continue
                parts: list[tuple[_Group, int, int]] = []
                envelopes: list[bytes] = []
                room, count = limit, MAX_BATCH_ITEMS
                while pending and count:
                    group = pending[0]
                    start = group.taken
                    end = _fit(group.envelopes, start, room, count)
                    if end == start:
                        if envelopes:
                            break  # the next envelope goes in the next batch
                        end = start + 1  # too big for a limit the remote lowered since
                    chunk = group.envelopes[start:end]
                    envelopes += chunk
                    room -= sum(map(len, chunk)) + FRAME * len(chunk)
                    count -= len(chunk)
                    parts.append((group, start, end))
                    group.taken = end
                    if end < len(group.envelopes):
                        break  # full
                    pending.popleft()
                results = await self._post_batch(domain, envelopes)
                offset = 0
                for group, start, end in parts:
                    group.settle(start, results[offset : offset + end - start])
                    offset += end - start
        finally:
            self._batchers[domain] -= 1

    async def _post_batch(self, domain: str, envelopes: list[bytes]) -> list[PostResult]:
        self.batches += 1
        try:
            async with self._client().post(
                self.url(domain),
                data=encode_batch(envelopes),
                headers={"Content-Type": BATCH_TYPE},
            ) as response:
                status = response.status
                self._learn(domain, response.headers.get(BATCH_HEADER))
                body = await response.read()
        except (aiohttp_client_error(), OSError) as err:
            return [PostResult(PostOutcome.FAILED, f"{type(err).__name__}: {err}")] * len(envelopes)
        except TimeoutError:
            return [PostResult(PostOutcome.FAILED, "timed out")] * len(envelopes)
        if status != 200:
            # the remote no longer takes batches (or broke): retry these one by one
            self.batch_max.pop(domain, None)
            detail = f"batch answered HTTP {status}"
            return [PostResult(PostOutcome.FAILED, detail)] * len(envelopes)
        if body == ALL_ACCEPTED * len(envelopes):  # the usual answer, without a parse
            return [_ACCEPTED] * len(envelopes)
        try:
            answers = decode_statuses(body, len(envelopes))
        except EnvelopeError as err:
            self.batch_max.pop(domain, None)
            return [PostResult(PostOutcome.FAILED, f"bad batch answer: {err}")] * len(envelopes)
        return [_result(status, reason) for status, reason in answers]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None


class _Group:
    """The envelopes of one `post_many` call, which may travel in several batches: how many
    were taken into a batch so far, and their answers; its future resolves when the last
    answer is in."""

    __slots__ = ("envelopes", "future", "left", "results", "taken")

    def __init__(self, envelopes: list[bytes], future: asyncio.Future[None]) -> None:
        self.envelopes = envelopes
        self.taken = 0
        self.results: list[PostResult] = [_ACCEPTED] * len(envelopes)  # placeholders
        self.left = len(envelopes)
        self.future = future

    def settle(self, start: int, results: list[PostResult]) -> None:
        """The answers of envelopes start, start + 1, ..."""
        self.results[start : start + len(results)] = results
        self.left -= len(results)
        if not self.left and not self.future.done():
            self.future.set_result(None)


def _fit(envelopes: list[bytes], start: int, room: int, count: int) -> int:
    """The end of the longest run from `start` of at most `count` envelopes whose framed size
    fits in `room` bytes (C-level sums; a search only when the whole run does not fit)."""
    end = min(len(envelopes), start + count)
    if sum(map(len, envelopes[start:end])) + FRAME * (end - start) <= room:
        return end
    total = start
    for size in accumulate(map(len, envelopes[start:end])):
        if size + FRAME * (total - start + 1) > room:
            break
        total += 1
    return total


_ACCEPTED = PostResult(PostOutcome.ACCEPTED)


def _result(status: int, text: str) -> PostResult:
    """What one envelope's answer means (rmb-rs semantics)."""
    if status == 202:
        return _ACCEPTED
    if 400 <= status < 500:
        return PostResult(PostOutcome.REJECTED, text or f"HTTP {status}")
    return PostResult(PostOutcome.FAILED, f"HTTP {status} {text}".strip())
