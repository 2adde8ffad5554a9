"""`rmb-relay tenants add|list|set|rm`: manage tunnel tenants in the embedded SQLite file.

Like `rmb-relay twins`, it edits the file directly and works while relays run on it (they see
a change once their tenant cache entry expires, 10 s). Errors are one line on stderr, exit 2.
A secret is read from `--secret`, or generated and printed once when `--generate-secret` is
given: only its hash is stored.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from collections.abc import Sequence
from dataclasses import replace

from rmb_relay.dialects.tunnel.tenants import ACK_MODES, Tenant, TenantStore, hash_secret
from rmb_relay.errors import ConfigError, RelayError
from rmb_relay.twins.local import default_twins_path, parse_twins_url


def _fields(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--display-name", help="shown in listings")
    parser.add_argument("--description")
    secret = parser.add_mutually_exclusive_group()
    secret.add_argument("--secret", help="the connector's client secret")
    secret.add_argument(
        "--generate-secret", action="store_true", help="make a random secret and print it once"
    )
    parser.add_argument(
        "--require-auth",
        choices=("yes", "no"),
        help="clients must send a bearer token of this tenant",
    )
    parser.add_argument(
        "--max-concurrent", type=int, metavar="N", help="requests in flight at once, 0 = default"
    )
    parser.add_argument("--ack-mode", choices=(*ACK_MODES, "default"), help="acknowledgement mode")
    parser.add_argument(
        "--forward-authorization",
        choices=("yes", "no"),
        help="with --require-auth yes: the client's Authorization header (the relay's token) "
        "still reaches the targets (default no: it is dropped)",
    )


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Manage the HTTP tunnel's tenants (in the embedded SQLite file)."
    )
    parser.add_argument(
        "--twins",
        metavar="sqlite:PATH",
        default=None,
        help=f"the SQLite file (default: sqlite:{default_twins_path()})",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    add = actions.add_parser("add", help="create a tenant")
    add.add_argument("name")
    _fields(add)
    change = actions.add_parser("set", help="change a tenant's fields")
    change.add_argument("name")
    _fields(change)
    lister = actions.add_parser("list", help="list tenants")
    lister.add_argument("--json", action="store_true")
    remove = actions.add_parser("rm", help="remove a tenant")
    remove.add_argument("name")
    return parser


def _apply(tenant: Tenant, args: argparse.Namespace) -> tuple[Tenant, str | None]:
    changes: dict[str, object] = {}
    if args.display_name is not None:
        changes["display_name"] = args.display_name
    if args.description is not None:
        changes["description"] = args.description
    if args.require_auth is not None:
        changes["require_authentication"] = args.require_auth == "yes"
    if args.max_concurrent is not None:
        if args.max_concurrent < 0:
            raise ConfigError("--max-concurrent must not be negative")
        changes["max_concurrent"] = args.max_concurrent
    if args.forward_authorization is not None:
        changes["forward_authorization"] = args.forward_authorization == "yes"
    if args.ack_mode is not None:
        changes["ack_mode"] = None if args.ack_mode == "default" else ACK_MODES[args.ack_mode]
    generated = None
    if args.generate_secret:
        generated = secrets.token_urlsafe(24)
        changes["secret_hash"] = hash_secret(generated)
    elif args.secret is not None:
        changes["secret_hash"] = hash_secret(args.secret)
    return replace(tenant, **changes), generated  # type: ignore[arg-type]


def _run(args: argparse.Namespace) -> None:
    path = parse_twins_url(args.twins) if args.twins else default_twins_path()
    with TenantStore(path) as store:
        if args.action == "add":
            tenant, generated = _apply(Tenant(args.name), args)
            store.add(tenant)
            print(f"tenant {tenant.name} saved in {path}")
            if generated is not None:
                print(f"secret: {generated}")
        elif args.action == "set":
            existing = store.get(args.name)
            if existing is None:
                raise ConfigError(f"no tenant {args.name} in {path}")
            tenant, generated = _apply(existing, args)
            store.update(tenant)
            print(f"tenant {tenant.name} updated")
            if generated is not None:
                print(f"secret: {generated}")
        elif args.action == "list":
            tenants = store.list()
            if args.json:
                print(json.dumps([t.as_json() for t in tenants]))
                return
            print(f"{'name':24} {'auth':4} {'max':>5} {'ack':>4} secret")
            for t in tenants:
                ack = "-" if t.ack_mode is None else str(t.ack_mode)
                auth = "yes" if t.require_authentication else "no"
                secret = "yes" if t.secret_hash else "no"
                print(f"{t.name:24} {auth:4} {t.max_concurrent:>5} {ack:>4} {secret}")
        elif args.action == "rm":
            if not store.remove(args.name):
                raise ConfigError(f"no tenant {args.name} in {path}")
            print(f"tenant {args.name} removed")


def main(argv: Sequence[str] | None = None, prog: str = "rmb-relay tenants") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        _run(args)
    except RelayError as err:
        print(f"{prog}: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return 0
