"""synk_comm.xla_cpu: the all-reduce inside a compiled JAX program, against numpy, over real
processes; its waits end on the group's abort word and on a peer's death (no hang)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
from comm_handlers import make_input, xla_cpu_all_reduce

import synk_comm

jax = pytest.importorskip("jax")
if shutil.which("c++") is None:
    pytest.skip("no C++ compiler: synk_comm.xla_cpu is not available", allow_module_level=True)

from synk_comm import xla_cpu  # noqa: E402

pytestmark = pytest.mark.timeout(180)
UFUNC = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def expected(case: dict, size: int) -> np.ndarray:
    """numpy's reduction of the active ranks' inputs in rank order (weights: 0 = left out)."""
    inputs = [make_input(case["dtype"], tuple(case["shape"]), case["seed"], r) for r in range(size)]
    weights = case["weights"]
    active = [(w, x) for w, x in zip(weights, inputs) if w != 0]
    if case["op"] == "avg":
        if not active:
            return np.full(case["shape"], np.nan, dtype=case["dtype"])
        total = sum(w for w, _ in active)
        acc = sum(x * np.asarray(w, dtype=case["dtype"]) for w, x in active)
        return (acc * np.asarray(1.0 / total, dtype=case["dtype"])).astype(case["dtype"])
    out = active[0][1].copy()
    for _, x in active[1:]:
        out = UFUNC[case["op"]](out, x)
    return out


def cases(size: int) -> list[dict]:
    some_idle = [0.0 if r == 1 else float(r + 1) for r in range(size)]
    out = []
    for op in ("sum", "prod", "max", "min"):
        for dtype in ("float32", "float64", "int32", "int64"):
            out.append({"op": op, "dtype": dtype, "shape": [5, 7], "seed": len(out), "weights": [1.0] * size})
    for dtype in ("float32", "float64"):
        out.append({"op": "avg", "dtype": dtype, "shape": [33], "seed": 50, "weights": [r + 1.0 for r in range(size)]})
        out.append({"op": "avg", "dtype": dtype, "shape": [33], "seed": 51, "weights": some_idle})
    out.append({"op": "sum", "dtype": "float64", "shape": [4], "seed": 60, "weights": some_idle})
    out.append({"op": "max", "dtype": "float32", "shape": [3000], "seed": 61, "weights": [1.0] * size})  # chunks
    out.append({"op": "sum", "dtype": "float32", "shape": [0], "seed": 62, "weights": [1.0] * size})
    return out


def reduce_in_ranks(size: int, capacity: int, todo: list[dict]) -> list[list]:
    """Every case all-reduced by ``size`` spawned ranks over a new segment: each rank's results."""
    segment = xla_cpu.Segment.create(size, capacity)
    try:
        return synk_comm.spawn(xla_cpu_all_reduce, size, args=(segment.name, capacity, todo),
                               imports=["comm_handlers"])
    finally:
        segment.close()


def assert_matches_numpy(case: dict, got: np.ndarray, size: int) -> None:
    want = expected(case, size)
    assert got.dtype == np.dtype(case["dtype"]) and got.shape == tuple(case["shape"]), case
    if np.dtype(case["dtype"]).kind == "f":
        np.testing.assert_allclose(got, want, rtol=1e-6 if case["dtype"] == "float32" else 1e-12, err_msg=str(case))
    else:
        np.testing.assert_array_equal(got, want, err_msg=str(case))


@pytest.mark.parametrize("size", [2, 3])
def test_all_reduce_in_a_program_matches_numpy(size: int) -> None:
    todo = cases(size)
    for case, *per_rank in zip(todo, *reduce_in_ranks(size, 1024, todo)):  # 1 KB: 3000 values take 12 exchanges
        for got in per_rank:
            assert_matches_numpy(case, got, size)


def large_cases(size: int) -> list[dict]:
    """Chunks of 256 KB or more: reduced split over 3 ranks or more, copied and reduced by a team."""
    some_idle = [0.0 if r == 1 else float(r + 1) for r in range(size)]
    return [
        {"op": "sum", "dtype": "float32", "shape": [300_001], "seed": 70, "weights": [1.0] * size},  # 2 chunks
        {"op": "avg", "dtype": "float64", "shape": [150_001], "seed": 71, "weights": some_idle},
        {"op": "max", "dtype": "int64", "shape": [70_000], "seed": 72, "weights": [1.0] * size},
        {"op": "min", "dtype": "float32", "shape": [65_537], "seed": 73, "weights": some_idle},  # ragged parts
        {"op": "sum", "dtype": "float32", "shape": [5, 7], "seed": 74, "weights": [1.0] * size},  # small after
    ]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_large_arrays_reduced_split_by_teams_of_threads_match_numpy(size: int, monkeypatch) -> None:
    """Each rank a team of 2 threads ($SYNK_ALL_REDUCE_THREADS; a pinned rank's default is its
    cores); from 3 ranks each reduces its slice of a large chunk, then copies every slice."""
    monkeypatch.setenv("SYNK_ALL_REDUCE_THREADS", "2")
    todo = large_cases(size)
    for case, *per_rank in zip(todo, *reduce_in_ranks(size, 1 << 20, todo)):
        for got in per_rank[1:]:  # every rank holds the same values, bit for bit
            np.testing.assert_array_equal(got, per_rank[0], err_msg=str(case))
        assert_matches_numpy(case, per_rank[0], size)


def alone_in(size: int, capacity: int = 256) -> xla_cpu.Segment:
    """A segment for ``size`` ranks, rank 0's weight set: rank 0 alone, the others never coming."""
    assert xla_cpu.available()
    segment = xla_cpu.Segment.create(size, capacity)
    segment.set_weight(0, 1.0)
    return segment


@pytest.mark.parametrize("values", [3, 1 << 18])  # 1 MB: a team of 3 threads, the chunk split
def test_a_wait_ends_when_the_group_aborts(values: int, monkeypatch) -> None:
    monkeypatch.setenv("SYNK_ALL_REDUCE_THREADS", "3")
    abort = np.zeros(1, dtype=np.int64)
    segment = alone_in(3, 1 << 20)
    segment.set_weight(1, 1.0)  # ranks 1 and 2 "alive" (this process), but they never post
    segment.set_weight(2, 1.0)
    x = np.arange(values, dtype=np.float32)
    try:
        abort[0] = 1
        step = jax.jit(lambda v: xla_cpu.all_reduce(v, "sum", segment, 0, 3, abort_address=abort.ctypes.data))
        for _ in range(2):
            with pytest.raises(Exception, match="another rank failed"):
                np.asarray(step(x))
    finally:
        segment.close()
    alone = alone_in(1, 1 << 20)  # the team (its threads waited with the caller) serves the next call
    try:
        step = jax.jit(lambda v: xla_cpu.all_reduce(v * 2, "sum", alone, 0, 1))
        np.testing.assert_array_equal(np.asarray(step(x)), x * 2)
    finally:
        alone.close()


def test_realign_puts_every_rank_at_the_furthest_call_posted() -> None:
    """Rank 0 posted a call that rank 1 never reached (stopped by the abort word): the counters
    disagree until :meth:`Segment.realign`, after which the next call of each rank is the same."""
    abort = np.zeros(1, dtype=np.int64)
    segment = alone_in(2)
    segment.set_weight(1, 1.0)
    try:
        abort[0] = 1
        step = jax.jit(lambda v: xla_cpu.all_reduce(v, "sum", segment, 0, 2, abort_address=abort.ctypes.data))
        for _ in range(2):
            with pytest.raises(Exception, match=xla_cpu.ABORTED):
                np.asarray(step(np.ones(3, dtype=np.float32)))
        assert segment._counters.tolist() == [[2, 0], [0, 0], [0, 0]]  # posted, done, reduced: by rank
        segment.realign()
        assert segment._counters.tolist() == [[2, 2], [2, 2], [2, 2]]
    finally:
        segment.close()


def test_a_wait_ends_when_a_peer_is_gone() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    segment = alone_in(2)
    try:
        segment._rows[1, 1:2].view(np.int64)[0] = gone.pid  # rank 1: a process that has exited
        step = jax.jit(lambda v: xla_cpu.all_reduce(v, "sum", segment, 0, 2))
        with pytest.raises(Exception, match=f"rank 1 \\(process {gone.pid}\\) is gone"):
            np.asarray(step(np.ones(3, dtype=np.float32)))
    finally:
        segment.close()


def test_bad_arguments_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="1 to 64 ranks"):
        xla_cpu.Segment.create(65)
    with pytest.raises(ValueError, match="multiple of 64"):
        xla_cpu.Segment.create(2, 100)
    segment = xla_cpu.Segment.create(2, 256)
    try:
        with pytest.raises(ValueError, match="op must be one of"):
            xla_cpu.all_reduce(jax.numpy.ones(2), "mean", segment, 0, 2)
    finally:
        segment.close()
