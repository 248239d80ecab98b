"""synk_lasagne.objectives' multiclass hinge loss, column/vector target alignment and SELU's
constants (one process) against numpy."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import FAST

from synk_lasagne import nonlinearities, objectives


def test_multiclass_hinge_loss_and_its_gradient():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(6, 4))
    targets = rng.integers(0, 4, size=6).astype("int32")
    p, t = pt.matrix("p"), pt.ivector("t")
    loss = objectives.multiclass_hinge_loss(p, t, delta=0.5)
    f = pytensor.function([p, t], [loss, pytensor.grad(loss.sum(), p)], **FAST)
    got, grad = f(scores, targets)
    rows = np.arange(6)
    others = np.where(np.eye(4, dtype=bool)[targets], -np.inf, scores)
    expected = np.maximum(0, 0.5 + others.max(axis=1) - scores[rows, targets])
    np.testing.assert_allclose(got, expected)
    expected_grad = np.zeros_like(scores)  # +1 at the best other class, -1 at the target, where the margin is hit
    active = expected > 0
    expected_grad[rows[active], others.argmax(axis=1)[active]] += 1
    expected_grad[rows[active], targets[active]] -= 1
    np.testing.assert_allclose(grad, expected_grad)
    one_hot = np.eye(4)[targets]
    np.testing.assert_allclose(objectives.multiclass_hinge_loss(scores, one_hot, delta=0.5).eval(), expected)
    with pytest.raises(TypeError, match="rank mismatch"):
        objectives.multiclass_hinge_loss(pt.vector(), pt.matrix())


def test_column_predictions_pair_with_vector_targets():
    p, t = pt.vector("p"), pt.vector("t")
    rng = np.random.default_rng(1)
    pv, tv = rng.uniform(0.1, 0.9, size=5), rng.uniform(size=5)
    loss = objectives.binary_crossentropy(p.dimshuffle(0, "x"), t)
    got = pytensor.function([p, t], loss, **FAST)(pv, tv)
    assert got.shape == (5, 1)
    np.testing.assert_allclose(got[:, 0], -tv * np.log(pv) - (1 - tv) * np.log(1 - pv))
    assert objectives.squared_error(p.dimshuffle(0, "x"), t).type.ndim == 2


def test_selu_constants():
    x = np.linspace(-2, 2, 9)
    np.testing.assert_allclose(nonlinearities.SELU()(pt.as_tensor_variable(x)).eval(),
                               np.where(x > 0, x, np.expm1(x)))
    np.testing.assert_allclose(nonlinearities.selu(pt.as_tensor_variable(x)).eval(),
                               1.0507009873554805 * np.where(x > 0, x, 1.6732632423543772 * np.expm1(x)))
    np.testing.assert_array_equal(nonlinearities.rectify(x), np.maximum(x, 0))
