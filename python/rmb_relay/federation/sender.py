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
"""

from __future__ import annotations

import asyncio
import enum
import ssl
from dataclasses import dataclass

import aiohttp

from rmb_relay import __version__
from rmb_relay.errors import ConfigError

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
                    body = await response.content.read(MAX_REASON)
            except (aiohttp.ClientError, OSError) as err:
                return PostResult(PostOutcome.FAILED, f"{type(err).__name__}: {err}")
            except TimeoutError:
                return PostResult(PostOutcome.FAILED, "timed out")
        if status == 202:
            return PostResult(PostOutcome.ACCEPTED)
        text = body.decode("utf-8", "replace").strip()
        if 400 <= status < 500:
            return PostResult(PostOutcome.REJECTED, text or f"HTTP {status}")
        return PostResult(PostOutcome.FAILED, f"HTTP {status} {text}".strip())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
