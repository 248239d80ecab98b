"""The seed's examples run as scripts (in a process of their own, as a user runs them), and a script
without a main guard that calls ``synk.fork()`` works: its workers never re-run it (in GPU mode too,
under ``SYNK_TEST_GPU=1``)."""

from __future__ import annotations

import os
import textwrap

import pytest
from synk_testutil import EXAMPLES, SHM_DIR, TIMEOUT, USE_GPU, max_ranks, run_script

pytestmark = pytest.mark.timeout(TIMEOUT)


def entries_of_pid(pid: int) -> list[str]:
    """/dev/shm entries of the run whose root process is ``pid``."""
    return sorted(e for e in os.listdir(SHM_DIR) if f"-{pid}-" in e)


EXPECTED = {
    "introductory.py": ["2 ranks: synkhronos"],
    # the numbers printed in the seed's documentation
    "shared_variables.py": ["s after PyTensor call (master only): [10. 10.]", "gathered s: [[3. 3.] [7. 7.]]",
                            "gathered s after reduce: [[10. 10.] [ 7. 7.]]", "all-reduce: [[10. 10.] [10. 10.]]"],
    "data_interface.py": ["after set_length(8): (8, 2) alloc_size 32", "after free_memory: None allocated: False"],
    "per_rank_values.py": ["lengths: [1, 2, 3]"],
    "batch_vs_batch_s.py": ["batch_s slice(0, 2) -> [ 0. 2. 10. 12.]"],
}


@pytest.mark.job
@pytest.mark.cpu_only("the seed's examples fork in CPU mode (use_gpu=False): they test nothing of GPU mode")
@pytest.mark.parametrize("name", list(EXPECTED))
def test_example_runs_and_passes_its_assertions(name):
    result = run_script(os.path.join(EXAMPLES, name))
    assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"
    assert "All assertions passed." in result.stdout
    flat = " ".join(result.stdout.split())
    for snippet in EXPECTED[name]:
        assert snippet in flat, f"{snippet!r} not in the output of {name}:\n{result.stdout}"


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
