"""synk_lasagne.layers.SpatialPyramidPoolingLayer, pool_2d and Pool3DLayer (one process) against numpy: the
pyramid's cells, both implementations, unknown spatial lengths, and the gradient of max pooling."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import FAST

from synk_lasagne import layers
from synk_lasagne.layers.pool import pool_2d


def cells(n, d, implementation):
    """The [start, stop) of each of the d cells over a length n."""
    if implementation == "fast":
        size, step = -(-n // d), n // d
        return [(i * step, i * step + size) for i in range(d)]
    return [(int(np.floor(i * n / d)), int(np.ceil((i + 1) * n / d))) for i in range(d)]


def reference(x, pool_dims, implementation, op):
    parts = []
    for d in pool_dims:
        for r0, r1 in cells(x.shape[2], d, implementation):
            for c0, c1 in cells(x.shape[3], d, implementation):
                parts.append(op(x[:, :, r0:r1, c0:c1], axis=(2, 3)))
    return np.stack(parts, axis=2)


@pytest.mark.parametrize("implementation,mode", [("fast", "max"), ("kaiming", "max"),
                                                 ("kaiming", "average_exc_pad")])
def test_spatial_pyramid_pooling_matches_numpy(implementation, mode):
    x = np.random.default_rng(0).normal(size=(2, 3, 11, 7))
    l_in = layers.InputLayer((None, 3, None, None))
    layer = layers.SpatialPyramidPoolingLayer(l_in, [3, 2, 1], mode=mode, implementation=implementation)
    assert layer.output_shape == (None, 3, 14)
    out = layers.get_output(layer)
    f = pytensor.function([l_in.input_var], [out, pytensor.grad(pt.sum(out), l_in.input_var)], **FAST)
    got, grad = f(x)
    np.testing.assert_allclose(got, reference(x, [3, 2, 1], implementation, np.max if mode == "max" else np.mean))
    if mode == "max":  # each cell sends a gradient of 1 to its maximum
        expected = np.zeros_like(x)
        for d in (3, 2, 1):
            for r0, r1 in cells(11, d, implementation):
                for c0, c1 in cells(7, d, implementation):
                    window = x[:, :, r0:r1, c0:c1].reshape(2, 3, -1)
                    rr, cc = np.unravel_index(window.argmax(axis=2), (r1 - r0, c1 - c0))
                    for b in range(2):
                        for c in range(3):
                            expected[b, c, r0 + rr[b, c], c0 + cc[b, c]] += 1
        np.testing.assert_allclose(grad, expected)


def test_pool_2d_with_run_time_window_sizes():
    x = np.random.default_rng(1).normal(size=(2, 2, 7, 9))
    xv, ws = pt.tensor4(), pt.ivector()
    f = pytensor.function([xv, ws], pool_2d(xv, ws, stride=ws, mode="average_exc_pad"), **FAST)
    got = f(x, np.array([2, 3], dtype="int32"))
    expected = x[:, :, :6, :9].reshape(2, 2, 3, 2, 3, 3).mean(axis=(3, 5))
    np.testing.assert_allclose(got, expected)
    with pytest.raises(ValueError, match="Mode must be"):
        layers.SpatialPyramidPoolingLayer((None, 1, 4, 4), mode="other")


@pytest.mark.parametrize("mode,pad", [("max", (1, 0, 1)), ("average_inc_pad", (0, 1, 0))])
def test_pool_3d_matches_numpy_windows(mode, pad):
    x = np.random.default_rng(2).normal(size=(2, 1, 5, 6, 4))
    l_in = layers.InputLayer((None, 1, 5, 6, 4))
    layer = layers.Pool3DLayer(l_in, (2, 3, 2), stride=(2, 2, 1), pad=pad, mode=mode)
    out = layers.get_output(layer)
    f = pytensor.function([l_in.input_var], [out, pytensor.grad(pt.sum(out), l_in.input_var)], **FAST)
    got, grad = f(x)
    fill = -np.inf if mode == "max" else 0.0
    padded = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in pad], constant_values=fill)
    shape = [(padded.shape[2 + a] - k) // s + 1 for a, (k, s) in enumerate(zip((2, 3, 2), (2, 2, 1)))]
    assert got.shape == (2, 1, *shape) == (2, 1, *layer.output_shape[2:])
    expected = np.zeros(got.shape)
    for i, j, k in np.ndindex(*shape):
        window = padded[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 3, k:k + 2]
        expected[:, :, i, j, k] = window.max(axis=(2, 3, 4)) if mode == "max" else window.mean(axis=(2, 3, 4))
    np.testing.assert_allclose(got, expected)
    if mode == "average_inc_pad":  # each input value counts 1/12 in every window that holds it
        hits = np.zeros(padded.shape)
        for i, j, k in np.ndindex(*shape):
            hits[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 3, k:k + 2] += 1 / 12
        np.testing.assert_allclose(grad, hits[:, :, :, 1:-1, :])
    with pytest.raises(ValueError, match="Expected 5 input dimensions"):
        layers.MaxPool3DLayer((1, 2, 3, 4), 2)
