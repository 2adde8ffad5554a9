"""Put first on `RMB_TEST_RELAY_PYTHONPATH` (`tests/old_build:OLD/python`) to run the tests'
relay processes on an older build (docs/hardening.md, "Against d7c5c1d"). Python imports it at
the start of each such process; it changes no behaviour the tests look at:

- the twin directory's schema: main's test helpers write SQLite files at schema version 3 (one
  column more, which an older relay never reads), and a build that knows only 2 refuses a newer
  file; the older build is taught version 3's migration;
- with `RMB_TEST_DROP_UNKNOWN_FLAGS=1`, a command's options that build does not have (and the
  value after each) are dropped, said on stderr, so that a test's scenario runs on the older
  build's defaults instead of stopping at `unrecognized arguments`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

#: main's migration to schema version 3 (python/rmb_relay/twins/local.py)
_VERSION_3 = (
    "ALTER TABLE tunnel_tenants ADD COLUMN forward_authorization INTEGER NOT NULL DEFAULT 0",
)


def _teach_schema_3() -> None:
    try:
        from rmb_relay.twins import local
    except ImportError:  # not a build of ours
        return
    if local.SCHEMA_VERSION == 2:
        local._MIGRATIONS += (_VERSION_3,)
        local.SCHEMA_VERSION = 3


def _drop_unknown_flags() -> None:
    parse_args = argparse.ArgumentParser.parse_args

    def parse_known_only(
        self: argparse.ArgumentParser, args: Any = None, namespace: Any = None
    ) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if self._subparsers is not None:  # (its subcommands' options: theirs)
            return parse_args(self, argv, namespace)
        known = self._option_string_actions
        kept, dropped, i = [], [], 0
        while i < len(argv):
            arg = argv[i]
            if arg.startswith("--") and arg.split("=", 1)[0] not in known:
                dropped.append(arg)
                if "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                    i += 1
                    dropped.append(argv[i])
            else:
                kept.append(arg)
            i += 1
        if dropped:
            print(f"old_build: dropped unknown flags: {' '.join(dropped)}", file=sys.stderr)
        return parse_args(self, kept, namespace)

    argparse.ArgumentParser.parse_args = parse_known_only  # type: ignore[method-assign]


_teach_schema_3()
if os.environ.get("RMB_TEST_DROP_UNKNOWN_FLAGS") == "1":
    _drop_unknown_flags()
