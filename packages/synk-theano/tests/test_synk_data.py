"""The Data interface through ``synk.data`` in 2 and 3 CPU ranks: dtype/ndim inference, TypeError when
they cannot be inferred, empty Data legal until used, and reallocation (set_value, set_length,
set_shape), in-place writes and free_memory reaching the workers: every call after a change gives
the numpy result."""

from __future__ import annotations

import gc

import numpy as np
import pytensor.tensor as pt
import pytest
from synk_testutil import TIMEOUT, own_entries, parts

import synkhronos as synk
from synkhronos.runtime import current

pytestmark = pytest.mark.timeout(TIMEOUT)


class Fns:
    def __init__(self) -> None:
        self.x = x = pt.matrix("x", dtype="float64")
        self.f = synk.function([x], [(x * 2, None), (pt.sum(x, axis=0), "sum"), (pt.sum(x), None)])


@pytest.fixture(scope="module")
def fns(ranks):
    return Fns()


def check(fns, d, expected: np.ndarray, ranks: int) -> None:
    """The function on Data ``d`` gives the numpy result for ``expected`` (every rank read it)."""
    gathered, total, per_rank = fns.f(d)
    np.testing.assert_array_equal(gathered, expected * 2)
    np.testing.assert_allclose(total, expected.sum(0), rtol=1e-12)
    np.testing.assert_allclose(per_rank, [p.sum() for p in parts(expected, ranks) if len(p)], rtol=1e-12)


def test_inference_from_var_value_and_arguments(fns):
    d = synk.data(var=fns.x)
    assert (d.dtype, d.ndim, d.name, d.allocated, d.shape, len(d)) == (np.float64, 2, "x", False, None, 0)
    d = synk.data(np.arange(6, dtype=np.int16).reshape(2, 3), name="v")
    assert (d.dtype, d.ndim, d.shape, d.name) == (np.int16, 2, (2, 3), "v")
    d = synk.data(dtype="float32", ndim=3)
    assert (d.dtype, d.ndim, d.allocated) == (np.float32, 3, False)
    d = synk.data(dtype="float32", shape=(4, 2))
    assert d.ndim == 2 and d.shape == (4, 2)
    np.testing.assert_array_equal(d.data, np.zeros((4, 2)))
    d = synk.data(np.ones((3, 2), dtype=np.float32), var=fns.x)  # safe cast to the variable's dtype
    assert d.dtype == np.float64 and d.name == "x"
    d = synk.data(np.ones((3, 2)), minibatch=True, oversize=2)
    assert d.minibatch and d.alloc_size >= 12


@pytest.mark.parametrize("kwargs", [{}, {"dtype": "float64"}, {"ndim": 2}, {"var": 3.0}, {"var": "x"}],
                         ids=["nothing", "no_ndim", "no_dtype", "var_number", "var_string"])
def test_not_inferable_is_type_error(kwargs):
    with pytest.raises(TypeError):
        synk.data(**kwargs)


def test_contradictions_and_unsafe_casts_are_type_errors(fns):
    with pytest.raises(TypeError, match="dtype"):
        synk.data(var=fns.x, dtype="float32")
    with pytest.raises(TypeError, match="ndim"):
        synk.data(var=fns.x, ndim=1)
    with pytest.raises(TypeError):
        synk.data(np.ones((2, 2)), dtype="float32")
    d = synk.data(np.full((2, 2), 1.5), dtype="float32", force_cast=True)
    assert d.dtype == np.float32
    np.testing.assert_array_equal(d.data, np.full((2, 2), 1.5))


def test_empty_data_is_legal_until_used_as_input(fns, ranks):
    d = synk.data(var=fns.x)
    with pytest.raises(ValueError, match="no memory"):
        fns.f(d)
    d.set_value(np.arange(10.0).reshape(5, 2))
    check(fns, d, np.arange(10.0).reshape(5, 2), ranks)
    e = synk.data(dtype="float64", ndim=2)
    e.set_shape((4, 2))
    check(fns, e, np.zeros((4, 2)), ranks)


def test_writes_in_place_are_seen_by_every_rank(fns, ranks):
    values = np.arange(14.0).reshape(7, 2)
    d = synk.data(values.copy())
    check(fns, d, values, ranks)
    d[5] = [100.0, -100.0]
    d.data[0, 0] = 42.0
    values[5], values[0, 0] = [100.0, -100.0], 42.0
    check(fns, d, values, ranks)


def test_set_value_reallocation_reaches_workers(fns, ranks):
    d = synk.data(np.ones((4, 2)))
    check(fns, d, np.ones((4, 2)), ranks)
    tag = d.tag
    bigger = np.random.default_rng(0).normal(size=(5000, 2))
    d.set_value(bigger)  # more than the allocation: new shared memory
    assert d.tag != tag
    check(fns, d, bigger, ranks)
    smaller = np.arange(6.0).reshape(3, 2)
    d.set_value(smaller)  # fits: same memory, new shape
    check(fns, d, smaller, ranks)


def test_oversize_leaves_room_to_grow_in_place(fns, ranks):
    d = synk.data(np.ones((10, 2)), oversize=2)
    tag = d.tag
    grown = np.arange(36.0).reshape(18, 2)
    d.set_value(grown)
    assert d.tag == tag  # no reallocation
    check(fns, d, grown, ranks)


def test_set_length_and_set_shape_reach_workers(fns, ranks):
    values = np.arange(8.0).reshape(4, 2)
    d = synk.data(values.copy())
    check(fns, d, values, ranks)
    d.set_length(1000)  # reallocates; the first rows are kept, the rest are zero
    expected = np.zeros((1000, 2))
    expected[:4] = values
    check(fns, d, expected, ranks)
    d.set_length(3)
    check(fns, d, values[:3], ranks)
    d.set_shape((5, 2))
    expected = np.zeros((5, 2))
    expected[:3] = values[:3]
    check(fns, d, expected, ranks)


def test_free_memory_then_fill_again(fns, ranks):
    d = synk.data(np.ones((6, 2)))
    check(fns, d, np.ones((6, 2)), ranks)
    d.free_memory()
    assert not d.allocated and d.data is None
    with pytest.raises(ValueError, match="no memory"):
        fns.f(d)
    again = np.arange(18.0).reshape(9, 2)
    d.set_value(again)
    check(fns, d, again, ranks)
    d.free_memory()
    d.set_shape((2, 2))
    check(fns, d, np.zeros((2, 2)), ranks)


def test_data_made_without_synk_data_is_registered_on_use(fns, ranks):
    values = np.arange(10.0).reshape(5, 2)
    d = synk.Data(values)
    check(fns, d, values, ranks)
    d.set_value(values[::-1] + 1)
    check(fns, d, values[::-1] + 1, ranks)


def test_many_data_and_index_buffer_growth(fns, ranks):
    """Index batches travel in a shared buffer that grows on demand; many Data come and go."""
    xd = np.random.default_rng(1).normal(size=(5000, 2))
    X = synk.data(xd)
    idx = np.random.default_rng(2).permutation(5000)[:4000]
    gathered, total, _ = fns.f(X, batch=idx)
    np.testing.assert_array_equal(gathered, xd[idx] * 2)
    np.testing.assert_allclose(total, xd[idx].sum(0), rtol=1e-10)
    for i in range(20):
        check(fns, synk.data(np.full((3, 2), float(i))), np.full((3, 2), float(i)), ranks)


def test_dropped_data_free_their_shared_memory_while_the_group_runs(fns, ranks):
    group = current().group.prefix.lstrip("/")

    def data_entries() -> set[str]:
        return {e for e in own_entries() if not e.startswith((group, "sem." + group))}

    gc.collect()
    before = data_entries()
    for i in range(20):
        d = synk.data(np.full((3, 2), float(i)))
        check(fns, d, np.full((3, 2), float(i)), ranks)
        del d
    gc.collect()
    assert data_entries() - before == set()
    values = np.arange(6.0).reshape(3, 2)
    check(fns, synk.data(values), values, ranks)  # the workers dropped theirs and still follow
