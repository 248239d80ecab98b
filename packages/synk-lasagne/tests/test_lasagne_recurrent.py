"""synk_lasagne's recurrent layers (one process) against numpy loops: RNN, LSTM (peepholes), GRU,
with masks, backwards, only_return_final, unroll_scan and precompute_input, and one gradient of
each against finite differences."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import FAST, float64_and_seeded  # noqa: F401 - autouse fixture

from synk_lasagne import layers, nonlinearities

BATCH, STEPS, FEATURES, UNITS = 3, 4, 5, 2



def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def value(p):
    return p.get_value()


def numpy_loop(step, x, mask, h0, backwards):
    """The states of every step, batch first, in the input's time order (Lasagne's layout)."""
    states, outs = h0, [None] * x.shape[1]
    order = range(x.shape[1])[::-1] if backwards else range(x.shape[1])
    for t in order:
        new = step(x[:, t], *states)
        states = tuple(np.where(mask[:, t, None] > 0, n, s) for n, s in zip(new, states))
        outs[t] = states[-1]
    return np.stack(outs, axis=1)


def rnn_reference(layer, x, mask, backwards):
    def step(x_t, h):
        return (np.maximum(0, x_t @ value(layer.W_in_to_hid) + value(layer.b) + h @ value(layer.W_hid_to_hid)),)
    return numpy_loop(step, x, mask, (np.zeros((len(x), UNITS)),), backwards)


def lstm_reference(layer, x, mask, backwards):
    p = {name: value(getattr(layer, name)) for name in dir(layer) if name.startswith(("W_", "b_"))}

    def gate(name, x_t, h):
        return x_t @ p[f"W_in_to_{name}"] + h @ p[f"W_hid_to_{name}"] + p[f"b_{name}"]

    def step(x_t, c, h):
        i = sigmoid(gate("ingate", x_t, h) + c * p["W_cell_to_ingate"])
        f = sigmoid(gate("forgetgate", x_t, h) + c * p["W_cell_to_forgetgate"])
        c_new = f * c + i * np.tanh(gate("cell", x_t, h))
        o = sigmoid(gate("outgate", x_t, h) + c_new * p["W_cell_to_outgate"])
        return c_new, o * np.tanh(c_new)
    zeros = np.zeros((len(x), UNITS))
    return numpy_loop(step, x, mask, (zeros, zeros), backwards)


def gru_reference(layer, x, mask, backwards):
    p = {name: value(getattr(layer, name)) for name in dir(layer) if name.startswith(("W_", "b_"))}

    def step(x_t, h):
        r = sigmoid(x_t @ p["W_in_to_resetgate"] + p["b_resetgate"] + h @ p["W_hid_to_resetgate"])
        u = sigmoid(x_t @ p["W_in_to_updategate"] + p["b_updategate"] + h @ p["W_hid_to_updategate"])
        c = np.tanh(x_t @ p["W_in_to_hidden_update"] + p["b_hidden_update"] + r * (h @ p["W_hid_to_hidden_update"]))
        return ((1 - u) * h + u * c,)
    return numpy_loop(step, x, mask, (np.zeros((len(x), UNITS)),), backwards)


CASES = [(layers.RecurrentLayer, rnn_reference), (layers.LSTMLayer, lstm_reference),
         (layers.GRULayer, gru_reference)]


@pytest.mark.parametrize("layer_class,reference", CASES, ids=["rnn", "lstm", "gru"])
@pytest.mark.parametrize("options", [{}, {"backwards": True, "precompute_input": False},
                                     {"unroll_scan": True, "only_return_final": True}],
                         ids=["forward", "backwards", "unrolled_final"])
def test_recurrent_layers_match_numpy_loops(layer_class, reference, options):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(BATCH, STEPS, FEATURES))
    mask = np.ones((BATCH, STEPS))
    mask[0, 2:] = 0  # a shorter sequence: its state is carried over
    mask[2, 0] = 0
    l_in = layers.InputLayer((BATCH, STEPS, FEATURES))
    l_mask = layers.InputLayer((BATCH, STEPS))
    layer = layer_class(l_in, UNITS, mask_input=l_mask, **options)
    out = layers.get_output(layer)
    got = pytensor.function([l_in.input_var, l_mask.input_var], out, **FAST)(x, mask)
    expected = reference(layer, x, mask, options.get("backwards", False))
    if options.get("only_return_final"):
        expected = expected[:, -1]
    assert got.shape == expected.shape == tuple(layer.output_shape)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layer_class", [layers.RecurrentLayer, layers.LSTMLayer, layers.GRULayer],
                         ids=["rnn", "lstm", "gru"])
def test_recurrent_gradient_matches_finite_differences(layer_class):
    x = np.random.default_rng(4).normal(size=(2, 3, FEATURES))
    l_in = layers.InputLayer((2, 3, FEATURES))
    layer = layer_class(l_in, UNITS, learn_init=True, **({"nonlinearity": nonlinearities.tanh}
                                                          if layer_class is layers.RecurrentLayer else {}))
    params = layers.get_all_params(layer, trainable=True)
    W = params[-1]  # a hidden-to-hidden or input weight matrix
    loss = pt.sum(layers.get_output(layer) ** 2)
    f = pytensor.function([l_in.input_var], [loss, pytensor.grad(loss, W)], **FAST)
    _, grad = f(x)
    w0 = W.get_value()
    numeric = np.zeros_like(w0)
    eps = 1e-6
    for index in np.ndindex(*w0.shape):
        for sign in (1, -1):
            w = w0.copy()
            w[index] += sign * eps
            W.set_value(w)
            numeric[index] += sign * f(x)[0] / (2 * eps)
    W.set_value(w0)
    assert len(params) == len(set(params)) and any(p.name == "hid_init" for p in params)
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7)


def test_custom_recurrent_layer_with_dense_networks_and_hid_init_layer():
    l_in = layers.InputLayer((2, 3, 4))
    l_h0 = layers.InputLayer((2, UNITS))
    in_to_hid = layers.DenseLayer(layers.InputLayer((None, 4)), UNITS, nonlinearity=None)
    hid_to_hid = layers.DenseLayer(layers.InputLayer((None, UNITS)), UNITS, nonlinearity=None, b=None)
    layer = layers.CustomRecurrentLayer(l_in, in_to_hid, hid_to_hid, nonlinearity=nonlinearities.tanh,
                                        hid_init=l_h0)
    assert layers.get_all_layers(layer) == [l_in, l_h0, layer]
    x = np.random.default_rng(5).normal(size=(2, 3, 4))
    h0 = np.random.default_rng(6).normal(size=(2, UNITS))
    got = pytensor.function([l_in.input_var, l_h0.input_var], layers.get_output(layer), **FAST)(x, h0)
    h, expected = h0, []
    for t in range(3):
        h = np.tanh(x[:, t] @ in_to_hid.W.get_value() + in_to_hid.b.get_value() + h @ hid_to_hid.W.get_value())
        expected.append(h)
    np.testing.assert_allclose(got, np.stack(expected, axis=1), rtol=1e-10)
    with pytest.raises(ValueError, match="unroll_scan"):
        layers.LSTMLayer(layers.InputLayer((2, None, 4)), 3, unroll_scan=True)
