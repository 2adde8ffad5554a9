"""What the package imports against what pyproject.toml declares: an undeclared import works
in a developer's venv (dev extras, leftovers) and fails for a user who `pip install`s the
relay. Every import counts, also the lazy ones inside functions (pyarrow was one)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "rmb_relay"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imports() -> dict[str, set[str]]:
    """Top-level module name -> the package files that import it."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(
                    path.relative_to(PACKAGE).as_posix()
                )
    return found


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {
        _normal(re.match(r"[A-Za-z0-9._-]+", spec).group())  # type: ignore[union-attr]
        for spec in project["dependencies"]
    }


def test_every_third_party_import_is_a_declared_dependency() -> None:
    distributions = importlib.metadata.packages_distributions()
    third_party = {
        module: files
        for module, files in imports().items()
        if module not in sys.stdlib_module_names and module != "rmb_relay"
    }
    undeclared = {
        module: sorted(files)
        for module, files in third_party.items()
        if not {_normal(d) for d in distributions.get(module, [module])} & declared()
    }
    assert undeclared == {}
    assert {"aiohttp", "prometheus_client", "pyarrow", "rich"} <= third_party.keys()


def test_rich_is_imported_by_the_terminal_views_only() -> None:
    """rich is declared for rmb-load's table and progress line and `rmb-relay top`; the relay
    must not need it."""
    users = imports()["rich"]
    assert users
    assert all(path.startswith("load/") or path == "monitoring/top.py" for path in users), sorted(
        users
    )


def built_relay(
    tmp_path: Path, *flags: str, modules: tuple[str, ...] = ("pyarrow", "numpy")
) -> str:
    """What a relay built by `rmb-relay serve`'s own code with `flags` (every dialect, every
    flag's wiring) holds once built, printed by a fresh interpreter: which of `modules` it
    imported (with what `rmb-relay` imports to list its commands), and how many threads it
    runs."""
    probe = (
        "import os, sys, asyncio\n"
        "from rmb_relay.commands import commands\n"
        "from rmb_relay.commands.serve import build_server, parser\n"
        "commands()\n"
        "args = parser('rmb-relay').parse_args(sys.argv[1:])\n"
        "async def main():\n"
        "    server, services = await build_server(args)\n"
        "    threads = len(os.listdir('/proc/self/task'))\n"
        "    await services.close()\n"
        "    return threads\n"
        "threads = asyncio.run(main())\n"
        f"print(sorted(m for m in {modules!r} if m in sys.modules), threads)\n"
    )
    twins = f"sqlite:{tmp_path / 't.db'}"
    out = subprocess.run(
        [sys.executable, "-c", probe, "-l", "127.0.0.1:0", "--twins", twins, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_a_relay_without_records_loads_no_arrow_or_numpy(tmp_path: Path) -> None:
    """pyarrow and numpy are for --records and the analytics plane; a plain relay must not pay
    their ~50 MiB of RSS."""
    assert built_relay(tmp_path).startswith("[] ")


def test_a_relay_on_defaults_loads_no_client_library_it_does_not_use(tmp_path: Path) -> None:
    """aiohttp (federation, the SBD auth hook, the connector), PyJWT (tunnel tokens) and
    redis-py (--redis) are imported when first used: together ~29 MB of RSS that a relay on
    embedded defaults must not pay (bench/README.md "Idle connections")."""
    loaded = built_relay(tmp_path, modules=("aiohttp", "jwt", "redis", "cryptography"))
    assert loaded.startswith("[] "), loaded


def test_a_recording_relay_loads_no_arrow_or_numpy_and_stays_single_threaded(
    tmp_path: Path,
) -> None:
    """With --records the Parquet writer is a child process: the relay itself imports neither
    pyarrow nor numpy (whose imports start threads) and runs no second thread, because any
    second thread makes glibc lock its malloc arena on every large allocation, which cost every
    1 KiB message ~40 ns (docs/analytics.md)."""
    assert built_relay(tmp_path, "--records", str(tmp_path / "records")) == "[] 1"


def test_parquet_samples_are_written_with_the_declared_pyarrow(tmp_path: Path) -> None:
    from array import array

    import pyarrow.parquet as pq

    from rmb_relay.load.cli import _write_samples

    path = tmp_path / "samples.parquet"
    _write_samples(path, array("q", [10, 0, 500, 20, 1, 700]), 64)
    table = pq.read_table(path)
    assert table.to_pylist() == [
        {
            "timestamp_ns": 10,
            "pair": 0,
            "size": 64,
            "latency_ns": 500,
            "outcome": "delivered",
            "dialect": "rmb",
        },
        {
            "timestamp_ns": 20,
            "pair": 1,
            "size": 64,
            "latency_ns": 700,
            "outcome": "delivered",
            "dialect": "rmb",
        },
    ]


@pytest.mark.parametrize("module", ["aiohttp", "prometheus_client"])
def test_typed_dependencies_need_no_mypy_override(module: str) -> None:
    """mypy --strict checks our calls into these (they ship py.typed); only stub-less packages
    belong in the override list."""
    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    ignored = {name for entry in overrides for name in entry["module"]}
    assert module not in ignored
    spec = importlib.util.find_spec(module)
    assert spec is not None
    assert spec.origin is not None
    assert (Path(spec.origin).parent / "py.typed").exists()
