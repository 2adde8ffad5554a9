"""`rmb-relay twins add|list|rm|show`: manage the embedded twin directory.

The commands edit the SQLite file directly, so they work while a relay runs on it; the relay
sees a change once its cache entry expires (`--twin-cache-ttl`, default 60 s, and 5 s for a
twin it did not find). Errors are one line on stderr and exit code 2, never a traceback: the
user is an operator at a shell, and the fix is always in what they typed or in the file.

`rmb-relay` wires these in as a subcommand (`add_twins_subcommands` + `twins_main`); the module
also runs on its own as `python -m rmb_relay.twins.cli ACTION ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rmb_relay.errors import ConfigError, CoreError, NodeError, RelayError
from rmb_relay.twins import ACCOUNT_LEN, MAX_TWIN_ID, PK_LEN, Twin, format_relays
from rmb_relay.twins.local import SqliteTwinDirectory, default_twins_path, parse_twins_url

if TYPE_CHECKING:
    from rmb_relay.identity import KeyType

__all__ = ["default_twins_path", "main", "twins_main"]

#: --key-type when --mnemonic/--seed is given without it (rmb-peer's default too)
DEFAULT_KEY_TYPE: KeyType = "sr25519"


def _hex(text: str, length: int, what: str) -> bytes:
    """Hex with an optional 0x prefix, of exactly `length` bytes."""
    digits = text.strip().removeprefix("0x")
    try:
        raw = bytes.fromhex(digits)
    except ValueError:
        raise ConfigError(f"{what} must be hex ({2 * length} digits, 0x optional)") from None
    if len(raw) != length:
        raise ConfigError(
            f"{what} must be {length} bytes ({2 * length} hex digits), got {len(raw)} bytes"
        )
    return raw


def _twin_id(value: int) -> int:
    if not 0 < value <= MAX_TWIN_ID:
        raise ConfigError(f"twin id must be 1..{MAX_TWIN_ID}, got {value}")
    return value


def _directory_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--twins",
        metavar="sqlite:PATH",
        default=None,
        help=f"twin directory file (default: sqlite:{default_twins_path()})",
    )


def _add_actions(parser: argparse.ArgumentParser) -> None:
    """The four actions, on whichever parser stands for `rmb-relay twins`."""
    actions = parser.add_subparsers(dest="twins_command", metavar="ACTION", required=True)

    add = actions.add_parser(
        "add",
        help="add a twin, or replace the one with that id",
        description="Add a twin, or replace the one with that id. The account key is given "
        "as hex, or derived from a mnemonic or seed as rmb-peer derives it.",
    )
    _directory_argument(add)
    add.add_argument("--id", type=int, required=True, help="twin id (1..4294967295)")
    key = add.add_mutually_exclusive_group(required=True)
    key.add_argument("--account", metavar="HEX", help="32-byte account public key")
    key.add_argument("--mnemonic", metavar="WORDS", help="BIP39 phrase to derive the account from")
    key.add_argument("--seed", metavar="0xHEX", help="32-byte hex seed to derive the account from")
    add.add_argument(
        "--key-type",
        choices=("sr25519", "ed25519"),
        default=None,
        help=f"scheme for --mnemonic/--seed (default: {DEFAULT_KEY_TYPE})",
    )
    add.add_argument(
        "--relay",
        action="append",
        metavar="DOMAIN",
        help="bare domain of a relay serving the twin (repeatable; "
        "omitted: relay info not set, as for a twin that never published one)",
    )
    add.add_argument("--pk", metavar="HEX", help="33-byte compressed secp256k1 key for e2e")
    add.add_argument(
        "--devchain",
        metavar="URL",
        help="add the twin to a running `rmb-relay devchain` (ws://HOST:PORT) instead of a "
        "file; the node announces it with a TwinStored event",
    )

    lister = actions.add_parser("list", help="list all twins")
    _directory_argument(lister)
    lister.add_argument("--json", action="store_true", help="a JSON array instead of a table")

    show = actions.add_parser("show", help="show one twin")
    _directory_argument(show)
    show.add_argument("id", type=int, help="twin id")
    show.add_argument("--json", action="store_true", help="a JSON object instead of text")

    remove = actions.add_parser("rm", help="remove a twin")
    _directory_argument(remove)
    remove.add_argument("id", type=int, help="twin id")


def _account(args: argparse.Namespace) -> bytes:
    if args.account is not None:
        if args.key_type is not None:
            raise ConfigError("--key-type applies to --mnemonic/--seed, not to --account")
        return _hex(args.account, ACCOUNT_LEN, "--account")
    if args.seed is not None and not args.seed.strip().startswith("0x"):
        raise ConfigError("--seed must be 0x followed by 64 hex digits")
    # imported here: the Rust signing key is only needed when deriving
    from rmb_relay.identity import signing_key

    secret = args.mnemonic if args.mnemonic is not None else args.seed
    try:
        return signing_key(secret, _key_type(args.key_type)).public_key
    except CoreError as err:
        raise ConfigError(f"cannot derive the account key: {err}") from None


def _key_type(name: str | None) -> KeyType:
    # argparse `choices` already limited the name; this narrows it for the type checker
    return "ed25519" if name == "ed25519" else DEFAULT_KEY_TYPE


def _as_json(twin: Twin) -> dict[str, Any]:
    return {
        "id": twin.id,
        "account": twin.account.hex(),
        "relays": None if twin.relays is None else sorted(twin.relays),
        "pk": None if twin.pk is None else twin.pk.hex(),
    }


def _relays_text(twin: Twin) -> str:
    if twin.relays is None:
        return "(not set)"
    return ",".join(sorted(twin.relays)) or "(none)"


def _put_on_devchain(url: str, twin: Twin) -> str:
    """`devchain_putTwin` on a running devchain; returns the block hash it went into."""
    import asyncio

    from rmb_relay.twins.rpc import RpcConnection
    from rmb_relay.twins.substrate import check_url

    check_url(url)
    twin_json = {**_as_json(twin), "relay": format_relays(twin.relays)}
    if twin.pk is not None:
        twin_json["pk"] = "0x" + twin.pk.hex()
    twin_json["account"] = "0x" + twin.account.hex()

    async def put() -> str:
        connection = await RpcConnection.connect(url, 10.0)
        try:
            return str(await connection.request("devchain_putTwin", [twin_json], 10.0))
        finally:
            await connection.close()

    try:
        return asyncio.run(put())
    except NodeError as err:
        raise ConfigError(f"the devchain did not take the twin: {err}") from None


def _run(args: argparse.Namespace) -> None:
    path = parse_twins_url(args.twins) if args.twins else default_twins_path()
    action = args.twins_command
    if action == "add":
        # everything the user typed is checked before the file is opened (or created)
        twin = Twin(
            _twin_id(args.id),
            _account(args),
            None if args.relay is None else frozenset(args.relay),
            None if args.pk is None else _hex(args.pk, PK_LEN, "--pk"),
        )
        if args.devchain:
            if args.twins:
                raise ConfigError("--devchain and --twins name two directories: give one")
            block = _put_on_devchain(args.devchain, twin)
            print(f"twin {twin.id} stored on {args.devchain} in block {block}")
            return
        with SqliteTwinDirectory(path) as directory:
            directory.add(twin)
        print(f"twin {twin.id} saved in {path} (account {twin.account.hex()})")
    elif action == "list":
        with SqliteTwinDirectory(path) as directory:
            twins = directory.list()
        if args.json:
            print(json.dumps([_as_json(twin) for twin in twins]))
            return
        print(f"{'id':>10}  {'account':64}  {'pk':3}  relays")
        for twin in twins:
            pk = "yes" if twin.pk else "no"
            print(f"{twin.id:>10}  {twin.account.hex()}  {pk:3}  {_relays_text(twin)}")
    elif action == "show":
        twin_id = _twin_id(args.id)
        with SqliteTwinDirectory(path) as directory:
            found = directory.show(twin_id)
        if found is None:
            raise ConfigError(f"no twin {twin_id} in {path}")
        if args.json:
            print(json.dumps(_as_json(found)))
            return
        print(f"id:      {found.id}")
        print(f"account: {found.account.hex()}")
        print(f"relays:  {_relays_text(found)}")
        print(f"pk:      {'(none)' if found.pk is None else found.pk.hex()}")
    elif action == "rm":
        twin_id = _twin_id(args.id)
        with SqliteTwinDirectory(path) as directory:
            removed = directory.remove(twin_id)
        if not removed:
            raise ConfigError(f"no twin {twin_id} in {path}")
        print(f"twin {twin_id} removed from {path}")
    else:  # pragma: no cover - argparse only lets the four actions through
        raise ConfigError(f"unknown action {action!r}")


def twins_main(args: argparse.Namespace) -> int:
    """Run a `twins` action; returns the exit code (2 with one line on stderr on error)."""
    try:
        _run(args)
    except RelayError as err:
        message = " ".join(str(err).split())  # one line, whatever the message held
        print(f"rmb-relay twins: {message}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "rmb-relay twins") -> int:
    """`rmb-relay twins ACTION ...` (also `python -m rmb_relay.twins.cli ACTION ...`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Manage the embedded twin directory (a SQLite file) that RMB logins are "
        "checked against. Safe to use while a relay runs on the same file.",
    )
    _add_actions(parser)
    return twins_main(parser.parse_args(argv))


if __name__ == "__main__":
    from rmb_relay.cli_support import exit_with

    exit_with(main)
