"""synk_lasagne.layers (one process): output shapes against the computed outputs, values against
numpy, parameters and their tags, values in and out, batch norm's running averages as default
updates, dropout, and init / objectives / regularization."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import FAST, float64_and_seeded, reference_conv, reference_pool  # noqa: F401 - autouse fixture

from synk_lasagne import init, layers, nonlinearities, objectives, regularization


def evaluate(net, x_value, **kwargs):
    inputs = [lay for lay in layers.get_all_layers(net) if isinstance(lay, layers.InputLayer)]
    out = layers.get_output(net, **kwargs)
    return pytensor.function([inputs[0].input_var], out, **FAST)(x_value)


def images(shape=(3, 2, 7, 6), seed=1):
    return np.random.default_rng(seed).normal(size=shape)


def test_dense_layer_values_and_flattening():
    net = layers.InputLayer((None, 2, 3))
    dense = layers.DenseLayer(net, 4, nonlinearity=nonlinearities.tanh)
    x = images((5, 2, 3))
    expected = np.tanh(x.reshape(5, 6) @ dense.W.get_value() + dense.b.get_value())
    np.testing.assert_allclose(evaluate(dense, x), expected)
    assert dense.output_shape == (None, 4)
    assert dense.get_params(regularizable=True) == [dense.W]
    assert layers.DenseLayer(net, 3, num_leading_axes=2).output_shape == (None, 2, 3)
    with pytest.raises(ValueError, match="trailing axes"):
        layers.DenseLayer(layers.InputLayer((None, None)), 3)


def test_outputs_have_lasagne_types_and_compiled_graphs_the_static_shapes():
    """As in Lasagne (Theano's types know only the lengths of 1), a value of another shape can
    stand for a layer's output; a compiled function still sees the static shapes (the retyping
    view is rewritten away) and computes the layer."""
    from synk_lasagne.layers.helper import LasagneTypedOp

    net = layers.InputLayer((None, 4))
    dense = layers.DenseLayer(net, 3, nonlinearity=None)
    out = layers.get_output(dense)
    assert out.type.shape == (None, None) and dense.W.type.shape == (4, 3)
    assert layers.get_output(net) is net.input_var
    value = images((2, 5))
    np.testing.assert_array_equal(out.eval({out: value}), value)
    f = pytensor.function([net.input_var], [out, pytensor.grad(out.sum(), dense.W)])
    assert not any(isinstance(node.op, LasagneTypedOp) for node in f.maker.fgraph.apply_nodes)
    assert f.maker.fgraph.outputs[0].type.shape == (None, 3)
    x = images((5, 4))
    y, g = f(x)
    np.testing.assert_allclose(y, x @ dense.W.get_value() + dense.b.get_value())
    np.testing.assert_allclose(g, x.T @ np.ones((5, 3)))


@pytest.mark.parametrize("kwargs", [{"pad": "same", "dilation": 2}, {"pad": "valid", "stride": 2}, {"pad": "full"},
                                    {"pad": 1, "dilation": 2}, {"pad": (2, 1), "num_groups": 2}])
def test_conv_layer_matches_numpy_and_its_output_shape(kwargs):
    net = layers.InputLayer((None, 2, 7, 6))
    conv = layers.Conv2DLayer(net, 4, (3, 2), nonlinearity=None, **kwargs)
    x = images()
    out = evaluate(conv, x)
    assert out.shape[1:] == conv.output_shape[1:]
    w = conv.W.get_value()[:, :, ::-1, ::-1]  # flip_filters=True: a true convolution, as Lasagne's default
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "num_groups"}
    expected = reference_conv(x, w, groups=kwargs.get("num_groups", 1), **ref_kwargs) \
        + conv.b.get_value()[None, :, None, None]
    np.testing.assert_allclose(out, expected, rtol=1e-10)


def test_conv_layer_options():
    net = layers.InputLayer((None, 2, 5, 5))
    conv = layers.Conv2DLayer(net, 3, 3, b=None, flip_filters=False, nonlinearity=None)
    x = images((2, 2, 5, 5))
    np.testing.assert_allclose(evaluate(conv, x), reference_conv(x, conv.W.get_value()))
    assert conv.get_params() == [conv.W]
    untied = layers.Conv2DLayer(net, 3, 3, untie_biases=True, b=init.Normal(1.0))
    assert untied.b.get_value().shape == (3, 3, 3)
    assert evaluate(untied, x).shape == (2, 3, 3, 3)
    with pytest.raises(ValueError, match="num_groups"):
        layers.Conv2DLayer(net, 3, 3, num_groups=2)
    with pytest.raises(ValueError, match="4-d"):
        layers.Conv2DLayer(layers.InputLayer((None, 3)), 3, 3)


@pytest.mark.parametrize("layer,kwargs,mode", [
    (layers.MaxPool2DLayer, {"pool_size": 2}, "max"),
    (layers.MaxPool2DLayer, {"pool_size": 3, "stride": 2, "pad": 1}, "max"),
    (layers.Pool2DLayer, {"pool_size": 2, "mode": "average_inc_pad"}, "average_inc_pad"),
    (layers.Pool2DLayer, {"pool_size": 3, "stride": 2, "pad": 1, "mode": "average_exc_pad"}, "average_exc_pad"),
])
def test_pool_layers(layer, kwargs, mode):
    pool = layer(layers.InputLayer((None, 2, 7, 6)), **kwargs)
    x = images()
    out = evaluate(pool, x)
    assert out.shape[1:] == pool.output_shape[1:]
    ref = {"ws": kwargs["pool_size"], "stride": kwargs.get("stride"), "pad": kwargs.get("pad", 0), "mode": mode}
    np.testing.assert_allclose(out, reference_pool(x, **ref))


def test_global_pool_flatten_reshape_nonlinearity():
    net = layers.InputLayer((None, 2, 3, 4))
    x = images((5, 2, 3, 4))
    np.testing.assert_allclose(evaluate(layers.GlobalPoolLayer(net), x), x.mean(axis=(2, 3)))
    np.testing.assert_allclose(evaluate(layers.GlobalPoolLayer(net, pt.max), x), x.max(axis=(2, 3)))
    assert layers.GlobalPoolLayer(net).output_shape == (None, 2)
    flat = layers.FlattenLayer(net)
    assert flat.output_shape == (None, 24)
    np.testing.assert_allclose(evaluate(flat, x), x.reshape(5, 24))
    reshaped = layers.ReshapeLayer(net, ([0], 6, -1))
    assert reshaped.output_shape == (None, 6, 4)
    np.testing.assert_allclose(evaluate(reshaped, x), x.reshape(5, 6, 4))
    with pytest.raises(ValueError, match="more than one -1"):
        layers.ReshapeLayer(net, (-1, -1))
    np.testing.assert_allclose(evaluate(layers.NonlinearityLayer(net), x), np.maximum(x, 0))


def test_merge_layers():
    a = layers.InputLayer((None, 2, 3))
    b = layers.ExpressionLayer(a, lambda v: 2 * v)
    total = layers.ElemwiseSumLayer([a, b], coeffs=[1, -0.5])
    x = images((4, 2, 3))
    np.testing.assert_allclose(evaluate(total, x), np.zeros_like(x), atol=1e-12)
    cat = layers.ConcatLayer([a, b], axis=2)
    assert cat.output_shape == (None, 2, 6)
    np.testing.assert_allclose(evaluate(cat, x), np.concatenate([x, 2 * x], axis=2))
    with pytest.raises(ValueError, match="differ"):
        layers.ElemwiseSumLayer([a, layers.InputLayer((None, 3, 3))]).output_shape  # noqa: B018


def test_get_output_with_given_inputs_and_several_layers():
    net = layers.InputLayer((None, 3))
    hidden = layers.DenseLayer(net, 4, name="hidden")
    out = layers.DenseLayer(hidden, 2, nonlinearity=None, name="out")
    x = pt.matrix("x")
    given = layers.get_output(out, x)
    assert x in pytensor.graph.graph_inputs([given])
    h_value = np.ones((2, 4))
    replaced = layers.get_output(out, {hidden: pt.as_tensor_variable(h_value)})
    np.testing.assert_allclose(replaced.eval(), h_value @ out.W.get_value() + out.b.get_value())
    both = layers.get_output([hidden, out], x)
    assert len(both) == 2
    assert layers.get_all_layers(out) == [net, hidden, out]
    assert out.W.name == "out.W"


def test_parameters_tags_counts_and_values():
    net = layers.InputLayer((None, 1, 6, 6))
    conv = layers.batch_norm(layers.Conv2DLayer(net, 3, 3, name="conv"))
    out = layers.DenseLayer(layers.DropoutLayer(conv), 2, nonlinearity=nonlinearities.softmax)
    bn = conv.input_layer
    assert isinstance(bn, layers.BatchNormLayer) and isinstance(conv, layers.NonlinearityLayer)
    assert bn.input_layer.b is None and bn.input_layer.nonlinearity is nonlinearities.identity
    every = layers.get_all_params(out)
    trainable = layers.get_all_params(out, trainable=True)
    assert len(every) == 7 and len(trainable) == 5  # W, beta, gamma, W, b; mean and inv_std are not trained
    assert layers.get_all_params(out, regularizable=True) == [bn.input_layer.W, bn.gamma, out.W]  # as Lasagne
    assert layers.count_params(out) == 27 + 4 * 3 + 48 * 2 + 2
    assert layers.count_params(out, trainable=True) == 27 + 2 * 3 + 48 * 2 + 2
    values = layers.get_all_param_values(out)
    new = [v + 1 for v in values]
    layers.set_all_param_values(out, new)
    for got, want in zip(layers.get_all_param_values(out), new):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="7 parameters"):
        layers.set_all_param_values(out, new[:-1])
    with pytest.raises(ValueError, match="shape"):
        layers.set_all_param_values(out, [np.zeros(1)] * 7)


def test_params_from_arrays_and_shared_variables():
    w = pytensor.shared(np.ones((3, 2)))
    dense = layers.DenseLayer(layers.InputLayer((None, 3)), 2, W=w, b=np.arange(2.0))
    assert dense.W is w and np.array_equal(dense.b.get_value(), [0.0, 1.0])
    with pytest.raises(ValueError, match="shape"):
        layers.DenseLayer(layers.InputLayer((None, 4)), 2, W=w)
    with pytest.raises(TypeError, match="callable"):
        layers.DenseLayer(layers.InputLayer((None, 3)), 2, W="glorot")


def test_batch_norm_training_evaluation_and_running_averages():
    net = layers.InputLayer((None, 2, 3, 3))
    bn = layers.BatchNormLayer(net, alpha=0.25, gamma=np.array([2.0, 3.0]), beta=np.array([0.5, -1.0]))
    x = images((4, 2, 3, 3)) * 2 + 1
    out = layers.get_output(bn)
    updates = layers.get_state_updates(out)
    assert [var for var, _ in updates] == [bn.mean, bn.inv_std]
    train = pytensor.function([net.input_var], out, updates=updates, **FAST)
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    inv_std = 1 / np.sqrt(var + bn.epsilon)
    expected = (x - mean[None, :, None, None]) * (np.array([2.0, 3.0]) * inv_std)[None, :, None, None] \
        + np.array([0.5, -1.0])[None, :, None, None]
    np.testing.assert_allclose(train(x), expected, rtol=1e-10)
    np.testing.assert_allclose(bn.mean.get_value(), 0.25 * mean)
    np.testing.assert_allclose(bn.inv_std.get_value(), 0.75 + 0.25 * inv_std)
    train(x)
    np.testing.assert_allclose(bn.mean.get_value(), 0.75 * 0.25 * mean + 0.25 * mean)
    test = pytensor.function([net.input_var], layers.get_output(bn, deterministic=True), **FAST)
    running_mean, running_inv_std = bn.mean.get_value(), bn.inv_std.get_value()
    expected_test = (x - running_mean[None, :, None, None]) * (np.array([2.0, 3.0]) * running_inv_std)[
        None, :, None, None] + np.array([0.5, -1.0])[None, :, None, None]
    np.testing.assert_allclose(test(x), expected_test, rtol=1e-10)
    np.testing.assert_allclose(bn.mean.get_value(), running_mean)  # evaluation does not update
    assert layers.get_running_statistics(bn) == [bn.mean, bn.inv_std]
    layers.average_running_statistics(bn)  # not forked: nothing to average, nothing changes
    np.testing.assert_allclose(bn.mean.get_value(), running_mean)


def test_dropout():
    net = layers.InputLayer((None, 200, 4))
    drop = layers.DropoutLayer(net, p=0.25)
    x = np.ones((8, 200, 4))
    np.testing.assert_array_equal(evaluate(drop, x, deterministic=True), x)
    out = layers.get_output(drop)
    f = pytensor.function([net.input_var], out, updates=layers.get_state_updates(out), **FAST)
    first, second = f(x), f(x)
    assert set(np.unique(first)) == {0.0, 1 / 0.75}
    assert abs(np.mean(first == 0) - 0.25) < 0.03
    assert not np.array_equal(first, second)  # the generator advances at every call
    shared = pytensor.function([net.input_var], layers.get_output(layers.DropoutLayer(net, 0.5, shared_axes=(2,))),
                               **FAST)(x)
    assert layers.get_state_updates(layers.get_output(drop, deterministic=True)) == []
    assert np.all(shared == shared[:, :, :1])
    with pytest.raises(ValueError, match="probability"):
        layers.DropoutLayer(net, p=1.0)


def test_initializers():
    for shape, fan_sum in (((400, 600), 1000), ((64, 32, 3, 3), 96 * 9)):
        std = np.sqrt(2 / fan_sum)
        assert abs(init.GlorotUniform()(shape).std() / std - 1) < 0.05
        assert abs(init.GlorotNormal()(shape).std() / std - 1) < 0.05
    fan_in = 32 * 9
    assert abs(init.HeNormal(gain="relu")((64, 32, 3, 3)).std() / np.sqrt(2 / fan_in) - 1) < 0.05
    assert abs(init.HeUniform()((400, 600)).std() / np.sqrt(1 / 400) - 1) < 0.05
    values = init.Uniform((2, 3))((1000,))
    assert values.min() >= 2 and values.max() <= 3
    assert init.Constant(3)((2,)).dtype == np.float64
    assert abs(init.Normal(2.0, 1.0)((20000,)).mean() - 1) < 0.05
    with pytest.raises(RuntimeError, match="2 or more"):
        init.GlorotUniform()((5,))


def test_objectives_against_numpy():
    rng = np.random.default_rng(8)
    scores = rng.normal(size=(6, 4))
    targets = rng.integers(0, 4, 6).astype("int32")
    s, t = pt.matrix("s"), pt.ivector("t")
    p_value = np.exp(scores) / np.exp(scores).sum(axis=1, keepdims=True)
    ce = objectives.categorical_crossentropy(nonlinearities.softmax(s), t)
    np.testing.assert_allclose(ce.eval({s: scores, t: targets}), -np.log(p_value[np.arange(6), targets]))
    onehot = np.eye(4)[targets]
    ce_dist = objectives.categorical_crossentropy(pt.matrix("p"), pt.matrix("q"))
    np.testing.assert_allclose(ce_dist.eval({"p": p_value, "q": onehot}), -np.log(p_value[np.arange(6), targets]))
    acc = objectives.categorical_accuracy(s, t).eval({s: scores, t: targets})
    np.testing.assert_array_equal(acc, scores.argmax(axis=1) == targets)
    top2 = objectives.categorical_accuracy(s, t, top_k=2).eval({s: scores, t: targets})
    np.testing.assert_array_equal(top2, [targets[i] in np.argsort(scores[i])[-2:] for i in range(6)])
    p, y = pt.vector("p"), pt.vector("y")
    pv, yv = np.array([0.2, 0.9, 0.6]), np.array([0.0, 1.0, 0.0])
    np.testing.assert_allclose(objectives.binary_crossentropy(p, y).eval({p: pv, y: yv}),
                               -(yv * np.log(pv) + (1 - yv) * np.log(1 - pv)))
    np.testing.assert_array_equal(objectives.binary_accuracy(p, y).eval({p: pv, y: yv}), [1, 1, 0])
    np.testing.assert_allclose(objectives.squared_error(p, y).eval({p: pv, y: yv}), (pv - yv) ** 2)
    w = pt.vector("w")
    loss = objectives.aggregate(objectives.squared_error(p, y), w, mode="normalized_sum")
    np.testing.assert_allclose(loss.eval({p: pv, y: yv, w: np.array([1.0, 2.0, 1.0])}),
                               np.sum([1, 2, 1] * (pv - yv) ** 2) / 4)
    with pytest.raises(ValueError, match="require weights"):
        objectives.aggregate(p, mode="normalized_sum")


def test_regularization():
    net = layers.InputLayer((None, 3))
    hidden = layers.DenseLayer(net, 2, W=np.ones((3, 2)), b=np.ones(2))
    out = layers.DenseLayer(hidden, 1, W=np.full((2, 1), 2.0))
    assert float(regularization.regularize_network_params(out, regularization.l2).eval()) == 6 + 8
    assert float(regularization.regularize_network_params(out, regularization.l1).eval()) == 6 + 4
    assert float(regularization.regularize_layer_params(hidden, regularization.l2).eval()) == 6
    weighted = regularization.regularize_layer_params_weighted({hidden: 0.5, out: 0.1}, regularization.l2)
    assert np.isclose(float(weighted.eval()), 3 + 0.8)


def test_dropout_and_batch_norm_under_jax():
    """The random draws and the running averages work on PyTensor's JAX backend too (what GPU mode runs)."""
    pytest.importorskip("jax")
    net = layers.InputLayer((None, 2, 50, 4))
    out_layer = layers.BatchNormLayer(layers.DropoutLayer(net, p=0.5))
    out = layers.get_output(out_layer)
    f = pytensor.function([net.input_var], out, updates=layers.get_state_updates(out), mode="JAX")
    x = np.ones((4, 2, 50, 4))
    first, second = np.asarray(f(x)), np.asarray(f(x))
    assert not np.array_equal(first, second)
    assert 0.4 < np.mean(first < 0) < 0.6  # dropped values normalize below the batch mean, kept ones above
    assert np.all(out_layer.mean.get_value() > 0)
