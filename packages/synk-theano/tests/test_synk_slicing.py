"""``batch_s`` on sliceable shared variables and ``num_slices``, in 2 and 3 CPU ranks, against numpy.

Sliceable shared data are scattered with :func:`synkhronos.scatter` (rank ``r`` holds part ``r`` of
``numpy.array_split``); ``batch_s`` then selects rows of each rank's own part.  Under ``num_slices``
each rank computes its rows in ``numpy.array_split`` slices, every slice from the original shared
values, and combines outputs and updates with their ops (avg weighted by rows) before the ranks
combine theirs; updates are applied once.
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from synk_testutil import ON_ENGINE, TIMEOUT, USE_GPU, combine, parts, slices_of

import synkhronos as synk

pytestmark = pytest.mark.timeout(TIMEOUT)

N_ROWS = 11
UPDATE_OPS = ["avg", "sum", "max", "min", "prod"]


class Fns:
    def __init__(self) -> None:
        x = pt.matrix("x", dtype="float64")
        self.S = S = pytensor.shared(np.zeros((1, 2)), name="S")
        self.T = T = pytensor.shared(np.zeros((1, 2)), name="T")
        # outputs of sliceable data only
        self.fs = synk.function([], [pt.mean(S, axis=0), (pt.sum(S, axis=0), "sum"), (pt.max(S, axis=0), "max"),
                                     (S * 2, None), (pt.sum(S), None)], sliceable_shareds=[S])
        # a scattered input and a sliceable shared, sliced together
        self.fxs = synk.function([x], [(x + S, None), pt.mean(x * S)], sliceable_shareds=[S])
        self.two = synk.function([], (pt.sum(S) + pt.sum(T), "sum"), sliceable_shareds=[S, T])
        # outputs of a scattered input only
        self.fx = synk.function([x], [pt.mean(x, axis=0), (pt.sum(x, axis=0), "sum"), (pt.prod(x, axis=0), "prod"),
                                      (pt.max(x, axis=0), "max"), (pt.min(x, axis=0), "min"), (x * 2, None),
                                      (pt.sum(x), None)])
        # one update per op; each depends on the original value and on the slice's rows
        self.acc = {op: pytensor.shared(np.zeros(2), name=f"acc_{op}") for op in UPDATE_OPS}
        a = self.acc
        exprs = {"avg": a["avg"] + pt.mean(x, axis=0), "sum": a["sum"] + pt.sum(x, axis=0),
                 "max": pt.maximum(a["max"], pt.max(x, axis=0)) + 1, "min": pt.minimum(a["min"], pt.min(x, axis=0)) - 1,
                 "prod": a["prod"] * pt.prod(x, axis=0)}
        self.fu = synk.function([x], (pt.sum(x, axis=0), "sum"),
                                updates=[(a[op], exprs[op], op) for op in UPDATE_OPS])
        self.counter = pytensor.shared(np.zeros(2), name="counter")
        self.fcount = synk.function([x], updates=[(self.counter, self.counter + 1)],  # a pair: op avg
                                    on_unused_input="ignore")


@pytest.fixture(scope="module")
def fns(ranks):
    return Fns()


@pytest.fixture(scope="module")
def sdata(fns, ranks):
    """S scattered: N_ROWS rows of known values over the ranks."""
    D = np.random.default_rng(0).uniform(0.5, 1.5, (N_ROWS, 2))
    synk.scatter(fns.S, D)
    assert synk.get_lengths(fns.S) == [len(p) for p in parts(D, ranks)]
    return D


def reference_fs(selected: list[np.ndarray]) -> list[np.ndarray]:
    """numpy: ``Fns.fs`` given each rank's selected rows of S."""
    weights = [len(s) for s in selected]
    return [combine("avg", [s.mean(0) if len(s) else np.zeros(2) for s in selected], weights),
            sum(s.sum(0) for s in selected), np.max(np.concatenate(selected), axis=0),
            np.concatenate(selected) * 2, np.array([s.sum() for s in selected if len(s)])]


def assert_all_close(got, expected) -> None:
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert np.shape(g) == np.shape(e), f"output {i}: shape {np.shape(g)} != {np.shape(e)}"
        np.testing.assert_allclose(g, e, rtol=1e-10, err_msg=f"output {i}")


# --- sliceable shareds without batch_s ---------------------------------------------------------------

@pytest.mark.parametrize("num_slices", [1, 2, 3])
def test_sliceable_shareds_whole_local_rows(fns, sdata, ranks, num_slices):
    """Without batch_s each rank computes on every row it holds; avg weights ranks by those rows."""
    per_rank = parts(sdata, ranks)
    got = fns.fs(num_slices=num_slices)
    expected = reference_fs(per_rank)
    assert_all_close(got[:4], expected[:4])
    np.testing.assert_allclose(got[0], sdata.mean(0), rtol=1e-12)
    # 0-d gather: one value per rank and slice, rank then slice order
    sums = [p[s].sum() for p in per_rank for s in slices_of(len(p), num_slices)]
    np.testing.assert_allclose(got[4], sums, rtol=1e-12)


# --- batch_s forms -------------------------------------------------------------------------------

ONE_FOR_ALL = {
    "slice": slice(1, 3),
    "slice_open": slice(None, 2),
    "slice_negative_start": slice(-2, None),
    "slice_step": slice(0, None, 2),
    "slice_reversed": slice(None, None, -1),
    "slice_negative_step": slice(-1, 0, -2),
    "list": [0, 2],
    "list_repeats_and_negative": [2, 2, -1, 0],
    "array": np.array([1, 0]),
}


@pytest.mark.parametrize("num_slices", [1, 2])
@pytest.mark.parametrize("batch_s", list(ONE_FOR_ALL.values()), ids=list(ONE_FOR_ALL))
def test_batch_s_one_selection_for_all_ranks(fns, sdata, ranks, batch_s, num_slices):
    selected = [p[batch_s] for p in parts(sdata, ranks)]
    assert_all_close(fns.fs(batch_s=batch_s, num_slices=num_slices)[:4], reference_fs(selected)[:4])


def test_batch_s_walks_through_the_rows(fns, sdata, ranks):
    """A training loop's minibatches: 2 rows at every start, then shuffled index batches.  In GPU
    mode the rows are selected inside the compiled function: one form for every start of 2 rows,
    one for every index array."""
    per_rank = parts(sdata, ranks)
    for start in range(min(len(p) for p in per_rank) - 1):
        rows = slice(start, start + 2)
        assert_all_close(fns.fs(batch_s=rows)[:4], reference_fs([p[rows] for p in per_rank])[:4])
    for index in ([2, 0], [1, -1, 1]):  # within the shortest part (3 rows, with 3 ranks)
        assert_all_close(fns.fs(batch_s=index)[:4], reference_fs([p[index] for p in per_rank])[:4])
    if USE_GPU and not ON_ENGINE:  # the master's own share took those forms
        assert {(None, 2), (None, 0)} <= set(fns.fs._replica._selected)



def test_a_repeated_batch_s_slice_reuses_its_plan_and_reads_the_rows_of_now(fns, sdata, ranks):
    """The master keeps the checked plan of a call with one ``batch_s`` slice (a training loop's
    window); windows that alternate, then new rows scattered under the same window, each equal numpy."""
    for data in (sdata, sdata[::-1] * 2):
        synk.scatter(fns.S, data)
        per_rank = parts(data, ranks)
        for rows in (slice(1, 3), slice(0, 2), slice(1, 3), slice(0, None, 2), slice(1, 3)):
            assert_all_close(fns.fs(batch_s=rows)[:4], reference_fs([p[rows] for p in per_rank])[:4])
    assert any(key[2] == (1, 3, None) for key in fns.fs._plans)  # the window's plan was kept
    synk.scatter(fns.S, sdata)  # the module's rows again
@pytest.mark.parametrize("mode", ["FAST_RUN", "JAX"])
def test_row_window_op_matches_numpy(mode):
    """``RowWindow(count)(x, start)`` is ``x[start:start + count]`` in PyTensor's default backend and
    under JAX (where GPU mode compiles it into the function)."""
    if mode == "JAX":
        pytest.importorskip("jax")
    from synkhronos.rows import RowWindow

    x, start = pt.matrix("x", dtype="float64"), pt.iscalar("start")
    f = pytensor.function([x, start], RowWindow(3)(x, start) * 2, mode=mode)
    a = np.arange(24, dtype=np.float64).reshape(12, 2)
    for s0 in (0, 4, 9):
        np.testing.assert_array_equal(np.asarray(f(a, np.int32(s0))), a[s0:s0 + 3] * 2)


def test_row_window_shape_is_inferred_without_the_rows():
    """PyTensor infers the window's shape from the Op (both the 3.0 and the 3.3 signature of
    ``infer_shape``), so the compiled shape graph never computes the window."""
    from synkhronos.rows import RowWindow

    x, start = pt.matrix("x", dtype="float64"), pt.iscalar("start")
    f = pytensor.function([x, start], RowWindow(5)(x, start).shape, mode="FAST_RUN", on_unused_input="ignore")
    assert not any(isinstance(node.op, RowWindow) for node in f.maker.fgraph.apply_nodes)
    np.testing.assert_array_equal(f(np.zeros((12, 7)), np.int32(2)), [5, 7])


def per_rank_slices(n: int) -> list[slice]:
    return [slice(0, 1), slice(None, None, -1), slice(-2, None), slice(1, 3)][:n]


def per_rank_lists(n: int) -> list[list[int]]:
    return [[0], [2, 1, 2], [1, 0, 2, 0]][:n]


def per_rank_one_empty(n: int) -> list[list[int]]:
    return [[0, 3], [], [2]][:n]


@pytest.mark.parametrize("num_slices", [1, 2])
@pytest.mark.parametrize("make", [per_rank_slices, per_rank_lists, per_rank_one_empty],
                         ids=["slices", "lists", "one_rank_empty"])
def test_batch_s_one_selection_per_rank(fns, sdata, ranks, make, num_slices):
    """avg weights each rank by its batch_s rows; a rank that selects nothing is left out."""
    selections = make(ranks)
    selected = [p[s] for p, s in zip(parts(sdata, ranks), selections)]
    got = fns.fs(batch_s=selections, num_slices=num_slices)
    expected = reference_fs(selected)
    assert_all_close(got[:4], expected[:4])
    np.testing.assert_allclose(got[0], np.concatenate(selected).mean(0), rtol=1e-12)


def test_batch_s_per_rank_needs_one_per_rank(fns, sdata, ranks):
    with pytest.raises(TypeError, match="batch_s"):
        fns.fs(batch_s=[slice(0, 1)] * (ranks + 1))
    with pytest.raises(TypeError, match="batch_s"):
        fns.fs(batch_s=[slice(0, 1), [0]] + [[0]] * (ranks - 2))
    with pytest.raises(TypeError, match="batch_s"):
        fns.fs(batch_s=np.zeros((2, 2), dtype=int))
    assert_all_close(fns.fs(batch_s=[0])[:4], reference_fs([p[[0]] for p in parts(sdata, ranks)])[:4])


# --- scattered inputs and sliceable shareds together --------------------------------------------------

@pytest.mark.parametrize("num_slices", [1, 3])
def test_scattered_input_and_sliceable_slice_together(fns, sdata, ranks, num_slices):
    xd = np.arange(N_ROWS * 2, dtype=np.float64).reshape(N_ROWS, 2)
    gathered, mean = fns.fxs(synk.data(xd), num_slices=num_slices)
    np.testing.assert_allclose(gathered, xd + sdata, rtol=1e-12)
    np.testing.assert_allclose(mean, (xd * sdata).mean(), rtol=1e-12)


def test_batch_and_batch_s_together(fns, sdata, ranks):
    """batch picks 2 rows per rank from the whole input; batch_s 2 rows of each rank's S."""
    xd = np.arange(40.0).reshape(20, 2)
    batch = [19, 3, 7, 0, 12, 5][:2 * ranks]
    gathered, _ = fns.fxs(synk.data(xd), batch=batch, batch_s=slice(1, 3), num_slices=2)
    expected = xd[batch] + np.concatenate([p[1:3] for p in parts(sdata, ranks)])
    np.testing.assert_allclose(gathered, expected, rtol=1e-12)


def test_row_counts_that_do_not_match_are_errors(fns, sdata, ranks):
    """Under batch_s or num_slices a rank's scattered rows and sliceable rows must match.  The
    ranks check their own lengths and meet at a barrier before computing: a mismatch in any rank
    is a synk.SelectionError (a ValueError) that names the rank; nothing is computed either way and
    the group stays usable."""
    X = synk.data(np.ones((4 * ranks, 2)))  # 4 rows per rank
    with pytest.raises(ValueError, match="rows"):
        fns.fxs(X, batch_s=slice(0, 3))  # 3 rows of S in every rank
    X = synk.data(np.ones((len(parts(sdata, ranks)[0]) * ranks, 2)))  # the last rank holds one row of S less
    with pytest.raises(synk.SelectionError, match=f"rank {ranks - 1}: .* rows"):
        fns.fxs(X, num_slices=2)
    gathered, _ = fns.fxs(X, batch_s=slice(0, 3), batch=3 * ranks)  # the group is fine
    np.testing.assert_allclose(gathered, 1 + np.concatenate([p[0:3] for p in parts(sdata, ranks)]))


def test_sliceables_of_unequal_length_need_batch_s_to_slice(fns, sdata, ranks):
    synk.scatter(fns.T, np.ones((2 * ranks, 2)))  # 2 rows per rank; S holds 3 or more
    expected = sum(p.sum() for p in parts(sdata, ranks)) + 4 * ranks
    np.testing.assert_allclose(fns.two(), expected)  # one pass over everything: fine
    with pytest.raises(ValueError, match="different lengths"):
        fns.two(num_slices=2)
    got = fns.two(batch_s=slice(0, 2), num_slices=2)
    np.testing.assert_allclose(got, sum(p[:2].sum() for p in parts(sdata, ranks)) + 4 * ranks)


# --- num_slices on scattered inputs ----------------------------------------------------------------

@pytest.mark.parametrize("n_rows, num_slices", [(10, 2), (10, 3), (7, 4), (2, 3), (5, 1)])
def test_num_slices_outputs_equal_single_process(fns, ranks, n_rows, num_slices):
    xd = np.random.default_rng(n_rows).uniform(0.5, 1.5, (n_rows, 3))
    got = fns.fx(synk.data(xd), num_slices=num_slices)
    sums = [p[s].sum() for p in parts(xd, ranks) for s in slices_of(len(p), num_slices)]
    expected = [xd.mean(0), xd.sum(0), xd.prod(0), xd.max(0), xd.min(0), xd * 2, np.array(sums)]
    assert_all_close(got, expected)


def test_num_slices_with_batch(fns, ranks):
    xd = np.random.default_rng(5).uniform(0.5, 1.5, (20, 3))
    batch = np.random.default_rng(6).permutation(20)[:9]
    got = fns.fx(synk.data(xd), batch=batch, num_slices=2)
    np.testing.assert_allclose(got[0], xd[batch].mean(0), rtol=1e-12)
    np.testing.assert_allclose(got[5], xd[batch] * 2, rtol=1e-12)


# --- num_slices with updates --------------------------------------------------------------------

def update_reference(op: str, start: np.ndarray, rows: np.ndarray, num_slices: int) -> np.ndarray:
    """numpy: the new value of ``acc_<op>`` in a rank that holds ``rows``: each slice from ``start``,
    combined with ``op`` (avg weighted by the slice's rows), applied once; no rows: unchanged."""
    if len(rows) == 0:
        return start
    exprs = {"avg": lambda r: start + r.mean(0), "sum": lambda r: start + r.sum(0),
             "max": lambda r: np.maximum(start, r.max(0)) + 1, "min": lambda r: np.minimum(start, r.min(0)) - 1,
             "prod": lambda r: start * r.prod(0)}
    pieces = [rows[s] for s in slices_of(len(rows), num_slices)]
    return combine(op, [exprs[op](p) for p in pieces], [len(p) for p in pieces])


@pytest.mark.parametrize("n_rows, num_slices", [(12, 1), (12, 3), (10, 4), (2, 2)])
def test_updates_under_num_slices_accumulate_with_their_op(fns, ranks, n_rows, num_slices):
    rng = np.random.default_rng(n_rows * 10 + num_slices)
    starts = {op: rng.uniform(0.5, 1.5, 2) for op in UPDATE_OPS}
    for op in UPDATE_OPS:
        synk.broadcast(fns.acc[op], starts[op])
    xd = rng.uniform(0.5, 1.5, (n_rows, 2))
    total = fns.fu(synk.data(xd), num_slices=num_slices)
    np.testing.assert_allclose(total, xd.sum(0), rtol=1e-12)
    assert fns.fu.update_modes == UPDATE_OPS
    for op in UPDATE_OPS:
        expected = np.stack([update_reference(op, starts[op], p, num_slices) for p in parts(xd, ranks)])
        np.testing.assert_allclose(synk.gather(fns.acc[op]), expected, rtol=1e-12, err_msg=f"update op {op}")


def test_updates_are_applied_once_per_call(fns, ranks):
    """``counter := counter + 1`` under 4 slices: +1 per call in every rank that has rows (a pair
    defaults to op avg), not +4."""
    synk.broadcast(fns.counter, np.zeros(2))
    X = synk.data(np.ones((8, 2)))
    fns.fcount(X, num_slices=4)
    fns.fcount(X, num_slices=4)
    assert fns.fcount.update_modes == ["avg"]
    np.testing.assert_array_equal(synk.gather(fns.counter), np.full((ranks, 2), 2.0))
    fns.fcount(synk.data(np.ones((1, 2))), num_slices=2)  # rank 0 alone has a row
    expected = np.full((ranks, 2), 2.0)
    expected[0] = 3
    np.testing.assert_array_equal(synk.gather(fns.counter), expected)


@pytest.mark.cpu_only("PyTensor's JAX backend compiles a copy of a shared random generator (its own warning says "
                      "so): the stream never advances in GPU mode")
def test_a_random_stream_advances_slice_by_slice(ranks):
    """A random generator's update is not combined over slices: it advances after each slice, so
    every slice draws new numbers, and the next call draws new ones again."""
    rng = pytensor.shared(np.random.default_rng(0), name="rng")
    x = pt.matrix("x", dtype="float64")
    next_rng, u = pt.random.uniform(size=x.shape, rng=rng).owner.outputs
    f = synk.function([x], outputs=(x * 0 + u, "gather"), updates=[(rng, next_rng)])
    xd = synk.data(np.zeros((8 * ranks, 1)))
    first = f(xd, num_slices=2)
    assert first.shape == (8 * ranks, 1) and np.all((first >= 0) & (first < 1))
    for r in range(ranks):  # rank r's rows: two slices of 4
        mine = first[8 * r:8 * r + 8, 0]
        assert not np.allclose(mine[:4], mine[4:]), f"rank {r}: both slices drew the same numbers"
    second = f(xd, num_slices=2)
    assert not np.allclose(first, second)
