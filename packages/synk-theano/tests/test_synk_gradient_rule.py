"""The gradient rule of in-graph collectives (see "Gradients" in :mod:`synkhronos.ops`), against
numpy on even and uneven shares: both forms -- each rank differentiates its own loss and the
gradient is all-reduced; or ``pytensor.grad`` of the all-reduced loss (JAX's check_vma rule) --
give every rank the full-batch gradient, and training with them keeps the ranks equal; a gradient
through ``all_reduce`` of a non-scalar that reads shared variables, from a cost equal on every
rank, is refused at build time (``DivergentGradientError``); in a plain PyTensor function the ops
stay the identity."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos import ops

FLOAT = pytensor.config.floatX
TOL = 1e-4 if FLOAT == "float32" else 1e-10


def _problem(rows: int):
    rng = np.random.default_rng(rows)
    xs, ys = rng.normal(size=(rows, 3)), rng.normal(size=rows)
    w0 = np.array([0.5, -1.0, 2.0])
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(w0.astype(FLOAT), name="w")
    return xs, ys, w0, x, y, w


@pytest.mark.parametrize("rows", [24, 25], ids=["even", "uneven"])
def test_allreduced_local_gradients_are_the_full_batch_gradient(ranks, rows):
    xs, ys, w0, x, y, w = _problem(rows)
    sse = pt.sum((x.dot(w) - y) ** 2)  # this rank's rows
    mean = pt.mean((x.dot(w) - y) ** 2)
    g_sum = ops.all_reduce(pytensor.grad(sse, w), "sum")
    g_avg = ops.all_reduce(pytensor.grad(mean, w), "avg")
    f = synk.function([x, y], outputs=[(g_sum, "max"), (g_avg, "max"), (g_sum, "min")])
    got_sum, got_avg, low = f(synk.data(xs.astype(FLOAT)), synk.data(ys.astype(FLOAT)))
    full = 2 * xs.T @ (xs @ w0 - ys)  # numpy: d/dw of the sum over every row
    np.testing.assert_allclose(got_sum, full, rtol=TOL)
    np.testing.assert_allclose(got_avg, full / rows, rtol=TOL)
    assert np.array_equal(got_sum, low)  # the same on every rank (max == min over the ranks)


@pytest.mark.parametrize("rows", [24, 25], ids=["even", "uneven"])
def test_gradient_of_the_allreduced_loss_is_the_full_batch_gradient(ranks, rows):
    xs, ys, w0, x, y, w = _problem(rows)
    total = ops.all_reduce(pt.sum((x.dot(w) - y) ** 2), "sum")
    mean = ops.all_reduce(pt.mean((x.dot(w) - y) ** 2), "avg")
    g_sum, g_avg = pytensor.grad(total, w), pytensor.grad(mean, w)
    f = synk.function([x, y], outputs=[(g_sum, "max"), (g_sum, "min"), (g_avg, "max"), (mean, "max")],
                      updates=[(w, w - 0.01 * g_avg)])
    got_sum, low, got_avg, got_mean = f(synk.data(xs.astype(FLOAT)), synk.data(ys.astype(FLOAT)))
    full = 2 * xs.T @ (xs @ w0 - ys)
    np.testing.assert_allclose(got_sum, full, rtol=TOL)
    assert np.array_equal(got_sum, low)  # the same on every rank
    np.testing.assert_allclose(got_avg, full / rows, rtol=TOL)
    np.testing.assert_allclose(got_mean, np.mean((xs @ w0 - ys) ** 2), rtol=TOL)
    after = [synk.get_value(r, w) for r in range(ranks)]
    assert all(np.array_equal(a, after[0]) for a in after)
    np.testing.assert_allclose(after[0], w0 - 0.01 * full / rows, rtol=TOL)


def test_gradient_through_allreduce_of_a_vector_reading_shared_is_refused(ranks):
    _, _, _, x, y, w = _problem(6)
    moments = ops.all_reduce(x.T.dot(x.dot(w) - y), "sum")  # a vector: no exact form
    g = pytensor.grad(pt.sum(moments ** 2), w)
    with pytest.raises(synk.DivergentGradientError, match=r"ops.all_reduce\(pytensor.grad\(loss_local, w\)"):
        synk.function([x, y], outputs=pt.sum(moments), updates=[(w, w - 0.1 * g)])
    with pytest.raises(synk.DivergentGradientError):
        synk.function([x, y], outputs=(g, "avg"))
    # a cost that differs between ranks (sync-batch-norm style) differentiates through all_reduce exactly
    stat = ops.all_reduce(pt.sum(x, axis=0), "sum")
    synk.function([x], outputs=pytensor.grad(pt.sum(x.dot(stat)), stat))


def test_plain_pytensor_keeps_the_identity():
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(np.ones(3, dtype=FLOAT))
    loss = ops.all_reduce(pt.sum((x.dot(w) - y) ** 2), "sum")
    f = pytensor.function([x, y], pytensor.grad(loss, w))
    xs, ys = np.eye(3, dtype=FLOAT), np.zeros(3, dtype=FLOAT)
    np.testing.assert_allclose(f(xs, ys), 2 * xs.T @ (xs @ np.ones(3) - ys), rtol=TOL)
