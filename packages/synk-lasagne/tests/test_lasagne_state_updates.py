"""Layer state as Lasagne advances it (one process, against numpy): a plain ``pytensor.function``
(or ``.eval()``) of a training-mode output advances batch norm's running averages and dropout's
random generator with no updates given, an evaluation-mode output does not, and a function also
given them explicitly (an update rule given the loss, :func:`synk_lasagne.layers.get_state_updates`)
advances them once.

Lasagne's maths: ``running := (1 - alpha) * running + alpha * batch_value`` for the mean and for
``inv_std = 1 / sqrt(var + epsilon)``, the batch statistics over every axis but the second.
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
from lasagne_testutil import FAST, float64_and_seeded  # noqa: F401 - autouse fixture

from synk_lasagne import layers, updates
from synk_lasagne.random import set_rng

ALPHA = 0.25


def batch_statistics(x: np.ndarray, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    axes = (0, *range(2, x.ndim))
    return x.mean(axis=axes), 1 / np.sqrt(x.var(axis=axes) + epsilon)


def advanced(running: tuple[np.ndarray, np.ndarray], x: np.ndarray, epsilon: float) -> tuple[np.ndarray, ...]:
    return tuple((1 - ALPHA) * r + ALPHA * b for r, b in zip(running, batch_statistics(x, epsilon)))


def make_layer(channels: int = 3) -> layers.BatchNormLayer:
    rng = np.random.default_rng(0)
    return layers.BatchNormLayer(layers.InputLayer((None, channels, 2)), alpha=ALPHA,
                                 mean=rng.normal(size=channels), inv_std=rng.uniform(0.5, 1.5, channels))


def values(bn: layers.BatchNormLayer) -> tuple[np.ndarray, np.ndarray]:
    return bn.mean.get_value(), bn.inv_std.get_value()


def assert_values(bn: layers.BatchNormLayer, expected: tuple[np.ndarray, ...]) -> None:
    for got, want in zip(values(bn), expected):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_a_plain_function_of_a_training_output_advances_the_running_averages():
    bn = make_layer()
    rng = np.random.default_rng(1)
    x1, x2 = rng.normal(size=(4, 3, 2)) * 2 + 1, rng.normal(size=(5, 3, 2))
    start = values(bn)
    train = pytensor.function([bn.input_layer.input_var], layers.get_output(bn), **FAST)  # no updates given
    train(x1)
    after_one = advanced(start, x1, bn.epsilon)
    assert_values(bn, after_one)
    train(x2)
    assert_values(bn, advanced(after_one, x2, bn.epsilon))

    now = values(bn)
    evaluate = pytensor.function([bn.input_layer.input_var], layers.get_output(bn, deterministic=True), **FAST)
    mean, inv_std = now
    np.testing.assert_allclose(evaluate(x1), (x1 - mean[:, None]) * inv_std[:, None], rtol=1e-12)
    held = pytensor.function([bn.input_layer.input_var],
                             layers.get_output(bn, batch_norm_update_averages=False), **FAST)
    held(x1)
    assert_values(bn, now)  # evaluation, and a training output told not to, leave them

    layers.get_output(bn, pt.constant(x2)).eval()  # Lasagne's test idiom
    assert_values(bn, advanced(now, x2, bn.epsilon))


def test_explicit_updates_advance_them_once():
    """Given the loss, an update rule holds the state updates as well (our explicit path, which
    a Synkhronos function needs): with the default update of the same graph, one step each."""
    bn = make_layer()
    out = layers.DenseLayer(bn, 1, W=np.ones((6, 1)))
    x_var = bn.input_layer.input_var
    loss = pt.mean(layers.get_output(out) ** 2)
    params = layers.get_all_params(out, trainable=True)
    step = updates.sgd(loss, params, learning_rate=0.0)
    assert bn.mean in step and bn.inv_std in step
    start = values(bn)
    x = np.random.default_rng(2).normal(size=(6, 3, 2))
    pytensor.function([x_var], loss, updates=step, **FAST)(x)
    assert_values(bn, advanced(start, x, bn.epsilon))

    now = values(bn)
    out_bn = layers.get_output(bn)
    pytensor.function([x_var], out_bn, updates=layers.get_state_updates(out_bn), **FAST)(x)
    assert_values(bn, advanced(now, x, bn.epsilon))


def test_use_averages_and_update_them_in_one_graph():
    """``batch_norm_use_averages=True`` with ``batch_norm_update_averages=True``: the output uses
    the averages as they were before the call, which then advance."""
    bn = make_layer()
    x = np.random.default_rng(3).normal(size=(4, 3, 2))
    mean, inv_std = start = values(bn)
    f = pytensor.function([bn.input_layer.input_var],
                          layers.get_output(bn, batch_norm_use_averages=True, batch_norm_update_averages=True),
                          **FAST)
    np.testing.assert_allclose(f(x), (x - mean[:, None]) * inv_std[:, None], rtol=1e-12)
    assert_values(bn, advanced(start, x, bn.epsilon))


def test_dropout_draws_a_new_mask_at_each_call_and_advances_once():
    """Two dropout layers of one seed: the plain function (no updates given) and the function
    given the state updates as well draw the same masks, call after call -- a new one each time."""
    x = np.ones((4, 50))

    def masks(explicit: bool) -> list[np.ndarray]:
        set_rng(np.random.RandomState(5))
        drop = layers.DropoutLayer(layers.InputLayer((None, 50)), p=0.5)
        out = layers.get_output(drop)
        given = layers.get_state_updates(out) if explicit else []
        f = pytensor.function([drop.input_layer.input_var], out, updates=given, **FAST)
        return [f(x) for _ in range(3)]

    plain, explicit = masks(False), masks(True)
    for a, b in zip(plain, explicit):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(plain[0], plain[1]) and not np.array_equal(plain[1], plain[2])
    assert set(np.unique(plain[0])) == {0.0, 2.0}
