"""The package's layering, read from its own import statements: no cycles, nothing imports upward."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "kvgroups"

# What each part of the package may import: each subpackage is a layer, and every layer may use the
# project's exceptions. The top-level modules are the package itself, its exceptions and two aliases.
ALLOWED: dict[str, set[str]] = {
    "package": {"errors", "core"},
    "errors": set(),
    "core": {"errors", "core"},
    "models": {"errors", "core", "models"},
    "datapath": {"errors", "core", "datapath"},
    "store": {"errors", "core", "datapath", "store"},
    "integrations": {"errors", "core", "models", "datapath", "store", "integrations"},
    "cli": {"errors", "core", "models", "datapath", "store", "integrations", "cli"},
    # Public names and entry points that only point at a subpackage.
    "alias:transfer": {"datapath"},
    "alias:__main__": {"cli"},
}
TOP_LEVEL_MODULES = {"kvgroups", "kvgroups.errors", "kvgroups.transfer", "kvgroups.__main__"}
MAX_MODULE_LINES = 350

# Inside store/, each room is a layer of its own (the package's store/__init__.py says the same in words):
# the byte stores know nothing of what their values are, and only the chunk store on top uses every room.
STORE_ROOMS: dict[str, set[str]] = {
    "metrics": {"metrics"},
    "entries": {"metrics", "entries"},
    "backends": {"metrics", "backends"},
    "chunks": {"metrics", "entries", "backends", "chunks"},
}
MAX_STORE_TOP_LEVEL_MODULES = 10


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str:
    """The layer a module belongs to: its subpackage, or what a top-level module is."""
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    if len(parts) > 2 or (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return {"errors": "errors", "transfer": "alias:transfer", "__main__": "alias:__main__"}.get(parts[1], "unknown")


def imports_of(path: Path) -> set[str]:
    """The kvgroups modules a file imports at module level or inside functions (all of them count)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("kvgroups"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvgroups"):
            found.add(node.module)
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports_of(path):
            # "from kvgroups.a import b" may name a module b; the edge goes to the deepest module that exists.
            targets.add(imported if imported in modules else imported.rsplit(".", 1)[0])
        edges[name] = targets - {name}
    return edges


def store_room(module: str) -> str | None:
    """The room of store/ a module lives in, "" for the store's own top level, None outside store/."""
    parts = module.split(".")
    if parts[:2] != ["kvgroups", "store"]:
        return None
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and (PACKAGE / "store" / parts[2]).is_dir()) else ""


def test_the_top_level_holds_only_the_package_its_errors_and_aliases() -> None:
    top_level = {module for module in graph() if module.count(".") <= 1 and part_of(module) in (
        "package", "errors", "alias:transfer", "alias:__main__", "unknown")}
    assert top_level == TOP_LEVEL_MODULES


def test_nothing_imports_upward() -> None:
    offenders = []
    for module, targets in graph().items():
        allowed = ALLOWED.get(part_of(module), set())
        offenders += [f"{module} -> {target}" for target in sorted(targets) if part_of(target) not in allowed]
    assert offenders == []


def test_the_store_rooms_import_only_the_rooms_below_them() -> None:
    offenders = []
    for module, targets in graph().items():
        room = store_room(module)
        if not room:  # outside store/, or its __init__, which exports every room's public names
            continue
        offenders += [f"{module} -> {target}" for target in sorted(targets)
                      if store_room(target) is not None and store_room(target) not in STORE_ROOMS[room]]
    assert offenders == []


def test_the_store_keeps_its_modules_in_rooms() -> None:
    store = PACKAGE / "store"
    assert len(list(store.glob("*.py"))) <= MAX_STORE_TOP_LEVEL_MODULES
    assert {path.name for path in store.iterdir() if (path / "__init__.py").is_file()} == set(STORE_ROOMS)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("__init__.py")), ids=lambda path: str(path.relative_to(PACKAGE)))
def test_every_room_says_what_lives_there(path: Path) -> None:
    assert ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))


def test_no_import_cycles() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles: list[list[str]] = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target):], target])
            elif target not in state:
                visit(target, [*stack, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert cycles == []


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda path: str(path.relative_to(PACKAGE)))
def test_modules_stay_small(path: Path) -> None:
    assert len(path.read_text(encoding="utf-8").splitlines()) <= MAX_MODULE_LINES


def test_the_layering_is_what_this_test_reads() -> None:
    """The checks above would pass on an empty graph; make sure they read the real one."""
    edges = graph()
    assert "kvgroups.core.layouts" in edges["kvgroups.core.groups"]
    assert "kvgroups.datapath.transfer" in edges["kvgroups.transfer"]
    assert part_of("kvgroups.models.engine") == "models" and part_of("kvgroups.core.cache_specs") == "core"
    assert part_of("kvgroups.models") == "models" and part_of("kvgroups.transfer") == "alias:transfer"
    assert "kvgroups.store.backends.base" in edges["kvgroups.store.backends.memory"]
    assert store_room("kvgroups.store.backends.redis.store") == "backends" and store_room("kvgroups.store") == ""
    assert store_room("kvgroups.store.chunks") == "chunks" and store_room("kvgroups.core.groups") is None


def test_the_command_and_the_core_import_nothing_heavy() -> None:
    """``kvgroups inspect`` starts fast: the CLI and the core never import numba, Triton, transformers or
    matplotlib (the plot module imports it when it draws)."""
    import subprocess
    import sys

    code = (
        "import sys, kvgroups, kvgroups.cli.main, kvgroups.cli.plot, kvgroups.transfer; "
        "print(sorted(m for m in ('numba', 'triton', 'transformers', 'vllm', 'redis', 'matplotlib') "
        "if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


BENCHMARKS = PACKAGE.parent.parent / "benchmarks"
# The benchmarks' rooms: the package's parts they measure, the soak, and what they share.
BENCHMARK_ROOMS = {"core", "datapath", "store", "integrations", "integrations/transformers", "integrations/vllm",
                   "integrations/sglang", "soak", "support"}


def test_the_benchmarks_keep_their_modules_in_rooms_that_say_what_lives_there() -> None:
    assert [path.name for path in BENCHMARKS.glob("*.py")] == ["__init__.py"]
    rooms = {str(path.parent.relative_to(BENCHMARKS)) for path in BENCHMARKS.rglob("__init__.py")} - {"."}
    assert rooms == BENCHMARK_ROOMS
    for path in BENCHMARKS.rglob("*.py"):
        assert (path.parent / "__init__.py").is_file(), path  # every module is importable as benchmarks.ROOM.NAME
    for path in BENCHMARKS.rglob("__init__.py"):
        assert ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))), path
