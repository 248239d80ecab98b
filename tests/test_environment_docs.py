"""The environment-variable reference (docs/environment.rst) against the code.

Parses the sources (no import, no process) for every ``SYNK_*`` variable that they read, with the
default that each read uses, and checks the page: every variable read is documented, every variable
documented is read somewhere, and each default written in the code appears in the page's default
column.  A read is ``os.environ.get(NAME, default)``, ``os.getenv``, ``environ[NAME]``, ``NAME in
os.environ`` or a helper whose name says it reads the environment (``_env_flag(NAME, default)``);
``NAME`` is a literal or a module constant that holds one (``BACKEND_ENV``, ``cpu.BACKEND_ENV``).
C++ sources count their ``getenv("SYNK_...")``.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "environment.rst"
SOURCES = ["packages/*/src/**/*.py", "packages/*/tests/**/*.py", "tests/**/*.py", "examples/**/*.py",
           "benchmarks/**/*.py", "noxfile.py"]
"""Where the variables are read.  tools/ is left out: its probes' ``SYNK_PROBE_*`` switches are
described in each script."""
C_SOURCES = ["packages/*/src/**/*.cc"]
PREFIX = "SYNK_"
READERS = {"get", "getenv"}
"""Method or function names that read the variable named by their first argument, besides any
name containing ``env`` that is not a write (``_env_flag``)."""
WRITERS = {"setenv", "delenv", "setdefault", "update", "putenv", "unsetenv", "pop"}
UNSET = object()


class Expression(str):
    """A default that is no literal: the source text of its expression."""


def _python_files() -> Iterator[Path]:
    for pattern in SOURCES:
        yield from (path for path in sorted(ROOT.glob(pattern)) if path != Path(__file__).resolve())


def _constants(trees: dict[Path, ast.Module]) -> dict[Path, dict[str, str]]:
    """Module-level ``NAME = "SYNK_..."`` assignments of every file."""
    found: dict[Path, dict[str, str]] = {}
    for path, tree in trees.items():
        for node in tree.body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str) and node.value.value.startswith(PREFIX)):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        found.setdefault(path, {})[target.id] = node.value.value
    return found


def _reader_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


@functools.cache
def reads() -> dict[str, list[tuple[str, object]]]:
    """Every ``SYNK_*`` variable read, with the places (``path:line``) and defaults (the value of a
    literal default, the source text of another expression, :data:`UNSET` for none)."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in _python_files()}
    constants = _constants(trees)
    by_stem: dict[str, dict[str, str]] = {}
    anywhere: dict[str, set[str]] = {}
    for path, names in constants.items():
        by_stem.setdefault(path.stem if path.stem != "__init__" else path.parent.name, {}).update(names)
        for key, value in names.items():
            anywhere.setdefault(key, set()).add(value)

    def variable(expr: ast.expr, path: Path) -> str | None:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str) and expr.value.startswith(PREFIX):
            return expr.value
        if isinstance(expr, ast.Name):  # this module's constant, else an imported one (one value everywhere)
            local = constants.get(path, {}).get(expr.id)
            return local or (next(iter(anywhere[expr.id])) if len(anywhere.get(expr.id, ())) == 1 else None)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            return by_stem.get(expr.value.id, {}).get(expr.attr)
        return None

    found: dict[str, list[tuple[str, object]]] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            name, default = None, UNSET
            if isinstance(node, ast.Call) and node.args:
                reader = _reader_name(node.func)
                if reader and reader not in WRITERS and (reader in READERS or "env" in reader.lower()):
                    name = variable(node.args[0], path)
                    if len(node.args) > 1:
                        arg = node.args[1]
                        default = arg.value if isinstance(arg, ast.Constant) else Expression(ast.unparse(arg))
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                name = variable(node.slice, path)
            elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                name = variable(node.left, path)
            if name:
                found.setdefault(name, []).append((f"{path.relative_to(ROOT)}:{node.lineno}", default))
    for pattern in C_SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                for name in re.findall(r'getenv\("(SYNK_\w+)"\)', line):
                    found.setdefault(name, []).append((f"{path.relative_to(ROOT)}:{n}", UNSET))
    return found


def documented() -> dict[str, str]:
    """The page's rows: variable -> the text of its default column (the list-tables' second cell)."""
    rows: dict[str, str] = {}
    text = PAGE.read_text()
    for match in re.finditer(r"^   \* - ``(SYNK_\w+)``\n     - (.*?)\n     - ", text, re.M | re.S):
        rows[match.group(1)] = " ".join(match.group(2).split())
    return rows


def _tokens(default: object) -> list[str]:
    """What the default column must show for a default found in the code: a literal's value (a
    flag's ``True``/``False`` as ``1``/``0``; nothing for no default or an empty one), every
    literal of an expression (``2000 if long_spin else 200``), or a name's last part
    (``XLA_GPU_FLAGS``; a local variable's value is not known here)."""
    if default is UNSET or default in ("", None):
        return []
    if isinstance(default, bool):
        return ["1" if default else "0"]
    if isinstance(default, Expression):
        expr = ast.parse(default, mode="eval").body
        literals = [str(node.value) for node in ast.walk(expr) if isinstance(node, ast.Constant) and node.value != ""]
        name = default.rsplit(".", 1)[-1]
        return literals or ([name] if name.isupper() else [])  # a constant's name; a local variable: nothing
    return [str(default)]


def _shows(cell: str, token: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(token)}(?![\w.])", cell) is not None


def test_the_scanner_finds_the_variables_it_must():
    found = reads()
    # literal names, module constants, another module's constant, a helper, the C++ handler
    for name in ("SYNK_SPIN_US", "SYNK_CPU_BACKEND", "SYNK_CPU_PIN", "SYNK_ENGINE", "SYNK_ALL_REDUCE_THREADS"):
        assert name in found, f"{name} not found: is the scanner broken?"
    backend_reads = " ".join(where for where, _ in found["SYNK_CPU_BACKEND"])
    assert "packages/synk-theano/src/synkhronos/runtime.py" in backend_reads  # cpu.BACKEND_ENV
    assert any(default is True for _, default in found["SYNK_CPU_PIN"])
    assert any(default == "200" for _, default in found["SYNK_SPIN_US"])
    assert len(found) >= 30, f"only {len(found)} variables found"


def test_every_variable_read_is_documented():
    rows = documented()
    missing = {name: [where for where, _ in places] for name, places in reads().items() if name not in rows}
    assert not missing, "read in the code, not in docs/environment.rst:\n" + "\n".join(
        f"{name} ({', '.join(places)})" for name, places in sorted(missing.items()))


def test_every_documented_variable_is_read():
    found = reads()
    stale = sorted(name for name in documented() if name not in found)
    assert not stale, f"documented in docs/environment.rst but read nowhere: {stale}"


def test_documented_defaults_match_the_code():
    rows = documented()
    problems = []
    for name, places in sorted(reads().items()):
        cell = rows.get(name)
        if cell is None:
            continue  # test_every_variable_read_is_documented reports it
        for where, default in places:
            for token in _tokens(default):
                if not _shows(cell, token):
                    problems.append(f"{name}: {where} defaults to {token!r}; the page says: {cell}")
    assert not problems, "\n".join(problems)
