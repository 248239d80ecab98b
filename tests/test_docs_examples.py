"""Every code example of the documentation runs, so that the docs cannot drift from the code.

What the pages of ``docs/`` (reStructuredText and MyST) may contain, and how each is checked:

``.. code-block:: python``
    A complete program.  It runs in a fresh interpreter and must exit with 0 (and leave nothing in
    ``/dev/shm``).  ``:class: no-run`` opts a block out -- for code of other libraries, such as the
    Theano program of the migration guide -- which is then only compiled.
``.. literalinclude:: ../examples/NAME.py``
    The file must exist; a Python file runs the same way, whole (``:lines:`` may show a part).
Output: ``.. code-block:: text`` with ``:class: output``
    Right after a program, the output it prints: the run's standard output must match it token by
    token, numbers within a relative 1e-3 (``:class: output any-numbers``: any numbers, for
    unseeded random data, pids and timings).
Shell: ``.. code-block:: bash`` (or ``console``, ``shell``)
    Not run; every ``nox -s NAME`` must name a session of ``noxfile.py`` and every repository path
    it names must exist.

Anything else that looks like Python (a ``>>>`` prompt, ``.. code::``, ``.. sourcecode::``, a
MyST ``python`` fence) fails the inventory test: such an example would not be checked.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SHM_DIR = "/dev/shm"
TIMEOUT = 240
"""Seconds one example may run (pytest-timeout adds a margin)."""

PYTHON = {"python", "python3", "py"}
SHELL = {"bash", "console", "shell", "sh"}
DIRECTIVE = re.compile(r"^(?P<indent>\s*)\.\. (?P<name>code-block|sourcecode|code|literalinclude)::\s*(?P<arg>\S*)\s*$")
FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})\s*(?:\{(?P<name>[\w-]+)\})?\s*(?P<arg>\S*)\s*$")
OPTION = re.compile(r"^:(?P<key>[\w-]+):\s*(?P<value>.*)$")
NUMBER = r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?"
TOKEN = re.compile(rf"{NUMBER}|\S")


@dataclass
class Block:
    """One code block or include of a page."""

    page: Path
    line: int
    kind: str  # the directive: code-block, literalinclude, ...
    arg: str  # the language, or the included path
    options: dict[str, str] = field(default_factory=dict)
    content: str = ""
    output: Block | None = None  # the output block right after this program, if any
    outputs: list[Block] = field(default_factory=list)  # every output to check against its run

    @property
    def classes(self) -> set[str]:
        return set(self.options.get("class", "").split())

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def is_program(self) -> bool:
        if self.kind == "literalinclude":
            return self.arg.endswith(".py")
        return self.kind == "code-block" and self.arg in PYTHON

    @property
    def is_output(self) -> bool:
        return self.kind == "code-block" and "output" in self.classes


def _rst_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = DIRECTIVE.match(lines[i])
        if m is None:
            i += 1
            continue
        block = Block(page, i + 1, m["name"], m["arg"])
        depth = len(m["indent"])
        i += 1
        while i < len(lines) and (opt := OPTION.match(lines[i].strip())) and lines[i].startswith(" " * (depth + 1)):
            block.options[opt["key"]] = opt["value"]
            i += 1
        body = []
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > depth):
            body.append(lines[i])
            i += 1
        block.content = textwrap.dedent("\n".join(body)).strip("\n") + "\n"
        blocks.append(block)
    return blocks


def _md_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        block = Block(page, i + 1, m["name"] or "code-block", m["arg"])
        i += 1
        while i < len(lines) and (opt := OPTION.match(lines[i].strip())):
            block.options[opt["key"]] = opt["value"]
            i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(m["fence"]):
            body.append(lines[i])
            i += 1
        i += 1
        block.content = "\n".join(body) + "\n"
        blocks.append(block)
    return blocks


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*") if p.suffix in (".rst", ".md") and "_build" not in p.parts)


def _blocks() -> list[Block]:
    blocks = []
    for page in _pages():
        found = _rst_blocks(page) if page.suffix == ".rst" else _md_blocks(page)
        for prev, block in zip([None, *found], found):
            if block.is_output and prev is not None and prev.is_program and prev.output is None:
                prev.output = block
        blocks.extend(found)
    return blocks


def _programs(blocks: list[Block]) -> list[Block]:
    """The blocks to run: each inline program, and each included file once (with its outputs)."""
    programs: list[Block] = []
    included: dict[Path, Block] = {}
    for b in blocks:
        if not b.is_program or "no-run" in b.classes:
            continue
        if b.kind != "literalinclude":
            programs.append(b)
            continue
        path = (b.page.parent / b.arg).resolve()
        first = included.setdefault(path, b)
        if first is b:
            programs.append(b)
        if b.output is not None:
            first.outputs.append(b.output)
    for b in programs:
        if b.kind != "literalinclude" and b.output is not None:
            b.outputs.append(b.output)
    return programs


BLOCKS = _blocks()
PROGRAMS = _programs(BLOCKS)


def _source(block: Block) -> tuple[Path | None, str]:
    """(the file that runs, or None for an inline block; its source)."""
    if block.kind == "literalinclude":
        path = (block.page.parent / block.arg).resolve()
        return path, path.read_text()
    return None, block.content


def _tokens_match(expected: str, actual: str, any_numbers: bool) -> bool:
    want, got = TOKEN.findall(expected), TOKEN.findall(actual)
    if len(want) != len(got):
        return False
    for w, g in zip(want, got):
        w_num, g_num = re.fullmatch(NUMBER, w), re.fullmatch(NUMBER, g)
        if w_num and g_num:
            if not any_numbers and not math.isclose(float(w), float(g), rel_tol=1e-3, abs_tol=1e-9):
                return False
        elif w != g:
            return False
    return True


def _shm_entries(pid: int) -> list[str]:
    try:
        return sorted(e for e in os.listdir(SHM_DIR) if f"-{pid}-" in e and "synk" in e)
    except OSError:
        return []


# --- the inventory ----------------------------------------------------------------------------------

def test_inventory():
    """The docs have examples, and every one of them is of a kind that this module checks."""
    assert len(PROGRAMS) >= 10, f"only {len(PROGRAMS)} runnable examples found: is the parser broken?"
    assert any(b.outputs for b in PROGRAMS), "no output block found"
    problems = []
    for page in _pages():
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith(">>>"):
                problems.append(f"{page.relative_to(ROOT)}:{n}: a doctest prompt: use a python code-block")
    for b in BLOCKS:
        if b.kind in ("code", "sourcecode"):
            problems.append(f"{b.where}: a {b.kind} block is not run: use code-block")
        if b.kind in ("code-block", "literalinclude") and not b.arg:
            problems.append(f"{b.where}: a {b.kind} without a language or path")
        if b.kind == "literalinclude" and not (b.page.parent / b.arg).resolve().exists():
            problems.append(f"{b.where}: {b.arg} does not exist")
        if b.is_output and not any(b is out for p in PROGRAMS for out in p.outputs):
            problems.append(f"{b.where}: an output block that follows no program")
    assert not problems, "\n".join(problems)


def test_no_run_blocks_compile():
    for b in BLOCKS:
        if b.is_program and "no-run" in b.classes:
            compile(b.content, b.where, "exec")


def test_shell_blocks_name_real_sessions_and_paths():
    sessions = set(re.findall(r"^def (\w+)\(session", (ROOT / "noxfile.py").read_text(), re.M))
    problems = []
    for b in BLOCKS:
        if b.kind != "code-block" or b.arg not in SHELL:
            continue
        lines = [line.split(" #")[0] for line in b.content.splitlines() if not line.lstrip().startswith("#")]
        commands = "\n".join(lines)
        for name in re.findall(r"nox -s ((?:\w+ ?)+)", commands):
            problems += [f"{b.where}: no nox session {s!r}" for s in name.split() if s not in sessions]
        folders = "packages|examples|benchmarks|tools|gpu|docs|tests"
        for path in re.findall(rf"(?<![\w/.-])((?:{folders})/[\w./-]+)", commands):
            if not (ROOT / path.rstrip(".")).exists():
                problems.append(f"{b.where}: {path} does not exist")
    assert not problems, "\n".join(problems)


# --- every program --------------------------------------------------------------------------------

@dataclass
class Run:
    """One example's run: its exit status, output and process id (or the time it ran over)."""

    returncode: int | None
    out: str
    err: str
    pid: int


def _run_example(block: Block, folder: Path) -> Run:
    path, source = _source(block)
    if path is None:
        path = folder / "example.py"
        path.write_text(source)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(path)], cwd=folder, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return Run(None, out, err, proc.pid)
    return Run(proc.returncode, out, err, proc.pid)


EXAMPLES_AT_ONCE = min(2, os.cpu_count() or 1)
"""Examples that run side by side.  Each is a fresh interpreter whose time goes mostly to imports
and compilation, mostly one process at a time, so that two at once keep the 2-core CI machine's
cores busy."""


@pytest.fixture(scope="module")
def example_runs(request, tmp_path_factory) -> Iterator[dict[str, Future[Run]]]:
    """Every selected example started on a pool of :data:`EXAMPLES_AT_ONCE` at the module's first
    example test, so that the next runs while a test checks its own; by :attr:`Block.where`."""
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_example_runs" and hasattr(item, "callspec")]
    with ThreadPoolExecutor(EXAMPLES_AT_ONCE, thread_name_prefix="docs-example") as pool:
        runs = {b.where: pool.submit(_run_example, b, tmp_path_factory.mktemp("example")) for b in selected}
        try:
            yield runs
        finally:
            for future in runs.values():
                future.cancel()


@pytest.mark.job
@pytest.mark.timeout(2 * TIMEOUT + 30)
@pytest.mark.parametrize("block", PROGRAMS, ids=[b.where for b in PROGRAMS])
def test_example_runs(block, example_runs):
    run = example_runs[block.where].result()
    out, err = run.out, run.err
    if run.returncode is None:
        pytest.fail(f"the example of {block.where} ran over {TIMEOUT} s\n{out}\n{err}")
    assert run.returncode == 0, f"the example of {block.where} failed:\n{out}\n{err}"
    assert _shm_entries(run.pid) == [], f"the example of {block.where} left shared memory behind"
    for output in block.outputs:
        any_numbers = "any-numbers" in output.classes
        assert _tokens_match(output.content, out, any_numbers), (
            f"the output documented at {output.where} differs from the example's:\n"
            f"--- documented\n{output.content}--- printed\n{out}")
