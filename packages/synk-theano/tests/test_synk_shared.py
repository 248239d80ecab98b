"""Shared variables across ranks in 2 and 3 CPU ranks: updates are local to each rank (the seed's
shared-variable example, with its numbers), ``as_theano`` and plain PyTensor functions change the
master only, ``distribute`` twice, lazy distribution of functions built later, one identity of a
shared variable across functions in every rank, and random streams that differ between ranks."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from synk_testutil import ON_ENGINE, TIMEOUT, parts

import synkhronos as synk

pytestmark = pytest.mark.timeout(TIMEOUT)

MASTER_COPY = pytest.mark.skipif(ON_ENGINE, reason=(
    "the master's own copy of a shared variable: the JAX engine's master holds none (get_value/set_value "
    "speak to worker 0) and a plain function in the master changes only its local copy (GPU guide)"))

EXAMPLE_ROWS = np.array([[1, 1], [2, 2], [3, 3], [4, 4]], dtype="float32")


@pytest.fixture(scope="module")
def example(ranks):
    """The seed's example: s = ones(2), f updates s := sum(x * s, axis=0)."""
    x = pt.matrix("x", dtype="float32")
    s = pytensor.shared(np.ones(2, dtype="float32"), name="s")
    f = synk.function([x], updates=[(s, pt.sum(x * s, axis=0))])
    synk.distribute()
    return x, s, f


def local_updates(ranks: int, start: np.ndarray) -> np.ndarray:
    """numpy: s in each rank after one call on EXAMPLE_ROWS (each rank updates from its own rows)."""
    return np.stack([(p * start).sum(0) for p in parts(EXAMPLE_ROWS, ranks)])


@MASTER_COPY
def test_seed_shared_variable_example(example, ranks):
    _, s, f = example
    ones = np.ones(2, dtype="float32")
    synk.broadcast(s, ones)
    x_dat = synk.data(EXAMPLE_ROWS)

    f.as_theano(x_dat.data)  # the master alone
    np.testing.assert_array_equal(s.get_value(), [10, 10])
    assert s.get_value().dtype == np.float32  # as declared, like every rank's (NCCL moves bytes)
    gathered = synk.gather(s, nd_up=1)
    np.testing.assert_array_equal(gathered[1:], np.ones((ranks - 1, 2)))  # workers untouched

    s.set_value(ones)  # the master's value only
    assert f(x_dat) is None  # no outputs
    gathered = synk.gather(s, nd_up=1)
    np.testing.assert_array_equal(gathered, local_updates(ranks, ones))
    np.testing.assert_array_equal(s.get_value(), gathered[0])
    # float32 stays float32 (GPU mode under floatX=float64: jax x64 is on, and PyTensor's JAX backend
    # returns a float32 sum in its float64 accumulator)
    assert gathered.dtype == np.float32 and s.get_value().dtype == np.float32
    assert synk.get_value(ranks - 1, s).dtype == np.float32

    synk.reduce(s, op="sum")
    np.testing.assert_array_equal(s.get_value(), [10, 10])
    after_reduce = synk.gather(s, nd_up=1)
    np.testing.assert_array_equal(after_reduce[0], [10, 10])
    np.testing.assert_array_equal(after_reduce[1:], gathered[1:])

    synk.broadcast(s, ones)
    f(x_dat)
    synk.all_reduce(s, op="sum")
    np.testing.assert_array_equal(synk.gather(s, nd_up=1), np.full((ranks, 2), 10.0))

    if ranks == 2:  # the numbers printed in the seed's documentation
        np.testing.assert_array_equal(gathered, [[3, 3], [7, 7]])
        np.testing.assert_array_equal(after_reduce, [[10, 10], [7, 7]])


def test_updates_given_as_dict(example, ranks):
    x, s, _ = example
    g = synk.function([x], updates={s: s + pt.sum(x, axis=0)})
    synk.broadcast(s, np.zeros(2, dtype="float32"))
    g(synk.data(EXAMPLE_ROWS))
    np.testing.assert_array_equal(synk.gather(s), np.stack([p.sum(0) for p in parts(EXAMPLE_ROWS, ranks)]))
    assert g.update_modes == ["avg"]


def test_float32_function_takes_float32_data(example, ranks):
    _, s, f = example
    with pytest.raises(TypeError, match="float32"):
        f(synk.data(EXAMPLE_ROWS.astype(np.float64)))
    with pytest.raises(TypeError):
        f.build_inputs(EXAMPLE_ROWS.astype(np.float64))  # not a safe cast
    X = f.build_inputs(EXAMPLE_ROWS.astype(np.float64), force_cast=True)
    assert X.dtype == np.float32 and X.name == "x"
    synk.broadcast(s, np.ones(2, dtype="float32"))
    f(X)
    np.testing.assert_array_equal(synk.gather(s), local_updates(ranks, np.ones(2, dtype="float32")))


@MASTER_COPY
def test_plain_pytensor_function_in_the_master_shares_shared_variables(example, ranks):
    _, s, f = example
    synk.broadcast(s, np.ones(2, dtype="float32"))
    double = pytensor.function([], updates=[(s, s * 2)])
    double()
    gathered = synk.gather(s)
    np.testing.assert_array_equal(gathered[0], [2, 2])
    np.testing.assert_array_equal(gathered[1:], np.ones((ranks - 1, 2)))
    f(synk.data(EXAMPLE_ROWS))  # the master's share starts from its doubled value
    expected = local_updates(ranks, np.ones(2, dtype="float32"))
    expected[0] *= 2
    np.testing.assert_array_equal(synk.gather(s), expected)


# --- distribution ---------------------------------------------------------------------------------

def test_distribute_twice_and_lazy_distribution(ranks):
    x = pt.vector("x", dtype="float64")
    k = pytensor.shared(np.float64(0.0), name="k")
    inc = synk.function([x], updates=[(k, k + pt.sum(x))])
    synk.distribute()
    synk.distribute()  # nothing pending: fine
    read = synk.function([], (k * 1.0, None))  # built after distribute: distributed on its first call
    synk.distribute()
    scale = synk.function([x], (pt.sum(x) * k, "sum"))  # never distributed explicitly

    xd = np.arange(1.0, 8.0)
    X = synk.data(xd)
    inc(X)
    local = np.array([p.sum() for p in parts(xd, ranks)])
    # one variable k in each rank: read (and scale) see what inc left in that rank
    np.testing.assert_array_equal(read(), local)
    np.testing.assert_allclose(scale(X), sum(p.sum() * p.sum() for p in parts(xd, ranks)), rtol=1e-12)
    np.testing.assert_array_equal(synk.gather(k), local)

    bump = synk.function([], updates=[(k, k + 100)])  # another writer, built later still
    bump()
    np.testing.assert_array_equal(read(), local + 100)
    inc(X)
    np.testing.assert_array_equal(read(), 2 * local + 100)


def test_collectives_distribute_pending_functions(ranks):
    w = pytensor.shared(np.arange(3.0), name="w")
    synk.function([], pt.sum(w))  # never called nor distributed
    np.testing.assert_array_equal(synk.gather(w), np.tile(np.arange(3.0), (ranks, 1)))
    synk.set_value(ranks - 1, w, np.ones(3))
    np.testing.assert_array_equal(synk.get_value(ranks - 1, w), np.ones(3))


# --- random streams -------------------------------------------------------------------------------

def test_random_streams_differ_between_ranks(ranks):
    x = pt.matrix("x", dtype="float64")
    rng = pt.random.shared_rng(seed=1234, name="rng")
    next_rng, u = rng.uniform(size=(x.shape[0],))
    draw = synk.function([x], (u, None), updates=[(rng, next_rng)])
    mask = synk.function([x], (x[:, 0] * (u < 0.5), None), updates=[(rng, next_rng)])  # dropout-like
    X = synk.data(np.ones((4 * ranks, 1)))
    first = draw(X)
    assert first.shape == (4 * ranks,) and np.all((first >= 0) & (first < 1))
    per_rank = first.reshape(ranks, 4)
    for a in range(ranks):
        for b in range(a + 1, ranks):
            assert not np.allclose(per_rank[a], per_rank[b]), f"ranks {a} and {b} drew the same numbers"
    second = draw(X)
    assert not np.allclose(first, second)  # the generator advanced in every rank
    masks = mask(synk.data(np.ones((50 * ranks, 1)))).reshape(ranks, 50)
    assert len({m.tobytes() for m in masks}) == ranks


def test_values_are_cast_to_their_declared_dtype_until_a_call_finds_them_so():
    """``Replica._in_declared``: a value in another dtype than its variable's (JAX's float64
    accumulator of a float32 sum) is cast on every call; once a call of a kind finds every value in
    its declared dtype, later calls of that kind skip the check (the compiled function's output
    dtypes follow from its fixed input dtypes)."""
    from synkhronos.replica import Replica

    rep = Replica.__new__(Replica)
    rep._exact = set()
    var = pt.vector("v", dtype="float32")
    wide = np.ones(2, dtype=np.float64)
    for _ in range(2):
        (out,) = rep._in_declared("outputs", [wide], [var])
        assert out.dtype == np.float32 and "outputs" not in rep._exact
    exact = np.ones(2, dtype=np.float32)
    assert rep._in_declared("outputs", [exact], [var])[0] is exact
    assert "outputs" in rep._exact
    assert rep._in_declared("outputs", [wide], [var])[0] is wide  # no longer checked
    assert rep._in_declared("updates", [wide], [var])[0].dtype == np.float32  # each kind on its own
