"""Graph helpers of :mod:`synkhronos.pymc`: a value's rows, a likelihood's graph rebuilt for a rank's
rows, PyMC's parameter checks as PyMC compiles them, and the CPU ranks' mode for batched likelihoods."""

from __future__ import annotations

from typing import Any

import numpy as np


def _rv_name(rv: Any) -> str:
    op = getattr(rv.owner, "op", None)
    kind = getattr(op, "name", None) or type(op).__name__
    return f"{rv.name!r} ({kind})"


def _leading(value: Any) -> int | None:
    """Rows of a root variable's value (its axis-0 length), None for a scalar or a non-array."""
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.basic import Constant

    if isinstance(value, SharedVariable):
        arr = value.get_value(borrow=True)
    elif isinstance(value, Constant):
        arr = value.data
    else:
        return None
    shape = np.shape(arr)
    return int(shape[0]) if len(shape) else None


def _rebuild(outputs: list[Any], replace: dict[Any, Any], rows: int, local_rows: Any) -> list[Any]:
    """``outputs`` with the variables of ``replace`` replaced, every ``SpecifyShape`` dropped and
    every ``Alloc`` to ``rows`` rows made an ``Alloc`` to ``local_rows`` (PyMC's graphs hold the full
    data's shapes; a rank holds some of the rows)."""
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.traversal import toposort
    from pytensor.tensor.basic import Alloc, get_underlying_scalar_constant_value
    from pytensor.tensor.exceptions import NotScalarConstantError
    from pytensor.tensor.shape import SpecifyShape

    memo = dict(replace)
    for node in toposort(outputs):
        inputs = [memo.get(i, i) for i in node.inputs]
        if isinstance(node.op, SpecifyShape):
            memo[node.outputs[0]] = inputs[0]
            continue
        if isinstance(node.op, Alloc) and len(inputs) > 1:
            try:
                first = int(get_underlying_scalar_constant_value(inputs[1]))
            except NotScalarConstantError:
                # a dimension's length (``pm.Model(coords=...)``: a shared scalar)
                shared = node.inputs[1]
                value = shared.get_value(borrow=True) if isinstance(shared, SharedVariable) else None
                first = int(value) if value is not None and np.ndim(value) == 0 else -1
            if first == rows:
                inputs[1] = local_rows
        if all(a is b for a, b in zip(inputs, node.inputs)):
            continue
        new = node.op.make_node(*inputs)
        memo.update(zip(node.outputs, new.outputs))
    return [memo.get(o, o) for o in outputs]


def _without_checks(check_bounds: bool, outs: list[Any]) -> list[Any]:
    """PyMC's parameter checks as PyMC compiles them: ``-inf`` where a check fails (or removed,
    ``check_bounds=False``), so that every rank's backend can compile the graph."""
    from pymc.logprob.utils import local_check_parameter_to_ninf_switch, local_remove_check_parameter
    from pytensor.graph.fg import FunctionGraph
    from pytensor.graph.rewriting.basic import in2out

    rewrite = local_check_parameter_to_ninf_switch if check_bounds else local_remove_check_parameter
    fgraph = FunctionGraph(outputs=outs, clone=False)
    in2out(rewrite).rewrite(fgraph)
    return list(fgraph.outputs)


def _lift_unary_over_switch(fgraph: Any, node: Any) -> list[Any] | None:
    """``switch(c, f(a), f(b))`` -> ``f(switch(c, a, b))`` for one elementwise function ``f`` of one
    argument: every element computes the same value as before (the branch it takes), and ``f`` runs
    once instead of twice.  PyMC's Bernoulli is such a switch on the observation, of two softplus."""
    from pytensor.scalar.basic import Switch
    from pytensor.tensor.elemwise import Elemwise
    from pytensor.tensor.math import switch

    if not (isinstance(node.op, Elemwise) and isinstance(node.op.scalar_op, Switch)):
        return None
    cond, a, b = node.inputs
    if a.owner is None or b.owner is None or a.owner.op != b.owner.op or not isinstance(a.owner.op, Elemwise):
        return None
    if len(a.owner.inputs) != 1 or len(a.owner.outputs) != 1:
        return None
    out: Any = a.owner.op(switch(cond, a.owner.inputs[0], b.owner.inputs[0]))
    old = node.outputs[0]
    return [out] if out.type.dtype == old.type.dtype and out.type.ndim == old.type.ndim else None


def _softplus_in_one_pass(fgraph: Any, node: Any) -> list[Any] | None:
    """``softplus(x)`` -> ``max(x, 0) + log1p(exp(-|x|))``: stable everywhere, one ``exp`` and one
    ``log1p`` an element, where PyTensor's JAX form of Softplus computes every branch of its
    piecewise definition (three ``exp``).  The two agree to 3e-16 relative over [-800, 800]."""
    import pytensor.tensor as pt
    from pytensor.scalar.math import Softplus
    from pytensor.tensor.elemwise import Elemwise

    if not (isinstance(node.op, Elemwise) and isinstance(node.op.scalar_op, Softplus)):
        return None
    (x,) = node.inputs
    if not x.type.dtype.startswith("float"):
        return None
    return [pt.maximum(x, 0) + pt.log1p(pt.exp(-pt.abs(x)))]


LIKELIHOOD_REWRITE_POSITION = 2.5
"""Between PyTensor's ``specialize`` (2) and ``uncanonicalize`` (3) in its optimisation database."""


def likelihood_mode() -> Any:
    """PyTensor's JAX mode with the two rewrites above, placed after PyTensor's stabilisation (which
    turns PyMC's ``log(sigmoid(x))`` into softplus) so that nothing turns them back: the rows' pass
    of a likelihood at several chains' points on CPU ranks (:class:`synkhronos.pymc.batched._Batched`).
    It pickles by reference (a function's spec travels to the ranks)."""
    from pytensor.compile.mode import Mode, get_mode
    from pytensor.graph.rewriting.basic import in2out, node_rewriter
    from pytensor.tensor.elemwise import Elemwise

    class LikelihoodMode(Mode):  # type: ignore[misc]
        def __reduce__(self) -> tuple[Any, tuple[()]]:
            return likelihood_mode, ()

    jax_mode = get_mode("JAX")
    rewrite = in2out(node_rewriter([Elemwise])(_lift_unary_over_switch),
                     node_rewriter([Elemwise])(_softplus_in_one_pass), name="synk_pymc_likelihood")
    base = LikelihoodMode(linker=jax_mode.linker, optimizer=jax_mode.provided_optimizer)
    return base.register((rewrite, LIKELIHOOD_REWRITE_POSITION))

