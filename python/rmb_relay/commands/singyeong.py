"""`rmb-relay singyeong [serve flags]`: the 신경 gateway configured the way the public singyeong
server is, by environment, so a deployment's unit file or container spec moves over with its
variables (docs/singyeong.md, "Moving a singyeong deployment over").

The variables are the public server's (queer/singyeong: config/config.exs; `CLUSTERING` and
`REDIS_DSN` from its Redis-clustered releases) and each becomes one of our flags; the relay that
runs is `rmb-relay serve` with them, SBD and the tunnel off:

- `AUTH` (the password; clients without it are restricted): the gateway password, passed as
  `SINGYEONG_AUTH` so it stays out of `ps`;
- `PORT` (the port, on every interface): `-l [::]:PORT`, 4000 when unset (the public server's
  development default);
- `CLUSTERING="true"` (join the other nodes): `--redis REDIS_DSN`, the instances sharing that
  Redis are one gateway (docs/cluster.md);
- `REDIS_DSN` (where cluster members find each other): that Redis; needed with
  `CLUSTERING=true`, unused without, as there;
- `COOKIE` (Erlang distribution's shared secret): not needed, the instances meet only through
  Redis, which `REDIS_DSN`'s password guards.

Flags after the command are `rmb-relay serve`'s and win over the environment.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

from rmb_relay.dialects.singyeong.settings import AUTH_ENV
from rmb_relay.errors import ConfigError

NAME = "singyeong"
HELP = "the 신경 gateway configured by the public server's environment (AUTH, PORT, ...)"

log = logging.getLogger("rmb_relay")

#: the public server's port when PORT is unset (its development configuration)
DEFAULT_PORT = 4000
#: variables of the public server's later releases that have no meaning here
IGNORED = ("GOSSIP_AUTH", "ZONE")


def serve_argv(env: Mapping[str, str]) -> list[str]:
    """The `rmb-relay serve` flags the public server's variables in `env` mean. Raises
    ConfigError for values it would refuse too."""
    port_text = env.get("PORT") or str(DEFAULT_PORT)
    try:
        port = int(port_text)
        if not 0 <= port <= 65535:
            raise ValueError
    except ValueError:
        raise ConfigError(f"PORT={port_text!r}: must be a port number") from None
    argv = ["-l", f"[::]:{port}", "--no-sbd", "--no-tunnel"]
    clustering = env.get("CLUSTERING") == "true"
    dsn = env.get("REDIS_DSN")
    if clustering:
        if not dsn:
            raise ConfigError("CLUSTERING=true needs REDIS_DSN: the instances meet through Redis")
        argv += ["--redis", dsn]
    return argv


def main(argv: Sequence[str], prog: str = "rmb-relay singyeong") -> int:
    from rmb_relay.commands import serve

    env = os.environ
    try:
        flags = serve_argv(env)
    except ConfigError as err:
        raise SystemExit(f"{prog}: {err}") from None
    auth = env.get("AUTH")
    if auth and not env.get(AUTH_ENV):
        os.environ[AUTH_ENV] = auth  # read by the gateway's settings, as --sg-auth's default
    if env.get("REDIS_DSN") and env.get("CLUSTERING") != "true":
        log.warning("singyeong: REDIS_DSN is unused without CLUSTERING=true (as upstream)")
    for name in IGNORED:
        if env.get(name):
            log.warning("singyeong: %s has no meaning here; ignored", name)
    return serve.main([*flags, *argv], prog)
