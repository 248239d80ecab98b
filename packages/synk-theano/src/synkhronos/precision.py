"""Precision policies: how a float32 graph computes.

PyTensor has no bfloat16 type: users write float32 graphs.  A policy changes how such a graph
computes, not the graph: it is a transformation of the JAX function that PyTensor's JAX
translation made (:func:`apply`), so every Op keeps its own translation.

=============  ===============================================================================
``"default"``  XLA's default: float32 products at the backend's default precision (TF32 tensor
               cores on Ampere and Hopper GPUs, float32 on CPUs).  The function is unchanged.
``"highest"``  Strict float32: every float32 product at ``lax.Precision.HIGHEST``.
``"bf16"``     Mixed precision with bfloat16 activations (as JAX's jmp policies, Keras's
               ``mixed_bfloat16`` and PyTorch's autocast): products and convolutions, and the
               element-wise work between them, compute and store bfloat16; reductions,
               precision-sensitive functions, parameters, optimizer state and the function's
               outputs stay float32.  The rules are below.
=============  ===============================================================================

The rules of ``"bf16"``, primitive by primitive (the values flowing between primitives are
bfloat16 or float32; the function's inputs are float32):

* **Products** (``dot_general``, ``conv_general_dilated``) of float32 (or bfloat16) operands take
  bfloat16 operands and make a bfloat16 result.  The backends accumulate in float32 inside (cuBLAS
  and cuDNN compute bfloat16 products with float32 accumulators, XLA's CPU backend upcasts); asking
  for a float32 result (``preferred_element_type=float32``) instead keeps every activation float32
  between products, and XLA's GPU compiler may then run the convolution in float32 altogether.
* **Element-wise and data-movement primitives** of ``_BF16_OPS`` (``add``, ``sub``, ``mul``,
  ``div``, ``max``, ``tanh``, ``logistic``, ``select_n``, comparisons, reshapes, transposes,
  slices, pads, gathers, max pooling...) with a bfloat16 operand run in bfloat16 where their other
  float operands are literals, scalars or weak-typed (these are rounded to bfloat16: a constant
  never upcasts an activation).  Where the other operands are *small* float32 arrays (holding fewer
  values than the result: per-channel batch-norm statistics, biases and scales broadcast against an
  activation, or broadcasts of constants such as ReLU's gradient mask) they compute in float32 and
  round the result to bfloat16 at once: XLA fuses the conversions, so the stored activation is
  bfloat16 and the arithmetic is float32's.  Where an operand is a float32 array of the result's
  size (a parameter, a velocity: ``param - lr * grad``) they compute in float32 and make float32.
  Division is among them: a quotient's relative error is the sum of its operands', small divisors
  included (bfloat16 has float32's exponent range).
* **Everything else computes in float32**, its bfloat16 operands converted back: reductions
  (``reduce_sum``, ``reduce_max``, ``argmax``, ``cumsum``: the means and variances of batch norm,
  softmax's and the loss's sums), transcendental and precision-sensitive functions (``exp``,
  ``log``, ``log1p``, ``expm1``, ``pow``, ``sqrt``, ``rsqrt``, ``erf``...: they amplify their
  operand's error or feed reductions), scatters, sorts, collectives (``psum``, callbacks: the
  gradients are summed in float32), and any primitive this module does not name.  A collective
  whose operand the function itself converts to bfloat16 (``ops.all_reduce(x, dtype="bfloat16")``)
  keeps it: an equation's operands are converted back only to the dtypes the function gives them,
  and a conversion from bfloat16 to float32 the function makes is kept.
* **Calls** (``jit``, ``remat``, ``custom_jvp_call``, ``custom_vjp_call``) are evaluated in place
  with the same rules, so bfloat16 values flow through them.  **Loops and branches** (``scan``,
  ``while``, ``cond``) and ``shard_map`` keep their float32 boundaries: their operands and carries
  are converted back to float32 and their bodies are rewritten with the same rules inside, each
  result converted back to its float32 type, so a carry's type never changes.
* The function's **outputs** (losses, updated parameters, optimizer state, running statistics)
  have the dtypes of the original function: float32.

Products of other dtypes (float64, integers) are left as they are under every policy.

Functions
    :func:`check`        a policy name, checked (``None``: ``"default"``)
    :func:`apply`        ``fn`` -> the same function under a policy (a jaxpr interpreter)
    :func:`jax_mode`     a PyTensor JAX mode whose compiled functions run under a policy
    :func:`compile_kwargs`  ``pytensor.function`` keyword arguments under a policy (the hook)
    :func:`check_backend`   the master's build-time check that a policy can apply

Example
-------
>>> import jax.numpy as jnp
>>> from synkhronos import precision
>>> f = precision.apply(lambda a, b: a @ b, "bf16")
>>> f(jnp.ones((2, 3)), jnp.ones((3, 2))).dtype
dtype('float32')

How ``apply`` works: the function is traced to a jaxpr at the shapes it is called with, and the
jaxpr is evaluated again equation by equation, each equation bound anew with the policy's operands
and parameters.  Sub-jaxprs of loops, branches and ``shard_map`` (and, under ``"highest"``, of
every primitive) are rewritten the same way wherever they hold a product, and their primitives
bound again with the rewritten jaxprs (same signatures, so the primitives' rules apply unchanged).
Under ``"bf16"`` the bodies of calls and custom-derivative functions are evaluated in place: the
transformed function computes the same values, but differentiating it with JAX afterwards would
differentiate those bodies rather than use their custom rules (PyTensor differentiates the graph
before it is translated, so a Synkhronos function never is).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["POLICIES", "apply", "check", "check_backend", "compile_kwargs", "jax_mode", "policy_of"]

log = logging.getLogger("synkhronos")

POLICIES = ("default", "highest", "bf16")
"""The policies, by name (see the module docstring)."""

_PRODUCTS = ("dot_general", "conv_general_dilated")
"""The primitives a policy changes."""


def check(precision: str | None) -> str:
    """``precision`` as a policy name (None: ``"default"``).

    Raises
    ------
    ValueError
        For a name not in :data:`POLICIES`.
    """
    if precision is None:
        return "default"
    if not isinstance(precision, str) or precision not in POLICIES:
        raise ValueError(f"precision must be one of {', '.join(repr(p) for p in POLICIES)}, got {precision!r}")
    return precision


# -- the transformation -------------------------------------------------------------------------
def apply(fn: Callable[..., Any], precision: str) -> Callable[..., Any]:
    """``fn`` (a function of JAX arrays) computing its products under ``precision``.

    ``"default"`` returns ``fn`` itself.  Otherwise each call traces ``fn`` at its arguments' shapes
    (inside ``jax.jit``: once per compilation) and evaluates the traced jaxpr with the policy.
    Arguments that are not arrays (Python numbers: PyTensor's static shape inputs) stay static.

    Parameters
    ----------
    fn : callable
        Arrays (and static Python values) -> a pytree of arrays.
    precision : str
        A name of :data:`POLICIES`.

    Returns
    -------
    callable
        Same arguments, same results' structure, shapes and dtypes.
    """
    policy = check(precision)
    if policy == "default":
        return fn
    import jax

    @functools.wraps(fn)
    def under_policy(*args: Any) -> Any:
        static = {i: a for i, a in enumerate(args) if not _is_array(a)}
        arrays = [a for i, a in enumerate(args) if i not in static]

        def with_static(*xs: Any) -> Any:
            it = iter(xs)
            return fn(*(static[i] if i in static else next(it) for i in range(len(args))))

        closed, shapes = jax.make_jaxpr(with_static, return_shape=True)(*arrays)
        outs = _eval(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves(arrays), policy)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), outs)

    return under_policy


def _is_array(value: Any) -> bool:
    import jax

    return isinstance(value, (jax.Array, np.ndarray, np.generic)) or hasattr(value, "aval")


def _core() -> Any:
    """JAX's jaxpr types: ``jax.extend.core`` (``jax.core`` before JAX exported them there)."""
    try:
        from jax.extend import core
    except ImportError:  # pragma: no cover - older JAX
        from jax import core  # type: ignore[no-redef]
    return core


_INLINED = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
                      "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
"""Primitives whose body ``"bf16"`` evaluates in place, so that bfloat16 values flow through them
(a custom derivative rule is not kept: see :func:`apply`)."""

_BF16_OPS = frozenset({
    # arithmetic whose relative error stays that of its operands
    "add", "sub", "mul", "div", "neg", "abs", "sign", "max", "min", "clamp", "square", "integer_pow",
    "tanh", "logistic", "floor", "ceil", "round", "select_n", "eq", "ne", "lt", "le", "gt", "ge",
    "is_finite", "copy", "copy_p", "convert_element_type", "stop_gradient",
    # data movement
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice", "dynamic_slice",
    "dynamic_update_slice", "gather", "concatenate", "pad", "rev", "select_and_gather_add",
    # exact in any precision: max/min pooling
    "reduce_window_max", "reduce_window_min",
})
"""Primitives that ``"bf16"`` runs in bfloat16 where their float operands are bfloat16 (or small
float32 values); every other primitive gets float32 operands (see the module docstring)."""


_JOINS = frozenset({"concatenate", "dynamic_update_slice"})
"""Primitives whose smaller operands are data of their own (not broadcast against the others)."""


def _eval(jaxpr: Any, consts: Any, args: list[Any], policy: str, cast_outputs: bool = True) -> list[Any]:
    """``jaxpr`` evaluated on ``args`` (binding on the current trace) under ``policy``; with
    ``cast_outputs`` its results have the jaxpr's dtypes (``"bf16"`` keeps bfloat16 values inside)."""
    import jax.numpy as jnp

    Literal = _core().Literal
    env: dict[Any, Any] = {}

    def read(var: Any) -> Any:
        return var.val if isinstance(var, Literal) else env[var]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    small: set[Any] = set()  # float32 values made of fewer values than they hold (broadcasts, constants)
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _PRODUCTS:
            outvals: Any = [_product(eqn, invals, policy)]
        elif policy == "bf16" and name in _INLINED:
            outvals = _inline(eqn, invals, policy)
        elif policy == "bf16" and any(_is_bf16(x) for x in invals):
            outvals = _mixed(eqn, invals, policy, small)
        else:
            outvals = _bind(eqn, invals, policy)
            if policy == "bf16" and _makes_small(eqn, invals, small):
                small.update(eqn.outvars)
        for var, val in zip(eqn.outvars, outvals):
            if type(var).__name__ != "DropVar":
                env[var] = val
    outs = [read(v) for v in jaxpr.outvars]
    if cast_outputs:
        outs = [x.astype(v.aval.dtype) if _is_bf16(x) and jnp.dtype(v.aval.dtype) != jnp.bfloat16 else x
                for x, v in zip(outs, jaxpr.outvars)]
    return outs


def _bind(eqn: Any, invals: list[Any], policy: str) -> list[Any]:
    """``eqn``'s primitive bound on ``invals``, the jaxprs of its parameters rewritten under ``policy``."""
    params = {k: _rewritten(v, policy) for k, v in eqn.params.items()}
    bind_params = eqn.primitive.get_bind_params(params)
    subfuns: Any = ()
    if isinstance(bind_params, tuple):  # jax < 0.7: (sub-functions, parameters)
        subfuns, bind_params = bind_params
    ctx = getattr(eqn, "ctx", None)
    with ctx.manager if ctx is not None else contextlib.nullcontext():
        outvals = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return outvals if eqn.primitive.multiple_results else [outvals]


def _is_bf16(value: Any) -> bool:
    import jax.numpy as jnp

    return getattr(value, "dtype", None) == jnp.bfloat16


def _inline(eqn: Any, invals: list[Any], policy: str) -> list[Any]:
    """A call-like equation (``jit``, ``remat``, ``custom_jvp_call``...): its body, evaluated in place."""
    ClosedJaxpr = _core().ClosedJaxpr
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr")))
    if isinstance(body, ClosedJaxpr):
        return _eval(body.jaxpr, body.consts, invals, policy, cast_outputs=False)
    if body is None or body.constvars:
        return _bind(eqn, _upcast(eqn, invals), policy)
    return _eval(body, (), invals, policy, cast_outputs=False)


def _is_small(var: Any, value: Any, size: int, small: set[Any], joins: bool = False) -> bool:
    """Whether a float32 operand of an equation whose largest result holds ``size`` values is small:
    a literal, a scalar, weak-typed, a broadcast of fewer values, or (unless the equation ``joins``
    arrays: a concatenation, an update of a slice) holding fewer values."""
    return (isinstance(var, _core().Literal) or np.ndim(value) == 0 or getattr(var.aval, "weak_type", False)
            or var in small or (int(np.prod(np.shape(value))) < size and not joins))


def _makes_small(eqn: Any, invals: list[Any], small: set[Any]) -> bool:
    """Whether a float32 equation without bfloat16 operands makes small values: one of
    ``_BF16_OPS`` (a broadcast, an element-wise op) whose float operands are all small (a
    batch-norm statistic broadcast to an activation's shape, the constants of ReLU's gradient)."""
    import jax.numpy as jnp

    if eqn.primitive.name not in _BF16_OPS or not any(
            jnp.dtype(getattr(v.aval, "dtype", np.int8)) == jnp.float32 for v in eqn.outvars):
        return False
    size = max(int(np.prod(getattr(v.aval, "shape", ()))) for v in eqn.outvars)
    return all(_is_small(v, x, size, small, eqn.primitive.name in _JOINS) for v, x in zip(eqn.invars, invals)
               if getattr(x, "dtype", None) == jnp.float32)


def _upcast(eqn: Any, invals: list[Any]) -> list[Any]:
    """``invals`` with their bfloat16 values back at the equation's own dtypes (float32)."""
    return [x.astype(v.aval.dtype) if _is_bf16(x) else x for x, v in zip(invals, eqn.invars)]


def _mixed(eqn: Any, invals: list[Any], policy: str, small: set[Any]) -> list[Any]:
    """An equation some of whose operands are bfloat16 activations, under ``"bf16"``.

    A primitive of ``_BF16_OPS`` runs in bfloat16 where its float32 operands are literals,
    scalars or weak-typed (rounded to bfloat16); computes in float32 and rounds its result to
    bfloat16 where they are other small values (``_is_small``: broadcast per-channel
    statistics, biases, scales, constants); computes in float32 where one is a float32 array of the
    result's size (a parameter, optimizer state).  Any other primitive computes in float32.
    """
    import jax.numpy as jnp

    name = eqn.primitive.name
    if name not in _BF16_OPS:
        return _bind(eqn, _upcast(eqn, invals), policy)
    if name == "convert_element_type":
        if jnp.dtype(eqn.params["new_dtype"]) == jnp.float32 and jnp.dtype(eqn.invars[0].aval.dtype) == jnp.float32:
            return [invals[0]]  # a float32 -> float32 conversion (weak type): the activation stays bfloat16
        return _bind(eqn, _upcast(eqn, invals), policy)
    size = max(int(np.prod(getattr(v.aval, "shape", ()))) for v in eqn.outvars)
    Literal = _core().Literal
    kind = "bf16"
    for var, x in zip(eqn.invars, invals):
        if getattr(x, "dtype", None) != jnp.float32:
            continue
        if isinstance(var, Literal) or np.ndim(x) == 0 or getattr(var.aval, "weak_type", False):
            continue
        small_one = _is_small(var, x, size, small, name in _JOINS)
        kind = "f32" if not small_one or kind == "f32" else "f32-rounded"
    if kind == "f32":
        return _bind(eqn, _upcast(eqn, invals), policy)
    if kind == "f32-rounded":
        outs = _bind(eqn, _upcast(eqn, invals), policy)
        return [y.astype(jnp.bfloat16) if getattr(y, "dtype", None) == jnp.float32 else y for y in outs]
    down = [x.astype(jnp.bfloat16) if getattr(x, "dtype", None) == jnp.float32 else x for x in invals]
    return _bind(eqn, down, policy)


def _product(eqn: Any, invals: list[Any], policy: str) -> Any:
    """One ``dot_general``/``conv_general_dilated`` under ``policy``: float32 operands as bfloat16
    with a bfloat16 result (``"bf16"``: the backends accumulate in float32), or at
    ``Precision.HIGHEST`` (``"highest"``)."""
    import jax.numpy as jnp
    from jax import lax

    lhs, rhs = invals[:2]
    params = dict(eqn.params)
    if not all(jnp.dtype(v.aval.dtype) == jnp.float32 for v in eqn.invars[:2]) or \
            jnp.dtype(eqn.outvars[0].aval.dtype) != jnp.float32:
        return eqn.primitive.bind(*_upcast(eqn, invals), **params)
    if policy == "highest":
        params["precision"] = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    else:
        params["precision"] = None
        params["preferred_element_type"] = jnp.dtype(jnp.bfloat16)
        lhs, rhs = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)
    return eqn.primitive.bind(lhs, rhs, *invals[2:], **params)


def _rewritten(value: Any, policy: str) -> Any:
    """A primitive's parameter, with every (closed) jaxpr in it rewritten under ``policy``."""
    ClosedJaxpr, Jaxpr = _core().ClosedJaxpr, _core().Jaxpr

    if isinstance(value, ClosedJaxpr):
        return _closed(value, policy)
    if isinstance(value, Jaxpr):
        return _open(value, policy)
    if isinstance(value, tuple) and value and all(isinstance(v, (ClosedJaxpr, Jaxpr)) for v in value):
        return tuple(_rewritten(v, policy) for v in value)
    return value


def _subjaxprs(jaxpr: Any) -> list[Any]:
    """The jaxprs in the parameters of ``jaxpr``'s equations (one level down)."""
    ClosedJaxpr, Jaxpr = _core().ClosedJaxpr, _core().Jaxpr
    found = []
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, ClosedJaxpr):
                    found.append(item.jaxpr)
                elif isinstance(item, Jaxpr):
                    found.append(item)
    return found


def _has_products(jaxpr: Any) -> bool:
    return any(eqn.primitive.name in _PRODUCTS for eqn in jaxpr.eqns) or any(
        _has_products(sub) for sub in _subjaxprs(jaxpr))


def _closed(closed: Any, policy: str) -> Any:
    """A ClosedJaxpr rewritten under ``policy`` (the same one where it holds no product): traced
    again at its input types, weak types included, so that its signature is unchanged."""
    if not _has_products(closed.jaxpr):
        return closed
    import jax

    structs = []
    for aval in closed.in_avals:
        if not hasattr(aval, "shape"):
            raise NotImplementedError(f"precision policy {policy!r}: a sub-jaxpr takes a {aval} operand, which it "
                                      "cannot trace again; use precision='default' for this function")
        structs.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False)))
    return jax.make_jaxpr(lambda *xs: _eval(closed.jaxpr, closed.consts, list(xs), policy))(*structs)


def _open(jaxpr: Any, policy: str) -> Any:
    """An open Jaxpr (``checkpoint``'s, ``shard_map``'s) rewritten under ``policy``."""
    ClosedJaxpr = _core().ClosedJaxpr

    if not _has_products(jaxpr):
        return jaxpr
    if jaxpr.constvars:
        raise NotImplementedError(f"precision policy {policy!r}: a sub-jaxpr with constants of its own; use "
                                  "precision='default' for this function")
    new = _closed(ClosedJaxpr(jaxpr, ()), policy)
    if new.consts:
        raise NotImplementedError(f"precision policy {policy!r}: rewriting a sub-jaxpr made constants; use "
                                  "precision='default' for this function")
    return new.jaxpr


# -- PyTensor: the JAX linker and the mode ----------------------------------------------------------
@functools.cache
def _linker_class(policy: str) -> type:
    """PyTensor's ``JAXLinker`` whose jitted function runs under ``policy`` (one class per policy:
    PyTensor makes a linker of the same class, without arguments, for each function it compiles)."""
    from pytensor.link.jax.linker import JAXLinker

    def jit_compile(self: Any, fn: Any) -> Any:
        return JAXLinker.jit_compile(self, apply(fn, policy))

    return type(f"JAXLinker_{policy}", (JAXLinker,), {"precision": policy, "jit_compile": jit_compile,
                                                        "__module__": __name__})


def _is_jax_mode(mode: Any) -> bool:
    from pytensor.compile.mode import get_mode
    from pytensor.link.jax.linker import JAXLinker

    return isinstance(get_mode(mode).linker, JAXLinker)


def jax_mode(mode: Any, precision: str) -> Any:
    """``mode`` (``"JAX"`` or a JAX-linker Mode: its rewrites) compiling under ``precision``.

    Under a policy other than ``"default"`` the products stay JAX's own (CPU ranks' BLAS products,
    :mod:`synkhronos.blas`, are excluded), so that the policy reaches them.

    Raises
    ------
    ValueError
        Where ``mode`` does not compile with JAX.
    """
    policy = check(precision)
    if policy == "default":
        return mode
    from pytensor.compile.mode import Mode, get_mode

    if mode is None or not _is_jax_mode(mode):
        raise ValueError(_no_jax(policy, f"it compiles in PyTensor mode {mode!r}" if mode is not None
                                 else "it compiles in PyTensor's default mode (C/Numba), not JAX: JAX could "
                                      "not compile it (an exception above says why), or its in-graph "
                                      "collectives run outside JAX here"))
    from synkhronos.blas import TAG

    rewrites = get_mode(mode).excluding(TAG)
    return Mode(linker=_linker_class(policy)(), optimizer=rewrites.provided_optimizer)


def compile_kwargs(precision: str, kwargs: dict[str, Any], device: Any) -> dict[str, Any]:
    """The hook: ``pytensor.function`` keyword arguments (``mode`` already chosen by the rank's
    device) with the mode compiling under ``precision``.  The JAX engine's master compiles only to
    check graphs (its workers apply the policy): it keeps its mode."""
    if check(precision) == "default" or getattr(device, "kind", None) == "engine-master":
        return kwargs
    return {**kwargs, "mode": jax_mode(kwargs.get("mode"), precision)}


def policy_of(fn: Any) -> str:
    """The policy of a compiled PyTensor function (``"default"`` unless :func:`jax_mode` made its mode)."""
    return getattr(getattr(getattr(fn, "maker", None), "linker", None), "precision", "default")


def check_backend(precision: str, device: Any, mode: Any = None) -> None:
    """In the master, before any worker acts: raise where ``precision`` cannot apply.

    Every function of GPU mode and of the JAX engine compiles with JAX; CPU mode's per-rank
    engine does where its backend is ``"jax"`` (:func:`synkhronos.cpu.choose_backend`).

    Raises
    ------
    ValueError
        For a policy other than ``"default"`` with a ``mode`` that is not JAX, or CPU ranks that
        compile with PyTensor's default mode (C/Numba).
    """
    policy = check(precision)
    if policy == "default":
        return
    if mode is not None and not _is_jax_mode(mode):
        raise ValueError(_no_jax(policy, f"mode={mode!r} is not a JAX mode: leave mode out, or give mode='JAX'"))
    if device.use_gpu or getattr(device, "kind", None) == "engine-master":
        return
    backend = getattr(device, "backend", "jax")
    if backend != "jax":
        raise ValueError(_no_jax(policy, f"CPU mode's ranks compile with PyTensor's default mode (backend "
                                         f"{backend!r}): install JAX (pip install 'synk-theano[cpu]') and leave "
                                         "SYNK_CPU_BACKEND unset or set it to 'jax', with no mode in PYTENSOR_FLAGS"))


def _no_jax(policy: str, why: str) -> str:
    return (f"precision={policy!r} applies to functions compiled with JAX (PyTensor's mode='JAX'), but {why}. "
            "Use precision='default' for this function.")
