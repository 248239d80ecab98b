"""Bad calls, collectives and function definitions in 2 and 3 CPU ranks: each is a clear
TypeError/ValueError raised in the master before any worker acts.  Proof of "before any worker
acts": the function under test updates a counter in every rank that computes, and the collectives
under test would change a shared value; after each error every rank's values are what they were,
and a correct call right after gives the numpy result."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from synk_testutil import TIMEOUT, parts

import synkhronos as synk

pytestmark = pytest.mark.timeout(TIMEOUT)

ROWS_PER_RANK = 3


class Env:
    """The functions, shared variables and Data of this module."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.x = x = pt.matrix("x", dtype="float64")
        self.z = z = pt.matrix("z", dtype="float64")
        self.y = y = pt.vector("y", dtype="float64")
        self.c = c = pytensor.shared(np.zeros(2), name="c")
        self.S = S = pytensor.shared(np.zeros((1, 2)), name="S")
        self.unused = pytensor.shared(np.zeros(2), name="unused")
        self.f = synk.function([x, z], (pt.sum(x * y, axis=0) + pt.sum(z), "sum"), bcast_inputs=[y],
                               updates=[(c, c + 1)])
        self.fs = synk.function([], (pt.sum(S, axis=0) + c, "sum"), sliceable_shareds=[S])
        self.f0 = synk.function([], (c * 2, "sum"))
        self.fmb = synk.function([z], (z * 2, None))
        n = ROWS_PER_RANK * ranks
        rng = np.random.default_rng(0)
        self.xd, self.zd, self.yd = rng.normal(size=(n, 2)), rng.normal(size=(n, 2)), np.array([1.0, -2.0])
        self.X, self.Z, self.Y = synk.data(self.xd), synk.data(self.zd), synk.data(self.yd)
        self.Sd = rng.normal(size=(n, 2))
        synk.scatter(S, self.Sd)

    def values(self) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's counter and sliceable data."""
        return synk.gather(self.c), synk.gather(self.S, nd_up=0)

    def assert_intact_and_usable(self, before: tuple[np.ndarray, np.ndarray]) -> None:
        """Nothing changed in any rank; a correct call then works and counts once in every rank."""
        counters, sliceable = self.values()
        np.testing.assert_array_equal(counters, before[0])
        np.testing.assert_array_equal(sliceable, before[1])
        got = self.f(self.X, self.Z, self.Y)
        np.testing.assert_allclose(got, (self.xd * self.yd).sum(0) + self.zd.sum(), rtol=1e-12)
        np.testing.assert_array_equal(synk.gather(self.c), before[0] + 1)
        np.testing.assert_allclose(self.fs(), self.Sd.sum(0) + (before[0] + 1).sum(0), rtol=1e-12)


@pytest.fixture(scope="module")
def env(ranks):
    e = Env(ranks)
    yield e
    for d in (e.X, e.Z, e.Y):  # the last test's arguments outlive the module: free the memory now
        d.free_memory()


def raises_before_workers_act(env: Env, exc, match: str | None, action) -> None:
    before = env.values()
    with pytest.raises(exc, match=match):
        action()
    env.assert_intact_and_usable(before)


# --- calls ---------------------------------------------------------------------------------------

N = ROWS_PER_RANK * 2  # rows per input in the smallest group (2 ranks)
CALL_ERRORS = {
    "too_few_inputs": (TypeError, "missing", lambda e: e.f(e.X, e.Z)),
    "too_many_inputs": (TypeError, "takes 3 Data", lambda e: e.f(e.X, e.Z, e.Y, e.Y)),
    "numpy_input": (TypeError, "synk.data", lambda e: e.f(e.xd, e.Z, e.Y)),
    "numpy_bcast_input": (TypeError, "synk.data", lambda e: e.f(e.X, e.Z, e.yd)),
    "dtype_differs": (TypeError, "dtype", lambda e: e.f(synk.data(e.xd.astype("float32")), e.Z, e.Y)),
    "ndim_differs": (TypeError, "ndim", lambda e: e.f(e.Y, e.Z, e.Y)),
    "unknown_keyword": (TypeError, "no input named", lambda e: e.f(e.X, e.Z, w=e.Y)),
    "keyword_twice": (TypeError, "twice", lambda e: e.f(e.X, e.Z, e.Y, x=e.X)),
    "empty_data": (ValueError, "no memory", lambda e: e.f(synk.data(var=e.x), e.Z, e.Y)),
    "lengths_differ": (ValueError, "different lengths", lambda e: e.f(e.X, synk.data(e.zd[:-1]), e.Y)),
    "batch_int_too_big": (ValueError, "more rows", lambda e: e.f(e.X, e.Z, e.Y, batch=len(e.xd) + 1)),
    "batch_negative_int": (ValueError, "negative", lambda e: e.f(e.X, e.Z, e.Y, batch=-1)),
    "batch_index_too_big": (ValueError, "out of range", lambda e: e.f(e.X, e.Z, e.Y, batch=[0, len(e.xd)])),
    "batch_index_too_negative": (ValueError, "out of range", lambda e: e.f(e.X, e.Z, e.Y, batch=[-len(e.xd) - 1])),
    "batch_float": (TypeError, "batch", lambda e: e.f(e.X, e.Z, e.Y, batch=1.5)),
    "batch_float_list": (TypeError, "integers", lambda e: e.f(e.X, e.Z, e.Y, batch=[0.0, 1.0])),
    "batch_float_array": (TypeError, "integers", lambda e: e.f(e.X, e.Z, e.Y, batch=np.array([0.5]))),
    "batch_2d_indices": (TypeError, "1-d", lambda e: e.f(e.X, e.Z, e.Y, batch=np.array([[0, 1], [2, 3]]))),
    "batch_bool": (TypeError, "batch", lambda e: e.f(e.X, e.Z, e.Y, batch=True)),
    "batch_string": (TypeError, "batch", lambda e: e.f(e.X, e.Z, e.Y, batch="0:2")),
    "batch_s_without_sliceables": (ValueError, "sliceable", lambda e: e.f(e.X, e.Z, e.Y, batch_s=slice(0, 1))),
    "batch_s_list_without_sliceables": (ValueError, "sliceable", lambda e: e.f(e.X, e.Z, e.Y, batch_s=[0])),
    "num_slices_zero": (ValueError, "num_slices", lambda e: e.f(e.X, e.Z, e.Y, num_slices=0)),
    "num_slices_negative": (ValueError, "num_slices", lambda e: e.f(e.X, e.Z, e.Y, num_slices=-2)),
    "num_slices_float": ((TypeError, ValueError), "num_slices", lambda e: e.f(e.X, e.Z, e.Y, num_slices=2.0)),
    "num_slices_nothing_to_slice": (ValueError, "something to slice", lambda e: e.f0(num_slices=2)),
    "batch_on_no_scattered_inputs": (ValueError, "batch", lambda e: e.f0(batch=2)),
    "output_subset_out_of_range": (ValueError, "output_subset", lambda e: e.f(e.X, e.Z, e.Y, output_subset=[1])),
    "minibatch_shorter_than_batch": (ValueError, "minibatch", lambda e: e.f(
        e.X, synk.data(e.zd[:2], minibatch=True), e.Y, batch=[0, 1, 2])),
    "minibatch_only_shorter_than_int_batch": (ValueError, "minibatch", lambda e: e.fmb(
        synk.data(e.zd[:3], minibatch=True), batch=4)),
    "batch_s_per_rank_wrong_count": (TypeError, "batch_s", lambda e: e.fs(batch_s=[[0]] * (e.ranks + 1))),
    "batch_s_slice_step_zero": (ValueError, "zero", lambda e: e.fs(batch_s=slice(0, 2, 0))),
    "batch_empty_list": (ValueError, "no rows", lambda e: e.f(e.X, e.Z, e.Y, batch=[])),
    "batch_zero_rows": (ValueError, "no rows", lambda e: e.f(e.X, e.Z, e.Y, batch=0)),
}


@pytest.mark.parametrize("case", list(CALL_ERRORS.values()), ids=list(CALL_ERRORS))
def test_bad_call_raises_in_master_and_changes_nothing(env, case):
    exc, match, action = case
    raises_before_workers_act(env, exc, match, lambda: action(env))


def test_batch_s_index_out_of_range_fails_in_every_rank(env):
    """batch_s indices are checked by each rank against its own rows (the master does not know the
    workers' lengths): the master's IndexError; nothing is computed and the group stays usable."""
    raises_before_workers_act(env, IndexError, "out of range", lambda: env.fs(batch_s=[0, ROWS_PER_RANK]))


# --- collectives ---------------------------------------------------------------------------------

COLLECTIVE_ERRORS = {
    "shared_no_function_uses": (ValueError, "not used by any synkhronos function",
                                lambda e: synk.broadcast(e.unused, np.ones(2))),
    "shared_no_function_uses_gather": (ValueError, "not used", lambda e: synk.gather([e.c, e.unused])),
    "symbolic_not_shared": (TypeError, "shared variables", lambda e: synk.broadcast(e.y, np.ones(2))),
    "numpy_not_shared": (TypeError, "shared variables", lambda e: synk.all_reduce(np.ones(2))),
    "no_variables": (ValueError, "no shared", lambda e: synk.all_reduce([])),
    "reduce_unknown_op": (ValueError, "unknown reduce op", lambda e: synk.reduce(e.c, op="mean")),
    "all_reduce_unknown_op": (ValueError, "unknown reduce op", lambda e: synk.all_reduce([e.c, e.S], op="gather")),
    "broadcast_value_count": (ValueError, "value", lambda e: synk.broadcast([e.c, e.S], [np.ones(2)])),
    "broadcast_value_ndim": (TypeError, "ndim", lambda e: synk.broadcast(e.c, np.ones((2, 2)))),
    "broadcast_unsafe_cast": (TypeError, "cast", lambda e: synk.broadcast(e.c, np.ones(2, dtype=complex))),
    "broadcast_empty_data": (ValueError, "no memory", lambda e: synk.broadcast(e.c, synk.data(dtype="f8", ndim=1))),
    "scatter_lengths_differ": (ValueError, "different lengths",
                               lambda e: synk.scatter([e.S, e.c], [np.ones((4, 2)), np.ones(3)])),
    "scatter_batch_out_of_range": (ValueError, "out of range", lambda e: synk.scatter(e.S, np.ones((4, 2)),
                                                                                       batch=[4])),
    "set_value_rank_out_of_range": (ValueError, "rank", lambda e: synk.set_value(e.ranks, e.c, np.ones(2))),
    "set_value_rank_negative": (ValueError, "rank", lambda e: synk.set_value(-1, e.c, np.ones(2))),
    "get_value_rank_out_of_range": (ValueError, "rank", lambda e: synk.get_value(e.ranks, e.c)),
    "gather_nd_up": (ValueError, "nd_up", lambda e: synk.gather(e.c, nd_up=2)),
}


@pytest.mark.parametrize("case", list(COLLECTIVE_ERRORS.values()), ids=list(COLLECTIVE_ERRORS))
def test_bad_collective_raises_in_master_and_changes_nothing(env, case):
    exc, match, action = case
    raises_before_workers_act(env, exc, match, lambda: action(env))


# --- function definitions ------------------------------------------------------------------------

DEFINITION_ERRORS = {
    "unknown_output_op": (ValueError, "unknown reduce op", lambda e: synk.function([e.x], (pt.sum(e.x), "mean"))),
    "unknown_output_op_in_list": (ValueError, "unknown reduce op",
                                  lambda e: synk.function([e.x], [pt.sum(e.x), (pt.max(e.x), "median")])),
    "unknown_update_op": (ValueError, "unknown reduce op",
                          lambda e: synk.function([e.x], updates=[(e.c, e.c + pt.sum(e.x), "mean")])),
    "gather_is_no_update_op": (ValueError, "unknown reduce op",
                               lambda e: synk.function([e.x], updates=[(e.c, e.c + pt.sum(e.x), None)])),
    "sliceable_not_used": (ValueError, "not used", lambda e: synk.function([e.x], pt.sum(e.x),
                                                                           sliceable_shareds=[e.unused])),
    "sliceable_not_shared": (TypeError, "shared", lambda e: synk.function([e.x], pt.sum(e.x),
                                                                          sliceable_shareds=[e.z])),
    "shared_as_input": (TypeError, "symbolic", lambda e: synk.function([e.c], pt.sum(e.x))),
    "scalar_scattered_input": (ValueError, "0-d", lambda e: synk.function([pt.scalar("a")], pt.scalar("a") * 2)),
    "output_not_a_variable": (TypeError, "output", lambda e: synk.function([e.x], "sum")),
    "update_not_a_pair": (TypeError, "update", lambda e: synk.function([e.x], updates=[e.c])),
    "update_target_not_shared": (TypeError, "shared", lambda e: synk.function([e.x], updates=[(e.y, pt.sum(e.x))])),
}


@pytest.mark.parametrize("case", list(DEFINITION_ERRORS.values()), ids=list(DEFINITION_ERRORS))
def test_bad_function_definition_raises_at_function(env, case):
    exc, match, action = case
    raises_before_workers_act(env, exc, match, lambda: action(env))


def test_a_selection_only_a_worker_can_check_names_its_rank_and_nobody_computes(env):
    """An error only a worker can see (its own sliceable rows are fewer): every rank checks its rows,
    then all meet at a barrier before computing, so the worker's IndexError/ValueError reaches the
    master as synk.SelectionError naming the rank, and no rank computed or changed anything."""
    last = env.ranks - 1
    synk.set_value(last, env.S, np.ones((1, 2)))
    try:
        before = env.values()
        with pytest.raises(synk.SelectionError, match=f"rank {last}: batch_s index out of range") as info:
            env.fs(batch_s=[1])  # rank `last` holds one row only
        assert isinstance(info.value, IndexError) and isinstance(info.value, ValueError)
        np.testing.assert_array_equal(env.values()[0], before[0])
    finally:
        synk.scatter(env.S, env.Sd)
    env.assert_intact_and_usable(env.values())


def test_index_parts_of_a_rank_follow_numpy_split(env):
    """Sanity of the references used above: S was scattered as numpy.array_split does."""
    assert synk.get_lengths(env.S) == [len(p) for p in parts(env.Sd, env.ranks)]


def test_more_dimensions_than_max_dim_is_a_value_error_naming_it(env):
    t5 = pt.TensorType("float64", shape=(None,) * 17)("t17")
    with pytest.raises(ValueError, match="max_dim"):
        synk.function([t5], outputs=t5.sum())
    env.assert_intact_and_usable(env.values())


def test_one_variable_takes_a_python_list_as_its_one_value(env):
    before = env.values()
    synk.broadcast(env.c, [5.0, 6.0])
    np.testing.assert_array_equal(synk.gather(env.c), np.tile([5.0, 6.0], (env.ranks, 1)))
    synk.broadcast(env.c, before[0][0])
    synk.set_value(0, env.c, before[0][0])
    np.testing.assert_array_equal(synk.gather(env.c), before[0])
