"""Collectives on shared variables in 2 and 3 CPU ranks, against numpy: set_value/get_value per rank,
broadcast, scatter, gather (nd_up 1 and 0, equal and unequal shapes), all_gather, reduce (in place or
not), all_reduce with every op, get_shapes/get_lengths; one variable or a list."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from synk_testutil import TIMEOUT, parts

import synkhronos as synk

pytestmark = pytest.mark.timeout(TIMEOUT)

OPS = ["avg", "sum", "prod", "max", "min"]
NP_OPS = {"avg": np.mean, "sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}


class Vars:
    def __init__(self) -> None:
        self.a = pytensor.shared(np.zeros(3), name="a")
        self.m = pytensor.shared(np.zeros((2, 2)), name="m")
        self.i = pytensor.shared(np.zeros(4, dtype=np.int64), name="i")
        self.t = pytensor.shared(np.float64(0.0), name="t")
        # a function that uses them, so that every rank has them; never called: the first
        # collective distributes it
        self.f = synk.function([], pt.sum(self.a) + pt.sum(self.m) + pt.sum(self.i) + self.t)


@pytest.fixture(scope="module")
def v(ranks):
    return Vars()


def per_rank(ranks: int, shape: tuple[int, ...], seed: int, dtype=np.float64) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "i":
        return [rng.integers(-3, 4, shape).astype(dtype) for _ in range(ranks)]
    return [rng.uniform(0.5, 1.5, shape).astype(dtype) for _ in range(ranks)]


def set_each(var, values) -> None:
    for r, value in enumerate(values):
        synk.set_value(r, var, value)


def values_in_ranks(var, ranks: int) -> list[np.ndarray]:
    return [synk.get_value(r, var) for r in range(ranks)]


# --- set_value / get_value / get_shapes / get_lengths ------------------------------------------------

def test_set_value_and_get_value_per_rank(v, ranks):
    vals = [np.arange(3.0) + 10 * r for r in range(ranks)]
    set_each(v.a, vals)
    for r in range(ranks):
        np.testing.assert_array_equal(synk.get_value(r, v.a), vals[r])
    np.testing.assert_array_equal(v.a.get_value(), vals[0])  # the master is rank 0
    mats = [np.full((r + 1, 2), float(r)) for r in range(ranks)]  # different shapes per rank
    set_each(v.m, mats)
    for r in range(ranks):
        np.testing.assert_array_equal(synk.get_value(r, v.m), mats[r])
    assert synk.get_shapes(v.m) == [(r + 1, 2) for r in range(ranks)]
    assert synk.get_lengths(v.m) == [r + 1 for r in range(ranks)]
    assert synk.get_shapes(v.t) == [()] * ranks


def test_set_value_lists_batches_data_and_casts(v, ranks):
    last = ranks - 1
    synk.set_value(last, [v.a, v.t], [np.array([1.0, 2.0, 3.0]), np.float64(7.5)])
    got = synk.get_value(last, [v.a, v.t])
    assert isinstance(got, tuple) and len(got) == 2
    np.testing.assert_array_equal(got[0], [1, 2, 3])
    assert float(got[1]) == 7.5
    D = np.arange(12.0).reshape(6, 2)
    synk.set_value(last, v.m, D, batch=[4, 0])
    np.testing.assert_array_equal(synk.get_value(last, v.m), D[[4, 0]])
    synk.set_value(last, v.m, synk.data(D), batch=slice(1, 4))
    np.testing.assert_array_equal(synk.get_value(last, v.m), D[1:4])
    synk.set_value(last, v.m, synk.data(D), batch=slice(None, None, -2))
    np.testing.assert_array_equal(synk.get_value(last, v.m), D[::-2])
    synk.set_value(last, v.m, D, batch=2)
    np.testing.assert_array_equal(synk.get_value(last, v.m), D[:2])
    synk.set_value(last, v.a, np.array([1, 2, 3], dtype=np.int32))  # a safe cast
    value = synk.get_value(last, v.a)
    assert value.dtype == np.float64
    np.testing.assert_array_equal(value, [1, 2, 3])
    lengths = synk.get_lengths([v.a, v.m])
    assert isinstance(lengths, tuple) and lengths[0] == [3] * ranks and lengths[1][last] == 2


# --- broadcast ------------------------------------------------------------------------------------

def test_broadcast_master_value(v, ranks):
    set_each(v.a, per_rank(ranks, (3,), seed=1))
    v.a.set_value(np.array([4.0, 5.0, 6.0]))  # the master's own value only
    assert not np.array_equal(synk.get_value(ranks - 1, v.a), [4, 5, 6])
    synk.broadcast(v.a)
    np.testing.assert_array_equal(synk.gather(v.a), np.tile([4.0, 5.0, 6.0], (ranks, 1)))


def test_broadcast_given_values_numpy_and_data(v, ranks):
    set_each(v.a, per_rank(ranks, (3,), seed=2))
    synk.broadcast([v.a, v.m], [np.array([1.0, 2.0, 3.0]), np.ones((5, 2))])
    np.testing.assert_array_equal(synk.gather(v.a), np.tile([1.0, 2.0, 3.0], (ranks, 1)))
    np.testing.assert_array_equal(synk.gather(v.m, nd_up=0), np.ones((5 * ranks, 2)))
    np.testing.assert_array_equal(v.a.get_value(), [1, 2, 3])  # the master's too
    D = synk.data(np.arange(8.0).reshape(4, 2))
    synk.broadcast(v.m, D)
    np.testing.assert_array_equal(synk.gather(v.m), np.stack([D.data] * ranks))
    synk.broadcast(v.i, np.array([1, 2, 3, 4], dtype=np.int8), nccl=False)
    np.testing.assert_array_equal(synk.gather(v.i), np.tile([1, 2, 3, 4], (ranks, 1)))


# --- scatter --------------------------------------------------------------------------------------

SCATTER_BATCHES = {"none": None, "int": 7, "slice": slice(2, 10), "slice_step": slice(1, None, 2),
                   "slice_reversed": slice(None, None, -1), "list": [10, 3, 3, 0, 5], "array": np.arange(11)[::-3]}


@pytest.mark.parametrize("as_data", [False, True], ids=["numpy", "Data"])
@pytest.mark.parametrize("batch", list(SCATTER_BATCHES.values()), ids=list(SCATTER_BATCHES))
def test_scatter(v, ranks, batch, as_data):
    D = np.arange(22.0).reshape(11, 2)
    source = synk.data(D) if as_data else D
    synk.scatter(v.m, source, batch=batch)
    rows = D if batch is None else D[:batch] if isinstance(batch, int) else D[batch]
    expected = parts(rows, ranks)
    for r in range(ranks):
        np.testing.assert_array_equal(synk.get_value(r, v.m), expected[r])
    assert synk.get_shapes(v.m) == [p.shape for p in expected]
    assert synk.get_lengths(v.m) == [len(p) for p in expected]


def test_scatter_list_of_variables(v, ranks):
    D, E = np.arange(20.0).reshape(10, 2), np.arange(30.0).reshape(10, 3)
    synk.scatter([v.m, v.a], [synk.data(D), E.reshape(-1)[:10]])
    np.testing.assert_array_equal(synk.gather(v.m, nd_up=0), D)
    np.testing.assert_array_equal(synk.gather(v.a, nd_up=0), E.reshape(-1)[:10])
    assert synk.get_lengths(v.a) == [len(p) for p in parts(np.arange(10), ranks)]
    with pytest.raises(ValueError, match="different lengths"):
        synk.scatter([v.m, v.a], [D, np.arange(4.0)])
    synk.scatter([v.m, v.a], [D, np.arange(4.0)], batch=slice(0, 3))
    np.testing.assert_array_equal(synk.gather(v.a, nd_up=0), np.arange(3.0))


# --- gather, all_gather --------------------------------------------------------------------------

def test_gather_equal_shapes(v, ranks):
    vals = per_rank(ranks, (3,), seed=3)
    set_each(v.a, vals)
    np.testing.assert_array_equal(synk.gather(v.a), np.stack(vals))
    np.testing.assert_array_equal(synk.gather(v.a, nd_up=1, nccl=True), np.stack(vals))
    np.testing.assert_array_equal(synk.gather(v.a, nd_up=0), np.concatenate(vals))
    set_each(v.t, [np.float64(r + 0.5) for r in range(ranks)])
    np.testing.assert_array_equal(synk.gather(v.t), np.arange(ranks) + 0.5)  # 0-d values stack to (n,)
    got = synk.gather([v.a, v.t])
    assert isinstance(got, tuple) and len(got) == 2
    np.testing.assert_array_equal(got[0], np.stack(vals))
    for r in range(ranks):  # gather changes nothing
        np.testing.assert_array_equal(synk.get_value(r, v.a), vals[r])


def test_gather_unequal_shapes(v, ranks):
    mats = [np.full((r + 2, 2), float(r)) for r in range(ranks)]
    set_each(v.m, mats)
    np.testing.assert_array_equal(synk.gather(v.m, nd_up=0), np.concatenate(mats))
    with pytest.raises(ValueError, match="nd_up=0"):
        synk.gather(v.m, nd_up=1)
    with pytest.raises(ValueError, match="nd_up"):
        synk.gather(v.m, nd_up=2)
    with pytest.raises(ValueError, match="0-d"):
        synk.gather(v.t, nd_up=0)
    np.testing.assert_array_equal(synk.gather(v.m, nd_up=0), np.concatenate(mats))  # still fine


def test_all_gather_after_uneven_scatter(v, ranks):
    D = np.arange(14.0).reshape(7, 2)
    synk.scatter(v.m, D)
    synk.all_gather(v.m)
    for r in range(ranks):
        np.testing.assert_array_equal(synk.get_value(r, v.m), D)
    assert synk.get_shapes(v.m) == [(7, 2)] * ranks
    vals = [np.full(3, float(r)) for r in range(ranks)]
    set_each(v.a, vals)
    synk.all_gather([v.a], nccl=False)
    np.testing.assert_array_equal(synk.gather(v.a), np.stack([np.concatenate(vals)] * ranks))


# --- reduce, all_reduce --------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_reduce_not_in_place_returns_and_changes_nothing(v, ranks, op):
    vals = per_rank(ranks, (3,), seed=4)
    set_each(v.a, vals)
    got = synk.reduce(v.a, op=op, in_place=False)
    np.testing.assert_allclose(got, NP_OPS[op](np.stack(vals), axis=0), rtol=1e-12)
    np.testing.assert_array_equal(synk.gather(v.a), np.stack(vals))


@pytest.mark.parametrize("op", OPS)
def test_reduce_in_place_sets_the_master_only(v, ranks, op):
    vals = per_rank(ranks, (3,), seed=5)
    set_each(v.a, vals)
    assert synk.reduce(v.a, op=op) is None
    expected = NP_OPS[op](np.stack(vals), axis=0)
    np.testing.assert_allclose(v.a.get_value(), expected, rtol=1e-12)
    gathered = synk.gather(v.a)
    np.testing.assert_allclose(gathered[0], expected, rtol=1e-12)
    np.testing.assert_array_equal(gathered[1:], np.stack(vals[1:]))


def test_reduce_list_returns_tuple(v, ranks):
    a_vals, i_vals = per_rank(ranks, (3,), seed=6), per_rank(ranks, (4,), seed=7, dtype=np.int64)
    set_each(v.a, a_vals)
    set_each(v.i, i_vals)
    got = synk.reduce([v.a, v.i], op="sum", in_place=False)
    assert isinstance(got, tuple) and len(got) == 2
    np.testing.assert_allclose(got[0], np.sum(a_vals, axis=0), rtol=1e-12)
    np.testing.assert_array_equal(got[1], np.sum(i_vals, axis=0))
    assert got[1].dtype == np.int64
    with pytest.raises(TypeError, match="avg"):
        synk.reduce(v.i, op="avg")  # an integer mean does not fit the dtype
    np.testing.assert_array_equal(synk.gather(v.i), np.stack(i_vals))


@pytest.mark.parametrize("op", OPS)
def test_all_reduce(v, ranks, op):
    vals = per_rank(ranks, (3,), seed=8)
    set_each(v.a, vals)
    t_vals = [np.float64(r + 2.0) for r in range(ranks)]
    set_each(v.t, t_vals)
    synk.all_reduce([v.a, v.t], op=op)
    expected = NP_OPS[op](np.stack(vals), axis=0)
    np.testing.assert_allclose(synk.gather(v.a), np.stack([expected] * ranks), rtol=1e-12)
    np.testing.assert_allclose(synk.gather(v.t), [NP_OPS[op](t_vals)] * ranks, rtol=1e-12)
    if op != "avg":
        i_vals = per_rank(ranks, (4,), seed=9, dtype=np.int64)
        set_each(v.i, i_vals)
        synk.all_reduce(v.i, op=op, nccl=False)
        np.testing.assert_array_equal(synk.gather(v.i), np.stack([NP_OPS[op](np.stack(i_vals), axis=0)] * ranks))


def test_function_without_split_data_weighs_ranks_equally(v, ranks):
    """Nothing scattered, nothing sliceable: every rank computes on its own shared values and the
    default op avg weighs the ranks equally."""
    a_vals, t_vals = per_rank(ranks, (3,), seed=10), [np.float64(3.0 * r) for r in range(ranks)]
    set_each(v.a, a_vals)
    set_each(v.t, t_vals)
    synk.broadcast([v.m, v.i], [np.ones((2, 2)), np.zeros(4, dtype=np.int64)])
    expected = np.mean([a.sum() + 4.0 + t for a, t in zip(a_vals, t_vals)])
    np.testing.assert_allclose(v.f(), expected, rtol=1e-12)
