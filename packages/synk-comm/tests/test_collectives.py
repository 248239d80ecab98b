"""Every collective of synk_comm in groups of 2, 3 and 4 processes, against numpy.

One group per process count serves the whole module (``synk_comm.start`` with the handlers of
:mod:`comm_handlers`); each case is one ``group.run("case", spec)``: every rank builds its input
from the spec, runs the collective, and the master gets every rank's outcome to compare with the
numpy reference computed here from the same inputs.  Hypothesis draws shapes, dtypes, ops and
roots.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from comm_handlers import make_input, rank_input
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import synk_comm
from synk_comm.shm_collectives import CHUNKED_MIN_BYTES, PIPELINE_BLOCK_BYTES, REDUCE_BLOCK_BYTES

# --- the groups -----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"n{n}")
def group(request: pytest.FixtureRequest):
    g = synk_comm.start(request.param, imports=["comm_handlers"])
    yield g
    g.close()


pytestmark = pytest.mark.timeout(120)

CASES = settings(max_examples=20, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# --- dtypes and ops -------------------------------------------------------------------------------

BOOL = [np.dtype(bool)]
INTS = [np.dtype(t) for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")]
FLOATS = [np.dtype(t) for t in ("float16", "float32", "float64", "longdouble")]
COMPLEX = [np.dtype(t) for t in ("complex64", "complex128", "clongdouble")]
PADDED = {np.dtype("longdouble"), np.dtype("clongdouble")}
ALL_DTYPES = BOOL + INTS + FLOATS + COMPLEX
DTYPES_OF_OP = {
    "sum": ALL_DTYPES,
    "prod": ALL_DTYPES,
    "max": BOOL + INTS + FLOATS,
    "min": BOOL + INTS + FLOATS,
    "avg": FLOATS + COMPLEX,
}
OP_DTYPES = [(op, dt) for op, dts in DTYPES_OF_OP.items() for dt in dts]
AVG_TOL = {"float16": 1e-2, "float32": 1e-5, "complex64": 1e-5}
UFUNC = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}

dtypes = st.sampled_from(ALL_DTYPES)
op_dtypes = st.sampled_from(OP_DTYPES)
seeds = st.integers(0, 2**32 - 1)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
shapes_1d_up = hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=7)
picklables = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


def run_case(group: synk_comm.Group, **spec: Any) -> list[Any]:
    """Every rank's outcome of the case, in rank order (``("ok", value)`` or ``("error", type, msg)``)."""
    outcomes = group.run("case", spec)
    assert len(outcomes) == group.size
    return outcomes


def values(outcomes: list[Any]) -> list[Any]:
    """The values of a case that every rank must have completed."""
    bad = [(r, o) for r, o in enumerate(outcomes) if o[0] != "ok"]
    assert not bad, f"ranks failed: {bad}"
    return [o[1] for o in outcomes]


def inputs(spec: dict[str, Any], size: int) -> list[np.ndarray]:
    return [rank_input(spec, r) for r in range(size)]


def reduce_reference(op: str, parts: list[np.ndarray]) -> np.ndarray:
    """``op`` over the parts in rank order, in their dtype (avg: the sum in rank order over n)."""
    ufunc = UFUNC["sum" if op == "avg" else op]
    total = np.array(parts[0], copy=True)
    for p in parts[1:]:
        ufunc(total, p, out=total)
    if op == "avg":
        total = np.asarray(total / len(parts), dtype=parts[0].dtype)
    return total


def assert_reduced(result: Any, op: str, parts: list[np.ndarray]) -> None:
    """``result`` is ``op`` over ``parts``: exact against the rank-order reduction, same dtype and
    shape; ``avg`` also close to numpy's mean."""
    ref = reduce_reference(op, parts)
    assert isinstance(result, np.ndarray)
    assert result.dtype == parts[0].dtype
    assert result.shape == parts[0].shape
    if op == "prod" and result.dtype.kind == "c":
        # a complex product is a*c - b*d + i(a*d + b*c): fused multiply-adds (SIMD loops) may
        # round differently from the scalar loop by an ulp
        tol = AVG_TOL.get(result.dtype.name, 1e-12)
        np.testing.assert_allclose(result, ref, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(result, ref)
    if op == "avg":
        tol = AVG_TOL.get(result.dtype.name, 1e-9)
        np.testing.assert_allclose(result, np.mean(np.stack(parts), axis=0), rtol=tol, atol=tol)


def identical(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bits (extended precision: same values; its padding bytes are junk)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in PADDED:
        return bool(np.array_equal(a, b))
    return a.tobytes() == b.tobytes()


def assert_same_everywhere(results: list[np.ndarray]) -> None:
    """Bit-identical results in every rank."""
    for r, res in enumerate(results[1:], 1):
        assert identical(res, results[0]), f"rank {r} differs from rank 0"


def assert_exact(result: Any, expected: np.ndarray) -> None:
    assert isinstance(result, np.ndarray)
    assert result.dtype == expected.dtype, (result.dtype, expected.dtype)
    assert result.shape == expected.shape, (result.shape, expected.shape)
    assert identical(result, expected)


def assert_all_errors(outcomes: list[Any], exc_type: type[Exception], match: str = "") -> None:
    for r, o in enumerate(outcomes):
        assert o[0] == "error" and o[1] == exc_type.__name__, f"rank {r}: expected {exc_type.__name__}, got {o}"
        assert match in o[2], f"rank {r}: {match!r} not in {o[2]!r}"


def assert_usable(group: synk_comm.Group) -> None:
    """The next command gives correct results."""
    n = group.size
    np.testing.assert_array_equal(group.run("sum_ranks", 5), np.full(5, n * (n - 1) / 2))


# --- reductions -----------------------------------------------------------------------------------


@CASES
@given(op_dtype=op_dtypes, shape=shapes, seed=seeds, out=st.sampled_from([None, "inplace", "strided",
                                                                         "noncontig_input"]))
def test_all_reduce(group, op_dtype, shape, seed, out):
    op, dtype = op_dtype
    if out in ("strided", "noncontig_input") and len(shape) == 0:
        out = "inplace"
    spec = dict(kind="all_reduce", op=op, dtype=dtype, shape=shape, seed=seed, out=out)
    results = values(run_case(group, **spec))
    for res in results:
        assert_reduced(res, op, inputs(spec, group.size))
    assert_same_everywhere(results)


@CASES
@given(op_dtype=op_dtypes, shape=shapes, seed=seeds, root=st.integers(0, 3))
def test_reduce(group, op_dtype, shape, seed, root):
    op, dtype = op_dtype
    root %= group.size
    spec = dict(kind="reduce", op=op, dtype=dtype, shape=shape, seed=seed, root=root)
    results = values(run_case(group, **spec))
    assert_reduced(results[root], op, inputs(spec, group.size))
    assert all(res is None for r, res in enumerate(results) if r != root)


@CASES
@given(op_dtype=op_dtypes, shape=shapes_1d_up, seed=seeds)
def test_reduce_scatter(group, op_dtype, shape, seed):
    op, dtype = op_dtype
    n = group.size
    spec = dict(kind="reduce_scatter", op=op, dtype=dtype, shape=shape, seed=seed)
    results = values(run_case(group, **spec))
    xs = inputs(spec, n)
    for r, res in enumerate(results):
        assert_reduced(res, op, [np.array_split(x, n, axis=0)[r] for x in xs])


@pytest.mark.parametrize(("op", "dtype"), [("sum", "float32"), ("avg", "float64"), ("prod", "int64"),
                                           ("sum", "complex128"), ("max", "float16"), ("min", "int16"),
                                           ("sum", "uint8"), ("avg", "complex64")])
@pytest.mark.parametrize("out", [None, "inplace", "strided", "noncontig_input", "overlap"])
def test_all_reduce_large_chunked(group, op, dtype, out):
    """Arrays of more than CHUNKED_MIN_BYTES take the path where each rank reduces one chunk."""
    itemsize = np.dtype(dtype).itemsize
    cols = 263
    rows = CHUNKED_MIN_BYTES // (itemsize * cols) + 7  # not a multiple of any group size
    spec = dict(kind="all_reduce", op=op, dtype=dtype, shape=(rows, cols), seed=rows, out=out, repeat=3)
    assert math.prod(spec["shape"]) * itemsize > CHUNKED_MIN_BYTES
    results = values(run_case(group, **spec))
    xs = inputs(spec, group.size)
    for res in results:
        assert_reduced(res, op, xs)
    assert_same_everywhere(results)


@contextlib.contextmanager
def pipeline(group: synk_comm.Group, value: bool | list[bool] | None) -> Iterator[None]:
    """Force the pipelined all-reduce on (True) or off (False) in every rank for the block."""
    group.run("set_pipeline", value)
    try:
        yield
    finally:
        group.run("set_pipeline", None)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "stepwise"])
@pytest.mark.parametrize(("op", "dtype"), [("sum", "float32"), ("max", "float64"), ("avg", "float32"),
                                           ("prod", "int32"), ("sum", "complex128")])
@pytest.mark.parametrize("out", [None, "inplace", "overlap"])
def test_all_reduce_many_blocks(group, op, dtype, out, pipelined):
    """Spans of several blocks, the last one partial, in every rank, pipelined or not; ``out``
    fresh, the input itself, or overlapping the input."""
    itemsize = np.dtype(dtype).itemsize
    cols = 1031
    rows = group.size * (5 * REDUCE_BLOCK_BYTES // 2) // (itemsize * cols) + 3
    spec = dict(kind="all_reduce", op=op, dtype=dtype, shape=(rows, cols), seed=rows, out=out, repeat=2)
    with pipeline(group, pipelined):
        results = values(run_case(group, **spec))
    xs = inputs(spec, group.size)
    for res in results:
        assert_reduced(res, op, xs)
    assert_same_everywhere(results)


@pytest.mark.parametrize("out", [None, "inplace", "strided"])
def test_all_reduce_pipelined_small_chunks(group, out):
    """The smallest pipelined all-reduces: one block per span, or spans of a few elements."""
    with pipeline(group, True):
        for rows in (CHUNKED_MIN_BYTES // (8 * 263) + 1, 3 * PIPELINE_BLOCK_BYTES // (8 * 263)):
            spec = dict(kind="all_reduce", op="sum", dtype="float64", shape=(rows, 263), seed=rows, out=out)
            results = values(run_case(group, **spec))
            for res in results:
                assert_reduced(res, "sum", inputs(spec, group.size))


def test_pipelined_in_some_ranks_only_is_value_error(group):
    """Ranks that disagree on pipelining: ValueError in every rank, never a hang; usable after."""
    n = group.size
    spec = dict(kind="all_reduce", op="sum", dtype="float64", shape=(200, 263), seed=1)
    with pipeline(group, [False] * (n - 1) + [True]):
        assert_all_errors(run_case(group, **spec), ValueError, match="different algorithms")
    assert_usable(group)


def test_all_reduce_buffers_grow_and_shrink(group):
    """Sizes that jump up and down: buffers grow (new segments) and readers re-attach."""
    for i, n in enumerate([3, 70_000, 10, 400_000, 1, 0, 200_000, 17]):
        spec = dict(kind="all_reduce", op="sum", dtype="float64", shape=(n,), seed=i)
        results = values(run_case(group, **spec))
        for res in results:
            assert_reduced(res, "sum", inputs(spec, group.size))


def test_reduce_empty_and_scalar(group):
    for shape in [(), (0,), (0, 3), (2, 0, 4)]:
        for kind in ("all_reduce", "reduce"):
            spec = dict(kind=kind, op="max", dtype="int32", shape=shape, seed=1, root=group.size - 1)
            res = values(run_case(group, **spec))[group.size - 1]
            assert_reduced(res, "max", inputs(spec, group.size))


# --- data movement --------------------------------------------------------------------------------


@CASES
@given(dtype=dtypes, shape=shapes, seed=seeds, root=st.integers(0, 3), give=st.sampled_from(["none", "array"]))
def test_broadcast(group, dtype, shape, seed, root, give):
    root %= group.size
    spec = dict(kind="broadcast", dtype=dtype, shape=shape, seed=seed, root=root, give=give)
    expected = make_input(dtype, shape, seed, root)
    for res in values(run_case(group, **spec)):
        assert_exact(res, expected)


def uneven_spec(data: st.DataObject, n: int, **spec: object) -> dict:
    """A case whose ``n`` ranks give arrays of different shapes and dtypes (drawn here)."""
    return dict(spec, shapes=data.draw(st.lists(shapes, min_size=n, max_size=n)),
                dtypes=data.draw(st.lists(dtypes, min_size=n, max_size=n)))


@CASES
@given(data=st.data(), seed=seeds, root=st.integers(0, 3))
def test_gather_uneven(group, data, seed, root):
    """Ranks give different shapes (and dtypes); the root gets each as it was given."""
    n = group.size
    root %= n
    spec = uneven_spec(data, n, kind="gather", seed=seed, root=root)
    results = values(run_case(group, **spec))
    assert all(res is None for r, res in enumerate(results) if r != root)
    gathered = results[root]
    assert isinstance(gathered, list) and len(gathered) == n
    for got, expected in zip(gathered, inputs(spec, n)):
        assert_exact(got, expected)


@CASES
@given(data=st.data(), seed=seeds)
def test_all_gather_uneven(group, data, seed):
    n = group.size
    spec = uneven_spec(data, n, kind="all_gather", seed=seed)
    expected = inputs(spec, n)
    for gathered in values(run_case(group, **spec)):
        assert len(gathered) == n
        for got, exp in zip(gathered, expected):
            assert_exact(got, exp)


@CASES
@given(data=st.data(), seed=seeds, root=st.integers(0, 3))
def test_scatter_uneven(group, data, seed, root):
    n = group.size
    root %= n
    spec = uneven_spec(data, n, kind="scatter", seed=seed, root=root)
    for res, expected in zip(values(run_case(group, **spec)), inputs(spec, n)):
        assert_exact(res, expected)


def test_gather_large_uneven(group):
    """Uneven arrays big enough to grow the buffers, through gather, all_gather and scatter."""
    n = group.size
    spec: dict[str, Any] = dict(seed=5, root=n - 1, shapes=[(1000 * (r + 1) + r, 7) for r in range(n)],
                                dtypes=["float64", "int16", "complex64", "uint8"][:n])
    expected = inputs(spec, n)
    for got, exp in zip(values(run_case(group, kind="gather", **spec))[n - 1], expected):
        assert_exact(got, exp)
    for gathered in values(run_case(group, kind="all_gather", **spec)):
        for got, exp in zip(gathered, expected):
            assert_exact(got, exp)
    for got, exp in zip(values(run_case(group, kind="scatter", **spec)), expected):
        assert_exact(got, exp)


# --- Python objects -------------------------------------------------------------------------------


@CASES
@given(objects=st.lists(picklables, min_size=4, max_size=4), root=st.integers(0, 3))
def test_broadcast_object(group, objects, root):
    root %= group.size
    results = values(run_case(group, kind="broadcast_object", objects=objects, root=root, seed=0))
    assert results == [objects[root]] * group.size


@CASES
@given(objects=st.lists(picklables, min_size=4, max_size=4), root=st.integers(0, 3))
def test_gather_object(group, objects, root):
    n = group.size
    root %= n
    results = values(run_case(group, kind="gather_object", objects=objects, root=root, seed=0))
    assert results[root] == objects[:n]
    assert all(res is None for r, res in enumerate(results) if r != root)


# --- a root other than the master -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["reduce", "broadcast", "gather", "scatter", "broadcast_object",
                                  "gather_object"])
def test_non_master_root(group, kind):
    n = group.size
    root = n - 1
    assert root != group.master_rank
    spec: dict[str, Any] = dict(kind=kind, root=root, seed=11, op="sum", dtype="float32", shape=(4, 3),
                                objects=[{"rank": r} for r in range(n)])
    results = values(run_case(group, **spec))
    xs = inputs(spec, n)
    if kind == "reduce":
        assert_reduced(results[root], "sum", xs)
    elif kind == "broadcast":
        for res in results:
            assert_exact(res, xs[root])
    elif kind == "gather":
        for got, exp in zip(results[root], xs):
            assert_exact(got, exp)
    elif kind == "scatter":
        for res, exp in zip(results, xs):
            assert_exact(res, exp)
    elif kind == "broadcast_object":
        assert results == [{"rank": root}] * n
    else:
        assert results[root] == [{"rank": r} for r in range(n)]
    if kind in ("reduce", "gather", "gather_object"):
        assert all(res is None for r, res in enumerate(results) if r != root)


# --- mistakes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("mismatch", ["shape", "ndim", "dtype", "large_shape", "small_vs_large"])
def test_mismatch_raises_value_error_everywhere(group, kind, mismatch):
    """Ranks that disagree on shape or dtype: ValueError in every rank; the group stays usable.

    Large arrays take the chunked all_reduce path (two barriers); ``small_vs_large`` has the
    last rank on the one-barrier path while the others are on the chunked one."""
    n = group.size
    base = (4, 3) if mismatch in ("shape", "ndim", "dtype") else (200, 263)
    if mismatch == "small_vs_large":
        spec = dict(dtype="float64", shapes=[base] * (n - 1) + [(2, 263)])
    elif mismatch == "dtype":
        spec = dict(shape=base, dtypes=["float64"] * (n - 1) + ["float32"])
    elif mismatch == "ndim":
        spec = dict(dtype="float64", shapes=[base] * (n - 1) + [(math.prod(base),)])
    else:
        spec = dict(dtype="float64", shapes=[base] * (n - 1) + [(base[0] + 1, base[1])])
    assert_all_errors(run_case(group, kind=kind, op="sum", seed=3, **spec), ValueError,
                      match="every rank must give the same shape and dtype")
    assert_usable(group)


def test_mismatch_uncaught_is_the_masters_error(group):
    """Not caught in the handlers: the master raises its own ValueError; the group stays usable."""
    n = group.size
    spec = dict(kind="all_reduce", op="sum", dtype="float32", seed=0, shapes=[(5,)] * (n - 1) + [(6,)])
    for _ in range(2):
        with pytest.raises(ValueError, match="same shape and dtype"):
            group.run("case_raw", spec)
        assert_usable(group)


def test_reduce_mismatch_raises_in_root(group):
    n = group.size
    root = n - 1
    spec = dict(kind="reduce", op="sum", dtype="int32", seed=0, root=root, shapes=[(5,)] * (n - 1) + [(2,)])
    outcomes = run_case(group, **spec)
    assert outcomes[root][0] == "error" and outcomes[root][1] == "ValueError"
    assert_usable(group)


@pytest.mark.parametrize("kind", ["all_reduce", "reduce", "reduce_scatter"])
@pytest.mark.parametrize("op", ["mean", "SUMM", "", "gather"])
def test_unknown_op(group, kind, op):
    outcomes = run_case(group, kind=kind, op=op, dtype="float64", shape=(3,), seed=0, root=0)
    assert_all_errors(outcomes, ValueError, match="unknown reduce op")
    assert_usable(group)


@pytest.mark.parametrize("dtype", BOOL + INTS)
def test_avg_of_integers_is_type_error(group, dtype):
    for kind in ("all_reduce", "reduce", "reduce_scatter"):
        outcomes = run_case(group, kind=kind, op="avg", dtype=dtype, shape=(3,), seed=0, root=0)
        assert_all_errors(outcomes, TypeError, match="'avg' needs a floating or complex dtype")
    assert_usable(group)


@pytest.mark.parametrize("kind", ["reduce", "broadcast", "gather", "scatter", "broadcast_object",
                                  "gather_object"])
def test_bad_root(group, kind):
    for root in (group.size, -1):
        outcomes = run_case(group, kind=kind, root=root, op="sum", dtype="float64", shape=(2,), seed=0,
                            objects=[None] * group.size)
        assert_all_errors(outcomes, ValueError, match="root must be a rank")
    assert_usable(group)


def test_reduce_op_enum_and_case_insensitive(group):
    for op in (synk_comm.ReduceOp.MAX, "MAX", "Max"):
        spec = dict(kind="all_reduce", op=op, dtype="int64", shape=(6,), seed=2)
        for res in values(run_case(group, **spec)):
            assert_reduced(res, "max", inputs(spec, group.size))


def test_many_cases_back_to_back(group):
    """Collectives of every kind in a row, alternating buffers, with nothing in between."""
    n = group.size
    for i, (kind, op) in enumerate(itertools.product(["all_reduce", "reduce", "reduce_scatter"],
                                                     ["sum", "max", "avg"])):
        spec = dict(kind=kind, op=op, dtype="float64", shape=(n + i, 2), seed=i, root=i % n, repeat=5)
        results = values(run_case(group, **spec))
        xs = inputs(spec, n)
        if kind == "all_reduce":
            for res in results:
                assert_reduced(res, op, xs)
        elif kind == "reduce":
            assert_reduced(results[i % n], op, xs)
        else:
            for r, res in enumerate(results):
                assert_reduced(res, op, [np.array_split(x, n)[r] for x in xs])
