"""Graph helpers of :mod:`synkhronos.pymc`: a value's rows, a likelihood's graph rebuilt for a rank's
rows, and PyMC's parameter checks as PyMC compiles them."""

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
