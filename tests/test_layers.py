"""The layering rule of ARCHITECTURE.md, checked on the source: dialects depend on the contract
(`dialects/base.py`), never on the listener (`server/`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "rmb_relay"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, including imports under `if TYPE_CHECKING:` and inside
    functions (a lazy import is still a dependency)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_dialects_import_nothing_from_server() -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            m for m in imported_modules(path) if m.startswith("rmb_relay.server")
        )
        for path in sorted((PACKAGE / "dialects").rglob("*.py"))
    }
    offenders = {name: mods for name, mods in offenders.items() if mods}
    assert offenders == {}


def test_the_import_walker_sees_type_checking_and_lazy_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from rmb_relay.server.connection import Connection\n"
        "def f():\n"
        "    import rmb_relay.server.listener\n"
    )
    found = imported_modules(sample)
    assert "rmb_relay.server.connection" in found
    assert "rmb_relay.server.listener" in found
