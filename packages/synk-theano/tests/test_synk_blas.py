"""CPU mode's matrix products with numpy's BLAS inside the ranks' JAX programs (synkhronos.blas):
the Op against numpy, the rewrite that makes it (transposed operands read in place), the JAX
custom call against numpy and plain JAX mode, and the switches that keep XLA's own dot."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.tensor.elemwise import DimShuffle
from pytensor.tensor.math import Dot
from synk_testutil import TIMEOUT, USE_GPU

from synkhronos import blas, cpu

pytestmark = [pytest.mark.timeout(TIMEOUT), pytest.mark.skipif(USE_GPU, reason="CPU mode's products")]
needs_blas = pytest.mark.skipif(not (cpu.jax_importable() and blas.available()),
                                reason="needs JAX, a C++ compiler and numpy's OpenBLAS (synkhronos.blas)")


@pytest.fixture(autouse=True)
def default_choice(monkeypatch):
    """No ``SYNK_CPU_BLAS`` from the environment: synkhronos's own choice."""
    monkeypatch.delenv(blas.BLAS_ENV, raising=False)


@pytest.fixture
def x64():
    """JAX computing float64 as float64 (as CPU mode asks when floatX is float64), then as before."""
    import jax

    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def ops_of(fn) -> list:
    return [node.op for node in fn.maker.fgraph.toposort()]


def operands(shape_a, shape_b, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape_a).astype(dtype), rng.standard_normal(shape_b).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("mode", ["FAST_RUN", pytest.param("blas", marks=needs_blas)])
def test_blas_dot_computes_each_transposed_product_as_numpy(x64, dtype, trans_a, trans_b, mode):
    """``op(a) @ op(b)`` for the four transpose flags: numpy's ``perform`` (default mode) and the
    BLAS custom call (CPU ranks' JAX mode), against numpy's product."""
    a_val, b_val = operands((7, 5) if trans_a else (5, 7), (3, 7) if trans_b else (7, 3), dtype)
    a, b = pt.matrix("a", dtype=dtype), pt.matrix("b", dtype=dtype)
    out = blas.BlasDot(trans_a, trans_b)(a, b)
    assert out.type.dtype == dtype
    f = pytensor.function([a, b], out, mode=blas.jax_mode(one_core=True) if mode == "blas" else mode)
    got = np.asarray(f(a_val, b_val))
    expected = (a_val.T if trans_a else a_val) @ (b_val.T if trans_b else b_val)
    assert got.shape == (5, 3) and got.dtype == dtype
    np.testing.assert_allclose(got, expected, rtol=1e-5 if dtype == "float32" else 1e-12)


@needs_blas
@pytest.mark.parametrize("shapes", [((0, 4), (4, 3)), ((5, 4), (4, 0)), ((5, 0), (0, 3))],
                         ids=["no rows", "no columns", "empty sum"])
def test_empty_products_are_empty_or_zeros(shapes):
    a_val, b_val = operands(*shapes, "float32")
    a, b = pt.matrix("a", dtype="float32"), pt.matrix("b", dtype="float32")
    f = pytensor.function([a, b], pt.dot(a, b), mode=blas.jax_mode(one_core=True))
    assert any(isinstance(op, blas.BlasDot) for op in ops_of(f))
    got = np.asarray(f(a_val, b_val))
    np.testing.assert_array_equal(got, np.zeros((shapes[0][0], shapes[1][1]), dtype="float32"))


def mlp_gradient(dtype: str):
    """A two-layer net's loss and gradients (products with transposed operands, as backprop makes)."""
    rng = np.random.default_rng(1)
    x = pt.matrix("x", dtype=dtype)
    w1 = pytensor.shared(rng.standard_normal((6, 8)).astype(dtype), name="w1")
    w2 = pytensor.shared(rng.standard_normal((8, 2)).astype(dtype), name="w2")
    loss = pt.sum(pt.tanh(x @ w1) @ w2) ** 2
    return x, [loss, *pytensor.grad(loss, [w1, w2])]


@needs_blas
def test_the_rewrite_reads_transposed_operands_in_place_and_matches_plain_jax_mode():
    x, outs = mlp_gradient("float32")
    plain = pytensor.function([x], outs, mode="JAX")
    ours = pytensor.function([x], outs, mode=blas.jax_mode(one_core=True))
    blas_dots = [op for op in ops_of(ours) if isinstance(op, blas.BlasDot)]
    assert len(blas_dots) == sum(isinstance(op, Dot) for op in ops_of(plain)) > 0
    assert not any(isinstance(op, Dot) for op in ops_of(ours))
    assert any(op.trans_a or op.trans_b for op in blas_dots)  # the gradient's x.T @ g: a flag, not a copy
    for node in ours.maker.fgraph.toposort():
        if isinstance(node.op, blas.BlasDot):
            for var in node.inputs:
                assert not (var.owner and isinstance(var.owner.op, DimShuffle) and var.owner.op.new_order == (1, 0))
    xd = np.random.default_rng(2).standard_normal((9, 6)).astype("float32")
    for got, expected in zip(ours(xd), plain(xd)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5)


@needs_blas
def test_other_modes_keep_their_own_product():
    """Plain JAX mode and the default mode of the same process never see the rewrite."""
    x, outs = mlp_gradient("float32")
    assert blas.jax_mode(one_core=True) != "JAX"
    for mode in ("JAX", "FAST_RUN"):
        assert not any(isinstance(op, blas.BlasDot) for op in ops_of(pytensor.function([x], outs, mode=mode)))


@pytest.mark.parametrize(("env", "one_core", "used"), [("", True, True), ("", False, False), ("0", True, False),
                                                       ("1", False, True)])
def test_one_core_ranks_use_the_blas_unless_synk_cpu_blas_says_otherwise(monkeypatch, env, one_core, used):
    if env:
        monkeypatch.setenv(blas.BLAS_ENV, env)
    assert blas.wanted(one_core) is used
    if blas.available():
        assert (blas.jax_mode(one_core) != "JAX") is used
    else:
        assert blas.jax_mode(one_core) == "JAX"


def test_a_bad_synk_cpu_blas_is_an_error_that_says_what_to_use(monkeypatch):
    monkeypatch.setenv(blas.BLAS_ENV, "yes")
    with pytest.raises(ValueError, match=r"SYNK_CPU_BLAS='yes': use 0 .* or 1"):
        blas.wanted(True)


def product_node(out):
    """The :class:`Dot` node under ``out`` (a matrix-vector product is a one-column matrix product
    under a squeeze)."""
    node = out.owner
    while not isinstance(node.op, Dot):
        node = node.inputs[0].owner
    return node


def test_the_rewrite_declines_integer_and_mixed_dtype_products():
    """Integer and mixed-dtype products stay :class:`Dot`; a matrix-vector product's one-column
    matrix product is taken."""
    i, j = pt.lmatrix("i"), pt.lmatrix("j")
    a, b = pt.matrix("a", dtype="float32"), pt.matrix("b", dtype="float64")
    for left, right in ((i, j), (a, b)):
        assert blas.use_blas_dot.transform(None, product_node(pt.dot(left, right))) is None
    node = product_node(pt.dot(a, pt.vector("v", dtype="float32")))
    (out,) = blas.use_blas_dot.transform(None, node)
    assert isinstance(out.owner.op, blas.BlasDot) and out.type.shape[1] == 1


@needs_blas
def test_a_matrix_vector_product_computes_as_numpy():
    a_val, v_val = operands((5, 7), (7,), "float32")
    a, v = pt.matrix("a", dtype="float32"), pt.vector("v", dtype="float32")
    f = pytensor.function([a, v], pt.dot(a, v), mode=blas.jax_mode(one_core=True))
    assert any(isinstance(op, blas.BlasDot) for op in ops_of(f))
    np.testing.assert_allclose(np.asarray(f(a_val, v_val)), a_val @ v_val, rtol=1e-5)


def test_blas_dot_refuses_what_it_cannot_multiply():
    with pytest.raises(TypeError, match="two float32 or float64 matrices of one dtype"):
        blas.BlasDot()(pt.matrix("a", dtype="float32"), pt.matrix("b", dtype="float64"))
    with pytest.raises(TypeError, match="matrices"):
        blas.BlasDot()(pt.matrix("a", dtype="float32"), pt.vector("v", dtype="float32"))


def test_the_modules_docstring_examples_run():
    import doctest

    result = doctest.testmod(blas)
    assert result.attempted > 0 and result.failed == 0
