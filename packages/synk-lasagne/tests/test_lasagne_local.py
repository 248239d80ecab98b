"""synk_lasagne.layers.LocallyConnected2DLayer (one process) against a numpy loop over output
positions (each its own filter), plain and channelwise, flipped or not, and one gradient."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import FAST

from synk_lasagne import layers


def reference(x, W, channelwise, flip):
    """Each output position (y, x) is a dot product of its zero-padded input window with its own filter."""
    rows, columns = x.shape[2:]
    kh, kw = W.shape[-4:-2]
    padded = np.pad(x, ((0, 0), (0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2)))
    out = np.zeros((x.shape[0], W.shape[0], rows, columns))
    for y in range(rows):
        for z in range(columns):
            window = padded[:, :, y:y + kh, z:z + kw]  # (batch, channels, kh, kw)
            w = W[..., y, z]
            if flip:
                w = w[..., ::-1, ::-1]
            if channelwise:
                out[:, :, y, z] = np.einsum("bfij,fij->bf", window, w)
            else:
                out[:, :, y, z] = np.einsum("bcij,fcij->bf", window, w)
    return out


@pytest.mark.parametrize("channelwise,flip", [(False, True), (False, False), (True, True)])
def test_locally_connected_matches_numpy(channelwise, flip):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 4, 5))
    l_in = layers.InputLayer((None, 3, 4, 5))
    W = rng.normal(size=(3, 3, 5, 4, 5) if channelwise else (3, 3, 3, 5, 4, 5))
    layer = layers.LocallyConnected2DLayer(l_in, 3, (3, 5), W=W, b=None, nonlinearity=None, flip_filters=flip,
                                           channelwise=channelwise)
    out = layers.get_output(layer)
    got = pytensor.function([l_in.input_var], out, **FAST)(x)
    assert got.shape == (2, 3, 4, 5) and layer.output_shape == (None, 3, 4, 5)
    np.testing.assert_allclose(got, reference(x, W, channelwise, flip), rtol=1e-10)
    # d(sum(out * g)) / dW[f, c, i, j, y, z] = g[:, f, y, z] . window[:, c, i', j'] (one entry)
    g = rng.normal(size=got.shape)
    grad = pytensor.function([l_in.input_var], pytensor.grad(pt.sum(out * g), layer.W), **FAST)(x)
    eps = 1e-6
    index = (1, 2, 1, 3, 2, 1)[:W.ndim]
    shifted = W.copy()
    shifted[index] += eps
    numeric = (np.sum(reference(x, shifted, channelwise, flip) * g)
               - np.sum(reference(x, W, channelwise, flip) * g)) / eps
    np.testing.assert_allclose(grad[index], numeric, rtol=1e-5)


def test_locally_connected_options_and_errors():
    l_in = layers.InputLayer((None, 2, 4, 4))
    layer = layers.LocallyConnected2DLayer(l_in, 4, 3, untie_biases=True)
    assert layer.b.get_value().shape == (4, 4, 4) and layer.W.get_value().shape == (4, 2, 3, 3, 4, 4)
    with pytest.raises(NotImplementedError, match="pad='same'"):
        layers.LocallyConnected2DLayer(l_in, 4, 3, pad="valid")
    with pytest.raises(ValueError, match="fixed input shape"):
        layers.LocallyConnected2DLayer(layers.InputLayer((None, 2, None, 4)), 2, 3)
