"""Precision policies (:mod:`synkhronos.precision`): the transformation of JAX functions alone, PyTensor's
JAX mode under a policy, and Synkhronos functions under ``precision=`` in a forked group.

References: the same function in float32 (``"bf16"`` results are close to it, and differ from it, so the
policy is in effect), numpy in float64 (``"highest"``), and a single-process PyTensor function compiled
under the same policy (a group's training step under ``"bf16"`` equals it).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from jax import lax  # noqa: E402
from synk_testutil import USE_GPU  # noqa: E402

import synkhronos as synk  # noqa: E402
from synkhronos import emulation, precision  # noqa: E402

RTOL = 2e-2
SPLIT_RTOL = 1e-2 if USE_GPU and not emulation.emulated_gpus() else 1e-4
"""A group's bf16 step against the same step in one process: on the CPU the same roundings (only
float32 sums change order); on GPUs cuBLAS's bfloat16 products of other shapes (each rank's share
of the rows) round differently, to within bfloat16's precision (measured on H200: the loss 2.7e-4
apart, parameters within 1e-3 of their largest)."""


@pytest.fixture
def jax32():
    """JAX's 32-bit default for a test of JAX functions alone, whatever an earlier test of this pytest
    process left (a CPU-mode fork turns ``jax_enable_x64`` on in the master under ``floatX=float64``)."""
    with jax.enable_x64(False):
        yield


def products(closed):
    """Every dot_general/conv_general_dilated equation of a ClosedJaxpr, sub-jaxprs included."""
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                yield eqn
            for value in eqn.params.values():
                for item in value if isinstance(value, tuple) else (value,):
                    sub = getattr(item, "jaxpr", item)  # a ClosedJaxpr's, or an open Jaxpr
                    if hasattr(sub, "eqns"):
                        yield from walk(sub)

    return list(walk(closed.jaxpr))


@jax.custom_vjp
def _matmul_vjp(a, b):
    return a @ b


_matmul_vjp.defvjp(lambda a, b: (a @ b, (a, b)), lambda res, g: (g @ res[1].T, res[0].T @ g))


def structured(x, w, n):
    """Products at the top, in jit (einsum), custom_jvp (relu around one), custom_vjp, scan, while and cond;
    ``n`` a static Python int."""
    y = jax.nn.relu(x @ w)
    y = jnp.einsum("ij,jk->ik", y, w) / n

    def step(c, _):
        return jnp.tanh(_matmul_vjp(c, w)), jnp.sum(c)

    y, sums = lax.scan(step, y, None, length=2)
    y = lax.while_loop(lambda c: c[1] < 2, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (y, 0))[0]
    y = lax.cond(jnp.sum(sums) > -1e9, lambda a: jnp.tanh(a @ w), lambda a: a, y)
    conv = lax.conv_general_dilated(y[None, None], w[None, None, :3, :3], (1, 1), "SAME")
    return y, conv[0, 0], jnp.arange(3) @ jnp.arange(3)  # an integer product: left alone


def _inputs():
    rng = np.random.default_rng(0)
    return rng.standard_normal((6, 5)).astype(np.float32), (rng.standard_normal((5, 5)) / 2).astype(np.float32)


def test_bf16_transform_rewrites_every_float32_product(jax32):
    x, w = _inputs()
    f = precision.apply(structured, "bf16")
    closed = jax.make_jaxpr(lambda a, b: f(a, b, 3))(x, w)
    found = products(closed)
    assert len(found) == 7  # the top one, einsum, custom_vjp, while, cond, conv, the integer one
    for eqn in found:
        dtypes = {v.aval.dtype for v in eqn.invars[:2]}
        if dtypes == {np.dtype(np.int32)}:
            continue
        assert dtypes == {np.dtype(jnp.bfloat16)}, eqn
        assert eqn.outvars[0].aval.dtype == jnp.bfloat16  # an activation: bfloat16 (float32 accumulation inside)
    assert [v.aval.dtype for v in closed.jaxpr.outvars] == [np.float32, np.float32, np.int32]
    want = jax.jit(structured, static_argnums=2)(x, w, 3)
    got = jax.jit(f, static_argnums=2)(x, w, 3)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
    for a, b in zip(got[:2], want[:2]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * float(np.abs(b).max()))
        assert not np.array_equal(a, b)  # the operands really were rounded to bfloat16
    assert int(got[2]) == int(want[2]) == 5


def test_highest_transform_sets_the_precision_of_every_product(jax32):
    x, w = _inputs()
    f = precision.apply(structured, "highest")
    found = products(jax.make_jaxpr(lambda a, b: f(a, b, 3))(x, w))
    floats = [e for e in found if e.invars[0].aval.dtype == np.float32]
    assert len(floats) == 6
    assert all(e.params["precision"] == (lax.Precision.HIGHEST,) * 2 for e in floats)
    got = jax.jit(f, static_argnums=2)(x, w, 3)
    want = jax.jit(structured, static_argnums=2)(x, w, 3)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)  # float32 on the CPU either way


def test_default_is_the_function_itself_and_bad_names_raise():
    assert precision.apply(structured, "default") is structured
    assert precision.check(None) == "default"
    with pytest.raises(ValueError, match="precision must be one of 'default', 'highest', 'bf16'"):
        precision.check("float16")


def test_no_backend_without_jax_is_a_clear_error():
    from synkhronos.device import CpuDevice

    with pytest.raises(ValueError, match="CPU mode's ranks compile with PyTensor's default mode"):
        precision.check_backend("bf16", CpuDevice("pytensor"))
    with pytest.raises(ValueError, match="mode='NUMBA' is not a JAX mode"):
        precision.check_backend("bf16", CpuDevice("pytensor"), "NUMBA")
    with pytest.raises(ValueError, match="applies to functions compiled with JAX"):
        precision.jax_mode(None, "bf16")
    precision.check_backend("default", CpuDevice("pytensor"), "NUMBA")  # nothing to apply


def _dense_net():
    """A float32 dense + batch-norm-like + dense graph, its input, parameters and input value (the
    convolutions: synk_lasagne's tests, where the Op lives)."""
    rng = np.random.default_rng(1)
    x = pt.fmatrix("x")
    k = pytensor.shared((rng.standard_normal((10, 12)) / 3).astype(np.float32), name="k")
    d = pytensor.shared((rng.standard_normal((12, 3)) / 3).astype(np.float32), name="d")
    h = x @ k
    h = pt.maximum((h - h.mean(axis=0)) / pt.sqrt(h.var(axis=0) + np.float32(1e-5)), 0)
    return x, [k, d], h @ d, rng.standard_normal((5, 10)).astype(np.float32)


def test_pytensor_jax_mode_under_bf16_keeps_float32_outputs():
    x, params, out, xv = _dense_net()
    loss = pt.mean(out ** 2)
    grads = pytensor.grad(loss, params)
    want = pytensor.function([x], [out, *grads], mode="JAX")(xv)
    fn = pytensor.function([x], [out, *grads], mode=precision.jax_mode("JAX", "bf16"))
    assert precision.policy_of(fn) == "bf16"
    got = fn(xv)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype  # the translation's own dtypes (float64 after a float64 accumulator under x64)
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * float(np.abs(b).max()))
        assert not np.array_equal(a, b)


# -- in a forked group --------------------------------------------------------------------------------
ROWS = 12


def _step():
    """A momentum step of a small tanh MLP whose gradient is all-reduced in the graph: loss, updates,
    parameters, velocities."""
    lr, mu = np.float32(0.2), np.float32(0.9)
    rng = np.random.default_rng(2)
    x, y = pt.fmatrix("x"), pt.fmatrix("y")
    w1 = pytensor.shared((rng.standard_normal((8, 16)) / 3).astype(np.float32), name="w1")
    w2 = pytensor.shared((rng.standard_normal((16, 4)) / 4).astype(np.float32), name="w2")
    params = [w1, w2]
    vel = [pytensor.shared(np.zeros(p.get_value().shape, np.float32), name=f"v_{p.name}") for p in params]
    per_row = pt.sum((pt.tanh(x @ w1) @ w2 - y) ** 2, axis=1)
    grads = pytensor.grad(pt.sum(per_row), params)
    updates = []
    for p, v, g in zip(params, vel, grads):
        new_v = mu * v + synk.ops.all_reduce(g, "sum") / np.float32(ROWS)
        updates += [(v, new_v), (p, p - lr * new_v)]
    return [x, y], pt.mean(per_row), updates, params + vel


def _batch():
    rng = np.random.default_rng(3)
    return rng.standard_normal((ROWS, 8)).astype(np.float32), rng.standard_normal((ROWS, 4)).astype(np.float32)


def _one_process(policy: str, steps: int) -> tuple[list[float], list[np.ndarray]]:
    """The step in this process alone (one rank: its all-reduce is the identity) under ``policy``."""
    inputs, loss, updates, state = _step()
    fn = pytensor.function(inputs, loss, updates=updates, mode=precision.jax_mode("JAX", policy))
    xv, yv = _batch()
    losses = [float(fn(xv, yv)) for _ in range(steps)]
    return losses, [np.asarray(v.get_value()) for v in state]


def test_bf16_training_in_the_group_equals_one_process(ranks):
    inputs, loss, updates, state = _step()
    train = synk.function(inputs, loss, updates=updates, precision="bf16")
    assert train.precision == "bf16"
    xv, yv = _batch()
    xd, yd = synk.data(xv), synk.data(yv)
    losses = [float(train(xd, yd)) for _ in range(2)]
    values = [v.get_value() for v in state]
    assert all(v.dtype == np.float32 for v in values)  # parameters and velocities stay float32
    want_losses, want_values = _one_process("bf16", 2)
    np.testing.assert_allclose(losses, want_losses, rtol=SPLIT_RTOL)
    for got, want in zip(values, want_values):
        atol = max(1e-6, SPLIT_RTOL * 0.2 * float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=SPLIT_RTOL, atol=atol)
    f32_losses, f32_values = _one_process("highest", 2)
    np.testing.assert_allclose(losses, f32_losses, rtol=RTOL)
    assert not np.array_equal(values[0], f32_values[0])  # the policy is in effect
    np.testing.assert_allclose(values[0], f32_values[0], rtol=RTOL, atol=RTOL * float(np.abs(f32_values[0]).max()))


def test_outputs_keep_the_graph_dtypes_and_the_fork_default_applies(ranks):
    from synkhronos.runtime import current

    x = pt.fmatrix("x")
    w = pytensor.shared(np.random.default_rng(4).standard_normal((8, 3)).astype(np.float32), name="w")
    out = pt.tanh(x @ w)
    xv = _batch()[0]
    want = pytensor.function([x], out, mode="JAX")(xv)
    rt = current()
    rt.precision = "bf16"  # as fork(precision="bf16") sets it
    try:
        fn = synk.function([x], [(out, "gather"), (pt.argmax(out, axis=1), "gather")])
    finally:
        rt.precision = "default"
    assert fn.precision == "bf16"
    got, idx = fn(synk.data(xv))
    assert got.dtype == np.float32 and idx.dtype == np.int64
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL)
    assert not np.array_equal(got, want)
    assert synk.function([x], out).precision == "default"
    with pytest.raises(ValueError, match="is not a JAX mode"):
        synk.function([x], out, precision="bf16", mode="NUMBA")


# -- the all-reduce in bfloat16 (ops.all_reduce(..., dtype="bfloat16")) ------------------------------
def test_round_bfloat16_is_jax_bfloat16(jax32):
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 4000),
                        np.array([0.0, -0.0, np.inf, -np.inf, 1 + 2**-8, 1 + 3 * 2**-8], np.float32)])
    want = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(synk.ops.round_bfloat16(x), want)
    assert np.isnan(synk.ops.round_bfloat16(np.array([np.nan], np.float32)))[0]


def test_bfloat16_all_reduce_rounds_each_rank_and_the_sum(ranks):
    """Each rank's sum of its rows (exact in float32: multiples of 2**-10), rounded to bfloat16, summed
    (exact), and the sum rounded: the reference in numpy; the float32 all-reduce differs from it."""
    rng = np.random.default_rng(8)
    xv = (rng.integers(0, 4096, (ROWS, 8)) / 1024).astype(np.float32)
    x = pt.fmatrix("x")
    part = pt.sum(x, axis=0)
    fn = synk.function([x], [(synk.ops.all_reduce(part, "sum", dtype="bfloat16"), "gather"),
                             (synk.ops.all_reduce(part, "sum"), "gather")])
    got, exact = (np.asarray(v).reshape(ranks, 8) for v in fn(synk.data(xv)))
    shares = np.array_split(xv, ranks)
    want = synk.ops.round_bfloat16(sum(synk.ops.round_bfloat16(s.sum(axis=0)) for s in shares))
    assert got.dtype == np.float32
    for r in range(ranks):  # every rank holds the same sum
        np.testing.assert_array_equal(got[r], want)
        np.testing.assert_array_equal(exact[r], xv.sum(axis=0))
    assert not np.array_equal(got[0], exact[0])
    np.testing.assert_allclose(got[0], exact[0], rtol=2**-7)  # three roundings of 2**-9 at most


def test_bfloat16_all_reduce_refuses_what_it_cannot_send():
    with pytest.raises(ValueError, match="use op='sum' or 'avg'"):
        synk.ops.all_reduce(pt.fvector(), "max", dtype="bfloat16")
    with pytest.raises(ValueError, match="use one of"):
        synk.ops.all_reduce(pt.fvector(), "sum", dtype="float16")
    with pytest.raises(TypeError, match="cast x to float32"):
        synk.ops.all_reduce(pt.dvector(), "sum", dtype="bfloat16")


# -- bfloat16 activations: a small CNN with batch norm, its training step in JAX ----------------------
def _cnn_state():
    rng = np.random.default_rng(5)
    params = {"k1": (rng.standard_normal((8, 1, 3, 3)) / 3).astype(np.float32),
              "gamma": np.ones(8, np.float32), "beta": np.zeros(8, np.float32),
              "w": (rng.standard_normal((8 * 8 * 8, 3)) / 20).astype(np.float32), "b": np.zeros(3, np.float32)}
    stats = {"mean": np.zeros(8, np.float32), "var": np.ones(8, np.float32)}
    x = rng.standard_normal((16, 1, 8, 8)).astype(np.float32)
    labels = (x.mean(axis=(1, 2, 3)) > 0).astype(np.int32) + (x[:, 0, 0, 0] > 1).astype(np.int32)
    return params, stats, x, labels


def _cnn_loss(params, x, labels):
    """conv -> batch norm (batch statistics) -> ReLU -> dense -> softmax cross-entropy; the loss and the
    batch statistics."""
    h = lax.conv_general_dilated(x, params["k1"], (1, 1), "SAME")
    mean, var = h.mean(axis=(0, 2, 3)), h.var(axis=(0, 2, 3))
    h = (h - mean[None, :, None, None]) * lax.rsqrt(var + 1e-5)[None, :, None, None]
    h = jnp.maximum(h * params["gamma"][None, :, None, None] + params["beta"][None, :, None, None], 0.0)
    logits = h.reshape(h.shape[0], -1) @ params["w"] + params["b"]
    logp = logits - jax.nn.logsumexp(logits, axis=1, keepdims=True)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1)), (mean, var)


def _cnn_step(params, stats, x, labels):
    """A plain SGD step and the running averages of the batch statistics: loss, parameters, statistics."""
    (loss, (mean, var)), grads = jax.value_and_grad(_cnn_loss, has_aux=True)(params, x, labels)
    params = {k: params[k] - 0.1 * grads[k] for k in params}
    stats = {"mean": 0.9 * stats["mean"] + 0.1 * mean, "var": 0.9 * stats["var"] + 0.1 * var}
    return loss, params, stats


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple) else (value,):
                sub = getattr(item, "jaxpr", item)
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


def test_bf16_computes_activations_in_bfloat16_and_keeps_state_float32(jax32):
    params, stats, x, labels = _cnn_state()
    closed = jax.make_jaxpr(precision.apply(_cnn_step, "bf16"))(params, stats, x, labels)
    eqns = list(_eqns(closed.jaxpr))
    names = {e.primitive.name for e in eqns}
    assert not names & {"jit", "pjit", "custom_jvp_call", "custom_vjp_call"}  # evaluated in place
    out_dtype = {e.primitive.name: set() for e in eqns}
    for e in eqns:
        out_dtype[e.primitive.name] |= {np.dtype(v.aval.dtype) for v in e.outvars}
    bf16 = np.dtype(jnp.bfloat16)
    # forward and backward products (the convolution, its two gradients, the dense layer's three): bfloat16
    products_ = [e for e in eqns if e.primitive.name in ("dot_general", "conv_general_dilated")]
    assert len(products_) >= 5
    assert all(e.outvars[0].aval.dtype == bf16 for e in products_)
    assert all(v.aval.dtype == bf16 for e in products_ for v in e.invars)
    # the activations between them (batch norm's arithmetic, ReLU, the gradient's element-wise ops): an
    # element-wise op with a bfloat16 operand makes bfloat16, or computes in float32 and is rounded at once
    consumers = {}
    for e in closed.jaxpr.eqns:
        for v in e.invars:
            if not hasattr(v, "val"):  # a Var, not a Literal
                consumers.setdefault(v, []).append(e)
    mixed = [e for e in closed.jaxpr.eqns if e.primitive.name in ("add", "sub", "mul", "max", "neg", "select_n")
             and any(getattr(v.aval, "dtype", None) == bf16 for v in e.invars)]
    assert len(mixed) >= 6
    for e in mixed:
        out = e.outvars[0]
        assert out.aval.dtype == bf16 or all(
            c.primitive.name == "convert_element_type" and c.params["new_dtype"] == bf16 for c in consumers[out]), e
    activation = (16, 8, 8, 8)
    in_bf16 = {e.primitive.name for e in mixed
               if e.outvars[0].aval.dtype == bf16 and e.outvars[0].aval.shape == activation}
    assert {"max", "mul", "neg"} <= in_bf16  # ReLU and batch norm's gradient
    # reductions and transcendentals: float32 only
    for name in ("reduce_sum", "reduce_max", "exp", "log", "rsqrt"):
        assert out_dtype[name] == {np.dtype(np.float32)}, name
    # every result, parameter and statistic: float32
    assert all(v.aval.dtype == np.float32 for v in closed.jaxpr.outvars)


def test_bf16_trains_a_cnn_with_batch_norm(jax32):
    params, stats, x, labels = _cnn_state()
    bf16_step = jax.jit(precision.apply(_cnn_step, "bf16"))
    f32_step = jax.jit(_cnn_step)
    p16, s16, p32, s32 = params, stats, params, stats
    losses, f32_losses = [], []
    for _ in range(15):
        loss, p16, s16 = bf16_step(p16, s16, x, labels)
        f32_loss, p32, s32 = f32_step(p32, s32, x, labels)
        losses.append(float(loss))
        f32_losses.append(float(f32_loss))
    assert losses[-1] < 0.6 * losses[0]  # it learns
    np.testing.assert_allclose(losses, f32_losses, rtol=5e-2)  # as float32 does
    assert losses != f32_losses
    for tree in (p16, s16):
        assert all(np.asarray(v).dtype == np.float32 for v in tree.values())
    np.testing.assert_allclose(s16["var"], s32["var"], rtol=5e-2)


def test_bf16_reductions_of_activations_sum_in_float32(jax32):
    """``sum(relu(x @ w), axis=0)`` under ``"bf16"``: a batch's sum of bfloat16 activations (as a bias's
    gradient, or batch norm's mean) against a bound of its error.

    With ``u = 2^-8`` (bfloat16's unit roundoff) and ``gamma_n = n 2^-24 / (1 - n 2^-24)`` (a float32
    sum of ``n`` terms): each activation ``z~`` is the bfloat16 rounding of a float32 sum of ``K = 64``
    exact products of rounded operands, so ``|z~ - z| <= u |z| + (1 + u) gamma_K A`` (``z`` the exact
    product of the rounded operands, ``A`` the sum of its terms' absolute values; ReLU does not widen a
    difference); their float32 sum over ``n = 4096`` rows adds at most ``gamma_n sum |z~|``.  A sum in
    bfloat16 instead stops growing once its partial sum is 2^8 times a term (here after about 500 of
    the 4096 rows), far beyond the bound; the test checks that numpy's bfloat16 sum of the same values
    breaks it.
    """
    import ml_dtypes

    rng = np.random.default_rng(12)
    n, k = 4096, 64
    xv = rng.standard_normal((n, k)).astype(np.float32)
    wv = (rng.standard_normal((k, 8)) / 8).astype(np.float32)
    x, w = pt.fmatrix("x"), pt.fmatrix("w")
    z = pt.maximum(x @ w, 0)
    fn = pytensor.function([x, w], [z, pt.sum(z, axis=0)], mode=precision.jax_mode("JAX", "bf16"))
    z_got, got = (np.asarray(v) for v in fn(xv, wv))
    assert got.dtype == np.float32
    xr, wr = (v.astype(ml_dtypes.bfloat16).astype(np.float64) for v in (xv, wv))
    z_exact = np.maximum(xr @ wr, 0)
    gamma = [m * 2.0 ** -24 / (1 - m * 2.0 ** -24) for m in (k, n)]
    u = 2.0 ** -8
    bound = (u * z_exact.sum(axis=0) + (1 + u) * gamma[0] * (np.abs(xr) @ np.abs(wr)).sum(axis=0)
             + gamma[1] * np.abs(z_got).sum(axis=0))
    exact = z_exact.sum(axis=0)
    assert np.all(np.abs(got - exact) <= bound), (np.abs(got - exact) / bound).max()
    in_bf16 = z_got.astype(ml_dtypes.bfloat16).sum(axis=0, dtype=ml_dtypes.bfloat16).astype(np.float64)
    assert np.all(np.abs(in_bf16 - exact) > bound)  # the bound catches a bfloat16 sum (numpy's: in order)
