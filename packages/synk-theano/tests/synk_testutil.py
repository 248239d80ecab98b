"""Helpers of the synkhronos tests (a module of its own, not conftest: every package's tests run in
one pytest session, where the name ``conftest`` is not unique).

The references here are plain numpy: how rows split over the ranks (``numpy.array_split``: the
first ``len % n`` ranks get one row more), and how per-rank or per-slice values combine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
EXAMPLES = os.path.join(ROOT, "examples")
SHM_DIR = "/dev/shm"
TIMEOUT = 120
"""Seconds for any test that runs several processes (pytest.mark.timeout)."""

COMM_TESTS = os.path.join(ROOT, "packages", "synk-comm", "tests")
if COMM_TESTS not in sys.path:  # the process and /dev/shm helpers (comm_testutil)
    sys.path.append(COMM_TESTS)

from comm_testutil import ON_ENGINE, USE_GPU, assert_no_workers_left, own_entries, worker_pids  # noqa: E402, F401


def n_workers(n: int) -> int:
    """Worker processes of a fork of ``n`` ranks (the per-rank engine's master is a rank)."""
    return n if ON_ENGINE else n - 1


def max_ranks() -> int:
    """The most ranks a test may fork: 3 in CPU mode, the visible GPUs in GPU mode."""
    if not USE_GPU:
        return 3
    from synkhronos.forking import gpu_count

    return gpu_count()


def rank_counts() -> list[int]:
    """The group sizes that the ``ranks`` fixture forks: 2 and 3, as far as the GPUs go (at least 2:
    GPU mode on fewer than 2 GPUs then fails at fork, saying so); ``SYNK_TEST_RANKS`` (e.g. ``2``,
    or ``2,3``) chooses among them (the noxfile's pass on an older interpreter forks 2 only)."""
    chosen = os.environ.get("SYNK_TEST_RANKS", "").strip()
    sizes = [int(n) for n in chosen.split(",")] if chosen else [2, 3]
    return [n for n in sizes if n <= max_ranks()] or [2]


# --- processes and shared memory ------------------------------------------------------------------

def run_script(path: str, timeout: float = 180.0, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python path`` as a run of its own (no inherited run prefix; in GPU mode, every GPU
    visible, not only the one a fork pinned this process to); capture its output."""
    env = dict(os.environ)
    env.pop("SYNK_RUN_PREFIX", None)
    if USE_GPU:
        from synkhronos.gpu import visible_devices

        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_devices())
    return subprocess.run([sys.executable, path], env=env, cwd=cwd or ROOT, capture_output=True, text=True,
                          timeout=timeout)


# --- numpy references ---------------------------------------------------------------------------

def parts(values: np.ndarray, n: int) -> list[np.ndarray]:
    """Each rank's rows of ``values`` when scattered over ``n`` ranks."""
    return np.array_split(np.asarray(values), n)


def combine(op: str | None, values: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """numpy reference of how parts combine (parts of weight 0 are left out).

    avg: weighted mean; sum/prod/max/min: element-wise; None/"gather": concatenation on axis 0,
    0-d values stacked.
    """
    kept = [(np.asarray(v), w) for v, w in zip(values, weights) if w > 0]
    vals = [v for v, _ in kept]
    if op is None or op == "gather":
        return np.stack(vals) if vals[0].ndim == 0 else np.concatenate(vals, axis=0)
    if op == "avg":
        total = sum(w for _, w in kept)
        return sum(v * w for v, w in kept) / total
    return {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}[op](np.stack(vals), axis=0)


def slices_of(n_rows: int, num_slices: int) -> list[slice]:
    """The non-empty slices in which a rank computes its ``n_rows`` rows under ``num_slices``."""
    chunks = np.array_split(np.arange(n_rows), num_slices)
    return [slice(int(c[0]), int(c[-1]) + 1) for c in chunks if len(c)]


# --- an Op that JAX cannot compile --------------------------------------------------------------

class TwiceInPython(Op):
    """``2 * x`` computed in Python (``perform``), with no JAX implementation: PyTensor's JAX mode
    cannot compile a graph that holds it (CPU mode's JAX backend falls back)."""

    __props__ = ()

    def make_node(self, x: Any) -> Apply:
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node: Any, inputs: Sequence[Any], output_storage: Any) -> None:
        output_storage[0][0] = np.asarray(2 * inputs[0], dtype=node.outputs[0].dtype)
