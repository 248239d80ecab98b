"""synk_lasagne's LocalResponseNormalization2DLayer, instance_norm and layer_norm (one process)
against numpy, with one gradient."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import FAST

from synk_lasagne import layers, nonlinearities


def lrn_reference(x, alpha, k, beta, n):
    out = np.empty_like(x)
    for c in range(x.shape[1]):
        window = x[:, max(0, c - n // 2):c + n // 2 + 1]
        out[:, c] = x[:, c] / (k + alpha * (window ** 2).sum(axis=1)) ** beta
    return out


def test_local_response_normalization_and_gradient():
    x = np.random.default_rng(0).normal(size=(2, 7, 3, 2))
    l_in = layers.InputLayer((None, 7, 3, 2))
    layer = layers.LocalResponseNormalization2DLayer(l_in, alpha=0.5, k=2, beta=0.75, n=3)
    out = layers.get_output(layer)
    g = np.random.default_rng(1).normal(size=x.shape)
    f = pytensor.function([l_in.input_var], [out, pytensor.grad(pt.sum(out * g), l_in.input_var)], **FAST)
    got, grad = f(x)
    np.testing.assert_allclose(got, lrn_reference(x, 0.5, 2, 0.75, 3))
    eps, index = 1e-6, (1, 3, 2, 0)
    shifted = x.copy()
    shifted[index] += eps
    numeric = (np.sum(lrn_reference(shifted, 0.5, 2, 0.75, 3) * g)
               - np.sum(lrn_reference(x, 0.5, 2, 0.75, 3) * g)) / eps
    np.testing.assert_allclose(grad[index], numeric, rtol=1e-4)
    assert layer.get_params() == []
    with pytest.raises(NotImplementedError, match="odd"):
        layers.LocalResponseNormalization2DLayer(l_in, n=4)


def test_instance_norm_and_layer_norm_stacks():
    x = np.random.default_rng(2).normal(size=(3, 4, 5, 5))
    l_in = layers.InputLayer((None, 4, 5, 5))
    conv = layers.Conv2DLayer(l_in, 4, 3, pad="same", nonlinearity=nonlinearities.rectify, name="conv")
    stack = layers.instance_norm(conv)
    assert conv.b is None and conv.nonlinearity is nonlinearities.identity
    assert [lay.name for lay in layers.get_all_layers(stack)[2:]] == ["conv_in", "conv_in_scale", "conv_in_bias",
                                                                      "conv_in_nonlin"]
    f = pytensor.function([l_in.input_var], [layers.get_output(conv), layers.get_output(stack)], **FAST)
    features, got = f(x)
    standardized = (features - features.mean(axis=(2, 3), keepdims=True)) / np.sqrt(
        features.var(axis=(2, 3), keepdims=True) + 1e-4)
    np.testing.assert_allclose(got, np.maximum(standardized, 0), atol=1e-10)  # scale 1, bias 0 at start
    dense = layers.DenseLayer(layers.InputLayer((None, 6)), 5, nonlinearity=None)
    normed = layers.layer_norm(dense)
    assert isinstance(normed, layers.BiasLayer)
    h = np.random.default_rng(3).normal(size=(4, 6))
    raw, got = pytensor.function([dense.input_layer.input_var], [layers.get_output(dense), layers.get_output(normed)],
                                 **FAST)(h)
    np.testing.assert_allclose(got, (raw - raw.mean(1, keepdims=True)) / np.sqrt(raw.var(1, keepdims=True) + 1e-4))
