"""synk_lasagne's PReLU, RReLU, InverseLayer and ExpressionLayer(output_shape="auto") (one process)
against numpy, with one gradient each where there is a parameter."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import FAST

from synk_lasagne import layers, nonlinearities
from synk_lasagne.layers.base import get_state_updates


def test_prelu_per_channel_values_and_gradient():
    x = np.random.default_rng(0).normal(size=(4, 3, 2, 2))
    l_in = layers.InputLayer((None, 3, 2, 2))
    layer = layers.ParametricRectifierLayer(l_in, alpha=np.array([0.1, 0.2, 0.3]))
    out = layers.get_output(layer)
    f = pytensor.function([l_in.input_var], [out, pytensor.grad(pt.sum(out), layer.alpha)], **FAST)
    got, grad = f(x)
    alpha = np.array([0.1, 0.2, 0.3])[None, :, None, None]
    np.testing.assert_allclose(got, np.where(x > 0, x, alpha * x))
    np.testing.assert_allclose(grad, np.minimum(x, 0).sum(axis=(0, 2, 3)))  # d/d alpha_c = sum of the negatives
    assert layers.ParametricRectifierLayer(l_in, shared_axes="all").alpha.get_value().shape == ()
    with pytest.raises(ValueError, match="not shared"):
        layers.ParametricRectifierLayer(l_in, shared_axes=(1, 2, 3))


def test_prelu_and_rrelu_replace_the_nonlinearity():
    dense = layers.DenseLayer(layers.InputLayer((None, 3)), 4, nonlinearity=nonlinearities.rectify)
    assert isinstance(layers.prelu(dense), layers.ParametricRectifierLayer)
    assert dense.nonlinearity is nonlinearities.identity
    assert isinstance(layers.rrelu(dense, lower=0.1, upper=0.2), layers.RandomizedRectifierLayer)


def test_rrelu_slopes_draws_and_determinism():
    x = -np.ones((50, 3, 2))
    l_in = layers.InputLayer((None, 3, 2))
    layer = layers.RandomizedRectifierLayer(l_in, lower=0.2, upper=0.4)
    out = layers.get_output(layer)
    f = pytensor.function([l_in.input_var], out, updates=get_state_updates(out), **FAST)
    first, second = f(x), f(x)
    slopes = -first
    assert slopes.min() >= 0.2 and slopes.max() <= 0.4
    assert np.allclose(slopes.var(axis=(0, 2)), 0)  # one slope per channel (shared over axes 0 and 2)
    assert not np.allclose(first, second)  # a new draw each call: the generator's update applies
    deterministic = layers.get_output(layer, deterministic=True)
    np.testing.assert_allclose(pytensor.function([l_in.input_var], deterministic, **FAST)(x), -0.3 * np.ones_like(x))
    np.testing.assert_allclose(pytensor.function([l_in.input_var], out, **FAST)(-x), -x)  # positives pass
    with pytest.raises(ValueError, match="lower <= upper"):
        layers.RandomizedRectifierLayer(l_in, lower=0.5, upper=0.1)


def test_inverse_layer_of_dense_and_of_max_pooling():
    x = np.random.default_rng(1).normal(size=(5, 6))
    l_in = layers.InputLayer((None, 6))
    dense = layers.DenseLayer(l_in, 3, b=None, nonlinearity=None)
    inverse = layers.InverseLayer(dense, dense)
    assert inverse.output_shape == (None, 6)
    W = dense.W.get_value()
    np.testing.assert_allclose(pytensor.function([l_in.input_var], layers.get_output(inverse), **FAST)(x),
                               x @ W @ W.T)
    images = np.random.default_rng(2).normal(size=(1, 1, 4, 4))
    l_img = layers.InputLayer((None, 1, 4, 4))
    pool = layers.MaxPool2DLayer(l_img, 2)
    unpooled = pytensor.function([l_img.input_var], layers.get_output(layers.InverseLayer(pool, pool)), **FAST)(images)
    windows = images.reshape(2, 2, 2, 2).transpose(0, 2, 1, 3).reshape(4, 4)
    expected = np.zeros((4, 4))
    for w, (r, c) in enumerate([(0, 0), (0, 2), (2, 0), (2, 2)]):
        i = windows[w].argmax()
        expected[r + i // 2, c + i % 2] = windows[w].max()
    np.testing.assert_allclose(unpooled[0, 0], expected)


@pytest.mark.parametrize("function,expected", [(lambda x: x ** 2, (1, None, None, 5)),
                                               (lambda x: x.mean(-1), (1, None, None)),
                                               (lambda x: x.sum(), ())])
def test_expression_layer_auto_shape(function, expected):
    layer = layers.ExpressionLayer(layers.InputLayer((1, None, None, 5)), function, output_shape="auto")
    assert layer.output_shape == expected
    assert layer.get_output_shape_for((2, 3, 4, 5)) == np.shape(function(np.zeros((2, 3, 4, 5))))


def test_merge_layers_crop_inputs_to_a_common_length():
    a, b = np.arange(5 * 3.0).reshape(5, 3), np.arange(4 * 6.0).reshape(4, 6)
    l_a, l_b = layers.InputLayer((None, 3)), layers.InputLayer((None, 6))
    maximum = layers.ElemwiseMergeLayer([l_a, l_b], pt.maximum, cropping=["center", "upper"])
    concat = layers.ConcatLayer([l_a, l_b], axis=1, cropping=["lower", "lower"])
    total = layers.ElemwiseSumLayer([l_a, l_b], coeffs=[2, -1], cropping=["lower", "lower"])
    assert maximum.output_shape == (None, 3) and concat.output_shape == (None, 9)
    f = pytensor.function([l_a.input_var, l_b.input_var], layers.get_output([maximum, concat, total]), **FAST)
    got_max, got_concat, got_total = f(a, b)
    np.testing.assert_array_equal(got_max, np.maximum(a[0:4], b[:, 3:]))  # rows: (5 - 4) // 2 = 0 onwards
    np.testing.assert_array_equal(got_concat, np.concatenate([a[:4], b[:4]], axis=1))
    np.testing.assert_array_equal(got_total, 2 * a[:4, :3] - b[:4, :3])
    assert layers.autocrop_array_shapes([(None, 3), (4, 6)], ["lower", "upper"]) == [(None, 3), (None, 3)]
    with pytest.raises(ValueError, match="unknown cropping"):
        layers.autocrop_array_shapes([(1, 2), (3, 4)], ["middle"])


def test_dropout_variants_share_their_masks():
    x = np.ones((50, 4, 3, 3))
    l_in = layers.InputLayer((None, 4, 3, 3))
    channels = layers.get_output(layers.dropout_channels(l_in, p=0.5))
    locations = layers.get_output(layers.dropout_locations(l_in, p=0.5))
    by_channel, by_location = pytensor.function([l_in.input_var], [channels, locations], **FAST)(x)
    assert np.all(by_channel.var(axis=(2, 3)) == 0) and by_channel.var() > 0  # whole maps kept or dropped
    assert np.all(by_location.var(axis=1) == 0) and by_location.var() > 0  # whole positions
    assert set(np.unique(by_channel)) <= {0.0, 2.0}


def test_reshape_layer_symbolic_lengths_and_size_checks():
    x = pt.tensor3("x")
    batch, steps, _ = x.shape
    l_in = layers.InputLayer((None, None, 4))
    layer = layers.ReshapeLayer(l_in, (batch * steps, [2]))
    assert layer.output_shape == (None, 4)
    values = np.arange(2 * 3 * 4.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(layers.get_output(layer, x).eval({x: values}), values.reshape(6, 4))
    assert layers.ReshapeLayer(layers.InputLayer((5, None, 2)), (-1, [1], [1])).output_shape == (None, None, None)
    with pytest.raises(ValueError, match="does not match"):
        layers.ReshapeLayer(layers.InputLayer((5, None, 2)), (3, [1], -1))


def numpy_affine_sample(images, theta, out_rows, out_cols):
    """Bilinear sampling of each image at theta @ [x, y, 1] over an output grid in [-1, 1]^2."""
    return numpy_sample(images, lambda b, gx, gy: theta[b].reshape(2, 3) @ np.array([gx, gy, 1.0]), out_rows, out_cols)


def numpy_sample(images, where, out_rows, out_cols):
    """Bilinear sampling of each image b at where(b, x, y) for each point of an output grid in
    [-1, 1]^2 (positions outside clipped to the border pixels)."""
    batch, channels, rows, cols = images.shape
    out = np.zeros((batch, channels, out_rows, out_cols))
    for b in range(batch):
        for i, gy in enumerate(np.linspace(-1, 1, out_rows)):
            for j, gx in enumerate(np.linspace(-1, 1, out_cols)):
                sx, sy = where(b, gx, gy)
                x, y = (sx + 1) / 2 * (cols - 1), (sy + 1) / 2 * (rows - 1)
                x0, y0 = np.floor(x), np.floor(y)
                value = 0
                for xi, wx in ((x0, x0 + 1 - x), (x0 + 1, x - x0)):
                    for yi, wy in ((y0, y0 + 1 - y), (y0 + 1, y - y0)):
                        r, c = int(np.clip(yi, 0, rows - 1)), int(np.clip(xi, 0, cols - 1))
                        value = value + wx * wy * images[b, :, r, c]
                out[b, :, i, j] = value
    return out


def test_transformer_layer_matches_numpy_bilinear_sampling():
    rng = np.random.default_rng(4)
    images = rng.normal(size=(2, 2, 5, 6))
    theta = np.array([[0.83, 0.27, 0.11, -0.19, 1.07, 0.04], [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]])  # no pixel edges
    l_in, l_loc = layers.InputLayer((None, 2, 5, 6)), layers.InputLayer((None, 6))
    layer = layers.TransformerLayer(l_in, l_loc, downsample_factor=(1.25, 1.5))
    assert layer.output_shape == (None, 2, 4, 4)
    out = layers.get_output(layer)
    f = pytensor.function([l_in.input_var, l_loc.input_var], [out, pytensor.grad(pt.sum(out), l_loc.input_var)],
                          **FAST)
    got, grad = f(images, theta)
    np.testing.assert_allclose(got, numpy_affine_sample(images, theta, 4, 4), atol=1e-10)
    eps, shifted = 1e-6, theta.copy()
    shifted[0, 2] += eps  # a horizontal shift: the gradient is the image's slope along x
    numeric = (numpy_affine_sample(images, shifted, 4, 4)[0].sum() - numpy_affine_sample(images, theta, 4, 4)[0].sum())
    np.testing.assert_allclose(grad[0, 2], numeric / eps, rtol=1e-4)
    with pytest.raises(ValueError, match="localization network"):
        layers.TransformerLayer(l_in, layers.InputLayer((None, 5)))


def numpy_tps(offsets, side):
    """where(b, x, y) of the thin-plate spline through the grid's control points moved by offsets[b]
    (solved with numpy: f = sum_i w_i U(|p - c_i|) + a0 + a1 x + a2 y, U = r^2 log r^2)."""
    gx, gy = np.meshgrid(np.linspace(-1, 1, side), np.linspace(-1, 1, side))
    c = np.stack([gx.ravel(), gy.ravel()], axis=1)  # (n, 2)
    n = len(c)

    def U(d2):
        return np.where(d2 > 0, d2 * np.log(np.where(d2 > 0, d2, 1)), 0)

    P = np.hstack([np.ones((n, 1)), c])
    system = np.block([[U(((c[:, None] - c[None]) ** 2).sum(-1)), P], [P.T, np.zeros((3, 3))]])

    def where(b, x, y):
        targets = c + offsets[b].reshape(2, n).T
        solution = np.linalg.solve(system, np.vstack([targets, np.zeros((3, 2))]))  # (n + 3, 2)
        basis = np.concatenate([U(((np.array([x, y]) - c) ** 2).sum(-1)), [1, x, y]])
        return basis @ solution
    return where


def test_tps_transformer_matches_a_numpy_spline():
    rng = np.random.default_rng(5)
    images = rng.normal(size=(2, 2, 6, 5))
    offsets = rng.normal(scale=0.2, size=(2, 8))  # 4 control points: a 2 x 2 grid
    l_in, l_loc = layers.InputLayer((None, 2, 6, 5)), layers.InputLayer((None, 8))
    for precompute in (True, False):
        layer = layers.TPSTransformerLayer(l_in, l_loc, control_points=4, precompute_grid=precompute)
        out = layers.get_output(layer)
        f = pytensor.function([l_in.input_var, l_loc.input_var], [out, pytensor.grad(pt.sum(out), l_loc.input_var)],
                              **FAST)
        got, grad = f(images, offsets)
        expected = numpy_sample(images, numpy_tps(offsets, 2), 6, 5)
        np.testing.assert_allclose(got, expected, atol=1e-9)
    shifted = offsets.copy()
    shifted[1, 5] += 1e-6
    numeric = (numpy_sample(images, numpy_tps(shifted, 2), 6, 5)[1].sum() - expected[1].sum()) / 1e-6
    np.testing.assert_allclose(grad[1, 5], numeric, rtol=1e-4)
    identity = f(images, np.zeros_like(offsets))[0]
    np.testing.assert_allclose(identity, images, atol=1e-9)
    with pytest.raises(ValueError, match="square"):
        layers.TPSTransformerLayer(l_in, layers.InputLayer((None, 10)), control_points=5)
