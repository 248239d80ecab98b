"""The gradient rule of in-graph collectives (see "Gradients" in :mod:`synkhronos.ops`): the
established form -- each rank differentiates its own loss, the gradient is all-reduced -- gives
every rank the full-batch gradient (numpy's), on even and uneven shares; the form that
differentiates through ``all_reduce`` of a loss from a cost equal on every rank is refused at
build time (``DivergentGradientError``), and stays the identity in a plain PyTensor function."""

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


def test_gradient_through_allreduce_of_a_loss_is_refused(ranks):
    _, _, _, x, y, w = _problem(6)
    loss = ops.all_reduce(pt.sum((x.dot(w) - y) ** 2), "sum")
    g = pytensor.grad(loss, w)
    with pytest.raises(synk.DivergentGradientError, match=r"ops.all_reduce\(pytensor.grad\(loss_local, w\)"):
        synk.function([x, y], outputs=loss, updates=[(w, w - 0.1 * g)])
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
