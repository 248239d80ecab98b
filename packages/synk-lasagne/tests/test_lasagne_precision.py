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


U_BF16 = 2.0 ** -8
"""bfloat16's unit roundoff: 8 significant bits, round to nearest."""
U_F32 = 2.0 ** -24


def _gamma(n: int) -> float:
    """The bound of a float32 sum of ``n`` terms: ``|fl(sum) - sum| <= gamma_n sum|terms|``."""
    return n * U_F32 / (1 - n * U_F32)


def test_bf16_convolution_and_its_gradients_accumulate_in_float32():
    """The convolution and its two gradients (the backward pass's transposed convolution and the
    weight gradient, a sum over the batch and the image) under ``"bf16"``, each element against a
    bound of its error.

    Each Op is a sum of ``n`` products of its two operands.  Under the policy the operands are rounded
    to bfloat16 (``a~``, ``b~``); their products are exact in float32 (8 + 8 significant bits); the
    sum of float32 terms is within ``gamma_n * A`` of the exact sum ``e = sum a~ b~``, where
    ``A = sum |a~ b~|`` and ``gamma_n = n 2^-24 / (1 - n 2^-24)``; the result, rounded to bfloat16,
    moves by at most ``u |s|`` (``u = 2^-8``).  So ``|y - e| <= u |e| + (1 + u) gamma_n A``, where
    ``e`` and ``A`` are computed in float64 by the Ops' numpy implementation on the rounded operands
    (``A`` is the same Op on their absolute values).  An accumulator in bfloat16 would round every
    partial sum by up to ``u`` of its size: on the weight gradient's ``n = 4096`` terms, ``gamma_n =
    2^-12`` is 16x below ``u``, and the test checks that such a sum of one element's terms breaks the
    bound.
    """
    import jax
    import ml_dtypes
    from pytensor.compile.mode import Mode

    from synk_lasagne.conv import Conv2D, Conv2DGradInputs, Conv2DGradWeights
    from synkhronos import precision

    rng = np.random.default_rng(11)
    x = rng.standard_normal((16, 8, 16, 16)).astype(np.float32)
    w = (rng.standard_normal((8, 8, 3, 3)) / 8).astype(np.float32)
    gz = rng.standard_normal((16, 8, 16, 16)).astype(np.float32)

    def rounded(v):
        return v.astype(ml_dtypes.bfloat16).astype(np.float64)

    xr, wr, gr = rounded(x), rounded(w), rounded(gz)
    cases = {  # op, its float32 inputs, its float64 inputs for e, for A; the terms of each sum
        "forward": (Conv2D(1, "same"), (x, w), (xr, wr), (np.abs(xr), np.abs(wr)), 8 * 9),
        "grad inputs": (Conv2DGradInputs(1, "same"), (x, w, gz), (xr, wr, gr), (xr, np.abs(wr), np.abs(gr)), 8 * 9),
        "grad weights": (Conv2DGradWeights(1, "same"), (x, w, gz), (xr, wr, gr), (np.abs(xr), wr, np.abs(gr)),
                         16 * 16 * 16),
    }
    exact_mode = Mode(linker="py", optimizer="fast_compile")  # the Ops' numpy perform
    for name, (op, f32, f64, absolute, n) in cases.items():
        with jax.enable_x64(False):
            sym = [pt.tensor(dtype="float32", shape=v.shape) for v in f32]
            got = pytensor.function(sym, op(*sym), mode=precision.jax_mode("JAX", "bf16"))(*f32)
            strict = pytensor.function(sym, op(*sym), mode=precision.jax_mode("JAX", "highest"))(*f32)
        sym64 = [pt.tensor(dtype="float64", shape=v.shape) for v in f64]
        exact_fn = pytensor.function(sym64, op(*sym64), mode=exact_mode)
        exact, total = exact_fn(*f64), exact_fn(*absolute)
        bound = U_BF16 * np.abs(exact) + (1 + U_BF16) * _gamma(n) * total
        assert got.dtype == np.float32 and got.shape == exact.shape, name
        excess = np.abs(got - exact) - bound
        assert excess.max() <= 0, f"{name}: {int((excess > 0).sum())} elements beyond the bound, by {excess.max():.3g}"
        assert not np.array_equal(got, strict), name  # the policy is in effect
    # the bound's power: one weight-gradient element summed in bfloat16 breaks it
    xp = np.pad(xr, ((0, 0), (0, 0), (1, 1), (1, 1)))
    terms = (gr[:, 0] * xp[:, 0, :16, :16]).ravel()  # grad_w[0, 0, 0, 0] = sum gz[:, 0] * x_padded[:, 0]
    in_bf16 = float(np.cumsum(terms.astype(ml_dtypes.bfloat16))[-1])
    e, a = terms.sum(), np.abs(terms).sum()
    assert abs(in_bf16 - e) > U_BF16 * abs(e) + (1 + U_BF16) * _gamma(terms.size) * a
