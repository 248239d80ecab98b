"""fork and close: calls before fork and after close, fork twice, fork again after close, argument
checks, one rank, a master rank other than 0, the default number of ranks, max_n_var, profiles of
workers, logs, and a worker that dies.  Each test forks its own group and closes it (in GPU mode
under ``SYNK_TEST_GPU=1``, as many ranks as there are GPUs: ``BIG`` is 3 ranks, or 2 on 2 GPUs)."""

from __future__ import annotations

import logging
import os
import pstats
import signal
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from synk_testutil import (
    ON_ENGINE,
    TIMEOUT,
    USE_GPU,
    assert_no_workers_left,
    max_ranks,
    n_workers,
    own_entries,
    parts,
    run_script,
    worker_pids,
)

import synkhronos as synk
from synkhronos.forking import gpu_count
from synkhronos.runtime import current

pytestmark = pytest.mark.timeout(TIMEOUT)

BIG = min(3, max_ranks())
"""The larger group of these tests: 3 ranks (2 in GPU mode on 2 GPUs)."""


@pytest.fixture(autouse=True)
def closed_around():
    """Every test starts and ends with no group."""
    synk.close()
    yield
    synk.close()
    assert_no_workers_left()


def row_function():
    x = pt.matrix("x", dtype="float64")
    return synk.function([x], [(x * 2, None), (pt.sum(x), None), pt.mean(x, axis=0)])


def check_row_function(f, xd: np.ndarray, n: int) -> None:
    rows, sums, mean = f(synk.data(xd))
    np.testing.assert_array_equal(rows, xd * 2)
    np.testing.assert_allclose(sums, [p.sum() for p in parts(xd, n) if len(p)], rtol=1e-12)
    np.testing.assert_allclose(mean, xd.mean(0), rtol=1e-12)


def not_forked_calls(shared):
    x = pt.matrix("x")
    return {
        "function": lambda: synk.function([x], pt.sum(x)),
        "data": lambda: synk.data(np.ones(3)),
        "distribute": synk.distribute,
        "broadcast": lambda: synk.broadcast(shared),
        "scatter": lambda: synk.scatter(shared, np.ones(3)),
        "gather": lambda: synk.gather(shared),
        "all_gather": lambda: synk.all_gather(shared),
        "reduce": lambda: synk.reduce(shared),
        "all_reduce": lambda: synk.all_reduce(shared),
        "set_value": lambda: synk.set_value(0, shared, np.ones(3)),
        "get_value": lambda: synk.get_value(0, shared),
        "get_shapes": lambda: synk.get_shapes(shared),
        "get_lengths": lambda: synk.get_lengths(shared),
    }


def test_calls_before_fork_are_runtime_errors():
    shared = pytensor.shared(np.zeros(3), name="s")
    for name, call in not_forked_calls(shared).items():
        with pytest.raises(RuntimeError, match="fork"):
            call()
        assert current() is None, name
    assert worker_pids() == []


@pytest.mark.parametrize("kwargs, match", [({"n_parallel": 0}, "n_parallel"), ({"n_parallel": "2"}, "n_parallel"),
                                           ({"n_parallel": 2, "master_rank": 2}, "master_rank"),
                                           ({"n_parallel": 2, "master_rank": -1}, "master_rank"),
                                           ({"n_parallel": 2, "max_n_var": 0}, "max_n_var")])
def test_fork_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        synk.fork(use_gpu=USE_GPU, **kwargs)
    assert current() is None and worker_pids() == []


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has a GPU (or emulates GPUs: SYNK_EMULATE_GPUS)")
def test_use_gpu_without_gpu_is_value_error():
    with pytest.raises(ValueError, match="GPU"):
        synk.fork(2, use_gpu=True)
    assert current() is None and worker_pids() == []


def test_fork_twice_close_and_fork_again():
    assert synk.fork(2, use_gpu=USE_GPU) == 2
    prefix = current().group.prefix
    assert len(worker_pids()) == n_workers(2)
    f = row_function()
    xd = np.arange(14.0).reshape(7, 2)
    D = synk.data(xd)
    with pytest.raises(RuntimeError, match="already forked"):
        synk.fork(2, use_gpu=USE_GPU)
    check_row_function(f, xd, 2)  # the first group is untouched

    synk.close()
    assert_no_workers_left()
    assert own_entries(prefix) == []
    shared = pytensor.shared(np.zeros(3), name="s")
    for call in [lambda: f(D), *not_forked_calls(shared).values()]:
        with pytest.raises(RuntimeError, match="fork"):
            call()
    synk.close()  # idempotent
    np.testing.assert_array_equal(D.data, xd)  # Data stay usable in the master

    assert synk.fork(BIG, use_gpu=USE_GPU) == BIG
    assert len(worker_pids()) == n_workers(BIG)
    g = row_function()  # may get the same internal id as f
    with pytest.raises(RuntimeError, match="closed"):
        f(D)  # a function of the closed group
    rows, sums, _ = g(D)  # a Data of the first group is known again on first use
    np.testing.assert_array_equal(rows, xd * 2)
    np.testing.assert_allclose(sums, [p.sum() for p in parts(xd, BIG)])
    check_row_function(g, xd[:5], BIG)


def test_one_rank():
    assert synk.fork(1, use_gpu=USE_GPU) == 1
    assert len(worker_pids()) == n_workers(1)
    check_row_function(row_function(), np.arange(10.0).reshape(5, 2), 1)
    s = pytensor.shared(np.arange(3.0), name="s")
    synk.function([], pt.sum(s))
    np.testing.assert_array_equal(synk.gather(s), [np.arange(3.0)])
    synk.all_reduce(s, op="sum")
    np.testing.assert_array_equal(s.get_value(), np.arange(3.0))


@pytest.mark.cpu_only("in GPU mode the master process runs on its rank's GPU from its first fork on; a master "
                      "rank other than 0 needs a fresh process (test_master_rank_other_than_zero_in_a_fresh_process)")
@pytest.mark.parametrize("n", [2, 3])
def test_master_rank_other_than_zero(n):
    """With the master as rank 1, rank 0 (a worker) gets the first rows and comes first in gathers."""
    assert synk.fork(n, use_gpu=USE_GPU, master_rank=1) == n
    f = row_function()
    check_row_function(f, np.arange(22.0).reshape(11, 2), n)
    s = pytensor.shared(np.zeros(2), name="s")
    synk.function([], pt.sum(s))
    for r in range(n):
        synk.set_value(r, s, np.full(2, float(r)))
    np.testing.assert_array_equal(synk.gather(s), np.repeat(np.arange(float(n)), 2).reshape(n, 2))
    np.testing.assert_array_equal(s.get_value(), [1.0, 1.0])  # the master's own value is rank 1's
    np.testing.assert_array_equal(synk.get_value(1, s), s.get_value())
    synk.reduce(s, op="max")
    np.testing.assert_array_equal(s.get_value(), [n - 1.0] * 2)
    np.testing.assert_array_equal(synk.get_value(0, s), [0.0, 0.0])


MASTER_RANK_1 = """\
import os

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk

assert synk.fork(2, use_gpu=True, master_rank=1) == 2
from synkhronos.gpu import visible_devices

assert os.environ["CUDA_VISIBLE_DEVICES"] == visible_devices()[1]  # the master runs on rank 1's GPU
x = pt.matrix("x", dtype="float64")
f = synk.function([x], [(x * 2, None), (pt.sum(x), None), pt.mean(x, axis=0)])
xd = np.arange(22.0).reshape(11, 2)
rows, sums, mean = f(synk.data(xd))
assert np.array_equal(rows, xd * 2) and np.allclose(mean, xd.mean(0)), (rows, mean)
assert np.allclose(sums, [p.sum() for p in np.array_split(xd, 2)]), sums  # rank 0 (a worker) first
s = pytensor.shared(np.zeros(2), name="s")
synk.function([], pt.sum(s))
for r in range(2):
    synk.set_value(r, s, np.full(2, float(r)))
assert np.array_equal(synk.gather(s), [[0.0, 0.0], [1.0, 1.0]])
assert np.array_equal(s.get_value(), [1.0, 1.0])  # the master's own value is rank 1's
synk.set_value(0, s, np.full(2, 5.0))
synk.reduce(s, op="max")
assert np.array_equal(s.get_value(), [5.0, 5.0]) and np.array_equal(synk.get_value(0, s), [5.0, 5.0])
print("master rank 1 ok")
"""


@pytest.mark.skipif(not USE_GPU or ON_ENGINE, reason="GPU mode's per-rank engine only (CPU mode: "
                    "test_master_rank_other_than_zero; the JAX engine's master has no rank, master_rank stays 0)")
def test_master_rank_other_than_zero_in_a_fresh_process(tmp_path):
    """GPU mode, master_rank=1 in a process that has not run JAX yet: the master takes rank 1's GPU."""
    script = tmp_path / "master_rank_1.py"
    script.write_text(MASTER_RANK_1)
    result = run_script(str(script), cwd=str(tmp_path))
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "master rank 1 ok" in result.stdout


SPAWN_THEN_FORK = """\
import operator

import numpy as np
import pytensor.tensor as pt
import synk_comm

import synkhronos as synk
from synkhronos.gpu import visible_devices

every = visible_devices()
assert synk_comm.spawn(operator.attrgetter("rank"), 2, devices=every[:2]) == [0, 1]
assert visible_devices() == every, (visible_devices(), every)  # spawn pinned this process to one GPU
assert synk.fork(use_gpu=True) == len(every)
x = pt.matrix("x", dtype="float64")
f = synk.function([x], (pt.sum(x), "sum"))
xd = np.arange(12.0).reshape(6, 2)
assert np.isclose(f(synk.data(xd)), xd.sum())
print("spawn then fork ok")
"""


@pytest.mark.skipif(not USE_GPU, reason="GPU mode only: pinning to a GPU")
def test_fork_after_a_synk_comm_group_uses_every_gpu(tmp_path):
    """A synk_comm group with devices pins the master to its GPU; a fork in the same process
    afterwards still uses every GPU of the run (it used to see only the pinned one)."""
    script = tmp_path / "spawn_then_fork.py"
    script.write_text(SPAWN_THEN_FORK)
    result = run_script(str(script), cwd=str(tmp_path))
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "spawn then fork ok" in result.stdout


@pytest.mark.skipif(not USE_GPU and len(os.sched_getaffinity(0)) > 4,
                    reason="one worker per core would be too many here")
def test_default_n_parallel_is_the_cpu_rule_or_every_gpu():
    """Without a GPU, fork() with no arguments is CPU mode with synkhronos.cpu.default_ranks of
    the cores (every core, up to 4); with GPUs, GPU mode on every GPU."""
    from synkhronos.cpu import default_ranks

    if USE_GPU:
        n = synk.fork()
        assert n == gpu_count()
        assert current().device.kind == ("engine-master" if ON_ENGINE else "gpu")
    else:
        cores = len(os.sched_getaffinity(0))
        n = synk.fork() if gpu_count() == 0 else synk.fork(use_gpu=False)
        assert n == default_ranks(cores)
        assert current().device.kind == "cpu"
    check_row_function(row_function(), np.arange(12.0).reshape(6, 2), n)


def worker_environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}


def test_workers_get_the_master_configuration_and_a_share_of_the_cores():
    """floatX and the compile directory (the master's compile cache) reach every worker; CPU workers
    limit their BLAS/OpenMP/Numba threads to their share of the cores unless the user set them; GPU
    workers get their own GPU and no XLA preallocation."""
    with pytensor.config.change_flags(floatX="float32"):
        synk.fork(2, use_gpu=USE_GPU)
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    pids = worker_pids()
    assert len(pids) == n_workers(2)
    for pid in pids:
        env = worker_environ(pid)
        flags = env["PYTENSOR_FLAGS"].split(",")
        assert "floatX=float32" in flags
        assert f"base_compiledir={pytensor.config.base_compiledir}" in flags
        if USE_GPU:
            from synkhronos.gpu import visible_devices

            assert env["CUDA_VISIBLE_DEVICES"] in (visible_devices()[:2] if ON_ENGINE else [visible_devices()[1]])
            assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
            continue
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
            assert env[var] == os.environ.get(var, share), var


def test_max_n_var_limits_the_data_arguments_and_output_indices():
    synk.fork(2, use_gpu=USE_GPU, max_n_var=3)
    xs = [pt.matrix(f"x{i}", dtype="float64") for i in range(4)]
    three = synk.function(xs[:3], [pt.sum(x) for x in xs[:3]])
    four = synk.function(xs, (sum(pt.sum(x) for x in xs), "sum"))
    D = synk.data(np.ones((4, 2)))
    with pytest.raises(ValueError, match="max_n_var"):
        four(D, D, D, D)
    with pytest.raises(ValueError, match="max_n_var"):
        three(D, D, D, output_subset=[0])  # 3 Data + 1 output index
    got = three(D, D, D)
    np.testing.assert_allclose(got, [4.0, 4.0, 4.0])  # avg of per-rank sums weighted by rows
    assert three(D, D, output_subset=None, x2=D)[0] == 4.0


def test_profile_workers_writes_a_profile_per_worker(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    synk.fork(BIG, use_gpu=USE_GPU, profile_workers=True)
    check_row_function(row_function(), np.arange(8.0).reshape(4, 2), BIG)
    synk.close()
    assert_no_workers_left()
    for rank in range(1, BIG):
        path = tmp_path / f"synkhronos_worker_rank{rank}.prof"
        assert path.exists(), sorted(p.name for p in tmp_path.iterdir())
        assert pstats.Stats(str(path)).total_calls > 0


def test_fork_and_distribute_log_what_they_did(caplog):
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        synk.fork(2, use_gpu=USE_GPU)
        row_function()
        synk.distribute()
    text = caplog.text
    assert "2 ranks" in text and ("GPU" if USE_GPU else "CPU") in text
    assert "distributed 1 function" in text


def test_a_worker_that_dies_fails_the_next_call_quickly():
    synk.fork(BIG, use_gpu=USE_GPU)
    prefix = current().group.prefix
    f = row_function()
    xd = np.arange(12.0).reshape(6, 2)
    check_row_function(f, xd, BIG)
    victim = worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError, match="died"):
        f(synk.data(xd))
    assert time.monotonic() - t0 < 5
    with pytest.raises(RuntimeError, match="closed"):
        f(synk.data(xd))
    synk.close()
    assert_no_workers_left()
    assert own_entries(prefix) == []
    synk.fork(2, use_gpu=USE_GPU)  # a new group works
    check_row_function(row_function(), xd, 2)
