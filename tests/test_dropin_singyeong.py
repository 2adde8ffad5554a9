"""Issue 34: `rmb-relay singyeong` configured as the public singyeong server is, by
environment (AUTH, PORT, REDIS_DSN, CLUSTERING): a client with the password is unrestricted,
one without restricted; with CLUSTERING=true two instances on one Redis are one gateway."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rmb_relay.commands.singyeong import serve_argv
from rmb_relay.errors import ConfigError
from tests.conftest import WAIT, RedisServer, free_port
from tests.dropin_fixtures import Launched, banner_port, get, launch
from tests.helpers import eventually, http_exchange
from tests.sg_client import SgClient

PASSWORD = "2d1e29fbe6895b3693112ff-long-password"


def started(tmp_path: Path, env: dict[str, str]) -> Launched:
    return launch(["rmb-relay", "singyeong"], env=env, data_home=tmp_path)


async def test_auth_and_port_as_the_public_server(tmp_path: Path) -> None:
    port = free_port()
    relay = started(tmp_path, {"AUTH": PASSWORD, "PORT": str(port)})
    try:
        assert banner_port(relay) == port
        assert not any(PASSWORD in line for line in relay.output.lines)  # not echoed
        good = await SgClient.connect("127.0.0.1", port)
        assert (await good.identify("good", auth=PASSWORD))["d"]["restricted"] is False
        without = await SgClient.connect("127.0.0.1", port)
        assert (await without.identify("without"))["d"]["restricted"] is True
        await good.close()
        await without.close()
        assert (await get(port, "/metrics"))[0] == 200
    finally:
        assert relay.stop() == 0


async def test_clustering_joins_the_instances_on_redis_dsn(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    ports = [free_port(), free_port()]
    env = {"CLUSTERING": "true", "REDIS_DSN": redis_server.url, "COOKIE": "very long cookie"}
    relays = [started(tmp_path, {**env, "PORT": str(port)}) for port in ports]
    try:
        for relay, port in zip(relays, ports, strict=True):
            assert banner_port(relay) == port
        a = await SgClient.connect("127.0.0.1", ports[0])
        await a.identify("a", app_id="app-a")
        b = await SgClient.connect("127.0.0.1", ports[1])
        await b.identify("b", app_id="app-b")

        async def a_sees_b() -> bool:
            query = json.dumps({"application": "app-b", "ops": []}).encode()
            request = (
                f"POST /api/v1/query HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(query)}\r\n\r\n"
            ).encode() + query
            reply = await http_exchange("127.0.0.1", ports[0], request)
            return b'"client_id":"b"' in reply.replace(b" ", b"")

        await eventually(a_sees_b)  # b's identify reached instance A through Redis
        # a message to app-b sent on instance A arrives on instance B
        await a.dispatch(
            "SEND",
            {
                "target": {"application": "app-b", "ops": []},
                "payload": {"hello": "over redis"},
                "nonce": "n1",
            },
        )
        frame = await b.expect(4, "SEND")
        assert frame["d"]["payload"] == {"hello": "over redis"}
        await a.close()
        await b.close()
    finally:
        for relay in relays:
            assert relay.stop() == 0


def test_environment_to_flags() -> None:
    assert serve_argv({}) == ["-l", "[::]:4000", "--no-sbd", "--no-tunnel"]
    assert serve_argv({"PORT": "4567", "REDIS_DSN": "redis://x"})[:2] == ["-l", "[::]:4567"]
    assert "--redis" not in serve_argv({"REDIS_DSN": "redis://x"})  # unused without CLUSTERING
    clustered = serve_argv({"CLUSTERING": "true", "REDIS_DSN": "redis://:pw@h:6379/0"})
    assert clustered[-2:] == ["--redis", "redis://:pw@h:6379/0"]
    with pytest.raises(ConfigError, match="needs REDIS_DSN"):
        serve_argv({"CLUSTERING": "true"})
    with pytest.raises(ConfigError, match="PORT"):
        serve_argv({"PORT": "http"})


def test_a_bad_environment_is_a_clear_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rmb_relay", "singyeong"],
        env={"PATH": "/usr/bin:/bin", "CLUSTERING": "true"},
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert done.returncode != 0
    assert "CLUSTERING=true needs REDIS_DSN" in done.stderr
