"""Lasagne's API beyond the core layers, in one process, against numpy: the 1-d convolution and
pooling layers, shape and feature layers, NIN, embedding, bias/scale, initialisers, utils and
theano_extensions (forward values, and gradients by finite differences)."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import FAST

from synk_lasagne import init, layers, utils
from synk_lasagne.theano_extensions import conv as tconv
from synk_lasagne.theano_extensions.padding import pad

RNG = np.random.default_rng(0)


def run(expr, *inputs_values):
    inputs = [i for i, _ in inputs_values]
    return pytensor.function(inputs, expr, **FAST)(*[v for _, v in inputs_values])


def numpy_conv1d(x, w, stride=1, pad_width=0, flip=True):
    x = np.pad(x, ((0, 0), (0, 0), (pad_width, pad_width)))
    w = w[:, :, ::-1] if flip else w
    k = w.shape[2]
    n = (x.shape[2] - k) // stride + 1
    return np.stack([np.einsum("bck,fck->bf", x[:, :, i * stride:i * stride + k], w) for i in range(n)], axis=2)


@pytest.mark.parametrize("stride, pad_width", [(1, 0), (2, 1), (3, 2)])
def test_conv1d_layer_matches_numpy_and_its_gradient(stride, pad_width):
    x = pt.tensor3("x")
    xv, wv = RNG.normal(size=(2, 3, 11)), RNG.normal(size=(4, 3, 3))
    layer = layers.Conv1DLayer(layers.InputLayer((None, 3, 11), x), 4, 3, stride=stride, pad=pad_width, W=wv,
                               nonlinearity=None)
    out = run(layers.get_output(layer), (x, xv))
    np.testing.assert_allclose(out, numpy_conv1d(xv, wv, stride, pad_width), rtol=1e-10)
    assert out.shape[1:] == layer.output_shape[1:]
    pytensor.gradient.verify_grad(lambda inp: layer.get_output_for(inp).sum(), [xv], rng=np.random.default_rng(1),
                                  mode="FAST_COMPILE")


@pytest.mark.parametrize("ignore_border", [True, False])
def test_maxpool1d_layer_matches_numpy(ignore_border):
    x = pt.tensor3("x")
    xv = RNG.normal(size=(2, 3, 10))
    layer = layers.MaxPool1DLayer(layers.InputLayer((None, 3, 10), x), 3, stride=2, ignore_border=ignore_border)
    out = run(layers.get_output(layer), (x, xv))
    starts = range(0, 8, 2) if ignore_border else range(0, 9, 2)  # partial last window [8:10] kept
    expected = np.stack([xv[:, :, s:s + 3].max(axis=2) for s in starts], axis=2)
    np.testing.assert_allclose(out, expected)
    assert layer.output_shape == (None, 3, len(starts))


def test_shape_layers_match_numpy():
    x = pt.tensor4("x")
    xv = RNG.normal(size=(2, 3, 1, 5))
    inp = layers.InputLayer((None, 3, 1, 5), x)
    np.testing.assert_allclose(run(layers.get_output(layers.DimshuffleLayer(inp, (0, 3, 1, "x"))), (x, xv)),
                               xv[:, :, 0, :].transpose(0, 2, 1)[..., None])
    padded = layers.PadLayer(inp, ((1, 2), 0), val=7)
    np.testing.assert_allclose(run(layers.get_output(padded), (x, xv)),
                               np.pad(xv, ((0, 0), (0, 0), (1, 2), (0, 0)), constant_values=7))
    assert padded.output_shape == (None, 3, 4, 5)
    np.testing.assert_allclose(run(layers.get_output(layers.SliceLayer(inp, slice(1, 4), axis=-1)), (x, xv)),
                               xv[..., 1:4])
    with pytest.raises(ValueError, match="collapse"):
        layers.DimshuffleLayer(inp, (0, 2, 3))


def test_feature_nin_embedding_bias_scale_match_numpy():
    x = pt.tensor4("x")
    xv = RNG.normal(size=(2, 4, 3, 3))
    inp = layers.InputLayer((None, 4, 3, 3), x)
    maxout = run(layers.get_output(layers.FeaturePoolLayer(inp, 2)), (x, xv))
    np.testing.assert_allclose(maxout, xv.reshape(2, 2, 2, 3, 3).max(axis=2))
    wta = run(layers.get_output(layers.FeatureWTALayer(inp, 2)), (x, xv))
    grouped = xv.reshape(2, 2, 2, 3, 3)
    np.testing.assert_allclose(wta, (grouped * (grouped == grouped.max(axis=2, keepdims=True))).reshape(xv.shape))
    wv, bv = RNG.normal(size=(4, 5)), RNG.normal(size=5)
    nin = layers.NINLayer(inp, 5, W=wv, b=bv, nonlinearity=None)
    np.testing.assert_allclose(run(layers.get_output(nin), (x, xv)),
                               np.einsum("bchw,cu->buhw", xv, wv) + bv[None, :, None, None], rtol=1e-10)
    biased = layers.standardize(inp, offset=np.full(4, 1.0), scale=np.full(4, 2.0))
    np.testing.assert_allclose(run(layers.get_output(biased), (x, xv)), (xv - 1) / 2)
    assert layers.get_all_params(biased, trainable=True) == []
    i = pt.imatrix("i")
    table = RNG.normal(size=(6, 3))
    emb = layers.EmbeddingLayer(layers.InputLayer((None, 2), i), 6, 3, W=table)
    iv = np.array([[0, 5], [2, 2]], dtype="int32")
    np.testing.assert_allclose(run(layers.get_output(emb), (i, iv)), table[iv])
    assert emb.output_shape == (None, 2, 3)


def test_get_output_shape_with_input_shapes():
    net = layers.DenseLayer(layers.Conv1DLayer(layers.InputLayer((None, 2, 9)), 3, 3), 4)
    assert layers.get_output_shape(net, (5, 2, 9)) == (5, 4)
    assert layers.get_output_shape(net.input_layer, (5, 2, 20)) == (5, 3, 18)


def test_dropout_keeps_float32():
    x = pt.matrix("x", dtype="float32")
    out = layers.get_output(layers.DropoutLayer(layers.InputLayer((None, 3), x), 0.5))
    assert out.dtype == "float32"


def test_initialisers():
    q = init.Orthogonal()((6, 2, 2))
    flat = q.reshape(6, 4)
    np.testing.assert_allclose(flat.T @ flat, np.eye(4), atol=1e-6)
    sparse = init.Sparse(sparsity=0.5)((10, 4))
    assert ((sparse != 0).sum(axis=0) == 5).all()
    w = init.GlorotUniform(c01b=True)((3, 2, 2, 5))
    assert np.abs(w).max() <= np.sqrt(3) * np.sqrt(2 / ((3 + 5) * 4)) + 1e-6
    with pytest.raises(RuntimeError, match="c01b"):
        init.HeNormal(c01b=True)((3, 2))


def test_utils():
    assert utils.as_tuple(2, 3) == (2, 2, 2)
    with pytest.raises(TypeError):
        utils.as_tuple([1.5], 1, utils.int_types)
    np.testing.assert_allclose(utils.one_hot(np.array([1, 3], dtype="int32"), 4).eval(), np.eye(4)[[1, 3]])
    np.testing.assert_allclose(utils.compute_norms(np.ones((3, 2, 2, 2))), np.full(3, np.sqrt(8)))
    a, b = pytensor.shared(1.0, name="a"), pytensor.shared(2.0, name="b")
    assert utils.collect_shared_vars(b * (a + b)) == [b, a]
    seq = pt.vector("s")
    (acc,) = utils.unroll_scan(lambda s_t, prev: prev + s_t, [seq], [pt.constant(0.0)], [], 4)
    np.testing.assert_allclose(run(acc, (seq, np.arange(4.0))), np.cumsum(np.arange(4.0)))
    shared = utils.create_param(lambda shape: np.zeros(shape), (2, 3), name="w")
    assert shared.name == "w" and shared.get_value().shape == (2, 3)
    with pytest.raises(RuntimeError):  # ParamShapeError: a ValueError and Lasagne 0.1's RuntimeError
        utils.create_param(np.zeros((3, 2)), (2, 3))


@pytest.mark.parametrize("impl", ["conv1d_sc", "conv1d_mc0", "conv1d_mc1", "conv1d_unstrided", "conv1d_sd",
                                  "conv1d_md"])
def test_theano_extensions_conv_and_pad(impl):
    x, w = pt.tensor3("x"), pt.tensor3("w")
    xv, wv = RNG.normal(size=(2, 1, 10)), RNG.normal(size=(3, 1, 4))
    out = getattr(tconv, impl)(x, w, xv.shape, wv.shape, subsample=(2,))
    np.testing.assert_allclose(run(out, (x, xv), (w, wv)), numpy_conv1d(xv, wv, 2), rtol=1e-10)
    np.testing.assert_allclose(pad(pt.constant(xv), 2, val=3, batch_ndim=2).eval(),
                               np.pad(xv, ((0, 0), (0, 0), (2, 2)), constant_values=3))


@pytest.mark.parametrize("mode", ["repeat", "dilate"])
def test_upscale_layers_match_numpy(mode):
    x = pt.tensor4("x")
    xv = RNG.normal(size=(2, 1, 2, 3))
    layer = layers.Upscale2DLayer(layers.InputLayer((None, 1, 2, 3), x), (2, 3), mode=mode)
    if mode == "repeat":
        expected = np.repeat(np.repeat(xv, 2, axis=2), 3, axis=3)
    else:
        expected = np.zeros((2, 1, 4, 9))
        expected[:, :, ::2, ::3] = xv
    np.testing.assert_allclose(run(layers.get_output(layer), (x, xv)), expected)
    assert layer.output_shape == (None, 1, 4, 9)
    with pytest.raises(ValueError, match="Scale factor"):
        layers.Upscale1DLayer(layers.InputLayer((None, 1, 3)), 0)


def test_standardization_layer_and_huber_loss_match_numpy():
    from synk_lasagne import objectives

    x = pt.tensor4("x")
    xv = RNG.normal(size=(2, 3, 4, 4)) * 3 + 1
    out = run(layers.get_output(layers.StandardizationLayer(layers.InputLayer((None, 3, 4, 4), x))), (x, xv))
    mean, var = xv.mean(axis=(2, 3), keepdims=True), xv.var(axis=(2, 3), keepdims=True)
    np.testing.assert_allclose(out, (xv - mean) / np.sqrt(var + 1e-4), rtol=1e-10)
    p, t = np.array([0.0, 0.5, 3.0]), np.zeros(3)
    np.testing.assert_allclose(objectives.huber_loss(pt.constant(p), pt.constant(t)).eval(), [0.0, 0.125, 2.5])
