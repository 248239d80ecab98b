"""Bad input of the lifecycle: calls before fork and after close, fork twice, bad fork arguments,
use of a closed synk_comm group.  Each raises its specific error without starting a process or
leaving anything in /dev/shm; Data outlive a closed group unchanged and a new group works with them.
"""

from __future__ import annotations

import gc

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import reliability_lib as rl

import synk_comm
import synkhronos as synk
from synkhronos.forking import gpu_count
from synkhronos.runtime import current

pytestmark = pytest.mark.timeout(120)
SY = "synkhronos"


@pytest.fixture(autouse=True)
def no_group_around():
    """Each test starts and ends with no group and leaves no process or segment of its own."""
    synk.close()
    children = rl.worker_pids()
    before = set(rl.own_entries(rl.run_prefix()))
    yield
    synk.close()
    gc.collect()
    rl.check_no_leak("worker processes of a lifecycle test", sorted(set(rl.wait_gone(rl.worker_pids(), 5.0))
                                                                     - set(children)))
    rl.check_no_leak("/dev/shm entries of a lifecycle test", sorted(set(rl.own_entries(rl.run_prefix())) - before))


def not_forked_calls(s: pytensor.compile.SharedVariable) -> dict[str, object]:
    x = pt.matrix("x")
    return {"function": lambda: synk.function([x], pt.sum(x)), "data": lambda: synk.data(np.ones(3)),
            "distribute": synk.distribute, "broadcast": lambda: synk.broadcast(s, np.ones(3)),
            "gather": lambda: synk.gather(s), "set_value": lambda: synk.set_value(0, s, np.ones(3))}


@pytest.mark.parametrize("call", [pytest.param(c, marks=pytest.mark.reliability("input", SY), id=f"before fork: {c}")
                                  for c in ["function", "data", "distribute", "broadcast", "gather", "set_value"]])
def test_call_before_fork(call):
    s = pytensor.shared(np.zeros(3), name="s")
    children = rl.worker_pids()
    with pytest.raises(RuntimeError, match=r"not forked: call synk.fork\(\) first"):
        not_forked_calls(s)[call]()  # type: ignore[operator]
    assert current() is None and rl.worker_pids() == children
    np.testing.assert_array_equal(s.get_value(), np.zeros(3))


@pytest.mark.reliability("input", SY)
def test_calls_after_close_then_fork_again():
    """After close(): a call of a function of the closed group, a collective and synk.data are
    RuntimeErrors; the Data keep their values; after fork() the old function is refused (it belongs
    to the closed group) and a new one computes on the same Data."""
    synk.fork(2, use_gpu=rl.USE_GPU)
    x = pt.matrix("x", dtype="float64")
    s = pytensor.shared(np.arange(3.0), name="s")
    f = synk.function([x], (pt.sum(x) + pt.sum(s), "sum"))
    xd = np.arange(12.0).reshape(6, 2)
    X = synk.data(xd)
    assert f(X) == xd.sum() + 2 * 3.0
    synk.close()
    for call in [lambda: f(X), lambda: synk.gather(s), lambda: synk.data(np.ones(2)), synk.distribute]:
        with pytest.raises(RuntimeError, match="not forked"):
            call()
    np.testing.assert_array_equal(X.data, xd)
    np.testing.assert_array_equal(s.get_value(), np.arange(3.0))
    synk.fork(2, use_gpu=rl.USE_GPU)
    with pytest.raises(RuntimeError, match="built for a group that is closed"):
        f(X)
    g = synk.function([x], (pt.sum(x) + pt.sum(s), "sum"))
    assert g(X) == xd.sum() + 2 * 3.0
    X.free_memory()


@pytest.mark.reliability("input", SY)
def test_fork_twice():
    synk.fork(2, use_gpu=rl.USE_GPU)
    group = current().group
    pids = rl.group_worker_pids(group)
    x = pt.matrix("x", dtype="float64")
    f = synk.function([x], (pt.sum(x), "sum"))
    with pytest.raises(RuntimeError, match=r"already forked: call synk.close\(\)"):
        synk.fork(2, use_gpu=rl.USE_GPU)
    assert current().group is group and rl.group_worker_pids(group) == pids
    assert rl.worker_pids() == pids
    X = synk.data(np.ones((4, 2)))
    assert f(X) == 8.0
    X.free_memory()


@pytest.mark.parametrize("kwargs, match", [
    pytest.param({"n_parallel": 0}, "n_parallel must be an int >= 1", id="fork: n_parallel 0"),
    pytest.param({"n_parallel": 2, "master_rank": 2}, r"master_rank must be in \[0, n_parallel=2\)",
                 id="fork: master_rank out of range"),
    pytest.param({"n_parallel": 2, "max_n_var": 0}, "max_n_var must be >= 1", id="fork: max_n_var 0"),
])
@pytest.mark.reliability("input", SY)
def test_bad_fork_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        synk.fork(use_gpu=rl.USE_GPU, **kwargs)
    assert current() is None and rl.worker_pids() == []


@pytest.mark.reliability("input", SY)
@pytest.mark.skipif(gpu_count() > 0, reason="needs a machine without GPUs: this one has (or emulates) "
                                            f"{gpu_count()}")
def test_fork_use_gpu_without_a_gpu():
    with pytest.raises(ValueError, match="no visible NVIDIA GPU"):
        synk.fork(2, use_gpu=True)
    assert current() is None and rl.worker_pids() == []


@pytest.mark.reliability("input", "synk_comm")
def test_closed_synk_comm_group():
    group = synk_comm.start(2, imports=["reliability_lib"])
    pids = rl.group_worker_pids(group)
    np.testing.assert_array_equal(group.run("rel.sum_ranks", 2), [1.0, 1.0])
    group.close()
    for call in [lambda: group.run("rel.sum_ranks", 2), lambda: group.all_reduce(np.ones(2)), group.barrier]:
        with pytest.raises(synk_comm.GroupBrokenError, match="closed"):
            call()
    assert rl.wait_gone(pids, 5.0) == [] and rl.own_entries(group.prefix) == []
