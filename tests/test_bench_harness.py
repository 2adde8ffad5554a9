"""The tunnel benchmark's own parts (bench/tunnel.py): its echo targets (`bench/echo_target.py`
and `bench/echo_target.c`) speak the HTTP/1.1 they claim, and its C generator
(`bench/http_load.c`) counts what it is answered and refuses a wrong answer. The figures of
issue 13 rest on them, so they are tested like the product: real processes, real sockets."""

from __future__ import annotations

import array
import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from bench.floor_build import compiled

from tests.conftest import WAIT
from tests.redis_process import free_port

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def programs() -> Iterator[dict[str, Path]]:
    with (
        compiled(BENCH / "echo_target.c") as target,
        compiled(BENCH / "http_load.c", "-lm") as load,
    ):
        yield {"echo_target": target, "http_load": load}


@pytest.fixture(params=["c", "lean"])
def echo_port(request: pytest.FixtureRequest, programs: dict[str, Path]) -> Iterator[int]:
    """The port of a running echo target: the C one, or the Python one."""
    port = free_port()
    if request.param == "c":
        command = [str(programs["echo_target"]), "--port", str(port)]
    else:
        command = [sys.executable, "-m", "bench.echo_target", "--port", str(port)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, cwd=BENCH.parent) as process:
        assert process.stdout is not None
        assert process.stdout.readline()  # it listens
        yield port
        process.terminate()


async def exchange(port: int, data: bytes) -> bytes:
    """Everything the server sends for `data` until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(-1), WAIT)
    writer.close()
    return answer


def answers(stream: bytes) -> list[tuple[bytes, dict[bytes, bytes], bytes]]:
    """The (status line, headers, body) of each Content-Length answer in `stream`."""
    out = []
    while stream:
        head, _, rest = stream.partition(b"\r\n\r\n")
        status, *lines = head.split(b"\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(b":") for x in lines)}
        length = int(headers[b"content-length"])
        out.append((status, headers, rest[:length]))
        stream = rest[length:]
    return out


def post(body: bytes, extra: str = "") -> bytes:
    return (
        f"POST /echo HTTP/1.1\r\nHost: t\r\n{extra}Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


async def test_pipelined_keep_alive_requests_are_echoed_in_order(echo_port: int) -> None:
    first, second = os.urandom(1024), os.urandom(20_000)
    stream = await exchange(
        echo_port, post(first) + post(second) + post(b"", "Connection: close\r\n")
    )
    got = answers(stream)
    assert [status for status, _, _ in got] == [b"HTTP/1.1 200 OK"] * 3
    assert [body for _, _, body in got] == [first, second, b""]
    assert got[2][1][b"connection"] == b"close"


async def test_a_chunked_body_is_answered_whole(echo_port: int) -> None:
    request = (
        b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        b"5\r\nhello\r\n4;name=value\r\n abc\r\n0\r\nTrailer: x\r\n\r\n"
    )
    ((status, _, body),) = answers(await exchange(echo_port, request))
    assert status == b"HTTP/1.1 200 OK"
    assert body == b"hello abc"


async def test_http10_closes_after_its_answer(echo_port: int) -> None:
    stream = await exchange(echo_port, b"POST /echo HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi")
    assert answers(stream)[0][2] == b"hi"


@pytest.mark.parametrize(
    "head",
    [
        b"POST /echo HTTP/1.1\r\nContent-Length: zz\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
    ],
)
async def test_malformed_requests_get_400_and_a_close(echo_port: int, head: bytes) -> None:
    assert (await exchange(echo_port, head)).startswith(b"HTTP/1.1 400 Bad Request\r\n")


async def test_a_large_body_is_echoed_byte_for_byte(echo_port: int) -> None:
    body = os.urandom(3 << 20)
    ((status, _, echoed),) = answers(await exchange(echo_port, post(body, "Connection: close\r\n")))
    assert status == b"HTTP/1.1 200 OK"
    assert echoed == body


async def run_load(
    programs: dict[str, Path], port: int, tmp_path: Path, *, rate: float = 0, expect: int = 256
) -> tuple[int, dict[str, float], str, array.array[float]]:
    """One short `http_load` run against `port` posting 256 bytes: its exit status, summary,
    stderr and latencies."""
    request, latencies = tmp_path / "request", tmp_path / "latencies"
    request.write_bytes(post(os.urandom(256)))
    process = await asyncio.create_subprocess_exec(
        str(programs["http_load"]), str(port), "4", "0.05", "0.3", str(rate), "poisson",
        str(request), str(expect), str(latencies),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(b""), WAIT)  # stdin closed: it may end
    lines = out.decode().splitlines()
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    if summary:
        assert lines[:2] == ["warm", "end"]
    recorded = array.array("d")
    if latencies.exists():
        recorded.frombytes(latencies.read_bytes())
    assert process.returncode is not None
    return process.returncode, summary, err.decode(), recorded


@pytest.mark.parametrize("rate", [0, 2000])
async def test_the_c_generator_counts_checked_answers(
    programs: dict[str, Path], echo_port: int, tmp_path: Path, rate: float
) -> None:
    status, summary, err, latencies = await run_load(programs, echo_port, tmp_path, rate=rate)
    assert status == 0, err
    assert summary["answered"] > 0
    assert summary["window"] > 0
    assert summary["cpu"] >= 0
    assert len(latencies) == summary["latencies"] >= summary["answered"]
    assert all(0 < latency < WAIT for latency in latencies)


async def test_the_c_generator_refuses_an_answer_of_another_length(
    programs: dict[str, Path], echo_port: int, tmp_path: Path
) -> None:
    status, summary, err, _ = await run_load(programs, echo_port, tmp_path, expect=255)
    assert status == 3
    assert not summary
    assert "another length" in err
