"""The update rules in one process (plain PyTensor, no fork): Lasagne's names, defaults and maths
against numpy, the flat-gradient layout, composition, constraints, errors, and the modules'
docstring examples."""

from __future__ import annotations

import doctest
import inspect
from collections import OrderedDict

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import FAST, NumpyRule, Reference, initial_params, loss_graph, make_data, shared_params

import synk_lasagne
from synk_lasagne import mnist, training, updates

RULES = ["sgd", "momentum", "nesterov_momentum", "adagrad", "rmsprop", "adadelta", "adam", "adamax", "amsgrad"]

LASAGNE_DEFAULTS = {  # Lasagne 0.2's signatures
    "momentum": {"momentum": 0.9},
    "nesterov_momentum": {"momentum": 0.9},
    "apply_momentum": {"params": None, "momentum": 0.9},
    "apply_nesterov_momentum": {"params": None, "momentum": 0.9},
    "adagrad": {"learning_rate": 1.0, "epsilon": 1e-6},
    "rmsprop": {"learning_rate": 1.0, "rho": 0.9, "epsilon": 1e-6},
    "adadelta": {"learning_rate": 1.0, "rho": 0.95, "epsilon": 1e-6},
    "adam": {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
    "adamax": {"learning_rate": 0.002, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
    "amsgrad": {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
    "norm_constraint": {"norm_axes": None, "epsilon": 1e-7},
    "total_norm_constraint": {"epsilon": 1e-7, "return_norm": False},
}


@pytest.mark.parametrize("name", list(LASAGNE_DEFAULTS))
def test_lasagne_defaults(name):
    params = inspect.signature(getattr(updates, name)).parameters
    for arg, default in LASAGNE_DEFAULTS[name].items():
        assert params[arg].default == default, f"{name}({arg}=...) should default to {default}"


def test_public_surface():
    assert set(RULES) | {"apply_momentum", "apply_nesterov_momentum", "norm_constraint",
                         "total_norm_constraint"} <= set(updates.__all__)
    for name in synk_lasagne.__all__:
        assert hasattr(synk_lasagne, name)
    for name in updates.__all__:
        obj = getattr(updates, name)
        assert obj.__doc__ and name in updates.__doc__, f"{name} is not in the module map"


@pytest.mark.parametrize("module", [updates, training, mnist, synk_lasagne], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    with pytensor.config.change_flags(mode="FAST_COMPILE"):  # the maths, without Numba's cold compile
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipped"])
@pytest.mark.parametrize("name", RULES)
def test_rule_in_one_process_matches_numpy(name, clip):
    """Lasagne's idiom in one process: ``pytensor.function(..., updates=rule(loss, params))``,
    three steps against numpy; clipped: with a grad_transform (total_norm_constraint)."""
    x, y = pt.matrix("x"), pt.ivector("y")
    params = shared_params(initial_params())
    hyper = {"learning_rate": 0.05} if name not in ("adadelta", "adamax") else {}
    transform = {"grad_transform": lambda g: updates.total_norm_constraint(g, 0.05)} if clip else {}
    rule = getattr(updates, name)(loss_graph(x, y, params), params, **hyper, **transform)
    assert type(rule) is OrderedDict
    step = pytensor.function([x, y], [], updates=rule, **FAST)
    ref_hyper = {**hyper, "max_norm": 0.05} if clip else hyper
    reference, ref_rule, ref = Reference(), NumpyRule(name, **ref_hyper), initial_params()
    xv, yv = make_data(30)
    for rows in (slice(0, 10), slice(10, 13), slice(13, 30)):
        step(xv[rows], yv[rows])
        ref = ref_rule.step(ref, reference(xv[rows], yv[rows], ref)[1])
        for p, e in zip(params, ref):
            np.testing.assert_allclose(p.get_value(), e, rtol=1e-10, atol=1e-13, err_msg=f"{name}: {p.name}")


@pytest.mark.parametrize("name", RULES)
def test_rule_state_is_flat_vectors_after_the_parameters(name):
    """The updates: the parameters in their order, then the rule's state, each a vector of every
    parameter value (the parameters' order), and Adam's counter."""
    x, y = pt.matrix("x"), pt.ivector("y")
    params = shared_params(initial_params())
    rule = getattr(updates, name)(loss_graph(x, y, params), params, learning_rate=0.1)
    keys = list(rule)
    assert keys[:len(params)] == params
    total = sum(p.get_value().size for p in params)
    state = keys[len(params):]
    for v in state:
        assert v.get_value().shape == (() if v.name == "t" else (total,)), v.name
    expected = {"sgd": [], "momentum": ["velocity"], "nesterov_momentum": ["velocity"], "adagrad": ["accu"],
                "rmsprop": ["accu"], "adadelta": ["accu", "delta_accu"], "adam": ["m", "v", "t"],
                "adamax": ["m", "u", "t"], "amsgrad": ["m", "v", "v_hat", "t"]}[name]
    assert [v.name for v in state] == expected


def _all_reduces(exprs):
    from synkhronos import ops

    return [n.op for n in ops.collective_nodes(exprs)]


def test_one_average_all_reduce_identity_in_a_plain_function():
    """The rules average the joined gradients with ONE in-graph all-reduce (avg), the identity in a
    plain function; inside no_all_reduce() they read the gradients as given."""
    from synkhronos import ops

    x, y = pt.matrix("x"), pt.ivector("y")
    params = shared_params(initial_params())
    loss = loss_graph(x, y, params)
    assert _all_reduces(updates.adam(loss, params).values()) == [ops.AllReduce("avg")]
    with updates.no_all_reduce():
        assert _all_reduces(updates.adam(loss, params).values()) == []
    grads = updates.average_over_ranks(pytensor.grad(loss, params))
    assert _all_reduces(grads) == [ops.AllReduce("avg")]
    xv, yv = make_data(9)
    values = pytensor.function([x, y], grads, **FAST)(xv, yv)
    for got, expected in zip(values, Reference()(xv, yv, initial_params())[1]):
        np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_flat_gradient_layout():
    """flat_grad = weight * concatenated raveled gradients, then the weight; views divide by it."""
    x = pt.matrix("x")
    a = pytensor.shared(np.arange(6.0).reshape(2, 3), name="a")
    b = pytensor.shared(np.ones(2), name="b")
    loss = pt.mean(x @ a.T @ b)  # rows of x: 3 values
    flat, expr, views = updates.flat_gradient(loss, [a, b], x.shape[0])
    assert flat.get_value().shape == (6 + 2 + 1,)
    xv = np.arange(12.0).reshape(4, 3)
    pytensor.function([x], [], updates=[(flat, expr)], **FAST)(xv)
    ga, gb = pytensor.grad(loss, [a, b])
    exact_a, exact_b = pytensor.function([x], [ga, gb], **FAST)(xv)
    np.testing.assert_allclose(flat.get_value(), np.concatenate([4 * exact_a.ravel(), 4 * exact_b, [4.0]]))
    view_a, view_b = pytensor.function([], views, **FAST)()
    np.testing.assert_allclose(view_a, exact_a)
    np.testing.assert_allclose(view_b, exact_b)


def test_get_or_compute_grads_returns_given_gradients():
    w = pytensor.shared(np.zeros(2), name="w")
    grads = [pt.ones(2)]
    assert updates.get_or_compute_grads(grads, [w]) is grads


def test_apply_momentum_keeps_lasagne_semantics():
    w = pytensor.shared(np.ones(3), name="w")
    plain = OrderedDict([(w, w - 0.5)])
    with_momentum = updates.apply_momentum(plain, momentum=0.5)
    assert isinstance(with_momentum, OrderedDict) and len(plain) == 1 and len(with_momentum) == 2
    f = pytensor.function([], [], updates=with_momentum, **FAST)
    f()
    f()  # velocity: -0.5, then 0.5 * -0.5 - 0.5 = -0.75
    np.testing.assert_allclose(w.get_value(), 1 - 0.5 - 0.75)
    nesterov = updates.apply_nesterov_momentum(OrderedDict([(w, w - 0.5)]), [w], momentum=0.5)
    w.set_value(np.ones(3))
    pytensor.function([], [], updates=nesterov, **FAST)()  # velocity -0.5; w := 0.5 * -0.5 + (1 - 0.5)
    np.testing.assert_allclose(w.get_value(), 0.25)


def test_one_counter_for_every_parameter():
    params = shared_params(initial_params())
    x, y = pt.matrix("x"), pt.ivector("y")
    for name in ("adam", "adamax", "amsgrad"):
        rule = getattr(updates, name)(loss_graph(x, y, params), params)
        counters = [v for v in rule if v.name == "t"]
        assert len(counters) == 1, f"{name} has {len(counters)} step counters"
        pytensor.function([x, y], [], updates=rule, **FAST)  # compiles with 4 parameters


def test_norm_constraint_matches_numpy():
    values = np.random.default_rng(0).normal(size=(3, 4, 2, 2)) * 5
    out = pytensor.function([], updates.norm_constraint(pt.constant(values), 2.0), **FAST)()
    norms = np.sqrt((values ** 2).sum(axis=(1, 2, 3), keepdims=True))
    np.testing.assert_allclose(out, values * np.clip(norms, 0, 2.0) / (1e-7 + norms))
    matrix = np.array([[3.0, 0.1], [4.0, 0.1]])
    out = pytensor.function([], updates.norm_constraint(pt.constant(matrix), 1.0), **FAST)()
    np.testing.assert_allclose(np.sqrt((out ** 2).sum(axis=0)), [1.0, np.sqrt(0.02)], rtol=1e-6)
    with pytest.raises(ValueError, match="norm_axes"):
        updates.norm_constraint(pt.vector("v"), 1.0)


def test_total_norm_constraint_matches_numpy():
    a, b = np.array([3.0, 0.0]), np.array([[4.0]])
    (sa, sb), norm = updates.total_norm_constraint([pt.constant(a), pt.constant(b)], 1.0, return_norm=True)
    out_a, out_b, out_norm = pytensor.function([], [sa, sb, norm], **FAST)()
    assert out_norm == pytest.approx(5.0)
    np.testing.assert_allclose(np.concatenate([out_a, out_b.ravel()]), np.array([3.0, 0.0, 4.0]) / 5, rtol=1e-6)


def test_bad_arguments():
    w = pytensor.shared(np.zeros(2), name="w")
    x = pt.vector("x")
    loss = pt.sum(w * x)
    with pytest.raises(ValueError, match="shared variables"):
        updates.sgd(loss, [x], 0.1)
    with pytest.raises(ValueError, match="2 gradient expressions for 1"):
        updates.sgd([x, x], [w], 0.1)
    with pytest.raises(ValueError, match="scalar"):
        updates.sgd(w * x, [w], 0.1)
    with pytest.raises(ValueError, match="empty"):
        updates.sgd(loss, [], 0.1)
    with pytest.raises(ValueError, match="more than once"):
        updates.sgd(loss, [w, w], 0.1)
    with pytest.raises(ValueError, match="grad_transform returned"):
        updates.sgd(loss, [w], 0.1, grad_transform=lambda g: [])
    with pytest.raises(ValueError, match="weight must be a scalar"):
        updates.flat_gradient(loss, [w], x)
    i = pytensor.shared(np.zeros(2, dtype="int64"), name="i")
    with pytest.raises(ValueError, match="floating point"):
        updates.sgd([pt.zeros(2)], [i], 0.1)


def test_float32_params_stay_float32():
    w = pytensor.shared(np.ones(3, dtype="float32"), name="w")
    x = pt.matrix("x", dtype="float32")
    rule = updates.adam(pt.mean(x @ w), [w], learning_rate=0.1)
    assert all(var.type.dtype == "float32" and expr.dtype == "float32" for var, expr in rule.items())


def test_layers_import_alone():
    """synk_lasagne imports without the optional extras (tqdm only when training, sklearn and
    matplotlib only for the example's data and plot)."""
    import subprocess
    import sys

    code = ("import sys, synk_lasagne; "
            "bad = [m for m in ('sklearn', 'matplotlib', 'tqdm', 'jax') if m in sys.modules]; assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_rules_apply_the_state_updates_of_their_loss():
    """Lasagne's idiom in a plain function advances batch norm's running averages (as Lasagne's
    graph does): the rule's updates hold the loss's state updates, gradients alone do not."""
    from synk_lasagne import layers

    x = pt.matrix("x")
    net = layers.BatchNormLayer(layers.InputLayer((None, 2), x), alpha=0.5)
    out = layers.DenseLayer(net, 1)
    loss = pt.mean(layers.get_output(out) ** 2)
    params = layers.get_all_params(out, trainable=True)
    rule = updates.sgd(loss, params, 0.1)
    assert net.mean in rule and net.inv_std in rule
    assert net.mean not in updates.sgd(pytensor.grad(loss, params), params, 0.1)
    xv = np.array([[1.0, 2.0], [3.0, 6.0]])
    pytensor.function([x], loss, updates=rule, **FAST)(xv)
    np.testing.assert_allclose(net.mean.get_value(), 0.5 * xv.mean(axis=0))
