"""The packages' layout: their import graphs have no cycles (every import a module runs, at its top or
inside a function, counts; imports under ``if TYPE_CHECKING:`` (annotations only) do not), and no
module is longer than :data:`MAX_LINES` unless :data:`LONG_MODULES` says why.  Built from the
sources (``ast``, line counts), no package is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]


def import_graph(src: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (a package's ``__init__`` under its own name;
    an import of a module's own package is left out: it runs first whoever imports)."""
    files = {}
    for path in (src / package).rglob("*.py"):
        parts = path.relative_to(src).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(sub) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for sub in ast.walk(node)}
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else str(node.module)
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("folder, package", [("synk-shm", "synk_shm"), ("synk-comm", "synk_comm"),
                                             ("synk-theano", "synkhronos"), ("synk-lasagne", "synk_lasagne")])
def test_no_import_cycles(folder, package):
    graph = import_graph(PACKAGES / folder / "src", package)
    assert len(graph) > 3
    assert cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


SYNKHRONOS = PACKAGES / "synk-theano" / "src" / "synkhronos"
PUBLIC_API = ("function.py", "chain.py", "collectives.py", "forking.py", "data_registry.py", "distribution.py")


def test_the_public_api_never_asks_which_engine_runs():
    """The API modules call ``Runtime.driver`` (an :class:`~synkhronos.engines.base.Engine`): no
    branch on the engine, no import of either engine's machinery."""
    for name in PUBLIC_API:
        text = (SYNKHRONOS / name).read_text()
        assert "engine is not None" not in text and "engine is None" not in text, name
        if name == "forking.py":  # the lifecycle starts the engines: it imports them
            continue
        graph = import_graph(PACKAGES / "synk-theano" / "src", "synkhronos")
        module = f"synkhronos.{name[:-3]}"
        leaked = {m for m in graph[module] if m.startswith(("synkhronos.engine.", "synkhronos.engines"))}
        assert not leaked - {"synkhronos.engine.phases"}, (name, leaked)


def test_commands_and_exceptions_have_one_home_each():
    """Every command name is in ``protocol.py``, every exception class in ``errors.py``."""
    for path in SYNKHRONOS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and path.name != "errors.py":
                bases = {ast.unparse(b) for b in node.bases}
                assert not bases & {"Exception", "ValueError", "RuntimeError", "TypeError", "IndexError"}, \
                    f"{path.name}: exception {node.name} outside errors.py"
            if isinstance(node, ast.Assign) and path.name != "protocol.py" and isinstance(node.value, ast.Constant):
                value = node.value.value
                assert not (isinstance(value, str) and value.startswith("synkhronos.") and value.count(".") >= 1
                            and " " not in value and value[11:].replace(".", "").replace("_", "").isalpha()), \
                    f"{path.name}: command {value!r} outside protocol.py"


MAX_LINES = 450
"""The longest a module may be (lines) without a reason in :data:`LONG_MODULES`."""

LONG_MODULES = {
    "synk-lasagne/src/synk_lasagne/updates.py": "mirrors lasagne.updates: every update rule in one module, as Lasagne",
    "synk-lasagne/src/synk_lasagne/layers/conv.py": "mirrors lasagne.layers.conv, one module per Lasagne module",
    "synk-lasagne/src/synk_lasagne/layers/pool.py": "mirrors lasagne.layers.pool, one module per Lasagne module",
    "synk-lasagne/src/synk_lasagne/layers/recurrent.py": "mirrors lasagne.layers.recurrent, one module per Lasagne "
                                                         "module",
    "synk-lasagne/src/synk_lasagne/layers/special.py": "mirrors lasagne.layers.special, one module per Lasagne module",
}
"""Modules allowed past :data:`MAX_LINES`, each with its reason (path under ``packages/``)."""


def module_lengths() -> dict[str, int]:
    """Lines of every module of the four packages, by path under ``packages/``."""
    return {path.relative_to(PACKAGES).as_posix(): len(path.read_text().splitlines())
            for path in sorted(PACKAGES.glob("*/src/**/*.py"))}


def test_no_module_is_longer_than_the_limit_without_a_reason():
    lengths = module_lengths()
    assert len(lengths) > 50
    too_long = {path: n for path, n in lengths.items() if n > MAX_LINES and path not in LONG_MODULES}
    assert not too_long, (f"modules over {MAX_LINES} lines: {too_long}; split them along their seams (or, if "
                          "one must stay whole, add it to LONG_MODULES with the reason)")
    stale = sorted(path for path in LONG_MODULES if lengths.get(path, 0) <= MAX_LINES)
    assert not stale, f"LONG_MODULES lists modules that are gone or no longer too long: remove {stale}"
    assert all(reason.strip() for reason in LONG_MODULES.values())
