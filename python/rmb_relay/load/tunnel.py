"""`rmb-load tunnel`: HTTP requests through the relay's tunnel (`/relay/<tenant>/<target>/...`)
to a target behind a connector, round-trip latency.

Each stream is one keep-alive HTTP/1.1 connection to the relay (`--concurrency` of them) with
one request out at a time; `--rate` paces them all (each connection's share), else each sends
its next request when the answer is in. Requests are built once (method, path, `--size` body,
the client token) and the answers are read by the connector's own HTTP client
(`dialects/tunnel/httpclient.py`, parsed in Rust); an answer counts as delivered when its status
is 2xx and, for the echo target, its body is as long as the request's.

Tokens: with `--secret` (and without `--anonymous`), the generator asks `POST /tunnel/token`
for a client-scoped token (`scope=client`) before anything else, so a wrong secret stops the
run at once (exit 2).
`--start-target` starts an echo target (`rmb_relay/load/echo_target.py`) and a connector
(`rmb-relay connector`, which asks for its own connector-scoped token) for the tenant, waits
until a request gets through, and stops both after the run. The tenant must exist on the relay
(`rmb-relay tenants add NAME --secret S`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from rmb_relay.errors import ConfigError
from rmb_relay.load.engine import Refused, Run, Stream, Streams

#: how long --start-target waits for its first request to get through
START_TIMEOUT = 30.0
#: answer bytes read with the head into one buffer (larger answers are read as they come)
WHOLE_LIMIT = 1 << 20
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8080/", help="the relay's HTTP URL")
    parser.add_argument("--tenant", default="load", help="the tunnel tenant")
    parser.add_argument(
        "--secret", help="the tenant's secret: fetch a client token (needed by --start-target)"
    )
    parser.add_argument(
        "--anonymous",
        action="store_true",
        help="send no client token (a tenant that does not require one); --secret is then "
        "only the connector's",
    )
    parser.add_argument("--token", help="a client token to send instead of fetching one")
    parser.add_argument("--target", default="echo", help="the connector's target name")
    parser.add_argument("--path", default="/echo", help="path under the target")
    parser.add_argument(
        "--request-path",
        help="send to this path instead of /relay/TENANT/TARGET/PATH (e.g. the target itself "
        "or another tunnel, for a baseline with the same generator)",
    )
    parser.add_argument(
        "--echo-check",
        action="store_true",
        help="an answer counts only if its body is as long as the request's (an echo target; "
        "on with --start-target)",
    )
    parser.add_argument("--method", choices=METHODS, default="POST")
    parser.add_argument(
        "--concurrency", type=int, default=16, help="keep-alive connections, one request each"
    )
    parser.add_argument(
        "--start-target",
        action="store_true",
        help="start an echo target and a connector for --tenant (stopped after the run)",
    )
    parser.add_argument(
        "--connector-msgpack", action="store_true", help="--start-target's connector: msgpack"
    )


def _base(url: str) -> tuple[str, str, int]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(f"--url must be http://HOST[:PORT]/, got {url!r}")
    return f"http://{parts.netloc}", parts.hostname, parts.port or 80


def client_token(base: str, tenant: str, secret: str) -> str:
    """A client-scoped token for `tenant` from `POST /tunnel/token`; `Refused` says why not."""
    form = urllib.parse.urlencode(
        {
            "grant_type": "client_credentials",
            "client_id": tenant,
            "client_secret": secret,
            "scope": "client",
        }
    ).encode()
    try:
        with urllib.request.urlopen(f"{base}/tunnel/token", form, timeout=10) as reply:
            return str(json.loads(reply.read())["access_token"])
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:200]
        what = (
            f"the relay refused tenant {tenant!r}'s secret"
            if err.code == 401
            else f"the relay refused a client token for tenant {tenant!r}"
        )
        raise Refused(f"tunnel: {what} (POST /tunnel/token: {err.code} {detail})") from None
    except (OSError, ValueError, KeyError) as err:
        raise Refused(f"tunnel: relay {base} unreachable: {err}") from None


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _started(args: argparse.Namespace, base: str) -> Iterator[None]:
    """The echo target and a connector for the run (`--start-target`)."""
    if args.secret is None:
        raise ConfigError("--start-target needs --secret (the connector logs in with it)")
    port = _free_port()
    py = sys.executable
    target = subprocess.Popen(
        [py, "-m", "rmb_relay.load.echo_target", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    processes = [target]
    try:
        assert target.stdout is not None
        if target.stdout.readline().strip() != b"ready":
            raise Refused("tunnel: the echo target did not start")
        connector = subprocess.Popen(
            [py, "-m", "rmb_relay", "connector", "--server", base, "--tenant", args.tenant,
             "--secret", args.secret, "--target", f"{args.target}=http://127.0.0.1:{port}",
             *(["--msgpack"] if args.connector_msgpack else [])],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        processes.append(connector)
        args.started = {"echo target": target.pid, "connector": connector.pid}
        _wait_through(args, connector)
        yield
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    stream.close()


def _wait_through(args: argparse.Namespace, connector: subprocess.Popen[bytes]) -> None:
    """Until one request gets through the tunnel (the connector prints nothing when up)."""
    deadline = time.monotonic() + START_TIMEOUT
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    url = args.base + (args.request_path or f"/relay/{args.tenant}/{args.target}{args.path}")
    last = ""
    while time.monotonic() < deadline:
        if connector.poll() is not None:
            assert connector.stderr is not None
            tail = connector.stderr.read().decode(errors="replace").strip().splitlines()
            raise Refused(f"tunnel: the connector exited: {tail[-1] if tail else '?'}")
        request = urllib.request.Request(url, b"x", headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                if reply.status == 200:
                    return
        except urllib.error.HTTPError as err:
            last = f"{err.code}"
        except OSError as err:
            last = str(err)
        time.sleep(0.1)  # polling a process we do not control; not a test's synchronisation
    raise Refused(f"tunnel: no request got through the connector in {START_TIMEOUT:.0f} s ({last})")


@contextlib.contextmanager
def prepare(args: argparse.Namespace) -> Iterator[list[Any]]:
    if args.size is None:
        args.size = 1024
    if not 0 <= args.size <= 64 << 20:
        raise ConfigError("--size must be 0..64 MiB for tunnel")
    if args.concurrency < 1:
        raise ConfigError("--concurrency must be positive")
    if args.method in ("GET", "DELETE") and args.size:
        args.size = 0  # no body
    args.base, args.host, args.port = _base(args.url)
    wants_token = args.secret is not None and not args.anonymous and args.token is None
    if wants_token:
        args.token = client_token(args.base, args.tenant, args.secret)
    with contextlib.ExitStack() as stack:
        if args.start_target:
            stack.enter_context(_started(args, args.base))
        yield list(range(args.concurrency))


def describe(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "url": args.url,
        "tenant": args.tenant,
        "target": args.target,
        "method": args.method,
        "streams": args.concurrency,
        "started_target": bool(args.start_target),
    }


def workload(args: argparse.Namespace, shares: list[int], run: Run) -> Streams:
    request = _request(args)
    return Streams([Connection(index, args, request, run) for index in shares])


def _request(args: argparse.Namespace) -> bytes:
    path = args.request_path or f"/relay/{args.tenant}/{args.target}{args.path}"
    head = [
        f"{args.method} {path} HTTP/1.1",
        f"Host: {args.host}:{args.port}",
        "Content-Type: application/octet-stream",
        f"Content-Length: {args.size}",
    ]
    if args.token:
        head.append(f"Authorization: Bearer {args.token}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + os.urandom(args.size)


class Connection(Stream):
    """One keep-alive connection to the relay; one request at a time."""

    def __init__(self, index: int, args: argparse.Namespace, request: bytes, run: Run) -> None:
        super().__init__(index, run)
        self.args = args
        self.request = request
        self.conn: Any = None
        self.echo = (args.echo_check or args.start_target) and args.method not in (
            "GET",
            "DELETE",
        )

    async def connect(self) -> None:
        from rmb_relay.dialects.tunnel.httpclient import TargetConnection

        loop = asyncio.get_running_loop()
        started = time.perf_counter_ns()
        try:
            _, self.conn = await loop.create_connection(
                TargetConnection, self.args.host, self.args.port
            )
        except OSError as err:
            raise Refused(f"tunnel: relay {self.args.base} unreachable: {err}") from None
        self.run.stats.connect_ns.append(time.perf_counter_ns() - started)

    async def send(self, n: int) -> int:
        from rmb_relay.dialects.tunnel.httpclient import TargetError

        run, size = self.run, self.args.size
        first = self.sent
        for _ in range(n):
            if run.stopping:
                break
            conn = self.conn
            if conn is None or conn.closed or (conn.received_any and not conn.reusable):
                await self._reconnect()
                conn = self.conn
            head_future = conn.start(False, WHOLE_LIMIT)
            started = time.time_ns()
            conn.transport.write(self.request)
            try:
                status, _headers, body = await head_future
                if body is None:
                    body = b"".join([c async for c in _chunks(conn)])
            except TargetError as err:
                run.refused(self, f"connection: {err}")
                self.sent += 1
                await self._reconnect()
                continue
            now = time.time_ns()
            self.sent += 1
            if not 200 <= status < 300:
                run.refused(self, f"HTTP {status}")
            elif self.echo and len(body) != size:
                run.refused(self, f"echo of {len(body)} bytes, not {size}")
            else:
                run.delivered(self, started, now, size)
        done, self.sent = self.sent - first, first  # the engine counts them
        return done

    async def _reconnect(self) -> None:
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.close()
        self.conn = None
        await self.connect()

    async def close(self) -> None:
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.close()


async def _chunks(conn: Any) -> Any:
    while (chunk := await conn.next_chunk()) is not None:
        yield chunk
