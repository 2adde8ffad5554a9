"""`rmb-peer`: the public rmb-peer's command line (spec/rmb.md §5.1) and startup (§5.2).

Launch lines written for the public rmb-peer work unchanged: the same flags, defaults and
deprecated aliases, and the same log line once a relay is connected
(`now connected to relay Some("<domain>")`), which operators and scripts wait for.

Twins come from tfchain through `--substrate URL` (repeatable, with failover, twins/substrate.py;
by default the main tfchain node, as upstream, so `rmb-peer -m "<words>"` alone joins the public
grid through wss://relay.grid.tf:443), or, the explicit offline choice, from the embedded
directory that `rmb-relay twins` manages with `--twins sqlite:PATH`.

Startup: derive the signing key and the secp256k1 key from the secret; find the twin whose
account is ours; unless `--no-update`, publish our relays' domains and our `pk` when the
directory holds something else (on chain: a signed `update_twin`, waited for until
finalized); then connect every relay and serve the msgbus until SIGINT
or SIGTERM. Errors before serving are one line on stderr and exit code 1, as rmb-peer's.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from rmb_relay import __version__
from rmb_relay._core import SigningKey
from rmb_relay.cli_support import HelpFormatter, setup_logging
from rmb_relay.errors import ChainError, ConfigError, CoreError, RedisUnavailable
from rmb_relay.identity import KeyType, secret_from_phrase, signing_key
from rmb_relay.twins import Twin, TwinDirectory
from rmb_relay.twins.local import SqliteTwinDirectory, default_twins_path

__all__ = ["PeerConfig", "main", "parse_args", "parser"]

log = logging.getLogger("rmb_relay.peer")

DEFAULT_REDIS = "redis://localhost:6379"
DEFAULT_SUBSTRATE = "wss://tfchain.grid.tf:443"
DEFAULT_RELAY = "wss://relay.grid.tf:443"
#: rmb-peer connects to at most this many relays (the chain holds at most 4, spec §8.5)
MAX_RELAYS = 4
#: how long a twin lookup is cached (a peer sees a twin's new key or relays after this)
TWIN_CACHE_TTL = 60.0
#: per-attempt timeout towards a chain node (rmb-rs: 12 s), twins/substrate.py
DEFAULT_SUBSTRATE_TIMEOUT = 12.0


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rmb-peer",
        description="RMB peer: holds a twin's identity, keeps its relay connections, and lets "
        "local programs send and serve RMB requests through Redis (the msgbus).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rmb-peer {__version__}")
    secret = parser.add_mutually_exclusive_group(required=True)
    secret.add_argument(
        "-m",
        "--mnemonic",
        metavar="PHRASE",
        help="the twin's BIP39 mnemonic, or 0x + 64 hex digits of its seed",
    )
    secret.add_argument("--mnemonics", metavar="PHRASE", help="deprecated alias of --mnemonic")
    secret.add_argument("--seed", metavar="0xHEX", help="deprecated alias of --mnemonic")
    parser.add_argument(
        "-k",
        "--key-type",
        type=str.lower,
        choices=("sr25519", "ed25519"),
        default="sr25519",
        help="signing key type",
    )
    parser.add_argument(
        "-r", "--redis", default=DEFAULT_REDIS, metavar="URL", help="the msgbus Redis"
    )
    parser.add_argument(
        "-s",
        "--substrate",
        action="append",
        metavar="URL",
        help="tfchain node, ws:// or wss:// (repeatable: failover in order; default "
        f"{DEFAULT_SUBSTRATE}, as upstream, unless --twins is given)",
    )
    parser.add_argument(
        "--substrate-timeout",
        type=float,
        default=DEFAULT_SUBSTRATE_TIMEOUT,
        metavar="SECONDS",
        help="per-attempt timeout towards a chain node before the next one is tried",
    )
    parser.add_argument(
        "--twins",
        metavar="sqlite:PATH",
        help="embedded twin directory instead of a chain, the offline choice (`rmb-relay "
        f"twins` fills it; e.g. sqlite:{default_twins_path()})",
    )
    parser.add_argument(
        "--relay",
        action="append",
        metavar="URL",
        help=f"relay to connect to, wss://DOMAIN[:PORT] (repeatable, up to {MAX_RELAYS}; "
        f"default {DEFAULT_RELAY})",
    )
    parser.add_argument(
        "--no-update",
        action="store_true",
        help="do not publish this peer's relays and e2e key in the twin directory",
    )
    parser.add_argument(
        "-u", "--uploads", metavar="PATH", help="accepted for compatibility; unused (as upstream)"
    )
    parser.add_argument("-d", "--debug", action="count", default=0, help="more logging (-d, -dd)")
    return parser


@dataclass(frozen=True)
class PeerConfig:
    secret: str
    key_type: KeyType
    redis: str
    twins: Path
    relays: tuple[str, ...]
    update: bool
    debug: int
    #: tfchain nodes; empty: the embedded directory `twins`
    substrate: tuple[str, ...] = ()
    substrate_timeout: float = DEFAULT_SUBSTRATE_TIMEOUT

    @property
    def domains(self) -> frozenset[str]:
        return frozenset(urlsplit(url).hostname or "" for url in self.relays)


def relay_url(url: str) -> str:
    """A --relay value checked: ws:// or wss://, and a domain name as host (rmb-peer publishes
    the domain, so an IP address could never be found again). Raises ConfigError."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss"):
        raise ConfigError(f"--relay {url!r}: must be a ws:// or wss:// URL")
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        is_ip = False
    else:
        is_ip = True
    if not host or is_ip:
        raise ConfigError(f"--relay {url!r}: relay URL must contain a domain name")
    try:
        parts.port  # noqa: B018 - raises for a bad port
    except ValueError:
        raise ConfigError(f"--relay {url!r}: bad port") from None
    return url


def parse_args(argv: Sequence[str] | None = None) -> PeerConfig:
    """The flags as a PeerConfig; argparse exits on unknown flags, ConfigError on bad values."""
    from rmb_relay.twins.local import parse_twins_url

    args = parser().parse_args(argv)
    secret = args.mnemonic or args.mnemonics or args.seed
    substrate: tuple[str, ...] = ()
    if args.twins is not None:
        twins = parse_twins_url(args.twins)
        if args.substrate:
            log.warning("--substrate is ignored: twins are read from %s", args.twins)
    else:
        from rmb_relay.twins.substrate import check_url

        twins = default_twins_path()  # unused: the chain is the directory
        substrate = tuple(check_url(url) for url in args.substrate or [DEFAULT_SUBSTRATE])
    if not args.substrate_timeout > 0:
        raise ConfigError("--substrate-timeout must be a positive number of seconds")
    relays = args.relay or [DEFAULT_RELAY]
    if len(relays) > MAX_RELAYS:
        raise ConfigError(f"--relay given {len(relays)} times: at most {MAX_RELAYS} relays")
    return PeerConfig(
        secret=secret,
        key_type="ed25519" if args.key_type == "ed25519" else "sr25519",
        redis=args.redis,
        twins=twins,
        relays=tuple(relay_url(url) for url in relays),
        update=not args.no_update,
        debug=args.debug,
        substrate=substrate,
        substrate_timeout=args.substrate_timeout,
    )


async def serve(config: PeerConfig) -> None:
    from rmb_relay.peer.e2e import E2eKey
    from rmb_relay.peer.gateway import Gateway
    from rmb_relay.sdk.resp import RespClient
    from rmb_relay.twins.cache import CachedTwinDirectory

    try:
        secret = secret_from_phrase(config.secret)
        key = signing_key(secret, config.key_type)
    except CoreError as err:
        raise ConfigError(f"cannot derive the signing key: {err}") from None
    e2e = E2eKey(secret)
    RespClient(config.redis)  # checks the URL before anything else starts
    directory: TwinDirectory
    if config.substrate:
        directory, twin = await _chain_twin(config, key, e2e.public_key)
    else:
        directory, twin = _local_twin(config, key, e2e.public_key)
    encrypt = twin.pk == e2e.public_key
    if not encrypt:
        log.warning(
            "twin %d does not publish this peer's e2e key: sending plaintext, since no "
            "receiver could decrypt what this peer encrypts (run without --no-update)",
            twin.id,
        )
    log.info("twin: %d", twin.id)
    gateway = Gateway(
        twin.id,
        key,
        e2e,
        CachedTwinDirectory(directory, ttl=TWIN_CACHE_TTL),
        redis_url=config.redis,
        relays=config.relays,
        encrypt=encrypt,
    )
    try:
        await gateway.redis.execute((b"PING",))
    except RedisUnavailable as err:
        log.warning("%s; the msgbus starts when redis answers", err)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await gateway.start()
    try:
        await stop.wait()
    finally:
        log.info("rmb-peer stopping")
        await gateway.close()
        await gateway.directory.close()


def _local_twin(config: PeerConfig, key: SigningKey, pk: bytes) -> tuple[TwinDirectory, Twin]:
    """Our twin in the embedded directory, updated there when it differs."""
    directory = SqliteTwinDirectory(config.twins)
    twin = directory.find_account(key.public_key)
    if twin is None:
        directory._close_quietly()
        raise ConfigError("no twin found on this network with given key")
    if config.update and (twin.relays != config.domains or twin.pk != pk):
        twin = Twin(twin.id, twin.account, config.domains, pk)
        directory.add(twin)
        _log_update(twin)
    return directory, twin


async def _chain_twin(config: PeerConfig, key: SigningKey, pk: bytes) -> tuple[TwinDirectory, Twin]:
    """Our twin on tfchain; a signed update_twin, waited for, when it differs (§5.2)."""
    from rmb_relay.twins.substrate import SubstrateClient, SubstrateTwinDirectory

    directory = SubstrateTwinDirectory(
        SubstrateClient(config.substrate, timeout=config.substrate_timeout)
    )
    try:
        twin = await directory.find_account(key.public_key)
        if twin is None:
            raise ConfigError("no twin found on this network with given key")
        if config.update and (twin.relays != config.domains or twin.pk != pk):
            log.info("publishing relays and e2e key of twin %d with update_twin", twin.id)
            await directory.update_twin(key, config.domains, pk)
            twin = Twin(twin.id, twin.account, config.domains, pk)
            _log_update(twin)
    except BaseException:
        await directory.close()
        raise
    return directory, twin


def _log_update(twin: Twin) -> None:
    log.info(
        "twin %d updated: relays %s, pk %s",
        twin.id,
        ",".join(sorted(twin.relays or ())),
        twin.pk.hex() if twin.pk else None,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """The `rmb-peer` console script."""
    try:
        config = parse_args(argv)
    except ConfigError as err:
        raise SystemExit(f"rmb-peer: {err}") from None
    setup_logging(config.debug)
    import uvloop

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(config))
    except (ConfigError, ChainError, OSError) as err:
        print(f"rmb-peer: {err}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
