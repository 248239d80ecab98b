"""Bad input, one kind per row: the specific exception and message, raised before any worker is told
to act; afterwards nothing is lost and the group works.

Three tables, run in 2 CPU ranks:

* :data:`SYNK_CASES` (synkhronos and synk_shm) on one synkhronos group.  For each row:
  a :class:`~reliability_lib.CommandSpy` on the master's group proves that no command reached the
  workers (rows marked ``READS``/``EVERY_RANK`` say why the workers must be asked: only they know
  their shapes); every shared variable's value in every rank (``synk.gather``) and every Data's
  contents are what they were; a correct call right after gives the numpy result and counts once
  in every rank.
* :data:`COMM_CASES` (synk_comm) on one plain process group: no command sent, every rank's state
  unchanged, a correct command right after gives the right sum.
* :data:`WORKER_MISUSE` (a handler or a function that, in a worker, starts commands, groups or a
  fork): a :class:`synk_comm.WorkerError` that names the rank and carries the worker's
  ``RuntimeError`` with a clear message; the group stays usable and nothing was started.

The lifecycle (calls before fork and after close, fork twice...) is in
:mod:`test_reliability_lifecycle`.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import reliability_lib as rl
import reliability_ops as ro

import synk_comm
import synk_shm
import synkhronos as synk
from synkhronos.runtime import current

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:Numba will use object mode")]

N_RANKS = 2
MAX_N_VAR = 6
ROWS = 6
ENGINE = rl.ON_ENGINE
"""GPU mode's engine: every rank is a worker (group rank ``r + 1`` computes rank ``r``'s share)."""
SAME_SHAPE = "every rank must (give|hold) the same shape"
"""The refusal of a reduction over different shapes (CPU mode says "give", the engine "hold")."""
NO_COMMAND, READS, EVERY_RANK = "none", "reads", "every rank"
"""How far a bad call may go: no command at all; a read-only command (only the workers know what
they hold); a command in which every rank finds the problem before changing anything."""


class Env:
    """The module's group, functions, shared variables (different in each rank) and Data."""

    def __init__(self) -> None:
        synk.fork(N_RANKS, use_gpu=rl.USE_GPU, max_n_var=MAX_N_VAR)
        self.group = current().group
        self.x = x = pt.matrix("x", dtype="float64")
        self.z = z = pt.matrix("z", dtype="float64")
        self.y = y = pt.vector("y", dtype="float64")
        self.c = c = pytensor.shared(np.zeros(2), name="c")  # +1 per call in every rank that computes
        self.W = W = pytensor.shared(np.zeros((2, 2)), name="W")
        self.Ws = Ws = pytensor.shared(np.zeros((2, 2)), name="Ws", shape=(2, 2))  # static shape
        self.k = k = pytensor.shared(np.arange(3, dtype="int64"), name="k")
        self.s0 = s0 = pytensor.shared(np.float64(1.5), name="s0")
        self.S = S = pytensor.shared(np.zeros((1, 2)), name="S")
        self.unused = pytensor.shared(np.zeros(2), name="unused")
        self.f = synk.function([x, z], (pt.sum(x * y, axis=0) + pt.sum(z) + pt.sum(W) + pt.sum(Ws), "sum"),
                               bcast_inputs=[y], updates=[(c, c + 1)])
        self.fk = synk.function([], [(pt.sum(k), "sum"), (s0 * 2, "sum")])
        self.fs = synk.function([], (pt.sum(S, axis=0), "sum"), sliceable_shareds=[S])
        self.fo = synk.function([x], [(pt.sum(x), "sum"), (pt.max(x), "max")])
        self.fmb = synk.function([z], (z * 2, None))
        xs = [pt.matrix(f"m{i}", dtype="float64") for i in range(MAX_N_VAR + 1)]
        self.fmany = synk.function(xs, (sum(pt.sum(m) for m in xs), "sum"))
        rng = np.random.default_rng(8)
        self.xd, self.zd, self.yd = rng.normal(size=(ROWS, 2)), rng.normal(size=(ROWS, 2)), np.array([1.0, -2.0])
        self.X, self.Z, self.Y = synk.data(self.xd), synk.data(self.zd), synk.data(self.yd)
        for r in range(N_RANKS):
            synk.set_value(r, [W, Ws, k], [np.full((2, 2), r + 1.0), np.full((2, 2), 10.0 * r), np.arange(3) + r])
        synk.scatter(S, rng.normal(size=(2 * N_RANKS + 1, 2)))  # uneven: the ranks hold different shapes
        self.f(self.X, self.Z, self.Y)  # distributes every function

    def snapshot(self) -> dict[str, np.ndarray]:
        """Every shared variable's value in every rank, and every Data's contents."""
        shot = dict(zip(["c", "W", "Ws", "k", "s0"], synk.gather([self.c, self.W, self.Ws, self.k, self.s0])))
        shot["S"] = synk.gather(self.S, nd_up=0)
        shot["S lengths"] = np.array(synk.get_lengths(self.S))
        shot["unused"] = self.unused.get_value().copy()
        for name in "XZY":
            shot[name] = np.array(getattr(self, name).data, copy=True)
        return shot

    def assert_intact_and_usable(self, before: dict[str, np.ndarray]) -> None:
        after = self.snapshot()
        for name, value in before.items():
            np.testing.assert_array_equal(after[name], value, err_msg=f"{name} changed")
        got = self.f(self.X, self.Z, self.Y)
        want = (self.xd * self.yd).sum(0) + self.zd.sum() + before["W"].sum() + before["Ws"].sum()
        np.testing.assert_allclose(got, want, rtol=1e-12)
        np.testing.assert_array_equal(synk.gather(self.c), before["c"] + 1)  # counted once in every rank


@pytest.fixture(scope="module")
def env():
    before = set(rl.own_entries(rl.run_prefix()))
    e = Env()
    prefix = e.group.prefix
    pids = rl.group_worker_pids(e.group)
    yield e
    synk.close()
    for d in (e.X, e.Z, e.Y):
        d.free_memory()
    del e
    gc.collect()
    rl.check_no_leak("workers of the bad-input group", rl.wait_gone(pids, 5.0))
    rl.check_no_leak("/dev/shm entries of the bad-input group", rl.own_entries(prefix))
    rl.check_no_leak("/dev/shm entries of the bad-input module",
                     sorted(set(rl.own_entries(rl.run_prefix())) - before))


@dataclass
class Case:
    package: str
    exc: type[BaseException] | tuple[type[BaseException], ...]
    match: str
    action: Callable[[Env, Any], Any]
    setup: Callable[[Env], Any] | None = None
    reach: str = NO_COMMAND


def freed(e: Env) -> synk.Data:
    d = synk.data(e.xd)
    d.free_memory()
    return d


def shm_total_bytes() -> int:
    """The size of /dev/shm: more than that can never be allocated, whatever else runs."""
    st = os.statvfs(rl.SHM_DIR)
    return st.f_blocks * st.f_frsize


def unregistered(e: Env, n: int = 1) -> list[synk_shm.Data]:
    """Data the workers do not know yet (registered on first use)."""
    return [synk_shm.Data(e.xd) for _ in range(n)]


SH, SY = "synk_shm", "synkhronos"
SYNK_CASES: dict[str, Case] = {
    # --- calls ----------------------------------------------------------------------------------
    "call: too few Data": Case(SY, TypeError, "missing Data for input", lambda e, a: e.f(e.X, e.Z)),
    "call: too many Data": Case(SY, TypeError, "takes 3 Data arguments", lambda e, a: e.f(e.X, e.Z, e.Y, e.Y)),
    "call: numpy array where Data is required": Case(SY, TypeError, r"needs a synkhronos Data.*synk\.data",
                                                     lambda e, a: e.f(e.xd, e.Z, e.Y)),
    "call: Data of another dtype": Case(SY, TypeError, "dtype float64, the Data has float32",
                                        lambda e, a: e.f(a, e.Z, e.Y),
                                        lambda e: synk.data(e.xd.astype("float32"))),
    "call: Data of another ndim": Case(SY, TypeError, "ndim 2, the Data has ndim 1", lambda e, a: e.f(e.Y, e.Z, e.Y)),
    "call: unknown keyword": Case(SY, TypeError, "no input named 'w'", lambda e, a: e.f(e.X, e.Z, w=e.Y)),
    "call: input given twice": Case(SY, TypeError, "given twice", lambda e, a: e.f(e.X, e.Z, e.Y, x=e.X)),
    "call: freed Data as an input": Case(SY, ValueError, "holds no memory", lambda e, a: e.f(a, e.Z, e.Y), freed),
    "call: never-filled Data as an input": Case(SY, ValueError, "holds no memory", lambda e, a: e.f(a, e.Z, e.Y),
                                                lambda e: synk.data(var=e.x)),
    "call: scattered inputs of different lengths": Case(SY, ValueError, "different lengths",
                                                        lambda e, a: e.f(e.X, a, e.Y),
                                                        lambda e: synk.data(e.zd[:-1])),
    "call: batch count beyond the rows": Case(SY, ValueError, "more rows", lambda e, a: e.f(e.X, e.Z, e.Y,
                                                                                         batch=ROWS + 1)),
    "call: negative batch count": Case(SY, ValueError, "negative", lambda e, a: e.f(e.X, e.Z, e.Y, batch=-1)),
    "call: batch index out of range": Case(SY, ValueError, r"batch indices \[6\] out of range",
                                           lambda e, a: e.f(e.X, e.Z, e.Y, batch=[0, ROWS])),
    "call: float batch": Case(SY, TypeError, "batch must be an int", lambda e, a: e.f(e.X, e.Z, e.Y, batch=1.5)),
    "call: float batch indices": Case(SY, TypeError, "must be integers", lambda e, a: e.f(e.X, e.Z, e.Y,
                                                                                         batch=[0.0, 1.0])),
    "call: 2-d batch indices": Case(SY, TypeError, "must be 1-d", lambda e, a: e.f(e.X, e.Z, e.Y,
                                                                                 batch=np.zeros((2, 2), int))),
    "call: empty batch": Case(SY, ValueError, "selects no rows", lambda e, a: e.f(e.X, e.Z, e.Y, batch=[])),
    "call: batch on a function without scattered inputs": Case(SY, ValueError, "function has none",
                                                               lambda e, a: e.fk(batch=1)),
    "call: batch_s on a function without sliceable shareds": Case(SY, ValueError, "sliceable_shareds",
                                                                  lambda e, a: e.f(e.X, e.Z, e.Y, batch_s=[0])),
    "call: batch_s for the wrong number of ranks": Case(SY, TypeError, f"list of {N_RANKS}",
                                                        lambda e, a: e.fs(batch_s=[[0]] * (N_RANKS + 1))),
    "call: batch_s slice with step 0": Case(SY, ValueError, "step cannot be zero",
                                            lambda e, a: e.fs(batch_s=slice(0, 1, 0))),
    "call: num_slices < 1": Case(SY, ValueError, "num_slices must be an int >= 1",
                                 lambda e, a: e.f(e.X, e.Z, e.Y, num_slices=0)),
    "call: num_slices > 1 with nothing to slice": Case(SY, ValueError, "something to slice",
                                                       lambda e, a: e.fk(num_slices=2)),
    "call: output_subset index out of range": Case(SY, ValueError, "index 2 out of range",
                                                   lambda e, a: e.fo(e.X, output_subset=[2])),
    "call: output_subset of non-ints": Case(SY, TypeError, "must hold ints",
                                            lambda e, a: e.fo(e.X, output_subset=["0"])),
    "call: output_subset repeated": Case(SY, ValueError, "repeated", lambda e, a: e.fo(e.X, output_subset=[0, 0])),
    "call: minibatch Data shorter than the batch": Case(SY, ValueError, "minibatch Data",
                                                        lambda e, a: e.fmb(a, batch=[0, 1, 2]),
                                                        lambda e: synk.data(e.zd[:2], minibatch=True)),
    "call: more Data than fork(max_n_var)": Case(SY, ValueError, "max_n_var", lambda e, a: e.fmany(*a),
                                                 lambda e: unregistered(e, MAX_N_VAR + 1)),
    # --- function definitions -----------------------------------------------------------------
    "function: unknown output op": Case(SY, ValueError, "unknown reduce op 'mean'",
                                        lambda e, a: synk.function([e.x], (pt.sum(e.x), "mean"))),
    "function: unknown update op": Case(SY, ValueError, "unknown reduce op 'gather'",
                                        lambda e, a: synk.function([e.x], updates=[(e.c, e.c + 1, "gather")])),
    "function: shared variable as an input": Case(SY, TypeError, "symbolic",
                                                  lambda e, a: synk.function([e.c], pt.sum(e.c))),
    "function: 0-d scattered input": Case(SY, ValueError, "0-d", lambda e, a: synk.function([a], a * 2),
                                          lambda e: pt.scalar("a")),
    "function: sliceable shared not used": Case(SY, ValueError, "not used by this function",
                                                lambda e, a: synk.function([e.x], pt.sum(e.x),
                                                                           sliceable_shareds=[e.unused])),
    "function: update of a non-shared variable": Case(SY, TypeError, "target must be a shared variable",
                                                      lambda e, a: synk.function([e.x], updates=[(e.y, e.y)])),
    "function: output not a variable": Case(SY, TypeError, "output", lambda e, a: synk.function([e.x], "sum")),
    # --- collectives --------------------------------------------------------------------------
    "collective: shared variable no function uses": Case(SY, ValueError, "not used by any synkhronos function",
                                                         lambda e, a: synk.broadcast(e.unused, np.ones(2))),
    "collective: symbolic variable (not shared)": Case(SY, TypeError, "PyTensor shared variables",
                                                       lambda e, a: synk.broadcast(e.y, np.ones(2))),
    "collective: numpy array (not a variable)": Case(SY, TypeError, "PyTensor shared variables",
                                                     lambda e, a: synk.all_reduce(np.ones(2))),
    "collective: empty list": Case(SY, ValueError, "no shared variables", lambda e, a: synk.gather([])),
    "reduce: unknown op": Case(SY, ValueError, "unknown reduce op 'mean'", lambda e, a: synk.reduce(e.c, op="mean")),
    "all_reduce: unknown op": Case(SY, ValueError, "unknown reduce op",
                                   lambda e, a: synk.all_reduce([e.c, e.W], op="gather")),
    "all_reduce: avg of an integer variable": Case(SY, TypeError, "'avg' needs a floating",
                                                   lambda e, a: synk.all_reduce(e.k, op="avg")),
    "broadcast: more values than variables": Case(SY, ValueError, r"1 shared variable\(s\) but 2 value",
                                                  lambda e, a: synk.broadcast([e.c], [np.ones(2), np.ones(2)])),
    "broadcast: value of another ndim": Case(SY, TypeError, "ndim 1, the value has ndim 2",
                                             lambda e, a: synk.broadcast(e.c, np.ones((2, 2)))),
    "broadcast: value of the wrong dtype": Case(SY, TypeError, "complex128 value cannot be cast safely",
                                                lambda e, a: synk.broadcast(e.c, np.ones(2, complex))),
    "broadcast: Data of the wrong dtype": Case(SY, TypeError, "float64 value cannot be cast safely",
                                               lambda e, a: synk.broadcast(e.k, a),
                                               lambda e: synk.data(np.ones(3))),
    "broadcast: freed Data as the value": Case(SY, ValueError, "holds no memory",
                                               lambda e, a: synk.broadcast(e.W, a), freed),
    "broadcast: a new Data, then a bad value": Case(SY, TypeError, "cannot be cast safely",
                                                    lambda e, a: synk.broadcast([e.W, e.c], [a, np.ones(2, complex)]),
                                                    lambda e: synk_shm.Data(np.ones((2, 2)))),
    "broadcast: shape against a static shape": Case(SY, TypeError, r"static shape \(2, 2\)",
                                                    lambda e, a: synk.broadcast(e.Ws, np.ones((3, 2)))),
    "scatter: values of the wrong dtype": Case(SY, TypeError, "float64 value cannot be cast safely",
                                               lambda e, a: synk.scatter(e.k, np.ones(4))),
    "scatter: Data of the wrong dtype": Case(SY, TypeError, "cannot be cast safely",
                                             lambda e, a: synk.scatter(e.W, a),
                                             lambda e: synk.data(np.ones((4, 2), "complex64"))),
    "scatter: 0-d variable": Case(SY, ValueError, "0-d", lambda e, a: synk.scatter(e.s0, np.float64(2))),
    "scatter: values of different lengths": Case(SY, ValueError, "different lengths",
                                                 lambda e, a: synk.scatter([e.W, e.S], [np.ones((4, 2)),
                                                                                      np.ones((3, 2))])),
    "scatter: batch index out of range": Case(SY, ValueError, "out of range",
                                              lambda e, a: synk.scatter(e.S, np.ones((4, 2)), batch=[4])),
    "scatter: parts against a static shape": Case(SY, TypeError, r"static shape \(2, 2\)",
                                                  lambda e, a: synk.scatter(e.Ws, np.ones((6, 2)))),
    "set_value: rank out of range": Case(SY, ValueError, r"rank must be an int in \[0, 2\)",
                                         lambda e, a: synk.set_value(N_RANKS, e.c, np.ones(2))),
    "set_value: batch count beyond the value": Case(SY, ValueError, "outside",
                                                    lambda e, a: synk.set_value(1, e.W, np.ones((2, 2)), batch=3)),
    "get_value: rank out of range": Case(SY, ValueError, "rank must be", lambda e, a: synk.get_value(-1, e.c)),
    "gather: nd_up not 0 or 1": Case(SY, ValueError, "nd_up must be 0", lambda e, a: synk.gather(e.c, nd_up=2)),
    "gather(nd_up=0): 0-d variable": Case(SY, ValueError, "0-d", lambda e, a: synk.gather(e.s0, nd_up=0)),
    "all_gather: 0-d variable": Case(SY, ValueError, "0-d", lambda e, a: synk.all_gather([e.c, e.s0])),
    "gather(nd_up=1): ranks hold different shapes": Case(SY, ValueError, "different shapes in the ranks",
                                                         lambda e, a: synk.gather(e.S, nd_up=1), reach=READS),
    "all_reduce: ranks hold different shapes": Case(SY, ValueError, SAME_SHAPE,
                                                    lambda e, a: synk.all_reduce(e.S, op="sum"), reach=EVERY_RANK),
    # --- Data (synk_shm) --------------------------------------------------------------------------
    "Data: object dtype": Case(SH, TypeError, "holds Python objects",
                               lambda e, a: synk_shm.Data(np.array([None, 1], dtype=object))),
    "Data: no dtype": Case(SH, TypeError, "needs a dtype", lambda e, a: synk_shm.Data(shape=(2,))),
    "Data: no ndim": Case(SH, TypeError, "needs an ndim", lambda e, a: synk_shm.Data(dtype="f8")),
    "Data: oversize outside [1, 2]": Case(SH, ValueError, "oversize", lambda e, a: synk_shm.Data(e.xd, oversize=3)),
    "Data: larger than /dev/shm": Case(SH, synk_shm.SharedMemoryFullError, "cannot allocate .* /dev/shm has",
                                       lambda e, a: synk_shm.Data(dtype="u1", shape=(shm_total_bytes() + 1,))),
    "Data.set_value of an input: unsafe cast": Case(SH, TypeError, "not safe",
                                                    lambda e, a: e.X.set_value(np.ones((9, 2), complex))),
    "Data.set_value of an input: other ndim": Case(SH, TypeError, "has ndim=2; the value has ndim=1",
                                                   lambda e, a: e.X.set_value(np.ones(9))),
    "Data.set_shape of an input: negative": Case(SH, ValueError, "negative dimension",
                                                 lambda e, a: e.X.set_shape((-1, 2))),
    "Data.set_shape of an input: other ndim": Case(SH, TypeError, "has ndim=2; shape",
                                                   lambda e, a: e.X.set_shape((3, 2, 1))),
    "Data.set_length of a 0-d Data": Case(SH, TypeError, "0-d", lambda e, a: a.set_length(2),
                                          lambda e: synk.data(np.float64(3.0))),
    "Data: resize an attached copy": Case(SH, RuntimeError, "attached from another process",
                                          lambda e, a: a.set_length(10),
                                          lambda e: synk_shm.Data.attach(e.X.handle())),
    "Data: read a freed Data": Case(SH, ValueError, "holds no memory", lambda e, a: a[0], freed),
    "SharedArray.attach: no such segment": Case(SH, FileNotFoundError, "no shared-memory segment",
                                                lambda e, a: synk_shm.SharedArray.attach("/synk-none", 1, "f8")),
    "synk.data: dtype contradicts var": Case(SY, TypeError, "contradicts",
                                             lambda e, a: synk.data(e.xd, var=e.x, dtype="float32")),
    "synk.data: value not castable to var's dtype": Case(SH, TypeError, "not safe",
                                                         lambda e, a: synk.data(e.xd.astype(complex), var=e.x)),
}


def params(table: dict[str, Any], package: Callable[[Any], str] = lambda case: case.package) -> list[Any]:
    """One pytest param per row, marked with its package for the summary table."""
    return [pytest.param(name, marks=pytest.mark.reliability("input", package(row)), id=name)
            for name, row in table.items()]


@pytest.mark.parametrize("name", params(SYNK_CASES))
def test_bad_input(env, name):
    case = SYNK_CASES[name]
    arg = case.setup(env) if case.setup else None
    before = env.snapshot()
    with rl.CommandSpy(env.group) as spy, pytest.raises(case.exc, match=case.match):
        case.action(env, arg)
    if case.reach == NO_COMMAND:
        assert spy.releases == 0, f"{spy.releases // (N_RANKS - 1)} command(s) reached the workers before the error"
    del arg
    env.assert_intact_and_usable(before)


def test_a_freed_data_refused_then_filled_again_works(env):
    """Not bad input: set_value on a freed Data is legal, reallocates, and the workers follow."""
    d = synk.data(env.xd)
    d.free_memory()
    with pytest.raises(ValueError, match="holds no memory"):
        env.f(d, env.Z, env.Y)
    before = env.snapshot()
    d.set_value(2 * env.xd)
    got = env.f(d, env.Z, env.Y)
    want = (2 * env.xd * env.yd).sum(0) + env.zd.sum() + before["W"].sum() + before["Ws"].sum()
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_array_equal(synk.gather(env.c), before["c"] + 1)
    d.free_memory()


@pytest.mark.reliability("input", SY)
def test_bad_input_all_reduce_list_with_different_shapes_changes_nothing(env):
    before = env.snapshot()
    with pytest.raises(ValueError, match=SAME_SHAPE):
        synk.all_reduce([env.c, env.S], op="sum")
    with pytest.raises(ValueError, match=SAME_SHAPE):
        synk.reduce([env.c, env.S], op="sum")
    try:
        env.assert_intact_and_usable(before)
    finally:
        for r in range(N_RANKS):  # put the counters back for the tests that follow
            synk.set_value(r, env.c, before["c"][r])


# --- synk_comm ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def comm():
    group = synk_comm.start(N_RANKS, imports=["reliability_lib"])
    pids = rl.group_worker_pids(group)
    group.run("rel.set_state")
    yield group
    group.close()
    rl.check_no_leak("workers of the synk_comm group", rl.wait_gone(pids, 5.0))
    rl.check_no_leak("/dev/shm entries of the synk_comm group", rl.own_entries(group.prefix))


CM = "synk_comm"
ONES = np.ones(4)
COMM_CASES: dict[str, Case] = {
    "start: size 0": Case(CM, ValueError, "size must be >= 1", lambda g, a: synk_comm.start(0)),
    "start: master_rank out of range": Case(CM, ValueError, r"master_rank must be in \[0, 2\)",
                                            lambda g, a: synk_comm.start(2, master_rank=2)),
    "start: devices of the wrong length": Case(CM, ValueError, "one entry per rank",
                                               lambda g, a: synk_comm.start(2, devices=[0])),
    "command: no such handler": Case(CM, ValueError, "no handler named 'rel.nothing'",
                                     lambda g, a: g.run("rel.nothing")),
    "command: unpicklable payload": Case(CM, TypeError, "pickle", lambda g, a: g.run("rel.sum_ranks",
                                                                                      threading.Lock())),
    "all_reduce: unknown op": Case(CM, ValueError, "unknown reduce op 'mean'", lambda g, a: g.all_reduce(ONES, "mean")),
    "all_reduce: avg of integers": Case(CM, TypeError, "'avg' needs a floating",
                                        lambda g, a: g.all_reduce(np.ones(4, int), "avg")),
    "all_reduce: out of another shape": Case(CM, ValueError, "out has", lambda g, a: g.all_reduce(ONES, out=ONES[:2])),
    "reduce: root out of range": Case(CM, ValueError, r"root must be a rank in \[0, 2\)",
                                      lambda g, a: g.reduce(ONES, root=2)),
    "broadcast: the root gives no array": Case(CM, TypeError, "root must give an array",
                                               lambda g, a: g.broadcast(None)),
    "scatter: one array per rank": Case(CM, ValueError, "must give 2 arrays", lambda g, a: g.scatter([ONES])),
    "gather_object: root out of range": Case(CM, ValueError, "root must be", lambda g, a: g.gather_object(1, root=-1)),
}


def comm_state(group: synk_comm.Group) -> list[Any]:
    return [np.array(v, copy=True) for v in group.run("rel.get_state")]


@pytest.mark.parametrize("name", params(COMM_CASES))
def test_bad_input_synk_comm(comm, name):
    case = COMM_CASES[name]
    before = comm_state(comm)
    children = rl.worker_pids()
    with rl.CommandSpy(comm) as spy, pytest.raises(case.exc, match=case.match):
        case.action(comm, None)
    assert spy.releases == 0, "a command reached the workers before the error"
    assert rl.worker_pids() == children, "a worker process was started"
    np.testing.assert_array_equal(comm.run("rel.sum_ranks", 3), np.full(3, 1.0))
    for a, b in zip(comm_state(comm), before):
        np.testing.assert_array_equal(a, b)


# --- misuse inside a worker ------------------------------------------------------------------------

def fork_in_function(e: Env) -> Any:
    f = synk.function([e.x], (pt.sum(ro.ForkInWorker()(e.x)), "sum"))
    return f(e.X)


WORKER_MISUSE: dict[str, tuple[str, str, Callable[[Any], Any]]] = {
    "worker: a handler starts a command": (CM, "only the master rank can send commands",
                                           lambda g: g.run("rel.command_from_worker")),
    "worker: a handler calls synk_comm.start()": (CM, r"start\(\) was called in worker rank 1",
                                                  lambda g: g.run("rel.start_in_worker")),
    "worker: a handler calls synk.fork()": (SY, r"synk.fork\(\) was called in worker rank 1",
                                            lambda g: g.run("rel.fork_in_worker")),
}


@pytest.mark.parametrize("name", params(WORKER_MISUSE, lambda row: row[0]))
def test_bad_input_misuse_in_a_worker_handler(comm, name):
    _, match, action = WORKER_MISUSE[name]
    before = comm_state(comm)
    pids = rl.group_worker_pids(comm)
    with pytest.raises(synk_comm.WorkerError, match=match) as info:
        action(comm)
    assert info.value.ranks == [1] and info.value.errors[0].type_name == "RuntimeError"
    assert "Traceback" in info.value.errors[0].traceback
    assert [rl.worker_pids(p) for p in pids] == [[]], "the worker started processes of its own"
    np.testing.assert_array_equal(comm.run("rel.sum_ranks", 3), np.full(3, 1.0))
    for a, b in zip(comm_state(comm), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.reliability("input", SY)
def test_bad_input_fork_inside_a_function_in_a_worker(env):
    """A graph whose Op calls synk.fork() when it runs in a worker: RuntimeError from rank 1 (on the
    engine from every rank, all workers, wrapped by JAX: the Op runs as a host callback)."""
    before = env.snapshot()
    with pytest.raises(synk.WorkerError, match=r"(?s)synk.fork\(\) was called in worker rank 1") as info:
        fork_in_function(env)
    if ENGINE:
        assert info.value.ranks == [1, 2] and "RuntimeError" in info.value.errors[0].traceback
    else:
        assert info.value.ranks == [1] and info.value.errors[0].type_name == "RuntimeError"
    pids = rl.group_worker_pids(env.group)
    assert [rl.worker_pids(p) for p in pids] == [[]] * len(pids), "a worker started processes of its own"
    env.assert_intact_and_usable(before)
