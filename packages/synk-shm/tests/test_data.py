"""Data against plain numpy: values, indexing, resizing and allocation; and every bad input's error.

The property tests keep a numpy reference next to each Data and apply the same operations to both.
A second Data attached in the same process (through a handle, the way another process attaches)
follows every change through :meth:`Data.update` and must always show the same values.
"""

from __future__ import annotations

import math
import os
import pickle
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from synk_shm import Data, DataHandle, SharedMemoryFullError

PROPS = settings(max_examples=50, deadline=None)
DTYPES = st.sampled_from(["bool", "int8", "uint16", "int32", "int64", "float16", "float32", "float64",
                          "complex64"]).map(np.dtype)
OVERSIZE = st.floats(1.0, 2.0)


def shapes(ndim: int, min_side: int = 0, max_side: int = 5) -> st.SearchStrategy[tuple[int, ...]]:
    return hnp.array_shapes(min_dims=ndim, max_dims=ndim, min_side=min_side, max_side=max_side)


def resized(ref: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The numpy reference of set_shape: the overlap is kept, the rest is zero."""
    out = np.zeros(shape, dtype=ref.dtype)
    region = tuple(slice(0, min(a, b)) for a, b in zip(ref.shape, shape))
    out[region] = ref[region]
    return out


def expected_alloc(count: int, dtype: np.dtype, oversize: float) -> int:
    """Items of a fresh allocation for ``count`` items: ceil(bytes * oversize), at least 1 byte."""
    return max(math.ceil(count * dtype.itemsize * oversize), 1) // dtype.itemsize


def shm_exists(segment: str | None) -> bool:
    return segment is not None and os.path.exists("/dev/shm/" + segment.lstrip("/"))


def assert_same(actual: np.ndarray | None, expected: np.ndarray) -> None:
    assert actual is not None
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    np.testing.assert_array_equal(actual, expected)


# --- property tests against numpy --------------------------------------------------------------

@PROPS
@given(st.data())
def test_set_value_matches_numpy(data):
    dtype = data.draw(DTYPES)
    ndim = data.draw(st.integers(0, 3))
    first = data.draw(hnp.arrays(dtype, shapes(ndim)))
    d = Data(first, oversize=data.draw(OVERSIZE))
    other = Data.attach(d.handle())
    assert d.dtype == dtype and d.ndim == ndim and not d.minibatch
    assert_same(d.data, first)
    assert_same(other.data, first)
    for _ in range(data.draw(st.integers(1, 4))):
        value = data.draw(hnp.arrays(dtype, shapes(ndim)))
        oversize = data.draw(OVERSIZE)
        alloc, tag = d.alloc_size, d.tag
        d.set_value(value, oversize=oversize)
        if value.size <= alloc:  # fits: no reallocation
            assert (d.tag, d.alloc_size) == (tag, alloc)
        else:
            assert d.tag == tag + 1
            assert d.alloc_size == expected_alloc(value.size, dtype, oversize)
        assert d.size == value.size <= d.alloc_size
        assert d.shape == value.shape
        if ndim:
            assert len(d) == len(value)
        else:
            with pytest.raises(TypeError, match="unsized"):  # as numpy's len() of a 0-d array
                len(d)
        assert_same(d.data, value)
        assert_same(np.asarray(d), value)
        other.update(d.handle())
        assert_same(other.data, value)
    other.close()
    d.free_memory()


@PROPS
@given(st.data())
def test_getitem_matches_numpy(data):
    dtype = data.draw(DTYPES)
    ndim = data.draw(st.integers(1, 3))
    value = data.draw(hnp.arrays(dtype, shapes(ndim, min_side=1)))
    d = Data(value)
    kind = data.draw(st.sampled_from(["basic", "fancy", "bool"]))
    if kind == "basic":
        key = data.draw(hnp.basic_indices(value.shape, allow_ellipsis=True, allow_newaxis=True))
    elif kind == "fancy":
        key = data.draw(hnp.integer_array_indices(value.shape))
    else:
        key = data.draw(hnp.arrays(bool, value.shape[: data.draw(st.integers(1, ndim))]))
    expected = value[key]
    got = d[key]
    if isinstance(expected, np.ndarray):
        assert_same(got, expected)
        # basic indexing gives a view of the shared memory, like numpy; fancy indexing a copy
        assert np.shares_memory(got, d.data) == np.shares_memory(expected, value)
    else:
        assert type(got) is type(expected)
        np.testing.assert_array_equal(got, expected)
    d.free_memory()


@PROPS
@given(st.data())
def test_setitem_matches_numpy_and_is_seen_in_place(data):
    dtype = data.draw(DTYPES)
    ndim = data.draw(st.integers(1, 3))
    ref = data.draw(hnp.arrays(dtype, shapes(ndim, min_side=1)))
    d = Data(ref)
    other = Data.attach(d.handle())
    calls = []
    d.on_change(calls.append)
    for _ in range(data.draw(st.integers(1, 3))):
        kind = data.draw(st.sampled_from(["basic", "fancy", "bool"]))
        if kind == "basic":
            key = data.draw(hnp.basic_indices(ref.shape, allow_ellipsis=True))
        elif kind == "fancy":
            key = data.draw(hnp.integer_array_indices(ref.shape))
        else:
            key = data.draw(hnp.arrays(bool, ref.shape))
        target = ref[key]
        # a value of the target's shape or a broadcastable one (a scalar or a last-axis row)
        shape = np.shape(target)
        vshape = data.draw(st.sampled_from([shape, (), shape[-1:]]))
        value = data.draw(hnp.arrays(dtype, vshape))
        writer = d if data.draw(st.booleans()) else other  # the creator or the attached Data
        writer[key] = value
        ref[key] = value
        assert_same(d.data, ref)
        assert_same(other.data, ref)
    assert calls == []  # writes of values change no handle
    other.close()
    d.free_memory()


@PROPS
@given(st.data())
def test_resizing_matches_numpy(data):
    dtype = data.draw(DTYPES)
    ndim = data.draw(st.integers(1, 3))
    ref = data.draw(hnp.arrays(dtype, shapes(ndim)))
    oversize = data.draw(OVERSIZE)
    d = Data(ref, oversize=oversize, name="x")
    assert d.alloc_size == expected_alloc(ref.size, dtype, oversize)
    other = Data.attach(d.handle())
    calls = []
    d.on_change(lambda data_: calls.append(data_.handle()))
    for _ in range(data.draw(st.integers(1, 6))):
        if data.draw(st.booleans()):
            shape = (data.draw(st.integers(0, 7)), *ref.shape[1:])
            how = "length"
        else:
            shape = data.draw(shapes(ndim, max_side=6))
            how = "shape"
        oversize = data.draw(OVERSIZE)
        alloc, tag, segment, n_calls = d.alloc_size, d.tag, d.handle().segment, len(calls)
        if how == "length":
            d.set_length(shape[0], oversize=oversize)
        else:
            d.set_shape(shape, oversize=oversize)
        changed = shape != ref.shape
        ref = resized(ref, shape)
        assert_same(d.data, ref)
        count = math.prod(shape)
        if count <= alloc:  # in place: same segment, same allocation
            assert (d.tag, d.alloc_size, d.handle().segment) == (tag, alloc, segment)
        else:  # reallocated: a new segment, the old one unlinked
            assert d.tag == tag + 1
            assert d.alloc_size == expected_alloc(count, dtype, oversize)
            assert d.handle().segment != segment and not shm_exists(segment)
        assert shm_exists(d.handle().segment)
        assert len(calls) == n_calls + changed
        if changed:
            assert calls[-1] == d.handle()
        other.update(d.handle())
        assert_same(other.data, ref)
        # new values everywhere, so that a later shrink-and-grow in place must zero stale items
        fresh = data.draw(hnp.arrays(dtype, shape))
        (other if data.draw(st.booleans()) else d)[...] = fresh
        ref = fresh.copy()
        assert_same(d.data, ref)
    other.close()
    d.free_memory()


@PROPS
@given(dtype=DTYPES, shape=shapes(2), oversize=OVERSIZE)
def test_oversize_reserves_room_to_grow(dtype, shape, oversize):
    d = Data(dtype=dtype, shape=shape, oversize=oversize)
    assert_same(d.data, np.zeros(shape, dtype))
    assert d.alloc_size == expected_alloc(math.prod(shape), dtype, oversize)
    assert d.size <= d.alloc_size
    tag = d.tag
    room = d.alloc_size // max(shape[1], 1) if shape[1] else 7
    d.set_length(room)  # the most rows that fit: no reallocation
    assert d.tag == tag
    d.set_length(room + 1 if shape[1] else room)
    assert d.tag == (tag + 1 if shape[1] else tag)
    d.free_memory()


# --- construction, dtype and ndim --------------------------------------------------------------

def test_construction_infers_dtype_ndim_and_keeps_options():
    d = Data([[1, 2], [3, 4]], minibatch=True, name="x")
    assert (d.dtype, d.ndim, d.shape, d.minibatch, d.name) == (np.dtype(int), 2, (2, 2), True, "x")
    assert repr(d) == "Data('x', shape=(2, 2), dtype=int64, minibatch=True)"
    d.free_memory()


def test_construction_from_shape_only():
    d = Data(dtype="float32", shape=(3, 2))
    assert (d.ndim, d.shape, d.allocated) == (2, (3, 2), True)
    assert not d.data.any()
    d.free_memory()


def test_construction_without_value_holds_no_memory():
    d = Data(dtype="int16", ndim=3)
    assert (d.shape, d.size, len(d), d.data, d.allocated, d.alloc_size) == (None, 0, 0, None, False, 0)
    assert d.handle().segment is None


@pytest.mark.parametrize("kwargs", [{}, {"ndim": 2}, {"shape": (2, 3)}])
def test_missing_dtype_is_a_type_error(kwargs):
    with pytest.raises(TypeError, match="needs a dtype"):
        Data(**kwargs)


def test_missing_ndim_is_a_type_error():
    with pytest.raises(TypeError, match="needs an ndim"):
        Data(dtype="float32")


@pytest.mark.parametrize("kwargs", [{"value": np.array(["a", None], dtype=object)},
                                    {"dtype": object, "ndim": 1},
                                    {"dtype": [("a", "f4"), ("b", "O")], "shape": (2,)}])
def test_python_object_dtype_is_a_type_error(kwargs):
    with pytest.raises(TypeError, match="holds Python objects, which cannot live in shared memory"):
        Data(**kwargs)


def test_strings_and_structured_dtypes_are_fine():
    s = Data(np.array(["ab", "c"]))
    r = Data(np.zeros(2, dtype=[("a", "f4"), ("b", "i2")]))
    s[1] = "xyz"  # truncated to U2, as numpy does
    r[0] = (1.5, 3)
    assert s.data.tolist() == ["ab", "xy"] and r.data.tolist() == [(1.5, 3), (0.0, 0)]
    s.free_memory()
    r.free_memory()


@pytest.mark.parametrize(("ndim", "error", "match"), [(-1, ValueError, "ndim must be >= 0, got -1"),
                                                      (1.5, TypeError, "ndim must be an integer"),
                                                      ("2", TypeError, "ndim must be an integer")])
def test_bad_ndim(ndim, error, match):
    with pytest.raises(error, match=match):
        Data(dtype="float32", ndim=ndim)


def test_construction_from_another_data_copies():
    a = Data(np.arange(4.0))
    b = Data(a)
    b[0] = 9
    assert a[0] == 0 and b.handle().segment != a.handle().segment
    assert_same(b.data, np.array([9.0, 1, 2, 3]))
    with pytest.raises(ValueError, match="holds no memory"):
        Data(Data(dtype="float32", ndim=1))
    a.free_memory()
    b.free_memory()


@pytest.mark.parametrize(("src", "dst"), [("int8", "int32"), ("uint8", "int16"), ("int32", "float64"),
                                          ("float32", "float64"), ("float32", "complex64"),
                                          ("bool", "float32")])
def test_safe_cast_is_accepted(src, dst):
    value = np.arange(6).reshape(2, 3).astype(src)
    d = Data(value, dtype=dst)
    assert_same(d.data, value.astype(dst))
    d.set_value(value[:1])
    assert_same(d.data, value[:1].astype(dst))
    assert_same(d.condition_data(value), value.astype(dst))
    d.free_memory()


@pytest.mark.parametrize(("src", "dst"), [("float64", "float32"), ("int64", "int32"), ("int32", "uint32"),
                                          ("float32", "int64"), ("complex64", "float64"),
                                          ("int64", "float32")])
def test_unsafe_cast_is_a_type_error_unless_forced(src, dst):
    value = (np.arange(6).reshape(2, 3) * 1.5).astype(src)
    with pytest.raises(TypeError, match=f"dtype {dst}; casting the value's {src} to it is not safe"):
        Data(value, dtype=dst)
    d = Data(dtype=dst, ndim=2)
    with pytest.raises(TypeError, match="force_cast=True"):
        d.set_value(value)
    assert not d.allocated  # nothing was allocated by the failed call
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numpy warns that complex -> real drops the imaginary part
        d.set_value(value, force_cast=True)
        forced = Data(value, dtype=dst, force_cast=True)
        expected = value.astype(dst)
    assert_same(d.data, expected)
    assert_same(forced.data, expected)
    d.free_memory()
    forced.free_memory()


def test_ndim_mismatch_is_a_type_error():
    d = Data(np.zeros((2, 3), "float32"), name="x")
    with pytest.raises(TypeError, match=r"Data 'x' has ndim=2; the value has ndim=1 \(shape \(3,\)\)"):
        d.set_value(np.zeros(3, "float32"))
    with pytest.raises(TypeError, match=r"ndim=2; shape \(2, 3, 1\) has 3"):
        d.set_shape((2, 3, 1))
    with pytest.raises(TypeError, match="ndim=2"):
        d.condition_data(np.float32(1))
    with pytest.raises(TypeError, match="ndim"):
        Data(np.zeros(3), ndim=2)
    assert d.shape == (2, 3)
    d.free_memory()


def test_set_length_of_0d_is_a_type_error():
    d = Data(np.float32(1.5))
    assert (d.ndim, d.shape, d[()]) == (0, (), 1.5)
    with pytest.raises(TypeError, match="0-d"):
        d.set_length(2)
    d.free_memory()


def test_set_length_without_shape():
    d2 = Data(dtype="float32", ndim=2, name="x")
    with pytest.raises(ValueError, match="Data 'x' has no shape yet"):
        d2.set_length(3)
    d1 = Data(dtype="float32", ndim=1)  # a 1-d Data needs nothing but the length
    d1.set_length(3)
    assert_same(d1.data, np.zeros(3, "float32"))
    d1.free_memory()


@pytest.mark.parametrize("bad", [0, 0.5, 0.99, 2.01, 3, float("nan"), float("inf"), -1])
def test_oversize_outside_1_2_is_a_value_error(bad):
    with pytest.raises(ValueError, match=r"oversize must be in \[1, 2\]"):
        Data(np.zeros(3), oversize=bad)
    d = Data(np.zeros(3))
    for call in (lambda: d.set_value(np.zeros(5), oversize=bad), lambda: d.set_length(5, oversize=bad),
                 lambda: d.set_shape((5,), oversize=bad)):
        with pytest.raises(ValueError, match="oversize"):
            call()
    assert d.shape == (3,)
    d.free_memory()


def test_negative_dimension_is_a_value_error():
    d = Data(np.zeros((2, 2)))
    with pytest.raises(ValueError, match="negative dimension"):
        d.set_shape((2, -1))
    with pytest.raises(ValueError, match="negative dimension"):
        d.set_length(-1)
    d.free_memory()


# --- no memory, free_memory ----------------------------------------------------------------------

def test_empty_data_errors_clearly_on_indexing():
    d = Data(dtype="float32", ndim=2, name="x")
    msg = r"Data 'x' holds no memory \(never filled, or freed\): call set_value\(\)"
    with pytest.raises(ValueError, match=msg):
        d[0]
    with pytest.raises(ValueError, match=msg):
        d[0] = 1
    with pytest.raises(ValueError, match=msg):
        np.asarray(d)
    with pytest.raises(ValueError, match="this Data holds no memory"):
        Data(dtype="float32", ndim=1)[0]


def test_free_memory_then_set_value_refills():
    d = Data(np.arange(6.0).reshape(2, 3))
    other = Data.attach(d.handle())
    calls = []
    d.on_change(calls.append)
    segment, tag = d.handle().segment, d.tag
    d.free_memory()
    assert (d.allocated, d.shape, d.data, d.alloc_size, d.ndim, d.dtype) == (
        False, None, None, 0, 2, np.float64)
    assert not shm_exists(segment)
    assert d.tag == tag + 1 and calls == [d]
    other.update(d.handle())
    assert (other.allocated, other.shape, other.ndim) == (False, None, 2)
    d.free_memory()  # idempotent, no second notice
    assert len(calls) == 1
    d.set_value(np.ones((1, 4)))
    assert_same(d.data, np.ones((1, 4)))
    assert len(calls) == 2 and d.handle().segment != segment
    other.update(d.handle())
    assert_same(other.data, np.ones((1, 4)))
    other.close()
    d.free_memory()


def test_full_dev_shm_is_a_clear_error_and_the_data_is_kept():
    d = Data(np.arange(4, dtype="float32"), name="big")
    segment = d.handle().segment
    with pytest.raises(SharedMemoryFullError) as info:
        d.set_length(2**43)  # 32 TiB
    msg = str(info.value)
    assert "cannot allocate 32.0 TiB" in msg and "Data 'big'" in msg and "--shm-size" in msg
    assert "free of" in msg
    assert d.handle().segment == segment
    assert_same(d.data, np.arange(4, dtype="float32"))
    with pytest.raises(SharedMemoryFullError, match="--shm-size"):
        Data(dtype="float64", shape=(2**42,))
    d.free_memory()


# --- numpy interoperation ------------------------------------------------------------------------

def test_array_protocol():
    d = Data(np.arange(3, dtype="float32"))
    assert np.shares_memory(np.asarray(d), d.data)
    assert not np.shares_memory(np.array(d), d.data)
    assert_same(np.asarray(d, dtype="float64"), np.arange(3.0))
    with pytest.raises(ValueError, match="copy=False"):
        np.asarray(d, dtype="float64", copy=False)
    assert np.shares_memory(np.asarray(d, copy=False), d.data)
    assert float(np.sum(d)) == 3.0
    d.free_memory()


def test_set_value_from_overlapping_view():
    d = Data(np.arange(5))
    d.set_value(d[::-1])
    assert_same(d.data, np.arange(5)[::-1])
    d.set_value(d)
    assert_same(d.data, np.arange(5)[::-1])
    d.free_memory()


# --- handles, attach, update, callbacks ---------------------------------------------------------

def test_handle_is_picklable_and_attachable():
    d = Data(np.arange(6, dtype="int32").reshape(3, 2), minibatch=True, name="x")
    h = d.handle()
    assert isinstance(h, DataHandle)
    h2 = pickle.loads(pickle.dumps(h))
    assert h2 == h and (h2.dtype, h2.shape, h2.minibatch, h2.name, h2.ndim) == ("<i4", (3, 2), True, "x", 2)
    other = Data.attach(h2)
    assert (other.dtype, other.ndim, other.shape, other.minibatch, other.name) == (
        np.int32, 2, (3, 2), True, "x")
    other[2, 1] = 50
    assert d[2, 1] == 50
    other.close()
    d.free_memory()


def test_attach_handle_of_empty_data_keeps_ndim():
    d = Data(dtype="float32", ndim=3)
    other = Data.attach(d.handle())
    assert (other.ndim, other.allocated) == (3, False)
    legacy = DataHandle(None, "<f4", None, 0, False, None)  # a handle without ndim
    assert Data.attach(legacy).ndim == 0


def test_attached_data_cannot_change_shape_or_allocation():
    d = Data(np.zeros((2, 3)), name="x")
    other = Data.attach(d.handle())
    for call in (lambda: other.set_length(5), lambda: other.set_shape((3, 2)),
                 lambda: other.set_value(np.zeros((1, 3))), other.free_memory):
        with pytest.raises(RuntimeError, match="Data 'x' is attached from another process"):
            call()
    other.set_value(np.ones((2, 3)))  # same shape: a write in place is fine
    assert_same(d.data, np.ones((2, 3)))
    with pytest.raises(RuntimeError, match="update\\(\\) is for an attached Data"):
        d.update(other.handle())
    other.close()
    d.free_memory()


def test_stale_handle_after_reallocation_cannot_attach():
    d = Data(np.zeros(2))
    old = d.handle()
    d.set_length(100)
    with pytest.raises(FileNotFoundError, match="freed or its creator exited"):
        Data.attach(old)
    d.free_memory()


def test_on_change_fires_on_handle_changes_only():
    d = Data(np.zeros((4, 2), "float32"), oversize=2)
    seen: list[DataHandle] = []
    d.on_change(lambda data_: seen.append(data_.handle()))
    d[0] = 1
    d.data[1] = 2
    d.set_value(np.ones((4, 2), "float32"))  # same shape: a value write
    d.set_shape((4, 2))
    assert seen == []
    d.set_length(8)  # in place (oversize 2): a new shape
    d.set_shape((2, 8))  # reshape in place
    d.set_length(100)  # reallocation
    d.free_memory()
    assert [h.shape for h in seen] == [(8, 2), (2, 8), (100, 8), None]
    assert [h.tag for h in seen] == [1, 1, 2, 3]


def test_close_unlinks_for_the_creator_without_notice():
    d = Data(np.zeros(3))
    calls = []
    d.on_change(calls.append)
    segment = d.handle().segment
    d.close()
    assert not shm_exists(segment) and calls == [] and d.data is None


def test_garbage_collected_data_unlinks_its_segment():
    d = Data(np.zeros(3))
    segment = d.handle().segment
    other = Data.attach(d.handle())
    del other  # an attached Data only unmaps
    assert shm_exists(segment)
    del d
    assert not shm_exists(segment)
