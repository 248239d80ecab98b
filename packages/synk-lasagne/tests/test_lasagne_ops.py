"""The convolution and pooling Ops (synk_lasagne.conv, synk_lasagne.pool): values against direct
numpy loops written from the definitions, gradients by finite differences (verify_grad), static
and inferred shapes, and the same answers from the JAX backend as from the default one."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import reference_conv, reference_pool

from synk_lasagne.conv import Conv2D, Conv2DGradInputs, Conv2DGradWeights, conv2d, conv_output_length
from synk_lasagne.pool import Pool2D, pool2d

FAST = "FAST_COMPILE"
CONV_CASES = [
    ({}, 1),
    ({"stride": 2, "pad": "same"}, 1),
    ({"pad": "full", "dilation": 2}, 1),
    ({"pad": (1, 2), "stride": (2, 1), "groups": 2}, 2),
    ({"pad": ((0, 1), (2, 0)), "dilation": (1, 2)}, 1),
]
POOL_CASES = [
    {"ws": 2, "mode": "max"},
    {"ws": 3, "stride": 2, "pad": 1, "mode": "max"},
    {"ws": (2, 3), "stride": (1, 2), "mode": "average_inc_pad"},
    {"ws": 3, "stride": 2, "pad": 1, "mode": "average_inc_pad"},
    {"ws": 3, "stride": 2, "pad": 1, "mode": "average_exc_pad"},
]


def conv_inputs(groups, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(2, 4, 7, 6)), rng.normal(size=(6, 4 // groups, 3, 2))


@pytest.mark.parametrize("kwargs,groups", CONV_CASES, ids=[str(c[0]) for c in CONV_CASES])
def test_conv2d_matches_the_definition(kwargs, groups):
    x_value, w_value = conv_inputs(groups)
    x, w = pt.tensor4("x"), pt.tensor4("w")
    out = conv2d(x, w, **kwargs)
    result = pytensor.function([x, w], out, mode=FAST)(x_value, w_value)
    np.testing.assert_allclose(result, reference_conv(x_value, w_value, **kwargs), rtol=1e-10, atol=1e-12)
    shape = pytensor.function([x, w], out.shape, mode=FAST)(x_value, w_value)  # from infer_shape: no convolution
    assert tuple(shape) == result.shape


@pytest.mark.parametrize("kwargs,groups", CONV_CASES, ids=[str(c[0]) for c in CONV_CASES])
def test_conv2d_gradients_by_finite_differences(kwargs, groups):
    x_value, w_value = conv_inputs(groups, seed=1)
    rng = np.random.default_rng(2)
    pytensor.gradient.verify_grad(lambda x, w: conv2d(x, w, **kwargs), [x_value, w_value], rng=rng, mode=FAST)


def test_conv2d_infers_static_shapes_and_rejects_bad_input():
    x = pt.tensor4("x", shape=(None, 3, 32, 32))
    w = pt.tensor4("w", shape=(8, 3, 5, 5))
    assert conv2d(x, w, stride=2, pad="same").type.shape == (None, 8, 16, 16)
    assert conv2d(x, w).type.shape == (None, 8, 28, 28)
    assert conv_output_length(32, 5, 1, (4, 4)) == 36
    with pytest.raises(ValueError, match="channels"):
        conv2d(x, pt.tensor4("w", shape=(8, 2, 3, 3)))
    with pytest.raises(TypeError, match="4-d"):
        conv2d(pt.matrix("x"), w)
    with pytest.raises(ValueError, match="pad must be one of"):
        conv2d(x, w, pad="half")
    with pytest.raises(ValueError, match="groups"):
        conv2d(x, w, groups=0)


def test_ops_compare_by_parameters_and_pickle():
    import pickle

    op = Conv2D(2, "same", 1, 1)
    assert op == Conv2D((2, 2), "same") and op != Conv2D(1, "same")
    assert Conv2DGradInputs(1) != Conv2DGradWeights(1)
    assert pickle.loads(pickle.dumps(op)) == op
    assert pickle.loads(pickle.dumps(Pool2D(3, 2, 1, "max"))) == Pool2D(3, 2, 1)


@pytest.mark.parametrize("kwargs", POOL_CASES, ids=[str(c) for c in POOL_CASES])
def test_pool2d_matches_the_definition(kwargs):
    x_value = np.random.default_rng(3).normal(size=(2, 3, 7, 8))
    x = pt.tensor4("x")
    out = pool2d(x, **kwargs)
    result = pytensor.function([x], out, mode=FAST)(x_value)
    np.testing.assert_allclose(result, reference_pool(x_value, **kwargs), rtol=1e-12)
    assert tuple(pytensor.function([x], out.shape, mode=FAST)(x_value)) == result.shape


@pytest.mark.parametrize("kwargs", POOL_CASES, ids=[str(c) for c in POOL_CASES])
def test_pool2d_gradients_by_finite_differences(kwargs):
    # distinct values far apart: no ties, no max that a finite-difference step could change
    rng = np.random.default_rng(4)
    x_value = rng.permutation(2 * 2 * 6 * 7).reshape(2, 2, 6, 7) * 0.1
    pytensor.gradient.verify_grad(lambda x: pool2d(x, **kwargs), [x_value], rng=rng, mode=FAST)


def test_pool2d_any_leading_axes_and_bad_input():
    x = pt.tensor3("x")
    value = np.random.default_rng(5).normal(size=(2, 4, 6))
    out = pytensor.function([x], pool2d(x, 2, mode="average_inc_pad"), mode=FAST)(value)
    np.testing.assert_allclose(out, reference_pool(value, 2, mode="average_inc_pad"))
    with pytest.raises(ValueError, match="mode"):
        pool2d(x, 2, mode="sum")
    with pytest.raises(ValueError, match="smaller than pool_size"):
        pool2d(x, 2, pad=2)
    with pytest.raises(TypeError, match="2 or more"):
        pool2d(pt.vector("v"), 2)


def small_cnn_graph():
    """A loss through conv (stride, same pad), max pool, conv (groups, dilation), average pool."""
    x, w1, w2 = pt.tensor4("x"), pt.tensor4("w1"), pt.tensor4("w2")
    h = pt.tanh(conv2d(x, w1, stride=1, pad="same"))
    h = pool2d(h, 3, stride=2, pad=1, mode="max")
    h = pt.tanh(conv2d(h, w2, pad=2, dilation=2, groups=2))
    h = pool2d(h, 2, mode="average_exc_pad", pad=1)
    loss = pt.sum(h ** 2)
    return [x, w1, w2], [loss, *pytensor.grad(loss, [x, w1, w2])]


@pytest.mark.parametrize("default_mode", ["default", FAST])
def test_jax_backend_gives_the_same_values_and_gradients(default_mode):
    pytest.importorskip("jax")
    inputs, outputs = small_cnn_graph()
    rng = np.random.default_rng(6)
    values = [rng.normal(size=(2, 3, 9, 8)), rng.normal(size=(4, 3, 3, 3)), rng.normal(size=(6, 2, 3, 3))]
    kwargs = {} if default_mode == "default" else {"mode": default_mode}
    expected = pytensor.function(inputs, outputs, **kwargs)(*values)
    got = pytensor.function(inputs, outputs, mode="JAX")(*values)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-9, atol=1e-10)


def test_jax_backend_float32():
    """Static image and filter sizes (as InputLayer and the layers give them): PyTensor 3.0's JAX
    backend needs concrete shapes where the gradient allocates (a sum's gradient)."""
    pytest.importorskip("jax")
    x = pt.tensor4("x", dtype="float32", shape=(None, 2, 8, 8))
    w = pt.tensor4("w", dtype="float32", shape=(5, 2, 3, 3))
    out = pool2d(conv2d(x, w, stride=2, pad=1), 2, mode="average_inc_pad")
    grads = pytensor.grad(out.sum(), [x, w])
    rng = np.random.default_rng(7)
    values = [rng.normal(size=(3, 2, 8, 8)).astype("float32"), rng.normal(size=(5, 2, 3, 3)).astype("float32")]
    expected = pytensor.function([x, w], [out, *grads], mode=FAST)(*values)
    jax = pytest.importorskip("jax")
    with jax.default_matmul_precision("highest"):  # strict float32 on GPUs too (TF32 is XLA's default there)
        got = pytensor.function([x, w], [out, *grads], mode="JAX")(*values)
    for e, g in zip(expected, got):
        assert np.asarray(g).dtype == np.float32
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-4, atol=1e-4)
