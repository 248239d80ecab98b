"""Calls of synkhronos functions in 2 and 3 CPU ranks, against numpy and the plain PyTensor function
on the whole data: output ops (avg weighted by rows, sum, prod, max, min, gather), broadcast inputs,
every form of ``batch``, minibatch Data, keywords, ``output_subset``, ``as_theano``, ``build_inputs``,
givens and PyTensor keyword arguments."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from synk_testutil import ON_ENGINE, TIMEOUT, parts

import synkhronos as synk

pytestmark = pytest.mark.timeout(TIMEOUT)

OPS = ["avg", "sum", "prod", "max", "min", None, None, "avg"]


class Fns:
    """The functions of this module, built once per forked group."""

    def __init__(self) -> None:
        x = pt.matrix("x", dtype="float64")
        y = pt.vector("y", dtype="float64")
        z = pt.matrix("z", dtype="float64")
        self.x, self.y = x, y
        self.exprs = [pt.mean(x.dot(y)), pt.sum(x, axis=0), pt.prod(x, axis=0), pt.max(x, axis=0),
                      pt.min(x, axis=0), x + y, pt.sum(x), pt.mean(x, axis=0)]
        outputs = [(e, op) for e, op in zip(self.exprs[:-1], OPS[:-1])] + [self.exprs[-1]]  # last: default op
        self.f = synk.function([x], outputs, bcast_inputs=[y], name="ops")
        self.f_th = pytensor.function([x, y], self.exprs)
        self.single = synk.function([x], pt.mean(x, axis=0))
        self.listed = synk.function([x], [pt.mean(x, axis=0)])
        self.mb = synk.function([x, z], [(x + z, None), pt.mean(x * z)])


@pytest.fixture(scope="module")
def fns(ranks):
    return Fns()


def reference(xs: np.ndarray, y: np.ndarray, n: int) -> list[np.ndarray]:
    """numpy: what ``Fns.f`` returns for rows ``xs`` on ``n`` ranks."""
    per_rank_sums = np.array([p.sum() for p in parts(xs, n) if len(p)])
    return [(xs @ y).mean(), xs.sum(0), xs.prod(0), xs.max(0), xs.min(0), xs + y, per_rank_sums, xs.mean(0)]


def assert_outputs(got, expected) -> None:
    assert isinstance(got, list) and len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert np.shape(g) == np.shape(e), f"output {i}: shape {np.shape(g)} != {np.shape(e)}"
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12, err_msg=f"output {i} (op {OPS[i]})")


def values(n_rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.uniform(0.5, 1.5, (n_rows, 3)), rng.uniform(-1, 1, 3)


# --- output ops -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n_rows", [10, 7, 2, 1])
def test_output_ops_match_numpy_and_pytensor(fns, ranks, n_rows):
    xd, yd = values(n_rows)
    got = fns.f(synk.data(xd), synk.data(yd))
    expected = reference(xd, yd, ranks)
    assert_outputs(got, expected)
    whole = fns.f_th(xd, yd)  # the plain PyTensor function on the whole data
    for i in (0, 1, 2, 3, 4, 5, 7):
        np.testing.assert_allclose(got[i], whole[i], rtol=1e-10, atol=1e-12)
    # 0-d outputs under op None stack one value per rank that had rows, in rank order
    assert got[6].shape == (min(n_rows, ranks),)


def test_avg_is_weighted_by_rows_on_uneven_split(fns, ranks):
    """10 rows: 5/5 on 2 ranks, 4/3/3 on 3; 7 rows: 4/3 on 2 ranks. The weighted mean is the
    single-process mean where an unweighted mean of the ranks' means is not."""
    for n_rows in (10, 7):
        xd = np.arange(float(n_rows))[:, None] ** 2 * np.ones((1, 3))
        got = fns.single(synk.data(xd))
        np.testing.assert_allclose(got, xd.mean(0), rtol=1e-12)
        unweighted = np.mean([p.mean(0) for p in parts(xd, ranks)], axis=0)
        if n_rows % ranks:
            assert not np.allclose(unweighted, xd.mean(0))  # the split is really uneven


@pytest.mark.parametrize("dtype", ["float32", "float64", "longdouble", "int32", "complex64"])
def test_avg_of_scalars_over_many_parts_keeps_the_dtype_and_skips_empty_parts(dtype):
    """The master's combining of 0-d outputs (real scalars take a path of their own): 16 parts,
    uneven rows, two parts without rows; against the float64 weighted mean."""
    from synkhronos.reduce_ops import combine

    rng = np.random.default_rng(5)
    raw = rng.uniform(-3, 3, 16) + (1j * rng.uniform(-3, 3, 16) if dtype.startswith("complex") else 0)
    values = [np.asarray(v, dtype=dtype) for v in raw]
    weights = [float(w) for w in rng.integers(1, 9, 16)]
    weights[3] = weights[11] = 0.0
    values[3] = np.asarray(np.nan, dtype="float64")  # a part of weight 0 is never read
    got = combine("avg", values, weights)
    kept = [(np.asarray(v, dtype=np.clongdouble), w) for v, w in zip(values, weights) if w > 0]
    expected = sum(v * w for v, w in kept) / sum(w for _, w in kept)
    assert got.shape == () and got.dtype == (np.dtype(dtype) if np.dtype(dtype).kind in "fc" else np.float64)
    np.testing.assert_allclose(got, expected if dtype.startswith("complex") else expected.real,
                               rtol=1e-6 if dtype in ("float32", "complex64") else 1e-12)


def test_output_modes_update_modes_and_name(fns):
    assert fns.f.output_modes == OPS
    assert fns.f.update_modes == []
    assert fns.f.name == "ops"
    assert fns.single.output_modes == ["avg"]


def test_single_output_returns_array_list_returns_list(fns):
    xd, _ = values(5)
    X = synk.data(xd)
    one = fns.single(X)
    assert isinstance(one, np.ndarray)
    np.testing.assert_allclose(one, xd.mean(0), rtol=1e-12)
    listed = fns.listed(X)
    assert isinstance(listed, list) and len(listed) == 1
    np.testing.assert_allclose(listed[0], xd.mean(0), rtol=1e-12)


def test_bcast_input_goes_whole_to_every_rank(fns, ranks):
    """y has as many entries as x has rows: split, it would not fit any rank's share."""
    xd = np.random.default_rng(3).uniform(0.5, 1.5, (3, 3))
    yd = np.array([2.0, -1.0, 0.5])
    got = fns.f(synk.data(xd), synk.data(yd))
    np.testing.assert_allclose(got[5], xd + yd, rtol=1e-12)
    np.testing.assert_allclose(got[0], (xd @ yd).mean(), rtol=1e-12)


# --- batch ---------------------------------------------------------------------------------------

N_BATCH_ROWS = 20
BATCHES = {
    "int": 6,
    "np_int": np.int64(13),
    "int_all": N_BATCH_ROWS,
    "slice": slice(2, 9),
    "slice_open_start": slice(None, 5),
    "slice_negative_start": slice(-6, None),
    "slice_negative_stop": slice(3, -4),
    "slice_step": slice(1, None, 3),
    "slice_reversed": slice(None, None, -1),
    "slice_negative_step": slice(15, 2, -4),
    "slice_negative_bounds_and_step": slice(-1, -8, -2),
    "slice_past_end": slice(5, 100),
    "list": [9, 0, 3, 3, 17],
    "list_negative": [-1, 0, -20],
    "list_one_row": [7],
    "array_int32": np.array([4, 2, 19, 11], dtype=np.int32),
    "array_uint8": np.array([1, 2, 3], dtype=np.uint8),
    "array_reversed": np.arange(N_BATCH_ROWS)[::-1],
    "shuffled": np.random.default_rng(0).permutation(N_BATCH_ROWS)[:11],
}


def selected(batch) -> np.ndarray:
    """numpy: the rows that ``batch`` selects (an int k is rows [:k])."""
    rows = np.arange(N_BATCH_ROWS)
    if isinstance(batch, (int, np.integer)):
        return rows[:batch]
    return rows[batch]


@pytest.mark.parametrize("batch", list(BATCHES.values()), ids=list(BATCHES))
def test_batch_forms(fns, ranks, batch):
    xd, yd = values(N_BATCH_ROWS, seed=1)
    X, Y = synk.data(xd), synk.data(yd)
    got = fns.f(X, Y, batch=batch)
    assert_outputs(got, reference(xd[selected(batch)], yd, ranks))
    np.testing.assert_array_equal(X.data, xd)  # batch reads, never writes, the Data


def test_batch_list_and_array_give_same_result(fns):
    xd, yd = values(N_BATCH_ROWS, seed=2)
    X, Y = synk.data(xd), synk.data(yd)
    idx = [3, 18, 0, 7]
    a = fns.f(X, Y, batch=idx)
    b = fns.f(X, Y, batch=np.array(idx))
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


# --- minibatch Data ------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [[11, 2, 2, 19, 5, 0, 8], slice(5, 12), slice(16, 3, -3), 4],
                         ids=["list", "slice", "slice_step", "int"])
def test_minibatch_data_position_i_is_row_i(fns, ranks, batch):
    rng = np.random.default_rng(4)
    xd = rng.uniform(0.5, 1.5, (N_BATCH_ROWS, 2))
    rows = selected(batch)
    zd = rng.uniform(0.5, 1.5, (len(rows) + 2, 2))  # longer than the batch is fine
    X, Z = synk.data(xd), synk.data(zd, minibatch=True)
    assert Z.minibatch
    gathered, mean = fns.mb(X, Z, batch=batch)
    np.testing.assert_allclose(gathered, xd[rows] + zd[:len(rows)], rtol=1e-12)
    np.testing.assert_allclose(mean, (xd[rows] * zd[:len(rows)]).mean(), rtol=1e-12)


def test_minibatch_shorter_than_batch_is_value_error(fns):
    xd = np.ones((N_BATCH_ROWS, 2))
    X, Z = synk.data(xd), synk.data(np.ones((3, 2)), minibatch=True)
    for batch in ([0, 1, 2, 3], slice(0, 5), 4):
        with pytest.raises(ValueError, match="minibatch"):
            fns.mb(X, Z, batch=batch)
    gathered, _ = fns.mb(X, Z, batch=[5, 6, 7])  # the group is fine
    np.testing.assert_array_equal(gathered, np.full((3, 2), 2.0))


def test_minibatch_without_batch_reads_every_row(fns):
    xd, zd = np.arange(10.0).reshape(5, 2), np.ones((5, 2))
    gathered, _ = fns.mb(synk.data(xd), synk.data(zd, minibatch=True))
    np.testing.assert_array_equal(gathered, xd + 1)


# --- keywords, output_subset, as_theano, build_inputs --------------------------------------------

def test_keywords_name_inputs_by_their_name(fns, ranks):
    xd, yd = values(9, seed=5)
    X, Y = synk.data(xd), synk.data(yd)
    expected = reference(xd, yd, ranks)
    assert_outputs(fns.f(x=X, y=Y), expected)
    assert_outputs(fns.f(X, y=Y), expected)
    assert_outputs(fns.f(y=Y, x=X), expected)


def test_output_subset_order_and_returns(fns, ranks):
    xd, yd = values(11, seed=6)
    X, Y = synk.data(xd), synk.data(yd)
    expected = reference(xd, yd, ranks)
    got = fns.f(X, Y, output_subset=[5, 0, 6])
    assert isinstance(got, list) and len(got) == 3
    for g, i in zip(got, [5, 0, 6]):
        np.testing.assert_allclose(g, expected[i], rtol=1e-10)
    # a subset that does not use the broadcast input y
    got = fns.f(X, Y, output_subset=(1,))
    assert isinstance(got, list) and len(got) == 1
    np.testing.assert_allclose(got[0], expected[1], rtol=1e-12)
    got = fns.f(X, Y, output_subset=np.array([4, 3]), batch=[0, 5, 6], num_slices=2)
    np.testing.assert_allclose(got[0], xd[[0, 5, 6]].min(0), rtol=1e-12)
    np.testing.assert_allclose(got[1], xd[[0, 5, 6]].max(0), rtol=1e-12)
    assert_outputs(fns.f(X, Y), expected)  # the full function still returns everything


@pytest.mark.parametrize("subset, exc", [([8], ValueError), ([-1], ValueError), ([0, 0], ValueError),
                                         ("01", TypeError), (3, TypeError), ([1.0], TypeError),
                                         ([True], TypeError)])
def test_bad_output_subset(fns, ranks, subset, exc):
    xd, yd = values(4)
    X, Y = synk.data(xd), synk.data(yd)
    with pytest.raises(exc, match="output_subset"):
        fns.f(X, Y, output_subset=subset)
    assert_outputs(fns.f(X, Y), reference(xd, yd, ranks))


def test_as_theano_and_as_pytensor_run_the_whole_function_in_the_master(fns):
    xd, yd = values(8, seed=7)
    whole = fns.f_th(xd, yd)
    for call in (fns.f.as_theano, fns.f.as_pytensor):
        got = call(xd, yd)
        for g, w in zip(got, whole):
            np.testing.assert_allclose(g, w, rtol=1e-12)
    got = fns.f.as_theano(synk.data(xd), y=yd)  # Data, and keywords, are fine too
    np.testing.assert_allclose(got[6], xd.sum(), rtol=1e-12)  # one process: one value


def test_build_inputs(fns, ranks):
    xd, yd = values(6, seed=8)
    X, Y = fns.f.build_inputs(xd.astype(np.float32), yd.astype(np.int32))  # safe casts to the inputs' dtypes
    for d, name, value in ((X, "x", xd.astype(np.float32)), (Y, "y", yd.astype(np.int32))):
        assert isinstance(d, synk.Data)
        assert d.dtype == np.float64 and d.name == name and not d.minibatch and d.ndim == value.ndim
        np.testing.assert_array_equal(d.data, value)
    assert_outputs(fns.f(X, Y), reference(xd.astype(np.float32).astype(np.float64), yd.astype(np.int32), ranks))

    X, Y = fns.f.build_inputs(x=xd, y=yd, minibatch=[True, False])
    assert X.minibatch and not Y.minibatch
    np.testing.assert_array_equal(Y.data, yd)

    one = fns.single.build_inputs(xd)
    assert isinstance(one, synk.Data) and one.name == "x"
    np.testing.assert_allclose(fns.single(one), xd.mean(0), rtol=1e-12)

    wide = xd.astype(np.longdouble)
    with pytest.raises(TypeError):
        fns.f.build_inputs(wide, yd)
    X, Y = fns.f.build_inputs(wide, yd, force_cast=True, oversize=2)
    assert X.dtype == np.float64 and X.alloc_size >= 2 * X.size
    with pytest.raises(ValueError, match="minibatch"):
        fns.f.build_inputs(xd, yd, minibatch=[True])


def test_givens_and_pytensor_keyword_arguments(ranks):
    x, v, y = pt.matrix("x", dtype="float64"), pt.vector("v", dtype="float64"), pt.vector("y", dtype="float64")
    w = pytensor.shared(np.array([1.0, -2.0, 0.5]), name="w")
    g = synk.function([x], pt.mean(x.dot(v)), givens={v: w})
    unused = synk.function([x], pt.sum(x), bcast_inputs=[y], on_unused_input="ignore")
    xd = np.random.default_rng(9).normal(size=(7, 3))
    X = synk.data(xd)
    np.testing.assert_allclose(g(X), (xd @ w.get_value()).mean(), rtol=1e-12)
    assert unused.output_modes == ["avg"]
    per_rank = [p.sum() for p in parts(xd, ranks)]
    weights = [len(p) for p in parts(xd, ranks)]
    np.testing.assert_allclose(unused(X, synk.data(np.zeros(2))), np.average(per_rank, weights=weights), rtol=1e-12)


# --- outputs: every op, uneven splits, ranks without rows ---------------------------------------------

@pytest.mark.parametrize("n_rows", [10, 7, 2, 1])
def test_outputs_with_uneven_splits_match_numpy(fns, ranks, n_rows):
    """Every reduce op, with uneven splits and ranks without rows (left out), repeated calls."""
    xd, yd = values(n_rows, seed=5)
    X, Y = synk.data(xd), synk.data(yd)
    expected = reference(xd, yd, ranks)
    for _ in range(3):
        assert_outputs(fns.f(X, Y), expected)


def test_integer_outputs_and_output_subsets(ranks):
    """Integer outputs of every op (an int avg is a float mean) beside a gathered one, with and
    without an output subset."""
    xi = pt.matrix("xi", dtype="int64")
    f = synk.function([xi], [(xi.sum(axis=0), "sum"), (xi.max(axis=0), "max"), (xi.min(axis=0), "min"),
                             xi.sum(axis=0), (xi * 2, None)])
    xd = np.random.default_rng(6).integers(-50, 50, (9, 4))
    weights = [len(p) for p in parts(xd, ranks)]
    sums = np.array([p.sum(0) for p in parts(xd, ranks)])
    expected = [xd.sum(0), xd.max(0), xd.min(0), np.average(sums, axis=0, weights=weights), xd * 2]
    X = synk.data(xd)
    for _ in range(3):
        got = f(X)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-12)
        np.testing.assert_array_equal(f(X, output_subset=[4, 0])[0], xd * 2)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_scalar_outputs_replied_as_numbers_match_numpy(ranks, dtype, monkeypatch):
    """Outputs that are all real scalars (a loss, an accuracy) travel as numbers in the control
    block, never as messages: every op, uneven splits, ranks without rows (left out whatever
    their slots hold from the call before), an output subset of a mixed function taking that
    path while the whole function does not; results in the output's dtype, against numpy.  On
    the engine (GPU mode) the same values, by its own path."""
    from synk_comm import Group

    x = pt.matrix("x", dtype=dtype)
    f = synk.function([x], [(x.sum(), "avg"), (x.sum(), "sum"), (x.sum(), "prod"), (x.max(), "max"),
                            (x.min(), "min"), x.mean()])
    mixed = synk.function([x], [(x.sum(axis=0), "sum"), (x.max(), "max")])
    messages = []
    if not ON_ENGINE:  # the engine's calls reply by message (GPU mode): only the values are checked there
        monkeypatch.setattr(Group, "replies", lambda self, *a, **k: messages.append(1) or {})
    rng = np.random.default_rng(11)
    for n_rows in (7, 9, 1, ranks - 1 if ranks > 2 else 1):
        xd = rng.uniform(0.5, 1.5, (n_rows, 3)).astype(dtype)
        kept = [p for p in parts(xd, ranks) if len(p)]
        sums = np.array([p.sum(dtype=np.float64) for p in kept])
        weights = [len(p) for p in kept]
        expected = [np.average(sums, weights=weights), sums.sum(), sums.prod(), xd.max(), xd.min(), xd.mean()]
        got = f(synk.data(xd))
        assert [g.dtype for g in got] == [np.dtype(dtype)] * 6 and all(g.shape == () for g in got)
        rtol = 1e-5 if dtype == "float32" else 1e-12
        for i, (g, e) in enumerate(zip(got, expected)):
            np.testing.assert_allclose(g, e, rtol=rtol, err_msg=f"output {i}, {n_rows} rows")
        (top,) = mixed(synk.data(xd), output_subset=[1])
        assert top.dtype == np.dtype(dtype) and top == xd.max()
    assert not messages  # no call read a message reply
    monkeypatch.undo()
    np.testing.assert_allclose(mixed(synk.data(xd))[0], xd.sum(0), rtol=rtol)  # a vector: by message


def test_combining_numbers_matches_numpy_and_keeps_nan():
    """The master's combining of replied numbers against numpy: weighted avg, sum, prod, max, min
    over 16 parts with two of weight 0 (NaN there: never read), NaN in a kept part wins max/min
    as in numpy, a lone part as it is, every part empty raises."""
    from synkhronos.reduce_ops import combine_numbers

    rng = np.random.default_rng(3)
    w = rng.integers(1, 9, 16).astype(float)
    v = rng.uniform(-2, 2, (16, 5))
    w[[3, 11]] = 0.0
    v[3] = np.nan
    ops = ["avg", "sum", "prod", "max", "min"]
    got = combine_numbers(ops, np.column_stack([w, v]).tolist())
    k = w > 0
    expected = [np.average(v[k, 0], weights=w[k]), v[k, 1].sum(), v[k, 2].prod(), v[k, 3].max(), v[k, 4].min()]
    np.testing.assert_allclose(got, expected, rtol=1e-13)
    v[5, 3] = v[6, 4] = np.nan
    got = combine_numbers(ops, np.column_stack([w, v]).tolist())
    assert np.isnan(got[3]) and np.isnan(got[4]) and not np.isnan(got[0])
    assert combine_numbers(["avg", "max"], [[0.0, 9.0, 9.0], [3.0, 0.1, -2.0]]) == [0.1, -2.0]
    with pytest.raises(ValueError, match="every rank had 0 rows"):
        combine_numbers(["sum"], [[0.0, 1.0], [0.0, 2.0]])


def test_output_shapes_that_differ_between_ranks_raise(ranks):
    """An output summed over the ranks must have one shape: a ValueError, and the group goes on."""
    x = pt.matrix("x", dtype="float64")
    f = synk.function([x], (x.sum(axis=1), "sum"))
    X = synk.data(np.ones((2 * ranks, 3)))
    np.testing.assert_allclose(f(X), np.full(2, 3.0 * ranks))  # even split: one shape
    uneven = synk.data(np.ones((2 * ranks + 1, 3)))
    with pytest.raises(ValueError, match="shape"):
        f(uneven)
    np.testing.assert_allclose(f(X), np.full(2, 3.0 * ranks))


def test_a_repeated_call_reuses_its_checked_plan_until_a_data_changes(fns, ranks, monkeypatch):
    # The same Data, batch and subset again: the master reuses the checked plan (Function._known_plan).
    # New values in place, a longer Data (a new segment), another batch, memory freed: each checked again.
    xs, y = values(12, seed=7)
    xd, yd = synk.data(xs), synk.data(y)
    fns.single._plans.clear()
    checked = []  # the calls of fns.single that ran every check and made a plan
    prepare = fns.single._prepare
    monkeypatch.setattr(fns.single, "_prepare", lambda *a, **k: checked.append(a[4]) or prepare(*a, **k))
    for batch in [8, 8, slice(2, 11), 8, "in place", 8, "grow", 8, slice(10, 20), slice(10, 20)]:
        if batch == "in place":
            xs = xs * 2.0
            xd.data[:] = xs
            continue
        if batch == "grow":
            xs = np.concatenate([xs, values(10, seed=8)[0]])
            xd.set_value(xs)
            continue
        rows = xs[:batch] if isinstance(batch, int) else xs[batch]
        np.testing.assert_allclose(fns.single(xd, batch=batch), rows.mean(axis=0), rtol=1e-12)
        np.testing.assert_allclose(fns.f(xd, yd, batch=batch)[0], (rows @ y).mean(), rtol=1e-12)
    assert checked == [8, slice(2, 11), 8, slice(10, 20)]  # of 7 calls; after "grow" 8 is checked again
    xd.free_memory()
    with pytest.raises(ValueError, match="holds no memory"):
        fns.single(xd, batch=8)


def test_a_repeated_batch_of_indices_reuses_its_plan_with_each_calls_indices(fns, ranks, monkeypatch):
    # A training loop's shuffled batches: index arrays of one length reuse the checked plan, and each
    # call reads its own rows (negative indices from the end); a bad index is still a ValueError,
    # after which the group goes on; another length or a longer Data is checked again.
    xs, y = values(20, seed=9)
    xd, yd = synk.data(xs), synk.data(y)
    fns.single._plans.clear()
    checked = []
    prepare = fns.single._prepare

    def counted(*a, **k):  # a[4]: the batch (a slice, or indices: their count)
        checked.append(a[4] if isinstance(a[4], slice) else len(a[4]))
        return prepare(*a, **k)

    monkeypatch.setattr(fns.single, "_prepare", counted)
    rng = np.random.default_rng(3)
    for _ in range(4):
        order = rng.permutation(20)[:7]
        np.testing.assert_allclose(fns.single(xd, batch=order), xs[order].mean(axis=0), rtol=1e-12)
        np.testing.assert_allclose(fns.f(xd, yd, batch=order)[0], (xs[order] @ y).mean(), rtol=1e-12)
    wrapped = np.array([-1, -20, 3, 4, 5, 6, 7])
    np.testing.assert_allclose(fns.single(xd, batch=wrapped), xs[wrapped].mean(axis=0), rtol=1e-12)
    for bad in ([0, 1, 2, 3, 4, 5, 20], [0, 1, 2, 3, 4, 5, -21]):
        with pytest.raises(ValueError, match="out of range"):
            fns.single(xd, batch=np.array(bad))
    order = rng.permutation(20)[:7]
    np.testing.assert_allclose(fns.single(xd, batch=order), xs[order].mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(fns.single(xd, batch=order[:5]), xs[order[:5]].mean(axis=0), rtol=1e-12)
    for batch in [slice(1, 20, 3), order, slice(1, 20, 3)]:  # a stepped slice's indices: its plan is not kept
        np.testing.assert_allclose(fns.single(xd, batch=batch), xs[batch].mean(axis=0), rtol=1e-12)
    xs = np.concatenate([xs, values(10, seed=10)[0]])
    xd.set_value(xs)
    late = np.array([29, 0, 25, 1, 2, 3, 4])
    np.testing.assert_allclose(fns.single(xd, batch=late), xs[late].mean(axis=0), rtol=1e-12)
    assert checked == [7, 5, slice(1, 20, 3), slice(1, 20, 3), 7]  # of 14 calls that ran (two more raised)


@pytest.mark.parametrize("op", ["avg", "sum", "max"])
def test_combining_refuses_parts_of_different_shapes_and_returns_a_lone_part_as_it_is(op):
    from synkhronos.reduce_ops import combine

    parts, weights = [np.arange(3.0) * (r + 1) for r in range(4)], [1.0, 2.0, 3.0, 4.0]
    expected = {"avg": sum(p * w for p, w in zip(parts, weights)) / sum(weights), "sum": sum(parts),
                "max": np.max(parts, axis=0)}[op]
    np.testing.assert_allclose(combine(op, parts, weights), expected, rtol=1e-12)
    with pytest.raises(ValueError, match=r"output 2 \(op .*different shapes.*\[\(2,\), \(3,\)\]"):
        combine(op, [np.zeros(2), np.zeros(3)], [1.0, 2.0], what="output 2")
    with pytest.raises(ValueError, match="different shapes"):
        combine(op, [np.zeros(()), np.zeros(1)], [1.0, 1.0])
    lone = np.arange(3.0)
    assert combine(op, [np.zeros(5), lone, np.ones(7)], [0.0, 2.0, 0.0]) is lone  # parts of weight 0: unread
    with pytest.raises(ValueError, match="no part computed"):
        combine(op, [lone, lone], [0.0, 0.0])


def _plan_fields(plan):
    return (plan.fid, plan.num_slices, plan.batch_kind, plan.batch_start, list(plan.data_ids), plan.subset,
            plan.positions.tolist(), plan.bs_kind, None if plan.bs is None else plan.bs.tolist(), plan.index_did)


def test_a_worker_decodes_each_plan_as_encoded_and_shares_a_plan_seen_before_read_only():
    from synkhronos import calls

    size = 3
    scratch = np.full(64, -5, dtype=np.int64)  # leftovers of earlier plans beyond a plan's slots
    short = calls.CallPlan(fid=2, num_slices=1, batch_kind=0, batch_start=5, data_ids=[7, 8], subset=(1, 0),
                           positions=calls.normalise_positions(10, size))
    long = calls.CallPlan(fid=3, num_slices=2, batch_kind=1, batch_start=0, data_ids=[7, 8, 9], subset=None,
                          positions=calls.normalise_positions(11, size), bs_kind=1,
                          bs=np.array([[0, 4, 1], [calls.NONE, 9, 2], [1, calls.NONE, calls.NONE]]), index_did=4)
    decoded = {}
    for name, plan in [("short", short), ("long", long), ("short", short)]:
        calls.encode(plan, scratch, size)
        got = calls.decode(scratch, size)
        assert _plan_fields(got) == _plan_fields(plan)
        if name in decoded:  # seen before: the same plan object, whatever the slots beyond it hold
            assert got is decoded[name]
        decoded[name] = got
    assert decoded["short"] is not decoded["long"]
    for arr in (decoded["long"].positions, decoded["long"].bs):
        with pytest.raises(ValueError, match="read-only"):
            arr[0, 0] = 1
