"""The evaluation of a traced JAX function under a precision policy (:func:`_eval`): the jaxpr
interpreter behind :func:`synkhronos.precision.apply`, which applies the rules written out in
:mod:`synkhronos.precision`, primitive by primitive."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

__all__: list[str] = []

_PRODUCTS = ("dot_general", "conv_general_dilated")
"""The primitives a policy changes."""


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
(a custom derivative rule is not kept: see :func:`~synkhronos.precision.apply`)."""

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


