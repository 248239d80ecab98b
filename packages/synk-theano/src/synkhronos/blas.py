"""CPU mode's matrix products: a rank pinned to one core computes the products of its JAX
programs with the process's BLAS (numpy's OpenBLAS) instead of XLA's own CPU dot.

XLA's CPU dot is Eigen's.  On one core it runs the benchmark MLP's float32 products (2048 x 1024
by 1024 x 1024) at 54-66 GFLOP/s where numpy's OpenBLAS (and torch) run them at 76-80, and a
training step of large layers is mostly such products: one core's MLP step took 640-650 ms with
XLA's dot and 505-520 ms with this one (development VM, AMD EPYC; ``docs/guides/cpu.rst``).

How
    :func:`jax_mode` is PyTensor's JAX mode plus one graph rewrite, :func:`use_blas_dot`, which
    replaces each product of two float matrices (:class:`~pytensor.tensor.math.Dot`) by
    :class:`BlasDot`, taking a transposed operand as a flag instead (the gradient's ``x.T @ g``:
    no copy of ``x.T``).  Under JAX a :class:`BlasDot` is a custom call (``blas_dot.cc``, built
    at first use by :func:`synk_comm.xla_cpu.register_handler`) of numpy's BLAS ``gemm``.  Small
    products gain too on one core: the eight 64-wide layers of the main job's gradient took
    2.0-2.4 ms against 2.2-2.9 ms with XLA's dot at 512 rows, 0.24-0.27 against 0.33-0.42 ms at
    32 rows.
Where
    In ranks pinned to one core of their own (the default with as many ranks as cores); ranks of
    several cores keep XLA's dot, whose thread pool would take turns with the BLAS's
    (:func:`wanted`).  ``SYNK_CPU_BLAS=1`` uses the BLAS in every rank, ``=0`` in none.  A
    function with a mode of its own never sees it, nor do plain PyTensor functions of the same
    process.
When not
    Without a C++ compiler, or where numpy's BLAS is not an ILP64 OpenBLAS whose ``gemm`` it can
    find (``scipy_cblas_sgemm64_``, ``cblas_sgemm64_``), :func:`available` is False (one log line)
    and ranks compile with plain JAX mode.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pytensor.graph.basic import Apply, Variable
from pytensor.graph.op import Op
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.tensor.elemwise import DimShuffle
from pytensor.tensor.math import Dot
from pytensor.tensor.type import TensorType

__all__ = ["BLAS_ENV", "BlasDot", "available", "jax_mode", "use_blas_dot", "wanted"]

log = logging.getLogger("synkhronos")

BLAS_ENV = "SYNK_CPU_BLAS"
"""``0``: CPU ranks keep XLA's own dot; ``1``: every CPU rank uses the BLAS (see :func:`wanted`)."""
TAG = "synk_blas"
"""The rewrite's tag in PyTensor's rewrite database: only :func:`jax_mode` includes it."""
SOURCE = Path(__file__).with_name("blas_dot.cc")
TARGET = "synkhronos_blas_dot"
GEMM_SYMBOLS = ("scipy_cblas_{}gemm64_", "cblas_{}gemm64_")
"""Where numpy's OpenBLAS keeps its ILP64 gemm (numpy >= 2, then older wheels)."""
FLOAT_DTYPES = ("float32", "float64")
_state: dict[str, Any] = {}


def _float_matrices(a: Variable, b: Variable) -> bool:
    """Whether ``a`` and ``b`` are float32 or float64 matrices of one dtype."""
    return a.type.ndim == 2 and b.type.ndim == 2 and a.type.dtype == b.type.dtype and a.type.dtype in FLOAT_DTYPES


class BlasDot(Op):
    """``op(a) @ op(b)`` of two float matrices of one dtype, ``op`` the transpose where
    ``trans_a`` / ``trans_b`` says so.

    Made by :func:`use_blas_dot` after differentiation, so it has no gradient of its own.  Under
    JAX (CPU mode's :func:`jax_mode`) it is a call of numpy's BLAS; elsewhere numpy
    computes it.

    Parameters
    ----------
    trans_a, trans_b : bool
        Whether the product reads the first or second operand transposed.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> a, b = pt.matrix("a"), pt.matrix("b")
    >>> f = pytensor.function([a, b], BlasDot(trans_a=True)(a, b))
    >>> x = np.arange(6.0).reshape(3, 2).astype(a.dtype)
    >>> f(x, np.ones((3, 1), dtype=a.dtype)).ravel().tolist()
    [6.0, 9.0]
    """

    __props__ = ("trans_a", "trans_b")

    def __init__(self, trans_a: bool = False, trans_b: bool = False) -> None:
        self.trans_a = bool(trans_a)
        self.trans_b = bool(trans_b)

    def make_node(self, a: Any, b: Any) -> Apply:  # type: ignore[override]
        from pytensor.tensor import as_tensor_variable

        a, b = as_tensor_variable(a), as_tensor_variable(b)
        if not _float_matrices(a, b):
            raise TypeError(f"BlasDot multiplies two float32 or float64 matrices of one dtype, not {a.type}, {b.type}")
        m = a.type.shape[1 if self.trans_a else 0]
        n = b.type.shape[0 if self.trans_b else 1]
        return Apply(self, [a, b], [TensorType(a.type.dtype, shape=(m, n))()])

    def perform(self, node: Apply, inputs: Sequence[Any], outputs: list[list[Any]]) -> None:
        """PyTensor's default backends: numpy's product."""
        a, b = inputs
        outputs[0][0] = np.asarray((a.T if self.trans_a else a) @ (b.T if self.trans_b else b), dtype=a.dtype)

    def infer_shape(self, *args: Any) -> list[Any]:
        """``(m, n)``: the rows of ``op(a)``, the columns of ``op(b)`` (the input shapes come
        last: PyTensor 3.0 passes ``fgraph, node, shapes``, 3.3 ``node, shapes``)."""
        (a0, a1), (b0, b1) = args[-1]
        return [(a1 if self.trans_a else a0, b0 if self.trans_b else b1)]


def _untransposed(var: Variable) -> tuple[Variable, bool]:
    """``(x, True)`` where ``var`` is the matrix transpose of ``x``, else ``(var, False)``."""
    owner = var.owner
    if owner is not None and isinstance(owner.op, DimShuffle) and tuple(owner.op.new_order) == (1, 0):
        return owner.inputs[0], True
    return var, False


@node_rewriter([Dot])
def use_blas_dot(fgraph: Any, node: Apply) -> list[Variable] | None:
    """A :class:`~pytensor.tensor.math.Dot` of two float matrices of one dtype becomes a
    :class:`BlasDot`, which reads a transposed operand in place (``a.T @ b``: ``trans_a``)."""
    a, b = node.inputs
    if not _float_matrices(a, b) or node.outputs[0].type.dtype != a.type.dtype:
        return None
    (a, trans_a), (b, trans_b) = _untransposed(a), _untransposed(b)
    return BlasDot(trans_a, trans_b).make_node(a, b).outputs


def _gemm_addresses() -> dict[str, int]:
    """The addresses of numpy's BLAS ``sgemm`` and ``dgemm`` (ILP64), by dtype.

    Raises
    ------
    LookupError
        Where numpy's BLAS has no ILP64 gemm under a name of :data:`GEMM_SYMBOLS`.
    """
    try:
        umath = importlib.import_module("numpy._core._multiarray_umath")
    except ImportError:  # numpy < 2
        umath = importlib.import_module("numpy.core._multiarray_umath")
    library = ctypes.CDLL(umath.__file__)  # its BLAS's symbols are found through it
    for pattern in GEMM_SYMBOLS:
        try:
            return {dtype: ctypes.cast(getattr(library, pattern.format(letter)), ctypes.c_void_p).value or 0
                    for dtype, letter in (("float32", "s"), ("float64", "d"))}
        except AttributeError:
            continue
    raise LookupError(f"numpy's BLAS has no ILP64 gemm ({', '.join(GEMM_SYMBOLS)}): numpy's OpenBLAS wheels have one")


def available() -> bool:
    """Whether the BLAS product can run here: the handler built and registered, numpy's gemm
    found (at the first call; False, with one log line saying why, where not)."""
    if "ok" not in _state:
        try:
            from synk_comm import xla_cpu

            _state["gemm"] = _gemm_addresses()
            xla_cpu.register_handler(SOURCE, "SynkBlasDot", TARGET)
            _register_rewrite()
            _state["ok"] = True
        except Exception as exc:  # no compiler, no JAX, another BLAS: plain JAX mode
            log.info("synkhronos: CPU ranks keep XLA's own matrix product (%s: %s)", type(exc).__name__, exc)
            _state["ok"] = False
    return bool(_state["ok"])


def wanted(one_core: bool) -> bool:
    """Whether a rank computes its products with numpy's BLAS: ``SYNK_CPU_BLAS=0`` never, ``=1``
    in every rank, unset in a rank pinned to one core of its own (``one_core``).

    A rank of several cores keeps XLA's dot by default: there the BLAS's thread pool and XLA's
    take turns on the same cores, and the main job's single process on 2 cores (1024 rows of 64)
    took 7.4-8.1 ms an epoch with the BLAS against 5.8-6.6 ms without (VM, three runs each).

    Raises
    ------
    ValueError
        For another value of ``SYNK_CPU_BLAS``.
    """
    value = os.environ.get(BLAS_ENV, "").strip().lower()
    if value not in ("", "0", "1"):
        raise ValueError(f"{BLAS_ENV}={value!r}: use 0 (XLA's own product) or 1 (numpy's BLAS), or unset it")
    return value == "1" or (value == "" and one_core)


def _register_rewrite() -> None:
    """:func:`use_blas_dot` in PyTensor's rewrite database, under :data:`TAG` alone (no mode but
    :func:`jax_mode` runs it), after every rewrite that makes or moves products, and the JAX
    implementation of :class:`BlasDot`."""
    from pytensor.compile import optdb

    if "synk_blas_dot" not in optdb:
        optdb.register("synk_blas_dot", in2out(use_blas_dot), TAG, position=99)
    _register_jax()


def jax_mode(one_core: bool) -> Any:
    """The mode of a CPU rank's JAX-compiled functions: PyTensor's JAX mode, with
    :func:`use_blas_dot` where :func:`wanted` and :func:`available`, else plain ``"JAX"``.

    Parameters
    ----------
    one_core : bool
        Whether the rank runs pinned to one core of its own.
    """
    if not (wanted(one_core) and available()):
        return "JAX"
    from pytensor.compile.mode import get_mode

    return get_mode("JAX").including(TAG)


def _register_jax() -> None:
    import jax
    import jax.numpy as jnp
    from pytensor.link.jax.dispatch import jax_funcify

    gemm = _state["gemm"]

    @jax_funcify.register(BlasDot)
    def jax_funcify_BlasDot(op: BlasDot, node: Apply | None = None, **kwargs: Any) -> Any:
        def blas_dot(a: Any, b: Any) -> Any:
            # PyTensor's JAX translation may hand over an operand wider than its type says (a
            # float64 constant under x64): promote, as JAX's own dot does
            dtype = jnp.result_type(a, b)
            a, b = a.astype(dtype), b.astype(dtype)
            m = a.shape[1] if op.trans_a else a.shape[0]
            n = b.shape[0] if op.trans_b else b.shape[1]
            call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), dtype))
            return call(a, b, gemm=np.int64(gemm[str(dtype)]), ilp64=np.int64(1),
                        trans_a=np.int64(op.trans_a), trans_b=np.int64(op.trans_b))

        return blas_dot
