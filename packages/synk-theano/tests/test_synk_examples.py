"""The seed's examples are in the docs, whose test runs them as scripts (in a process of their own, as a
user runs them); a script without a main guard that calls ``synk.fork()`` works: its workers never
re-run it (in GPU mode too, under ``SYNK_TEST_GPU=1``)."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest
from synk_testutil import EXAMPLES, SHM_DIR, TIMEOUT, USE_GPU, max_ranks, run_script

pytestmark = pytest.mark.timeout(TIMEOUT)


def entries_of_pid(pid: int) -> list[str]:
    """/dev/shm entries of the run whose root process is ``pid``."""
    return sorted(e for e in os.listdir(SHM_DIR) if f"-{pid}-" in e)


SEED_EXAMPLES = ["introductory.py", "shared_variables.py", "data_interface.py", "per_rank_values.py",
                 "batch_vs_batch_s.py"]
"""The seed's examples: each is included in a page of the docs, whose test
(``tests/test_docs_examples.py``) runs it as a user does and compares its output with the output the
page documents (the seed's numbers), so they are not run a second time here."""


def test_every_seed_example_runs_with_the_docs():
    pages = "\n".join(p.read_text() for p in Path(EXAMPLES).parent.joinpath("docs").rglob("*.rst"))
    for name in SEED_EXAMPLES:
        assert os.path.exists(os.path.join(EXAMPLES, name)), name
        assert re.search(rf"^\.\. literalinclude:: [./]*examples/{re.escape(name)}$", pages, re.M), (
            f"examples/{name} is in no page of docs/: include it (with its output) so that the docs tests run it")


SCRIPT = """\
import os
import sys

import numpy as np
import pytensor.tensor as pt

import synkhronos as synk

with open(sys.argv[1] if len(sys.argv) > 1 else {marker!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")  # once per run of this file's top level
print("pid", os.getpid())
n = synk.fork({n}, use_gpu={use_gpu})
x = pt.matrix("x", dtype="float64")
f = synk.function([x], (pt.sum(x, axis=1), None))
r = f(synk.data(np.arange(12.0).reshape(6, 2)))
assert np.array_equal(r, [1, 5, 9, 13, 17, 21]), r
print("ranks", n, "ok")
"""


def test_script_without_main_guard(tmp_path):
    marker = tmp_path / "runs.txt"
    script = tmp_path / "no_guard.py"
    n = min(3, max_ranks())
    script.write_text(textwrap.dedent(SCRIPT.format(marker=str(marker), n=n, use_gpu=USE_GPU)))
    result = run_script(str(script), cwd=str(tmp_path))
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert f"ranks {n} ok" in result.stdout
    pid = int(result.stdout.split("pid", 1)[1].split()[0])
    assert marker.read_text().split() == [str(pid)], "a worker re-ran the script's top level"
    assert entries_of_pid(pid) == [], "the script's run left shared memory behind"
