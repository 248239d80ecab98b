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
