"""``make_train_function(precision="bf16")`` on a CNN with batch norm and Adam, in a group of 2 CPU ranks (JAX
backend): the convolutions and products take bfloat16 operands, while parameters, Adam's moments, the step
counter and batch norm's running statistics stay float32 and the step stays close to the strict float32 one
(reference: the same step under ``precision="highest"``)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

import pytensor
import pytensor.tensor as pt
from lasagne_testutil import forked_group

import synkhronos as synk
from synk_lasagne import layers, make_train_function, nonlinearities, objectives, updates
from synk_lasagne.random import set_rng
from synkhronos.runtime import current

RTOL = 2e-2


@pytest.fixture(scope="module")
def group():
    """A group of 2 CPU ranks that compile with JAX (the policy needs it), for the module."""
    with forked_group(2) as n:
        if getattr(current().device, "backend", "jax") != "jax":
            pytest.skip("CPU ranks compile with PyTensor's default mode here (SYNK_CPU_BACKEND or a mode in "
                        "PYTENSOR_FLAGS): a precision policy needs JAX")
        yield n


def _train(policy: str, xv: np.ndarray, yv: np.ndarray, steps: int = 2):
    with pytensor.config.change_flags(floatX="float32"):  # float32 parameters, as a float32 user's
        return _build_and_train(policy, xv, yv, steps)


def _build_and_train(policy: str, xv: np.ndarray, yv: np.ndarray, steps: int):
    set_rng(np.random.RandomState(5))
    x, y = pt.tensor4("x", dtype="float32"), pt.ivector("y")
    net = layers.InputLayer((None, 1, 8, 8))
    net = layers.batch_norm(layers.Conv2DLayer(net, 4, 3, pad="same", nonlinearity=nonlinearities.rectify))
    net = layers.DenseLayer(net, 3, nonlinearity=nonlinearities.softmax)
    loss = objectives.aggregate(objectives.categorical_crossentropy(layers.get_output(net, x), y))
    params = layers.get_all_params(net, trainable=True)
    train = make_train_function(loss, params, [x, y], updates.adam, precision=policy,
                                learning_rate=np.float32(1e-2))
    xd, yd = synk.data(xv), synk.data(yv)
    losses = [float(train(xd, yd)) for _ in range(steps)]
    state = [v for v in layers.get_all_params(net) if v not in params]  # batch norm's running statistics
    return train, losses, [v.get_value() for v in [*params, *train.state, *state]]


def test_bf16_step_keeps_state_float32_and_stays_close(group):
    rng = np.random.default_rng(6)
    xv = rng.standard_normal((10, 1, 8, 8)).astype(np.float32)
    yv = rng.integers(0, 3, 10).astype(np.int32)
    train, losses, values = _train("bf16", xv, yv)
    assert train.precision == "bf16" and train.function.precision == "bf16"
    strict, want_losses, want_values = _train("highest", xv, yv)
    assert strict.precision == "highest"
    assert len(values) == len(want_values) > 6  # W, b, beta, gamma, Adam's moments and step, running stats
    for got, want in zip(values, want_values):
        assert got.dtype == want.dtype
        if want.dtype.kind == "f":
            assert got.dtype == np.float32
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    assert losses[0] != want_losses[0]  # the policy is in effect from the first step
    conv_w, want_w = values[0], want_values[0]
    np.testing.assert_allclose(conv_w, want_w, rtol=RTOL, atol=RTOL * float(np.abs(want_w).max()))


def _dense_step(all_reduce_dtype: str | None, precision: str, xv: np.ndarray, yv: np.ndarray, steps: int = 3):
    """A dense net's momentum step in the group, its gradient all-reduced in ``all_reduce_dtype``."""
    with pytensor.config.change_flags(floatX="float32"):
        set_rng(np.random.RandomState(9))
        x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
        net = layers.DenseLayer(layers.InputLayer((None, 16)), 32, nonlinearity=nonlinearities.tanh)
        net = layers.DenseLayer(net, 5, nonlinearity=nonlinearities.softmax)
        loss = objectives.aggregate(objectives.categorical_crossentropy(layers.get_output(net, x), y))
        params = layers.get_all_params(net, trainable=True)
        train = make_train_function(loss, params, [x, y], updates.momentum, precision=precision,
                                    all_reduce_dtype=all_reduce_dtype, learning_rate=np.float32(0.5),
                                    momentum=np.float32(0.9))
        xd, yd = synk.data(xv), synk.data(yv)
        losses = [float(train(xd, yd)) for _ in range(steps)]
        return losses, [v.get_value() for v in [*params, *train.state]]


def test_bfloat16_gradient_all_reduce_stays_close_to_float32(group):
    """The gradient exchanged in bfloat16 (with bfloat16 activations: the policy keeps the explicit
    conversions of the all-reduce): the first loss (before any update) equal, the parameters and the
    velocities float32, close to the float32 all-reduce's and not equal to them."""
    policy = "bf16"
    rng = np.random.default_rng(10)
    xv = rng.standard_normal((12, 16)).astype(np.float32)
    yv = rng.integers(0, 5, 12).astype(np.int32)
    losses, values = _dense_step("bfloat16", policy, xv, yv)
    want_losses, want_values = _dense_step(None, policy, xv, yv)
    assert losses[0] == want_losses[0]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-2)
    assert len(values) > 4  # W, b of each layer and the velocities
    for got, want in zip(values, want_values):
        assert got.dtype == want.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(np.abs(want).max()))
    assert not np.array_equal(values[0], want_values[0])  # the all-reduce really was in bfloat16
