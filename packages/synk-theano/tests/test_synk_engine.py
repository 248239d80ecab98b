"""The JAX engine (``synk.fork(..., engine="jax")``): every call one program over the ranks, the
ranks joined by JAX's multi-process runtime, here on JAX's CPU devices (gloo collectives) in 2 and
3 worker processes.  References are numpy (how rows split, how parts combine) and plain PyTensor.

Needs JAX (skipped without it): in CI, the 3.12 run of ``nox -s tests`` that installs it.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

pytest.importorskip("jax")

from synk_engine_ops import RankSum, Stall
from synk_testutil import TIMEOUT, USE_GPU, assert_no_workers_left, combine, own_entries, parts

import synkhronos as synk
from synk_comm import WorkerError
from synkhronos import ops
from synkhronos.runtime import current

pytestmark = [pytest.mark.timeout(TIMEOUT),
              pytest.mark.filterwarnings("ignore:Numba will use object mode:UserWarning"),
              pytest.mark.skipif(USE_GPU, reason="forks use_gpu=False whatever SYNK_TEST_GPU says: it runs in the "
                                                 "CPU-mode pass (GPU mode's pass runs the whole suite on the engine)")]

PER_RANK = "runs as per-rank programs"


def fork_engine(n: int) -> int:
    return synk.fork(n, use_gpu=False, engine="jax")


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def engine(request):
    """A group of ``request.param`` engine workers for the module (forked again by a test that
    breaks it); yields the number of ranks."""
    n = fork_engine(request.param)
    assert current().engine is not None and current().size == n and current().group.size == n + 1
    yield n
    synk.close()
    assert_no_workers_left()


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def per_rank_logged(caplog) -> bool:
    return PER_RANK in caplog.text


# --- outputs and updates -------------------------------------------------------------------------

def test_every_reduce_op_equals_numpy_in_one_program(engine, rng, caplog):
    n = engine
    x = pt.matrix("x")
    ops = ["avg", "sum", "max", "min", "prod", None]
    f = synk.function([x], outputs=[(x.sum(axis=0), "avg"), (x.sum(), "sum"), (x.max(axis=0), "max"),
                                    (x.min(), "min"), (1 + 0.01 * x.sum(axis=0), "prod"), (x * 2, None),
                                    (x.shape[0], "avg"), (pt.mean(x), None)])
    xd = rng.standard_normal((4 * n, 3))
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        got = f(synk.data(xd))
    assert not per_rank_logged(caplog)
    ps = parts(xd, n)
    w = [len(p) for p in ps]
    refs = [combine(op, [v for v in vals], w) for op, vals in zip(
        ops, [[p.sum(axis=0) for p in ps], [p.sum() for p in ps], [p.max(axis=0) for p in ps],
              [p.min() for p in ps], [1 + 0.01 * p.sum(axis=0) for p in ps], [p * 2 for p in ps]])]
    for g, r in zip(got[:6], refs):
        np.testing.assert_allclose(g, r, rtol=1e-12)
    assert got[6] == pytest.approx(4.0) and got[6].dtype == np.float64  # an integer avg is a float mean
    np.testing.assert_allclose(got[7], [p.mean() for p in ps])  # 0-d values gather to shape (n,)


def test_updates_apply_locally_in_each_rank(engine, rng):
    n = engine
    x = pt.matrix("x")
    w = pytensor.shared(np.zeros(3), name="w")
    count = pytensor.shared(np.int64(0), name="count")  # a 0-d shared variable
    f = synk.function([x], outputs=(x.sum(), "sum"), updates=[(w, w + x.sum(axis=0)), (count, count + 1)])
    xd = rng.standard_normal((2 * n, 3))
    for _ in range(2):
        f(synk.data(xd))
    for r, p in enumerate(parts(xd, n)):
        np.testing.assert_allclose(synk.get_value(r, w), 2 * p.sum(axis=0), rtol=1e-12)
        assert int(synk.get_value(r, count)) == 2
    np.testing.assert_allclose(w.get_value(), 2 * parts(xd, n)[0].sum(axis=0))  # the master reads rank 0's
    w.set_value(np.ones(3))  # compute rank 0's value (the master's, in the seed's terms)
    f(synk.data(xd))
    for r, p in enumerate(parts(xd, n)):
        start = 1 if r == 0 else 2 * p.sum(axis=0)
        np.testing.assert_allclose(synk.get_value(r, w), start + p.sum(axis=0), rtol=1e-12)


def test_output_subset_givens_and_bcast_inputs(engine, rng, caplog):
    n = engine
    x, y = pt.matrix("x"), pt.vector("y")
    scale = pytensor.shared(np.float64(3.0), name="scale")
    z = pt.scalar("z")
    f = synk.function([x], bcast_inputs=[y], outputs=[(x.dot(y), None), ((x * z).sum(), "sum"), (x.max(), "max")],
                      givens=[(z, scale)])
    xd, yd = rng.standard_normal((3 * n, 4)), rng.standard_normal(4)
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        full = f(synk.data(xd), synk.data(yd))
        sub = f(synk.data(xd), synk.data(yd), output_subset=[2, 0])
    assert not per_rank_logged(caplog)
    np.testing.assert_allclose(full[0], xd.dot(yd), rtol=1e-12)
    assert full[1] == pytest.approx(3 * xd.sum())
    assert sub[0] == pytest.approx(xd.max())
    np.testing.assert_allclose(sub[1], xd.dot(yd), rtol=1e-12)


def test_batch_indices_slices_and_counts(engine, rng, caplog):
    n = engine
    x = pt.matrix("x")
    f = synk.function([x], outputs=[(x, None), (x.sum(), "sum")])
    xd = rng.standard_normal((10 * n, 2))
    d = synk.data(xd)
    index = rng.permutation(len(xd))[:4 * n]
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        for batch, rows in [(index, xd[index]), (2 * n, xd[:2 * n]), (slice(n, 5 * n), xd[n:5 * n]),
                            (slice(0, 8 * n, 2), xd[0:8 * n:2])]:
            got = f(d, batch=batch)
            np.testing.assert_allclose(got[0], rows, rtol=1e-12)
            assert got[1] == pytest.approx(rows.sum())
    assert not per_rank_logged(caplog)


# --- what runs per rank, still right ---------------------------------------------------------------

@pytest.mark.parametrize("extra", [1, -1], ids=["one-more", "zero-row-rank"])
def test_uneven_shares_run_in_the_program_and_equal_numpy(engine, rng, caplog, extra):
    """Uneven shares (2n+1 rows; or n-1 rows: one rank has none) run in one program, each rank's
    branch on exactly its rows: a mean over the rows, an output whose length follows the rows,
    an integer avg, a 0-d gather and the updates are those of numpy's split."""
    n = engine
    x = pt.matrix("x")
    w = pytensor.shared(np.zeros(3), name="w")
    steps = pytensor.shared(np.int64(0), name="steps")
    outputs = [(x.mean(axis=0), "avg"), (pt.exp(x).sum(), "sum"), (x.max(axis=0), "max"), (x.min(), "min"),
               (1 + 0.01 * x.sum(axis=0), "prod"), (x * 2, None), (x.shape[0], "avg"), (x.mean(), None),
               (x[:-1], None)]
    f = synk.function([x], outputs=outputs, updates=[(w, w + x.mean(axis=0)), (steps, steps + 1)])
    rows = 2 * n + 1 if extra == 1 else n - 1
    xd = rng.standard_normal((rows, 3))
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        got = f(synk.data(xd))
    assert not per_rank_logged(caplog)
    ps = parts(xd, n)
    ps_all, ps = ps, [p for p in ps if len(p)]  # combine leaves ranks without rows out
    wt = [len(p) for p in ps]
    refs = [combine("avg", [p.mean(axis=0) for p in ps], wt), combine("sum", [np.exp(p).sum() for p in ps], wt),
            combine("max", [p.max(axis=0) for p in ps], wt), combine("min", [p.min() for p in ps], wt),
            combine("prod", [1 + 0.01 * p.sum(axis=0) for p in ps], wt), xd * 2,
            combine("avg", [float(len(p)) for p in ps], wt), combine(None, [p.mean() for p in ps], wt),
            combine(None, [p[:-1] for p in ps], wt)]
    for i, (g, r) in enumerate(zip(got, refs)):
        np.testing.assert_allclose(g, r, rtol=1e-12, err_msg=f"output {i}")
    np.testing.assert_allclose(refs[0], xd.mean(axis=0), rtol=1e-12)  # the weighted avg is the single-process mean
    for r, p in enumerate(ps_all):  # a rank without rows keeps its values (it computed nothing)
        np.testing.assert_allclose(synk.get_value(r, w), p.mean(axis=0) if len(p) else np.zeros(3), rtol=1e-12)
        assert int(synk.get_value(r, steps)) == (1 if len(p) else 0)
        synk.set_value(r, w, np.zeros(3))
        synk.set_value(r, steps, np.int64(0))
    sub = f(synk.data(xd), output_subset=[5, 0])
    np.testing.assert_allclose(sub[0], xd * 2, rtol=1e-12)
    np.testing.assert_allclose(sub[1], refs[0], rtol=1e-12)


def test_uneven_shares_give_plain_pytensors_full_batch_loss_and_gradient(engine, rng, caplog):
    """A mean loss and its gradient, declared avg: weighted by rows they are plain PyTensor's on the
    whole batch, however the rows split; each rank's update uses its own gradient."""
    n = engine
    x, y = pt.matrix("x"), pt.matrix("y")
    w0 = rng.standard_normal((3, 2))
    w = pytensor.shared(w0.copy(), name="w")
    loss = pt.mean((pt.tanh(x.dot(w)) - y) ** 2)
    grad = pytensor.grad(loss, w)
    f = synk.function([x, y], outputs=[(loss, "avg"), (grad, "avg")], updates=[(w, w - 0.1 * grad)])
    plain = pytensor.function([x, y], [loss, grad])
    local = pytensor.function([x, y], grad, givens=[(w, pytensor.shared(w0))])
    for rows in (2 * n + 1, 3 * n - 1):
        for r in range(n):
            synk.set_value(r, w, w0)
        xd, yd = rng.standard_normal((rows, 3)), rng.standard_normal((rows, 2))
        with caplog.at_level(logging.INFO, logger="synkhronos"):
            got = f(synk.data(xd), synk.data(yd))
        for g, want in zip(got, plain(xd, yd)):
            np.testing.assert_allclose(g, want, rtol=1e-10)
        for r, (px, py) in enumerate(zip(parts(xd, n), parts(yd, n))):
            np.testing.assert_allclose(synk.get_value(r, w), w0 - 0.1 * local(px, py), rtol=1e-10)
    assert not per_rank_logged(caplog)


def test_num_slices_and_batch_s_run_per_rank_and_are_right(engine, rng, caplog):
    n = engine
    x = pt.matrix("x")
    f = synk.function([x], outputs=[(x.sum(axis=0), "avg"), (x, None)])
    xd = rng.standard_normal((4 * n, 3))
    got = f(synk.data(xd), num_slices=2)
    np.testing.assert_allclose(got[0], xd.sum(axis=0) / (2 * n), rtol=1e-12)  # avg of the 2n slices' sums
    np.testing.assert_allclose(got[1], xd, rtol=1e-12)
    s = pytensor.shared(np.zeros((4, 2)), name="s")
    g = synk.function([], outputs=(s.sum(), "sum"), sliceable_shareds=[s])
    sd = np.arange(8.0).reshape(4, 2)
    s.set_value(sd)
    assert g(batch_s=slice(1, 3)) == pytest.approx(n * sd[1:3].sum())


def test_batch_s_windows_of_sliceable_shareds_run_in_the_program(engine, rng, caplog):
    n = engine
    s = pytensor.shared(np.zeros((1, 2)), name="s")
    w = pytensor.shared(np.zeros(2), name="w")
    x = pt.matrix("x")
    f = synk.function([], outputs=[(s.sum(axis=0), "sum"), (s, None)], updates=[(w, w + s.sum(axis=0))],
                      sliceable_shareds=[s])
    g = synk.function([x], outputs=(x.dot(s.T).sum(), "sum"), sliceable_shareds=[s])
    values = rng.standard_normal((6 * n, 2))
    synk.scatter(s, synk.data(values))
    ps = parts(values, n)
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        got = f(batch_s=slice(1, 4))
        per_rank_rows = [slice(r % 3, r % 3 + 2) for r in range(n)]
        got2 = f(batch_s=per_rank_rows)
        xd = rng.standard_normal((3 * n, 2))
        got3 = g(synk.data(xd), batch_s=slice(2, 5))
    assert not per_rank_logged(caplog)
    np.testing.assert_allclose(got[0], sum(p[1:4].sum(axis=0) for p in ps), rtol=1e-12)
    np.testing.assert_allclose(got[1], np.concatenate([p[1:4] for p in ps]), rtol=1e-12)
    np.testing.assert_allclose(got2[1], np.concatenate([p[sel] for p, sel in zip(ps, per_rank_rows)]), rtol=1e-12)
    for r, (p, sel) in enumerate(zip(ps, per_rank_rows)):
        np.testing.assert_allclose(synk.get_value(r, w), p[1:4].sum(axis=0) + p[sel].sum(axis=0), rtol=1e-12)
    xs = parts(xd, n)
    assert got3 == pytest.approx(sum(xp.dot(p[2:5].T).sum() for xp, p in zip(xs, ps)))
    with caplog.at_level(logging.INFO, logger="synkhronos"):  # past the rows: per rank, Python's slicing
        got = f(batch_s=slice(4, 9))
    assert "beyond the rows" in caplog.text
    np.testing.assert_allclose(got[1], np.concatenate([p[4:9] for p in ps]), rtol=1e-12)
    synk.scatter(s, synk.data(values[:6 * n - 1]))  # one rank holds a row less
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        got = f(batch_s=slice(0, 2))
    assert "different shapes" in caplog.text
    np.testing.assert_allclose(got[1], np.concatenate([p[0:2] for p in parts(values[:6 * n - 1], n)]), rtol=1e-12)


def test_sliceable_shapes_are_compared_again_only_when_they_may_have_changed(engine, rng, monkeypatch, caplog):
    """The ranks compare their sliceable variables' shapes (a collective with the master) at a plan's
    first call; a call of the same plan skips it while only calls that ran as one program and kept
    every shape came in between.  A command in between (scatter) or a program whose update reshapes
    a variable makes the next call compare again, so a window that no longer fits is found."""
    from synkhronos.engine import master as engine_master

    n = engine
    checks = []
    real = engine_master.fit_reason
    monkeypatch.setattr(engine_master, "fit_reason", lambda *a: checks.append(1) or real(*a))
    s = pytensor.shared(np.zeros((1, 2)), name="s")
    f = synk.function([], outputs=(s, None), sliceable_shareds=[s])
    other = synk.function([], outputs=(s.sum(), "sum"))  # a program call in between keeps the shapes
    drop_first = synk.function([], updates=[(s, s[1:])])  # every rank's s loses its first row
    values = rng.standard_normal((6 * n, 2))
    synk.scatter(s, synk.data(values))
    ps = parts(values, n)
    for _ in range(3):
        np.testing.assert_allclose(f(batch_s=slice(2, 6)), np.concatenate([p[2:6] for p in ps]), rtol=1e-12)
        other()
    assert len(checks) == 1
    synk.scatter(s, synk.data(values[::-1].copy()))
    ps = parts(values[::-1], n)
    np.testing.assert_allclose(f(batch_s=slice(2, 6)), np.concatenate([p[2:6] for p in ps]), rtol=1e-12)
    assert len(checks) == 2
    drop_first()
    with caplog.at_level(logging.INFO, logger="synkhronos"):  # 5 rows now: per rank, Python's slicing
        got = f(batch_s=slice(2, 6))
    assert len(checks) == 3 and "beyond the rows" in caplog.text
    np.testing.assert_allclose(got, np.concatenate([p[3:6] for p in ps]), rtol=1e-12)


# --- in-graph collectives through synk_axis --------------------------------------------------------

def test_a_psum_op_gives_the_full_batch_gradient(engine, rng):
    n = engine
    x, y = pt.matrix("x"), pt.matrix("y")
    w0 = rng.standard_normal((3, 2))
    w = pytensor.shared(w0.copy(), name="w")
    batch = 4 * n
    loss_local = pt.sum((x.dot(w) - y) ** 2)
    grad = RankSum()(pytensor.grad(loss_local, w)) / batch
    f = synk.function([x, y], outputs=(RankSum()(loss_local) / batch, "avg"), updates=[(w, w - 0.1 * grad)])
    xd, yd = rng.standard_normal((batch, 3)), rng.standard_normal((batch, 2))
    loss = f(synk.data(xd), synk.data(yd))
    full_grad = 2 * xd.T.dot(xd.dot(w0) - yd) / batch
    assert loss == pytest.approx(np.sum((xd.dot(w0) - yd) ** 2) / batch)
    for r in range(n):
        np.testing.assert_allclose(synk.get_value(r, w), w0 - 0.1 * full_grad, rtol=1e-10)


def test_a_graph_with_collectives_refuses_to_run_per_rank(engine, rng, caplog):
    """An Op of one's own marked ``synk_collective``: uneven shares run in the one program (its
    translation runs between the branches: until issue 17's segments, NotOneProgramError);
    num_slices, which would need per-rank programs, is refused before any rank acts."""
    n = engine
    x = pt.matrix("x")
    f = synk.function([x], outputs=(RankSum()(x.sum()), "avg"))
    xd = rng.standard_normal((2 * n + 1, 2))
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        assert f(synk.data(xd)) == pytest.approx(xd.sum())
    assert not per_rank_logged(caplog)
    with pytest.raises(ValueError, match=r"in-graph collectives.*num_slices=1"):
        f(synk.data(xd), num_slices=2)
    assert f(synk.data(xd[:2 * n])) == pytest.approx(xd[:2 * n].sum())  # the group is still usable


UNEVEN = pytest.mark.parametrize("extra", [1, -1], ids=["one-more", "zero-row-rank"])


def uneven_rows(n: int, extra: int) -> int:
    """2n+1 rows over n ranks (one rank a row more), or n-1 (the last rank without rows)."""
    return 2 * n + 1 if extra == 1 else n - 1


@UNEVEN
def test_uneven_collectives_in_segments_equal_numpy(engine, rng, caplog, extra):
    """Uneven shares through collectives of depth 1 and 2, in one program: values computed on the
    rows after a collective (two segments both reading the rows), a shape (``x.shape[0]``) read
    after one, all_gather and broadcast (the root without rows: its sum of no rows, zeros), and an
    update that every rank applies, the rank without rows included (as in CPU mode)."""
    n = engine
    x = pt.matrix("x")
    acc = pytensor.shared(np.zeros(3), name="acc")
    m = x.mean(axis=0)
    mu = ops.all_reduce(m, "avg")  # depth 1: segment 1 reads the rows again
    centered = x - mu
    rows = ops.all_reduce(pt.cast(x.shape[0], "float64"), "sum")
    var = ops.all_reduce((centered ** 2).sum(axis=0), "sum") / rows  # depth 2
    z = centered / pt.sqrt(var)
    top = ops.all_reduce(x.sum(), "max")
    outputs = [(mu, "max"), (var, "min"), (z, None), ((z ** 2).sum(), "sum"),
               (ops.all_gather(x.sum(axis=0)[None]), "max"), (ops.broadcast(x.sum(axis=0), root=n - 1), "min"),
               (pt.ones((x.shape[0], 1)) * top, None), (ops.all_reduce(m, "min"), "max"),
               (ops.all_reduce(x.sum(axis=0), "prod"), "max")]
    f = synk.function([x], outputs=outputs, updates=[(acc, acc + mu)])
    xd = rng.standard_normal((uneven_rows(n, extra), 3))
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        got = f(synk.data(xd))
    assert not per_rank_logged(caplog)
    ps = parts(xd, n)
    kept = [p for p in ps if len(p)]
    mean = xd.mean(axis=0)
    variance = ((xd - mean) ** 2).mean(axis=0)
    with np.errstate(invalid="ignore"):  # one row (2 ranks, one without rows): a variance of 0, z is NaN
        zs = (xd - mean) / np.sqrt(variance)
    refs = [mean, variance, zs, (zs ** 2).sum(), np.stack([p.sum(axis=0) for p in kept]), ps[n - 1].sum(axis=0),
            np.full((len(xd), 1), max(p.sum() for p in kept)), np.min([p.mean(axis=0) for p in kept], axis=0),
            np.prod([p.sum(axis=0) for p in kept], axis=0)]
    for i, (g, r) in enumerate(zip(got, refs)):
        np.testing.assert_allclose(g, r, rtol=1e-10, err_msg=f"output {i}")
    for r in range(n):  # every rank, the one without rows included, applied the same update
        np.testing.assert_allclose(synk.get_value(r, acc), mean, rtol=1e-12)
        synk.set_value(r, acc, np.zeros(3))


@UNEVEN
def test_uneven_gradients_through_collectives_equal_numpy(engine, rng, extra):
    """``d/dx`` of ``sum(c * all_reduce(m, "avg")) + sum(all_gather(m[None]) ** 2)``, ``m`` each
    rank's mean of tanh of its rows: numpy's, over the ranks with rows (a rank without rows puts
    in nothing and gets an empty gradient)."""
    n = engine
    x = pt.matrix("x")
    c = np.array([1.0, -2.0, 0.5])
    m = pt.mean(pt.tanh(x), axis=0)
    cost = pt.sum(c * ops.all_reduce(m, "avg")) + pt.sum(ops.all_gather(m[None]) ** 2)
    f = synk.function([x], outputs=(pytensor.grad(cost, x), None))
    xd = rng.uniform(0.2, 1.2, (uneven_rows(n, extra), 3))
    got = f(synk.data(xd))
    split = [p for p in parts(xd, n) if len(p)]
    active, total = len(split), len(xd)
    expected = [active * (c * len(p) / total + 2 * np.tanh(p).mean(axis=0)) * (1 - np.tanh(p) ** 2) / len(p)
                for p in split]
    np.testing.assert_allclose(got, np.concatenate(expected), rtol=1e-10)


@UNEVEN
def test_uneven_all_gather_of_rows_and_its_gradient_equal_numpy(engine, rng, extra):
    """``all_gather`` of each rank's rows (blocks of other lengths, along either axis) in rank
    order, and the gradient of ``sum(all_gather(tanh(x)) ** 2)``: each rank's block of the sum
    over the ranks with rows."""
    n = engine
    x = pt.matrix("x")
    gathered = ops.all_gather(pt.tanh(x))
    f = synk.function([x], outputs=[(gathered, "max"), (ops.all_gather(x.T, axis=1), "min"),
                                    (pytensor.grad(pt.sum(gathered ** 2), x), None)])
    xd = rng.standard_normal((uneven_rows(n, extra), 3))
    rows, cols, grad = f(synk.data(xd))
    np.testing.assert_allclose(rows, np.tanh(xd), rtol=1e-12)
    np.testing.assert_array_equal(cols, xd.T)
    active = sum(len(p) > 0 for p in parts(xd, n))
    np.testing.assert_allclose(grad, active * 2 * np.tanh(xd) * (1 - np.tanh(xd) ** 2), rtol=1e-12)


EMPTY_OPERAND = re.compile(r"stablehlo\.(all_gather|all_reduce|all_to_all|collective_permute|reduce_scatter)\b"
                           r".*:\s*\((?:[^)]*\b)?tensor<(?:\d+x)*0x")
"""A collective whose operand has a zero dimension, in a lowered program's text."""


@pytest.mark.parametrize("gathered", [False, True], ids=["reduced-only", "with-gather"])
def test_uneven_program_sends_no_empty_collective(gathered):
    """An uneven program sends no collective of an empty array: XLA's GPU compiler crashed (SIGSEGV,
    found on 2 H100s) on the all-gather of the gathered outputs' lengths when there were none.
    The uneven body of a one-device mesh, lowered; without gathered outputs its last result is a
    constant."""
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from synkhronos.engine.program import AXIS, _output_form, _shard_map, _uneven_body, funcify
    from synkhronos.engine.segments import Segment

    x = pt.matrix("x", dtype="float32")
    outputs = [x.sum(axis=1).mean(), *([x.sum(axis=1)] if gathered else [])]
    ops_ = ["avg", *(["gather"] if gathered else [])]
    fgraph = pytensor.function([x], outputs, mode="JAX").maker.fgraph
    dtypes = [np.dtype(v.type.dtype) for v in fgraph.outputs]
    forms = [_output_form(op, dt) for op, dt in zip(ops_, dtypes)]
    stages = [Segment(list(fgraph.inputs), list(fgraph.outputs), funcify(fgraph))]
    body = _uneven_body(fgraph, stages, (2, 3), (), 1, [], forms, dtypes, [])
    mesh = Mesh(np.array(jax.devices()[:1]), (AXIS,))
    program = jax.jit(_shard_map()(body, mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                                   out_specs=(P(),) * (len(outputs) + 1), check_vma=False))
    text = program.lower(np.ones((3, 4), np.float32), np.array([1], np.int32)).as_text()
    assert not EMPTY_OPERAND.search(text), [line for line in text.splitlines() if EMPTY_OPERAND.search(line)]
    assert ("stablehlo.all_gather" in text) == gathered  # the lengths travel only where outputs are gathered
    got = program(np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1], np.int32))
    np.testing.assert_allclose(got[0], np.arange(12.0).reshape(3, 4).sum(1).mean(), rtol=1e-6)


@pytest.mark.parametrize("cols", [0, 2], ids=["empty", "not-empty"])
def test_no_collective_of_an_empty_operand_is_sent(cols):
    """Output reductions and in-graph collectives of an empty value send no collective (zeros of the
    result's shape instead: XLA's GPU compiler crashes on a collective of an empty operand); of a
    value that is not empty, they do.  Lowered over a one-device mesh."""
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P
    from pytensor.link.jax.dispatch import jax_funcify

    from synkhronos.engine.program import AXIS, STACKED, _reduce, _shard_map

    x = pt.matrix("x", dtype="float32")
    nodes = [ops.all_reduce(x, "sum").owner, ops.all_gather(x, axis=1).owner, ops.broadcast(x).owner]
    fns = [jax_funcify(node.op, node=node, synk_axis=AXIS) for node in nodes]
    f32 = np.dtype("float32")

    def body(v):
        return (*(fn(v) for fn in fns), *(_reduce(v, form, f32) for form in ("sum", "avg", "max", "gather", STACKED)))

    mesh = Mesh(np.array(jax.devices()[:1]), (AXIS,))
    program = jax.jit(_shard_map()(body, mesh=mesh, in_specs=P(), out_specs=(P(),) * 8, check_vma=False))
    value = np.arange(3 * cols, dtype=np.float32).reshape(3, cols)
    text = program.lower(value).as_text()
    assert bool(EMPTY_OPERAND.search(text)) is False
    assert ("stablehlo.all_reduce" in text) == (cols > 0)
    got = program(value)
    want = [value, value, value, value, value, value, value, value[None]]
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_empty_outputs_and_collectives_in_a_call_equal_numpy(engine, rng, caplog):
    n = engine
    x = pt.matrix("x")
    none = x[:, :0]  # every rank's rows, no columns
    f = synk.function([x], outputs=[(none * 2, None), (ops.all_reduce(none, "sum").sum(axis=0), "sum"),
                                    (x.sum(), "sum")])
    xd = rng.standard_normal((4 * n, 3))
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        got = f(synk.data(xd))
    assert not per_rank_logged(caplog)
    assert got[0].shape == (4 * n, 0) and got[1].shape == (0,)
    assert got[2] == pytest.approx(xd.sum())


def test_uneven_collective_of_rows_says_what_to_do(engine, rng):
    """A collective of a value whose shape follows the rows (other than all_gather) cannot run on
    uneven shares: every rank says so (and what to do); even shares run, and the group stays
    usable."""
    n = engine
    x = pt.matrix("x")
    f = synk.function([x], outputs=(ops.all_reduce(x * 2, "sum"), "max"))
    with pytest.raises(WorkerError, match=r"follows the rows.*split the rows evenly"):
        f(synk.data(rng.standard_normal((2 * n + 1, 2))))
    xd = rng.standard_normal((2 * n, 2))
    np.testing.assert_allclose(f(synk.data(xd)), 2 * sum(parts(xd, n)), rtol=1e-12)


def test_collectives_on_shared_variables_and_chain(engine, rng):
    """Programs over the ranks (engine.collectives); a chain runs its three operations one by one."""
    n = engine
    w = pytensor.shared(np.zeros(3), name="w")
    f = synk.function([], outputs=(w.sum(), "sum"))
    values = rng.standard_normal((3 * n, 3))
    parts_ = parts(values, n)
    for r, p in enumerate(parts_):
        synk.set_value(r, w, p.sum(axis=0))
    np.testing.assert_allclose(synk.gather(w), np.stack([p.sum(axis=0) for p in parts_]))
    assert f() == pytest.approx(values.sum())
    synk.all_reduce(w, op="avg")
    np.testing.assert_allclose(synk.gather(w), np.tile(values.sum(axis=0) / n, (n, 1)), rtol=1e-12)
    w.set_value(np.ones(3))  # compute rank 0's only, as the master's in the seed
    assert f() == pytest.approx(3 + (n - 1) * values.sum() / n)
    synk.broadcast(w)
    assert f() == pytest.approx(3 * n)
    m = pytensor.shared(np.zeros((1, 2)), name="m")
    synk.function([], outputs=m.sum())
    synk.scatter(m, synk.data(np.arange(4.0 * n).reshape(2 * n, 2)))
    assert synk.get_lengths(m) == [2] * n
    np.testing.assert_allclose(synk.reduce(m, op="sum", in_place=False), np.arange(4.0 * n).reshape(n, 2, 2).sum(0))
    step = synk.chain(f, all_reduce=w, op="sum", then=synk.function([], updates=[(w, w * 2)]))
    assert step() == pytest.approx(3 * n)  # first's output, before the all-reduce
    np.testing.assert_allclose(synk.gather(w), np.full((n, 3), 2.0 * n))


def test_collectives_run_as_programs_and_equal_numpy(engine, rng):
    """Every op and dtype of all_reduce / reduce, broadcast over ranks of other shapes, all_gather of
    uneven lengths, scatter and set_value from Data (read by the workers) and numpy."""
    n = engine
    f = pytensor.shared(np.zeros(3), name="f")
    i = pytensor.shared(np.zeros(3, dtype="int32"), name="i")
    b = pytensor.shared(np.zeros(3, dtype=bool), name="b")
    m = pytensor.shared(np.zeros((1, 2)), name="m")
    synk.function([], outputs=f.sum() + i.sum() + b.sum() + m.sum())
    fs = rng.standard_normal((n, 3))
    is_ = rng.integers(-5, 5, (n, 3)).astype("int32")
    bs = rng.random((n, 3)) < 0.5

    def set_all():
        for r in range(n):
            synk.set_value(r, [f, i, b], [fs[r], is_[r], bs[r]])

    for op, ufunc in [("sum", np.add), ("prod", np.multiply), ("max", np.maximum), ("min", np.minimum)]:
        set_all()
        got = synk.reduce([f, i, b], op=op, in_place=False)
        for g, vals in zip(got, [fs, is_, bs]):
            np.testing.assert_allclose(g, ufunc.reduce(vals, axis=0).astype(vals.dtype), rtol=1e-12)
            assert g.dtype == vals.dtype
        synk.all_reduce([f, i, b], op=op)
        for var, vals in zip([f, i, b], [fs, is_, bs]):
            want = np.tile(ufunc.reduce(vals, axis=0).astype(vals.dtype), (n, 1))
            np.testing.assert_allclose(synk.gather(var), want, rtol=1e-12)
    set_all()
    synk.all_reduce(f, op="avg")
    np.testing.assert_allclose(synk.gather(f), np.tile(fs.mean(axis=0), (n, 1)), rtol=1e-12)
    set_all()
    synk.reduce(f, op="max")  # in place: compute rank 0 only
    np.testing.assert_allclose(synk.gather(f), np.vstack([fs.max(axis=0), fs[1:]]), rtol=1e-12)
    with pytest.raises(TypeError, match="avg"):
        synk.all_reduce(i, op="avg")
    rows = rng.standard_normal((2 * n + 1, 2))  # uneven: one rank a row more than the others
    synk.scatter(m, synk.data(rows))
    assert synk.get_lengths(m) == [len(p) for p in parts(rows, n)]
    assert synk.get_shapes(m) == [p.shape for p in parts(rows, n)]
    with pytest.raises(ValueError, match="same shape"):
        synk.all_reduce(m, op="sum")
    synk.all_gather(m)
    np.testing.assert_allclose(synk.gather(m, nd_up=0), np.concatenate([rows] * n), rtol=1e-12)
    synk.scatter(m, rows, batch=[0, 2, 4])  # numpy values and indices
    np.testing.assert_allclose(synk.gather(m, nd_up=0), rows[[0, 2, 4]], rtol=1e-12)
    synk.set_value(n - 1, m, synk.data(rows), batch=slice(1, 3))
    np.testing.assert_allclose(synk.get_value(n - 1, m), rows[1:3], rtol=1e-12)
    synk.set_value(0, m, np.ones((4, 2)))
    synk.broadcast(m)  # rank 0's value, whatever the others held
    np.testing.assert_allclose(synk.gather(m), np.ones((n, 4, 2)))
    synk.broadcast([f, b], values=[synk.data(fs[0]), bs[1]])
    np.testing.assert_allclose(synk.gather(f), np.tile(fs[0], (n, 1)))
    np.testing.assert_array_equal(synk.gather(b), np.tile(bs[1], (n, 1)))


def test_values_stay_readable_after_close(engine, rng):
    n = engine
    x = pt.matrix("x")
    w = pytensor.shared(np.zeros(2), name="w")
    f = synk.function([x], updates=[(w, w + x.sum(axis=0))])
    xd = rng.standard_normal((2 * n, 2))
    f(synk.data(xd))
    synk.close()  # reads compute rank 0's values first
    np.testing.assert_allclose(w.get_value(), parts(xd, n)[0].sum(axis=0), rtol=1e-12)
    fork_engine(n)


# --- failure ---------------------------------------------------------------------------------------

def _check_group_gone(prefix: str) -> None:
    synk.close()
    assert_no_workers_left()
    assert own_entries(prefix) == []


def _works(n: int) -> None:
    x = pt.vector("x")
    f = synk.function([x], outputs=(x.sum(), "sum"))
    assert f(synk.data(np.arange(2.0 * n))) == pytest.approx(np.arange(2.0 * n).sum())


def test_a_worker_killed_during_a_call_fails_it_quickly_and_fork_works_again(engine):
    n = engine
    x = pt.vector("x")
    f = synk.function([x], outputs=(RankSum()(Stall(3.0)(x).sum()), "sum"))
    group = current().group
    victim = group._procs[n]  # the last compute rank (group rank n)
    killed: list[float] = []

    def kill() -> None:
        os.kill(victim.pid, signal.SIGKILL)
        killed.append(time.monotonic())

    timer = threading.Timer(1.0, kill)
    timer.start()
    with pytest.raises(synk.WorkerDiedError, match="died"):
        f(synk.data(np.ones(2 * n)))
    timer.join()
    assert time.monotonic() - killed[0] < 5
    _check_group_gone(group.prefix)
    fork_engine(n)
    _works(n)


def test_a_worker_raising_alone_inside_a_program_fails_the_call_quickly(engine):
    n = engine
    x = pt.vector("x")
    f = synk.function([x], outputs=(RankSum()(Stall(0.0, fail_rank=n - 1)(x).sum()), "avg"))
    group = current().group
    assert f(synk.data(np.ones(2 * n))) == pytest.approx(2 * n)  # compiled; every rank fine
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerError, match="fails on purpose"):
        f(synk.data(-np.ones(2 * n)))
    assert time.monotonic() - t0 < 5  # the ranks stuck in the all-reduce with it are stopped
    _check_group_gone(group.prefix)
    fork_engine(n)
    _works(n)


def test_a_worker_killed_between_calls_fails_the_next_call(engine):
    n = engine
    group = current().group
    os.kill(group._procs[1].pid, signal.SIGKILL)  # compute rank 0: it hosts JAX's coordination service
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError):
        _works(n)
    assert time.monotonic() - t0 < 5
    _check_group_gone(group.prefix)
    fork_engine(n)
    _works(n)


def test_scalars_integers_booleans_and_no_outputs(engine, rng, caplog):
    n = engine
    k = pt.lvector("k")
    c = pt.scalar("c", dtype="float32")
    count = pytensor.shared(np.float32(0.0), name="count")
    f = synk.function([k], bcast_inputs=[c], outputs=[(k.sum(), "sum"), (k > 3, None), ((k > 3).any(), "max"),
                                                      ((k > 3).all(), "min"), (k.max(), "avg"), (k * c, "prod")])
    g = synk.function([k], updates=[(count, count + k.sum().astype("float32"))])
    kd = rng.integers(0, 7, 2 * n).astype("int64")
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        got = f(synk.data(kd), synk.data(np.array(0.5, dtype="float32")))
        assert g(synk.data(kd)) is None
    assert not per_rank_logged(caplog)
    ps = parts(kd, n)
    assert got[0] == kd.sum() and got[0].dtype == np.int64
    np.testing.assert_array_equal(got[1], kd > 3)
    assert bool(got[2]) == any(bool((p > 3).any()) for p in ps)
    assert bool(got[3]) == all(bool((p > 3).all()) for p in ps)
    assert got[4] == pytest.approx(np.mean([p.max() for p in ps]))
    np.testing.assert_allclose(got[5], np.prod([p * 0.5 for p in ps], axis=0), rtol=1e-6)
    for r, p in enumerate(ps):
        assert float(synk.get_value(r, count)) == pytest.approx(p.sum())
