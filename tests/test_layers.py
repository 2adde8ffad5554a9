"""The layer order of docs/architecture.md, checked on the source: no module imports from a
layer above its own, the dialect contract imports no dialect, and there is no import cycle at
all. Every import counts: under `if TYPE_CHECKING:` and inside functions too (a lazy import is
still a dependency, and a cycle of them still ties the modules together)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "rmb_relay"

#: bottom to top; a module belongs to the layer of the longest prefix it matches, and may import
#: from its own layer and the ones below (docs/architecture.md draws the same list)
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundation",
        (
            "rmb_relay",
            "rmb_relay._core",
            "rmb_relay._proto",
            "rmb_relay.errors",
            "rmb_relay.lazy_errors",
            "rmb_relay.clock",
            "rmb_relay.contract",
            "rmb_relay.tasks",
            "rmb_relay.budget",
            "rmb_relay.gc_tuning",
            "rmb_relay.malloc_tuning",
            "rmb_relay.cli_support",
            "rmb_relay.log_budget",
            "rmb_relay.config",
            "rmb_relay.identity",
        ),
    ),
    ("sdk", ("rmb_relay.sdk",)),
    ("directory and telemetry", ("rmb_relay.twins", "rmb_relay.telemetry")),
    (
        "delivery",
        (
            "rmb_relay.mailbox",
            "rmb_relay.switch",
            "rmb_relay.cluster",
            "rmb_relay.federation",
            "rmb_relay.throttle",
        ),
    ),
    ("services", ("rmb_relay.services",)),
    ("dialects", ("rmb_relay.dialects",)),
    ("server", ("rmb_relay.server",)),
    ("monitoring", ("rmb_relay.monitoring",)),
    (
        "programs",
        (
            "rmb_relay.commands",
            "rmb_relay.cli",
            "rmb_relay.__main__",
            "rmb_relay.peer",
            "rmb_relay.load",
            "rmb_relay.analytics",
        ),
    ),
)


def module_names(package: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (generated protobuf classes aside)."""
    found: dict[str, Path] = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if "_proto" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported_modules(path: Path, name: str, modules: Iterable[str]) -> set[str]:
    """The package's modules a file imports. `from pkg import sub` depends on `pkg.sub` when
    that is a module, else on `pkg`; a name inside a module resolves to that module."""
    known = set(modules)
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            for alias in node.names:
                child = f"{module}.{alias.name}"
                targets.add(child if child in known else module)
    found: set[str] = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imported_modules(path, name, modules) for name, path in modules.items()}


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            if todo:
                child = todo.pop()
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, sorted(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(name: str) -> int:
    best, best_len = -1, -1
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    return best


def upward_imports(graph: Mapping[str, set[str]]) -> list[str]:
    found = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(name):
                found.append(
                    f"{name} ({LAYERS[layer_of(name)][0]}) imports "
                    f"{target} ({LAYERS[layer_of(target)][0]})"
                )
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(PACKAGE)


def test_every_module_has_a_layer(graph: dict[str, set[str]]) -> None:
    assert [name for name in graph if layer_of(name) < 0] == []


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    described = ["; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in cycles(graph)]
    assert described == []


def test_no_module_imports_from_a_layer_above(graph: dict[str, set[str]]) -> None:
    assert upward_imports(graph) == []


def test_the_dialect_contract_imports_no_dialect(graph: dict[str, set[str]]) -> None:
    contract = ("rmb_relay.dialects.base", "rmb_relay.dialects.paths", "rmb_relay.dialects")
    offenders = {
        name: sorted(t for t in graph[name] if t.startswith("rmb_relay.dialects."))
        for name in contract
        if name in graph and name != "rmb_relay.dialects"
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_dialects_import_nothing_from_server(graph: dict[str, set[str]]) -> None:
    offenders = {
        name: sorted(t for t in targets if t.startswith("rmb_relay.server"))
        for name, targets in graph.items()
        if name.startswith("rmb_relay.dialects")
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def _write(root: Path, files: dict[str, str]) -> Path:
    package = root / "rmb_relay"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_the_walker_sees_type_checking_lazy_and_relative_imports(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "__init__.py": "",
            "server/__init__.py": "",
            "server/connection_base.py": "",
            "server/listener.py": "",
            "switch.py": "",
            "dialects/__init__.py": "",
            "dialects/sample.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from rmb_relay.server.connection_base import ConnectionBase\n"
                "def f():\n"
                "    import rmb_relay.server.listener\n"
                "from .. import switch\n"
            ),
        },
    )
    found = import_graph(package)["rmb_relay.dialects.sample"]
    assert found == {
        "rmb_relay.server.connection_base",
        "rmb_relay.server.listener",
        "rmb_relay.switch",
    }


def test_a_planted_cycle_and_an_upward_import_are_found(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "__init__.py": "",
            "switch.py": "from rmb_relay import mailbox\n",
            "mailbox.py": "def f():\n    from rmb_relay.switch import g\n",
            "errors.py": "from rmb_relay.switch import Outcome\n",
        },
    )
    graph = import_graph(package)
    assert cycles(graph) == [["rmb_relay.mailbox", "rmb_relay.switch"]]
    assert upward_imports(graph) == [
        "rmb_relay.errors (foundation) imports rmb_relay.switch (delivery)"
    ]


# ---- Rust -------------------------------------------------------------------------------------

RUST = PACKAGE.parent.parent / "rust"
#: bottom to top, as rust/lib.rs and docs/architecture.md draw them; a module belongs to the
#: layer of the longest prefix it matches
RUST_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("shared", ("", "error", "limiter", "crypto", "records", "lent")),
    ("codec", ("codec",)),
    ("forward", ("forward",)),
    ("dialects", ("dialects",)),
    ("crate", ("fuzzing", "load")),
)
#: no dialect is named below the dialects layer
DIALECT_NAMES = re.compile(r"\b(rmb|sbd|singyeong|sg|tunnel)(::|_index\b)")


def rust_modules(root: Path) -> dict[str, Path]:
    """Every Rust file by module path (`codec::ws`; `mod.rs` and `lib.rs` are their folder)."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.rs")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] in ("mod", "lib"):
            parts = parts[:-1]
        found["::".join(parts)] = path
    return found


def rust_imports(name: str, path: Path, modules: Iterable[str]) -> set[str]:
    """The crate's files a Rust file names (`crate::a::b::Item` depends on the file `a::b`),
    its tests and bindings included: a test-only import still ties two files together."""
    known = set(modules)
    found: set[str] = set()
    for match in re.finditer(r"crate::((?:\w+::)*\w+)", path.read_text()):
        parts = match.group(1).split("::")
        for n in range(len(parts), 0, -1):
            candidate = "::".join(parts[:n])
            if candidate in known:
                if candidate != name:
                    found.add(candidate)
                break
    return found


def rust_layer_of(name: str) -> int:
    best, level = -1, 0
    for index, (_, prefixes) in enumerate(RUST_LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + "::") or prefix == "") and len(
                prefix
            ) > best:
                best, level = len(prefix), index
    return level


def rust_graph(root: Path = RUST) -> dict[str, set[str]]:
    modules = rust_modules(root)
    return {name: rust_imports(name, path, modules) for name, path in modules.items()}


def test_no_rust_module_cycle() -> None:
    graph = rust_graph()
    # the crate root registers every binding: it is above everything, not part of a cycle
    graph[""] = set()
    assert cycles(graph) == []


def test_no_rust_module_imports_from_a_layer_above() -> None:
    wrong = [
        f"{name} ({RUST_LAYERS[rust_layer_of(name)][0]}) imports {dep} "
        f"({RUST_LAYERS[rust_layer_of(dep)][0]})"
        for name, deps in rust_graph().items()
        if name
        for dep in sorted(deps)
        if rust_layer_of(dep) > rust_layer_of(name)
    ]
    assert wrong == []


def test_the_codec_and_forward_layers_name_no_dialect() -> None:
    named = [
        f"{path.relative_to(RUST)}:{number}: {line.strip()}"
        for name, path in rust_modules(RUST).items()
        if name.split("::")[0] in ("codec", "forward")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "use crate::" in line and DIALECT_NAMES.search(line)
    ]
    assert named == []


def test_the_rust_cycle_check_sees_a_planted_cycle(tmp_path: Path) -> None:
    (tmp_path / "a.rs").write_text("use crate::b::B;\n")
    (tmp_path / "b.rs").write_text("fn f() { crate::a::g() }\n")
    graph = rust_graph(tmp_path)
    assert cycles(graph) != []
