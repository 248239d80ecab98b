"""synk_lasagne's TransposedConv2DLayer and DilatedConv2DLayer (one process) against numpy: the
transpose as a scatter-add of each input pixel times the filters, the dilated convolution against
the direct loop of lasagne_testutil, and one gradient."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import FAST, reference_conv

from synk_lasagne import layers


def transposed_reference(x, W, stride, crop, flip):
    """Each input pixel (i, j) adds x[:, c, i, j] * K[c, f] at rows i * stride - crop + a (K: W
    flipped unless flip: the transpose of a true convolution)."""
    batch, _, rows, cols = x.shape
    _, filters, kh, kw = W.shape
    K = W if flip else W[:, :, ::-1, ::-1]
    full = np.zeros((batch, filters, (rows - 1) * stride + kh, (cols - 1) * stride + kw))
    for i in range(rows):
        for j in range(cols):
            full[:, :, i * stride:i * stride + kh, j * stride:j * stride + kw] += np.einsum(
                "bc,cfij->bfij", x[:, :, i, j], K)
    return full[:, :, crop:full.shape[2] - crop, crop:full.shape[3] - crop]


@pytest.mark.parametrize("stride,crop,flip", [(1, 0, False), (2, 1, False), (3, 0, True)])
def test_transposed_conv_matches_a_scatter_add(stride, crop, flip):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 4, 5))
    W = rng.normal(size=(3, 2, 3, 3))
    l_in = layers.InputLayer((None, 3, 4, 5))
    layer = layers.TransposedConv2DLayer(l_in, 2, 3, stride=stride, crop=crop, W=W, b=None, nonlinearity=None,
                                         flip_filters=flip)
    out = layers.get_output(layer)
    g = rng.normal(size=transposed_reference(x, W, stride, crop, flip).shape)
    f = pytensor.function([l_in.input_var], [out, pytensor.grad(pt.sum(out * g), layer.W)], **FAST)
    got, grad = f(x)
    expected = transposed_reference(x, W, stride, crop, flip)
    assert got.shape == expected.shape == (2, 2, *layer.output_shape[2:])
    np.testing.assert_allclose(got, expected, atol=1e-10)
    eps, index = 1e-6, (1, 0, 2, 1)
    shifted = W.copy()
    shifted[index] += eps
    numeric = (np.sum(transposed_reference(x, shifted, stride, crop, flip) * g) - np.sum(expected * g)) / eps
    np.testing.assert_allclose(grad[index], numeric, rtol=1e-4)
    assert layers.Deconv2DLayer is layers.TransposedConv2DLayer


def test_dilated_conv_layer():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 3, 9, 8))
    W = rng.normal(size=(3, 4, 3, 2))  # (channels, filters, rows, columns)
    l_in = layers.InputLayer((None, 3, 9, 8))
    layer = layers.DilatedConv2DLayer(l_in, 4, (3, 2), dilation=(2, 3), W=W, b=None, nonlinearity=None)
    got = pytensor.function([l_in.input_var], layers.get_output(layer), **FAST)(x)
    expected = reference_conv(x, W.transpose(1, 0, 2, 3), dilation=(2, 3))
    assert got.shape == expected.shape == (2, *layer.output_shape[1:]) == (2, 4, 5, 5)
    np.testing.assert_allclose(got, expected, atol=1e-10)
    with pytest.raises(NotImplementedError, match="pad"):
        layers.DilatedConv2DLayer(l_in, 4, 3, pad="same")
    with pytest.raises(NotImplementedError, match="flip_filters=False"):
        layers.DilatedConv2DLayer(l_in, 4, 3, flip_filters=True)


def conv3d_reference(x, W, stride, pad):
    """A 3-d cross-correlation as the sum over the filters' depth taps of 2-d ones (reference_conv)."""
    x = np.pad(x, [(0, 0), (0, 0), (pad[0], pad[0]), (0, 0), (0, 0)])
    depth = (x.shape[2] - W.shape[2]) // stride[0] + 1
    return np.stack([sum(reference_conv(x[:, :, d * stride[0] + k], W[:, :, k], stride=stride[1:],
                                        pad=(pad[1], pad[2]) if pad[1] == pad[2] else pad[1])
                         for k in range(W.shape[2])) for d in range(depth)], axis=2)


def test_conv3d_layer_matches_depth_taps_of_2d_convolutions():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 3, 5, 6, 4))
    W = rng.normal(size=(2, 3, 3, 2, 3))
    l_in = layers.InputLayer((None, 3, None, 6, 4))
    layer = layers.Conv3DLayer(l_in, 2, (3, 2, 3), stride=(2, 1, 1), pad=1, W=W, b=None, nonlinearity=None,
                               flip_filters=False)
    assert layer.output_shape == (None, 2, None, 7, 4)
    out = layers.get_output(layer)
    g = rng.normal(size=(2, 2, 3, 7, 4))
    got, grad = pytensor.function([l_in.input_var], [out, pytensor.grad(pt.sum(out * g), layer.W)], **FAST)(x)
    expected = conv3d_reference(x, W, (2, 1, 1), (1, 1, 1))
    np.testing.assert_allclose(got, expected, atol=1e-10)
    eps, index = 1e-6, (1, 2, 0, 1, 2)
    shifted = W.copy()
    shifted[index] += eps
    numeric = (np.sum(conv3d_reference(x, shifted, (2, 1, 1), (1, 1, 1)) * g) - np.sum(expected * g)) / eps
    np.testing.assert_allclose(grad[index], numeric, rtol=1e-4)
    flipped = layers.Conv3DLayer(l_in, 2, (3, 2, 3), pad="valid", W=W[:, :, ::-1, ::-1, ::-1], b=None,
                                 nonlinearity=None)  # flip_filters=True undoes the flip
    np.testing.assert_allclose(layers.get_output(flipped).eval({l_in.input_var: x}),
                               conv3d_reference(x, W, (1, 1, 1), (0, 0, 0)), atol=1e-10)


def test_lasagne_conv_output_length():
    from synk_lasagne.layers.conv import conv_output_length

    for pad, expected in (("valid", 3), (0, 3), ("full", 6), ("same", 5), (2, 5)):
        assert conv_output_length(13, 5, 3, pad) == expected
        reference = layers.Conv2DLayer(layers.InputLayer((None, 1, 13, 13)), 1, 5, stride=3, pad=pad).output_shape
        assert reference[2] == expected
    assert conv_output_length(None, 5, 3, "same") is None
    with pytest.raises(ValueError, match="Invalid pad"):
        conv_output_length(13, 5, 3, "middle")
    with pytest.raises(TypeError, match="iterable of int"):
        layers.Conv2DLayer(layers.InputLayer((None, 1, 4, 4)), 1, 3, pad="middle")


def test_transposed_conv_with_a_symbolic_output_size():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 3, 4, 5))
    W = rng.normal(size=(3, 2, 3, 3))
    size = pytensor.shared(np.array([10, 12]))  # stride 2 reaches 9 x 11: one more row and column
    l_in = layers.InputLayer((None, 3, 4, 5))
    layer = layers.TransposedConv2DLayer(l_in, 2, 3, stride=2, W=W, b=None, nonlinearity=None, output_size=size)
    assert layer.output_shape == (None, 2, None, None)
    got = pytensor.function([l_in.input_var], layers.get_output(layer), **FAST)(x)
    expected = np.zeros((2, 2, 10, 12))
    expected[:, :, :9, :11] = transposed_reference(x, W, 2, 0, False)
    np.testing.assert_allclose(got, expected, atol=1e-10)


def test_conv3d_layer_in_groups():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 4, 3, 4, 4))
    W = rng.normal(size=(6, 2, 2, 3, 3))
    l_in = layers.InputLayer((None, 4, 3, 4, 4))
    layer = layers.Conv3DLayer(l_in, 6, (2, 3, 3), W=W, b=None, nonlinearity=None, flip_filters=False,
                               num_groups=2)
    got = pytensor.function([l_in.input_var], layers.get_output(layer), **FAST)(x)
    expected = np.concatenate([conv3d_reference(x[:, 2 * g:2 * g + 2], W[3 * g:3 * g + 3], (1, 1, 1), (0, 0, 0))
                               for g in range(2)], axis=1)
    assert got.shape == (2, *layer.output_shape[1:])
    np.testing.assert_allclose(got, expected, atol=1e-10)


def test_base_conv_layer_checks_its_settings():
    from synk_lasagne.layers.conv import BaseConvLayer, conv_input_length

    assert [BaseConvLayer((2, 4) + (5,) * n, 4, 3).n for n in (1, 2, 3)] == [1, 2, 3]
    assert BaseConvLayer((2, 4, 9), 6, 3, stride=2, pad="full", num_groups=2).output_shape == (2, 6, 6)
    assert BaseConvLayer((2, 4, 9), 6, 3, num_groups=2).W.get_value().shape == (6, 2, 3)
    with pytest.raises(NotImplementedError):
        BaseConvLayer((2, 4, 9), 1, 3).convolve(pt.tensor3())
    with pytest.raises(ValueError, match="Expected 4 input dimensions"):
        BaseConvLayer((2, 4, 9), 1, 3, n=2)
    with pytest.raises(ValueError, match="evenly divide"):
        BaseConvLayer((2, 3, 9), 1, 3, num_groups=2)
    with pytest.raises(ValueError, match="must be positive"):
        BaseConvLayer((2, 3, 9), 1, 3, num_groups=0)
    for pad in ("valid", 0, 2, "same", "full"):  # the input length of the output length: back where it came from
        out = layers.Conv1DLayer((None, 1, 13), 1, 5, pad=pad).output_shape[2]
        assert conv_input_length(out, 5, 1, pad) == 13
    with pytest.raises(ValueError, match="Invalid pad"):
        conv_input_length(3, 5, 3, "middle")


@pytest.fixture
def lasagne_01():
    import synk_lasagne

    synk_lasagne.set_lasagne_api("0.1")
    yield
    synk_lasagne.set_lasagne_api("0.2")


def test_same_padding_of_even_filters_raises_as_lasagne_02():
    with pytest.raises(NotImplementedError, match="requires odd filter size"):
        layers.Conv2DLayer((None, 2, 7, 6), 3, (3, 2), pad="same")
    with pytest.raises(NotImplementedError, match="requires odd filter size"):
        layers.Conv1DLayer((None, 2, 7), 3, 4, pad="same")


def test_lasagne_01_same_padding_keeps_the_size(lasagne_01):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 2, 7, 6))
    layer = layers.Conv2DLayer((None, 2, 7, 6), 3, (3, 4), pad="same", b=None, nonlinearity=None,
                               flip_filters=False)
    got = layer.get_output_for(pt.as_tensor(x)).eval()
    expected = reference_conv(x, layer.W.get_value(), pad=((1, 1), (2, 1)))  # 0.1: one less after than before
    assert got.shape == expected.shape == (2, *layer.output_shape[1:]) == (2, 3, 7, 6)
    np.testing.assert_allclose(got, expected, atol=1e-10)
    line = layers.Conv1DLayer((None, 2, 7), 3, 4, pad="same", b=None, nonlinearity=None, flip_filters=False)
    x = x[:, :, :, 0]  # (2, 2, 7)
    got = line.get_output_for(pt.as_tensor(x)).eval()
    expected = reference_conv(x[:, :, None], line.W.get_value()[:, :, None], pad=((0, 0), (2, 1)))[:, :, 0]
    assert got.shape == (2, *line.output_shape[1:]) == (2, 3, 7)
    np.testing.assert_allclose(got, expected, atol=1e-10)


def test_lasagne_01_dense_layer_on_one_axis_and_grads_of_variables(lasagne_01):
    from synk_lasagne.updates import get_or_compute_grads

    dense = layers.DenseLayer((None,), 3, nonlinearity=None)  # one feature per example
    assert dense.W.get_value().shape == (1, 3) and dense.output_shape == (None, 3)
    x = np.arange(4.0)
    np.testing.assert_allclose(dense.get_output_for(pt.as_tensor(x)).eval(),
                               x[:, None] @ dense.W.get_value() + dense.b.get_value())
    a, b = pt.scalar("a"), pt.scalar("b")
    grads = get_or_compute_grads(a * b, [a, b])
    assert [g.eval({a: 2.0, b: 3.0}) for g in grads] == [3.0, 2.0]


def test_lasagne_api_is_checked_and_02_refuses_what_01_allows():
    import synk_lasagne
    from synk_lasagne.updates import get_or_compute_grads

    assert synk_lasagne.lasagne_api() == "0.2"
    with pytest.raises(ValueError, match=r"one of 0\.1, 0\.2"):
        synk_lasagne.set_lasagne_api("0.3")
    with pytest.raises(ValueError, match="trailing axes"):
        layers.DenseLayer((None,), 3)
    with pytest.raises(ValueError, match="shared variables"):
        get_or_compute_grads(pt.scalar("a") * 2, [pt.scalar("a")])


def transposed3d_reference(x, W, stride, crop):
    """Each input voxel adds x[:, c, i, j, k] * W[c, f] (flipped: the transpose of a true
    convolution) at i * stride - crop + a along each axis."""
    K = W[:, :, ::-1, ::-1, ::-1]
    size = [(n - 1) * s + k for n, s, k in zip(x.shape[2:], stride, W.shape[2:])]
    full = np.zeros((x.shape[0], W.shape[1], *size))
    for i, j, k in np.ndindex(*x.shape[2:]):
        a, b, c = i * stride[0], j * stride[1], k * stride[2]
        full[:, :, a:a + W.shape[2], b:b + W.shape[3], c:c + W.shape[4]] += np.einsum(
            "bc,cfijk->bfijk", x[:, :, i, j, k], K)
    return full[:, :, crop[0]:size[0] - crop[0], crop[1]:size[1] - crop[1], crop[2]:size[2] - crop[2]]


def test_transposed_conv3d_matches_a_scatter_add():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, 3, 3, 4, 2))
    W = rng.normal(size=(3, 2, 2, 3, 2))  # (channels, filters, depth, rows, columns)
    l_in = layers.InputLayer((None, 3, 3, 4, 2))
    layer = layers.TransposedConv3DLayer(l_in, 2, (2, 3, 2), stride=(2, 1, 2), crop=(0, 1, 0), W=W, b=None,
                                         nonlinearity=None)
    got = pytensor.function([l_in.input_var], layers.get_output(layer), **FAST)(x)
    expected = transposed3d_reference(x, W, (2, 1, 2), (0, 1, 0))
    assert got.shape == expected.shape == (2, *layer.output_shape[1:]) == (2, 2, 6, 4, 4)
    np.testing.assert_allclose(got, expected, atol=1e-10)
    assert layers.Deconv3DLayer is layers.TransposedConv3DLayer
