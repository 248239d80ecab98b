"""Data-parallel training equals single-process training, step for step, for every update rule.

Each test trains the same small MLP (four parameters of three shapes, a weight-decay term) in 2
and 3 CPU ranks, and after every step compares every rank's parameters (``synk.gather``) with a
numpy implementation of the rule fed with the single-process PyTensor gradient of the whole
batch.  The batches (7, 10, 1, 5, 8 rows) split unevenly over the ranks, and the batch of one row
leaves some ranks with nothing to do.
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import FAST, TIMEOUT, NumpyRule, Reference, initial_params, loss_graph, make_data, shared_params

import synkhronos as synk
from synk_lasagne import make_train_function, updates

pytestmark = pytest.mark.timeout(TIMEOUT)

SIZES = [7, 10, 1, 5, 8]
N_ROWS = 40
RULES = {
    "sgd": {"learning_rate": 0.1},
    "momentum": {"learning_rate": 0.1, "momentum": 0.8},
    "nesterov_momentum": {"learning_rate": 0.1},
    "adagrad": {"learning_rate": 0.1},
    "rmsprop": {"learning_rate": 0.01},
    "adadelta": {},
    "adam": {"learning_rate": 0.01},
    "adamax": {},
    "amsgrad": {"learning_rate": 0.01, "beta2": 0.9},
}
RTOL, ATOL = 1e-9, 1e-12


@pytest.fixture(scope="module")
def data(ranks):
    x, y = make_data(N_ROWS)
    return x, y, synk.data(x), synk.data(y)


@pytest.fixture(scope="module")
def reference():
    return Reference()


def batches(seed: int = 2) -> list[np.ndarray]:
    order = np.random.default_rng(seed).permutation(N_ROWS)
    ends = np.cumsum(SIZES)
    return [order[e - s:e] for s, e in zip(SIZES, ends)]


def build(rule, **hyper):
    x, y = pt.matrix("x"), pt.ivector("y")
    params = shared_params(initial_params())
    train = make_train_function(loss_graph(x, y, params), params, [x, y], rule, function_kwargs=FAST, **hyper)
    return train, params


def assert_every_rank(params, expected, ranks, what):
    gathered = synk.gather(params, nd_up=1)
    for p, g, e in zip(params, gathered, expected):
        assert g.shape[0] == ranks
        for r in range(ranks):
            np.testing.assert_allclose(g[r], e, rtol=RTOL, atol=ATOL, err_msg=f"{what}: {p.name} in rank {r}")


def train_and_compare(train, params, ref_rule, data, reference, ranks, what, **call):
    x, y, x_data, y_data = data
    ref = initial_params()
    for step, idx in enumerate(batches()):
        loss = train(x_data, y_data, batch=idx, **call)
        ref_loss, grads = reference(x[idx], y[idx], ref)
        ref = ref_rule.step(ref, grads)
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, err_msg=f"{what}: loss of step {step}")
        assert_every_rank(params, ref, ranks, f"{what}, step {step} ({len(idx)} rows)")


@pytest.mark.parametrize("name", list(RULES))
def test_rule_matches_single_process(name, ranks, data, reference):
    train, params = build(getattr(updates, name), **RULES[name])
    train_and_compare(train, params, NumpyRule(name, **RULES[name]), data, reference, ranks, name)


def test_num_slices_accumulates_the_same_gradient(ranks, data, reference):
    train, params = build(updates.adam, learning_rate=0.01)
    train_and_compare(train, params, NumpyRule("adam", learning_rate=0.01), data, reference, ranks,
                      "adam, num_slices=2", num_slices=2)


def test_gradient_clipping_after_the_all_reduce(ranks, data, reference):
    hyper = {"learning_rate": 0.1}
    train, params = build(updates.sgd, grad_transform=lambda g: updates.total_norm_constraint(g, 0.05), **hyper)
    train_and_compare(train, params, NumpyRule("sgd", max_norm=0.05, **hyper), data, reference, ranks,
                      "sgd with total_norm_constraint")


class RmspropWithMomentum:
    """numpy: rmsprop's update, then apply_momentum on it (Lasagne's composition example)."""

    def __init__(self, lr, mu):
        self.rms = NumpyRule("rmsprop", learning_rate=lr)
        self.mu = mu
        self.velocity = None

    def step(self, params, grads):
        stepped = self.rms.step(params, grads)
        if self.velocity is None:
            self.velocity = [np.zeros_like(p) for p in params]
        out = []
        for i, (p, s) in enumerate(zip(params, stepped)):
            x = self.mu * self.velocity[i] + s
            self.velocity[i] = x - p
            out.append(x)
        return out


def test_apply_momentum_composes_with_a_rule(ranks, data, reference):
    def rule(loss_or_grads, params):
        return updates.apply_momentum(updates.rmsprop(loss_or_grads, params, 0.01), params, momentum=0.5)

    train, params = build(rule)
    # rmsprop's accumulator: one flat vector; apply_momentum's velocities: one per parameter
    total = sum(p.get_value().size for p in params)
    assert [v.get_value().shape for v in train.state] == [(total,)] + [p.get_value().shape for p in params]
    train_and_compare(train, params, RmspropWithMomentum(0.01, 0.5), data, reference, ranks,
                      "apply_momentum(rmsprop)")


class SgdWithNormConstraint:
    def __init__(self, lr, max_norm):
        self.lr, self.max_norm = lr, max_norm

    def step(self, params, grads):
        out = [p - self.lr * g for p, g in zip(params, grads)]
        norms = np.sqrt((out[0] ** 2).sum(axis=0, keepdims=True))
        out[0] = out[0] * (np.clip(norms, 0, self.max_norm) / (1e-7 + norms))
        return out


def test_norm_constraint_on_a_parameter_update(ranks, data, reference):
    def rule(loss_or_grads, params):
        result = updates.sgd(loss_or_grads, params, 0.5)
        result[params[0]] = updates.norm_constraint(result[params[0]], 0.6)
        return result

    train, params = build(rule)
    train_and_compare(train, params, SgdWithNormConstraint(0.5, 0.6), data, reference, ranks, "norm_constraint")


def test_adam_keeps_one_step_counter(ranks, data):
    train, params = build(updates.adam)
    counters = [v for v in train.state if v.name == "t"]
    total = sum(p.get_value().size for p in params)
    assert len(counters) == 1 and [v.name for v in train.state] == ["m", "v", "t"]  # flat moments
    assert [v.get_value().shape for v in train.state] == [(total,), (total,), ()]
    _, _, x_data, y_data = data
    for idx in batches()[:3]:
        train(x_data, y_data, batch=idx)
    np.testing.assert_array_equal(synk.gather(counters[0], nd_up=1), np.full(ranks, 3.0))


def test_scattered_data_with_batch_s(ranks, reference):
    """The seed's second data pattern: the data scattered once into sliceable shared variables,
    each rank selecting its own rows with batch_s; equals one process on the union of the rows."""
    x, y = make_data(31, seed=5)
    x_s = pytensor.shared(np.zeros((0, x.shape[1])), name="x_s")
    y_s = pytensor.shared(np.zeros(0, dtype="int32"), name="y_s")
    params = shared_params(initial_params())
    train = make_train_function(loss_graph(x_s, y_s, params), params, [], updates.adam, sliceable_shareds=[x_s, y_s],
                                function_kwargs=FAST, learning_rate=0.01)
    synk.scatter([x_s, y_s], [x, y])
    local = np.array_split(np.arange(len(x)), ranks)  # the global rows each rank holds
    rng = np.random.default_rng(3)
    ref, ref_rule = initial_params(), NumpyRule("adam", learning_rate=0.01)
    for step, per_rank in enumerate([[4, 3, 2], [1, 0, 0], [5, 5, 5]]):
        rows = [rng.permutation(len(part))[:k] for part, k in zip(local, per_rank)]
        loss = train(batch_s=rows)
        union = np.concatenate([part[r] for part, r in zip(local, rows)])
        ref_loss, grads = reference(x[union], y[union], ref)
        ref = ref_rule.step(ref, grads)
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
        assert_every_rank(params, ref, ranks, f"batch_s step {step} ({len(union)} rows)")


def test_extra_outputs_come_after_the_loss(ranks, data):
    x, y = pt.matrix("x"), pt.ivector("y")
    params = shared_params(initial_params())
    logits = pt.tanh(x @ params[0] + params[1]) @ params[2] + params[3]
    accuracy = pt.mean(pt.eq(pt.argmax(logits, axis=1), y))
    train = make_train_function(loss_graph(x, y, params), params, [x, y], updates.sgd, learning_rate=0.1,
                                outputs={"accuracy": accuracy, "rows": (x.shape[0], "sum")}, function_kwargs=FAST)
    assert train.output_names == ["loss", "accuracy", "rows"]
    xv, yv, x_data, y_data = data
    p0 = initial_params()
    logits0 = np.tanh(xv[:9] @ p0[0] + p0[1]) @ p0[2] + p0[3]
    _, acc, rows = train(x_data, y_data, batch=9)
    assert int(rows) == 9
    np.testing.assert_allclose(acc, np.mean(logits0.argmax(1) == yv[:9]))
    with pytest.raises(ValueError, match="empty"):
        train(x_data, y_data, batch=[])


def test_the_step_is_one_function_with_the_all_reduce_in_its_graph(ranks, data, reference):
    """``num_slices=1`` runs ONE Synkhronos function whose graph holds the in-graph all-reduce (the
    chain of the first design is built only for ``num_slices`` > 1); batches of 1 and 2 rows leave
    ranks without rows, which still take part and end with the same parameters."""
    from synkhronos import ops

    train, params = build(updates.sgd, learning_rate=0.1)
    reducers = [n.op for n in ops.collective_nodes(v for _, v in train.function._spec.updates)]
    assert reducers and all(op == ops.AllReduce("sum") for op in reducers)
    x, y, x_data, y_data = data
    ref, ref_rule = initial_params(), NumpyRule("sgd", learning_rate=0.1)
    for idx in ([3], [5, 8], [0, 1, 2, 3, 4, 5, 6]):
        loss = train(x_data, y_data, batch=idx)
        ref_loss, grads = reference(x[idx], y[idx], ref)
        ref = ref_rule.step(ref, grads)
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
        assert_every_rank(params, ref, ranks, f"{len(idx)} rows")
    assert train._sliced is None


@pytest.mark.parametrize("name", ["sgd", "nesterov_momentum", "adam"])
def test_lasagnes_idiom_in_a_synk_function(name, ranks, data, reference):
    """Lasagne's step, ``function([x, y], loss, updates=rule(loss, params, ...))``, built with
    ``synk.function``: the rule's in-graph average makes it the single-process step on uneven
    batches (and on a batch of one row, which leaves ranks without rows)."""
    x, y = pt.matrix("x"), pt.ivector("y")
    params = shared_params(initial_params())
    loss = loss_graph(x, y, params)
    step = synk.function([x, y], loss, updates=getattr(updates, name)(loss, params, **RULES[name]), **FAST)
    train_and_compare(lambda *a, **k: step(*a, **k), params, NumpyRule(name, **RULES[name]), data, reference,
                      ranks, f"synk.function with {name}'s updates")


def test_lasagnes_idiom_equals_make_train_function(ranks, data):
    """The rule's updates in a synk.function and make_train_function take the same steps."""
    x, y = pt.matrix("x"), pt.ivector("y")
    a, b = shared_params(initial_params()), shared_params(initial_params())
    loss_a = loss_graph(x, y, a)
    step = synk.function([x, y], loss_a, updates=updates.adam(loss_a, a, learning_rate=0.01), **FAST)
    train = make_train_function(loss_graph(x, y, b), b, [x, y], updates.adam, learning_rate=0.01,
                                function_kwargs=FAST)
    _, _, x_data, y_data = data
    for idx in batches()[:3]:
        np.testing.assert_allclose(step(x_data, y_data, batch=idx), train(x_data, y_data, batch=idx), rtol=RTOL)
    for pa, pb in zip(synk.gather(a, nd_up=1), synk.gather(b, nd_up=1)):
        np.testing.assert_allclose(pa, pb, rtol=RTOL, atol=ATOL)
