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

A remote that announces batches (`batch.py`) gets them: `post` then parks the envelope in the
remote's pending list and up to `concurrency` batch tasks per remote post whatever is pending,
one batch after another, and hand each caller its envelope's own answer. Nothing waits for a
batch to fill: an idle remote gets a batch of one at once, a busy one gets the envelopes that
arrived while the previous batches were in flight.
"""

from __future__ import annotations

import asyncio
import enum
import ssl
from collections import deque
from dataclasses import dataclass

import aiohttp

from rmb_relay import __version__
from rmb_relay.errors import ConfigError, EnvelopeError
from rmb_relay.federation.batch import (
    BATCH_HEADER,
    BATCH_TYPE,
    MAX_BATCH_ITEMS,
    batch_size,
    decode_statuses,
    encode_batch,
)

#: rmb-rs: per-request timeout 3 s, connect 2 s
DEFAULT_TIMEOUT = 3.0
CONNECT_TIMEOUT = 2.0
#: requests in flight (and pooled connections) per remote relay
DEFAULT_CONCURRENCY = 32
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
        cafile: str | None = None,
    ) -> None:
        if concurrency < 1:
            raise ConfigError("--federation-concurrency must be at least 1")
        if not timeout > 0:
            raise ConfigError("--federation-timeout must be a positive number of seconds")
        self.url_template = check_url_template(url_template)
        self.concurrency = concurrency
        self._tls = client_tls(cafile)
        self._timeout = aiohttp.ClientTimeout(total=timeout, connect=min(CONNECT_TIMEOUT, timeout))
        self._session: aiohttp.ClientSession | None = None
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._urls: dict[str, str] = {}
        #: remotes that take batches -> their body limit (learnt from their answers)
        self.batch_max: dict[str, int] = {}
        self._pending: dict[str, deque[tuple[bytes, asyncio.Future[PostResult]]]] = {}
        self._batchers: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: batches posted (for the benchmark and tests: did batching happen)
        self.batches = 0

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0,
                limit_per_host=self.concurrency,
                keepalive_timeout=KEEPALIVE_SECONDS,
                ssl=self._tls,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                headers={"User-Agent": f"rmb-relay/{__version__}"},
                auto_decompress=False,
            )
        return self._session

    def url(self, domain: str) -> str:
        url = self._urls.get(domain)
        if url is None:
            url = self._urls[domain] = self.url_template.format(domain=domain)
        return url

    async def post(self, domain: str, envelope: bytes) -> PostResult:
        """One attempt; never raises for anything the remote or the network does."""
        limit = self.batch_max.get(domain)
        if limit is not None and batch_size(envelope) <= limit:
            return await self._post_in_batch(domain, envelope)
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
            except (aiohttp.ClientError, OSError) as err:
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

    async def _post_in_batch(self, domain: str, envelope: bytes) -> PostResult:
        future: asyncio.Future[PostResult] = asyncio.get_running_loop().create_future()
        pending = self._pending.get(domain)
        if pending is None:
            pending = self._pending[domain] = deque()
        pending.append((envelope, future))
        if self._batchers.get(domain, 0) < self.concurrency:
            self._batchers[domain] = self._batchers.get(domain, 0) + 1
            task = asyncio.get_running_loop().create_task(self._batcher(domain))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await future

    async def _batcher(self, domain: str) -> None:
        """Post what is pending for `domain`, batch after batch, until nothing is."""
        pending = self._pending[domain]
        try:
            while pending:
                limit = self.batch_max.get(domain, 0)
                batch: list[tuple[bytes, asyncio.Future[PostResult]]] = []
                size = 0
                while pending and len(batch) < MAX_BATCH_ITEMS:
                    envelope = pending[0][0]
                    if batch and size + batch_size(envelope) > limit:
                        break
                    batch.append(pending.popleft())
                    size += batch_size(envelope)
                results = await self._post_batch(domain, [env for env, _ in batch])
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)
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
        except (aiohttp.ClientError, OSError) as err:
            return [PostResult(PostOutcome.FAILED, f"{type(err).__name__}: {err}")] * len(envelopes)
        except TimeoutError:
            return [PostResult(PostOutcome.FAILED, "timed out")] * len(envelopes)
        if status != 200:
            # the remote no longer takes batches (or broke): retry these one by one
            self.batch_max.pop(domain, None)
            detail = f"batch answered HTTP {status}"
            return [PostResult(PostOutcome.FAILED, detail)] * len(envelopes)
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


_ACCEPTED = PostResult(PostOutcome.ACCEPTED)


def _result(status: int, text: str) -> PostResult:
    """What one envelope's answer means (rmb-rs semantics)."""
    if status == 202:
        return _ACCEPTED
    if 400 <= status < 500:
        return PostResult(PostOutcome.REJECTED, text or f"HTTP {status}")
    return PostResult(PostOutcome.FAILED, f"HTTP {status} {text}".strip())
