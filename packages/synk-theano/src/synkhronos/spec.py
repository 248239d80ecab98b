"""FunctionSpec: what a Synkhronos function is, independent of where it runs.

The master builds one from the arguments of :func:`synkhronos.function`; the spec (graphs, not
compiled code) travels to the workers by pickle, and every rank compiles its own
:class:`~synkhronos.replica.Replica` from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from synkhronos.reduce_ops import UPDATE_OPS, check_op

if TYPE_CHECKING:
    from synkhronos.runtime import Runtime

__all__ = ["FunctionSpec", "parse_outputs", "parse_updates"]


@dataclass
class FunctionSpec:
    """The parts of a Synkhronos function (all PyTensor variables, picklable)."""

    fid: int
    name: str | None
    inputs: list[Any]
    bcast_inputs: list[Any]
    outputs: list[Any]
    output_ops: list[str]
    single_output: bool
    updates: list[tuple[Any, Any]]
    update_ops: list[str]
    givens: list[tuple[Any, Any]]
    sliceable: list[Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    precision: str = "default"
    """How its products compute: a policy of :mod:`synkhronos.precision`."""

    @property
    def all_inputs(self) -> list[Any]:
        """Scattered inputs, then broadcast inputs: the order of Data arguments in a call."""
        return [*self.inputs, *self.bcast_inputs]


def _is_variable(obj: Any) -> bool:
    from pytensor.graph.basic import Variable

    return isinstance(obj, Variable)


def parse_outputs(outputs: Any) -> tuple[list[Any], list[str], bool]:
    """``outputs`` of :func:`synkhronos.function` -> (variables, ops, single).

    Accepts None, a variable, ``(variable, op)``, or a list of variables and pairs.
    """
    if outputs is None:
        return [], [], False

    def one(item: Any) -> tuple[Any, str]:
        if isinstance(item, tuple) and len(item) == 2 and _is_variable(item[0]) and not _is_variable(item[1]):
            return item[0], check_op(item[1], f"output {item[0]}")
        if not _is_variable(item):
            raise TypeError(f"an output must be a PyTensor variable or a (variable, op) pair, got {item!r}")
        return item, "avg"

    if _is_variable(outputs) or (isinstance(outputs, tuple) and len(outputs) == 2
                                 and _is_variable(outputs[0]) and not _is_variable(outputs[1])):
        var, op = one(outputs)
        return [var], [op], True
    if not isinstance(outputs, (list, tuple)):
        raise TypeError(f"outputs must be a variable, a (variable, op) pair or a list of them, got {outputs!r}")
    pairs = [one(item) for item in outputs]
    return [v for v, _ in pairs], [o for _, o in pairs], False


def parse_updates(updates: Any) -> tuple[list[tuple[Any, Any]], list[str]]:
    """``updates`` (pairs, ``(var, expr, op)`` triples, or a dict) -> (pairs, ops); op default avg."""
    from pytensor.compile.sharedvalue import SharedVariable

    if updates is None:
        return [], []
    items: Sequence[Any] = list(updates.items()) if isinstance(updates, Mapping) else list(updates)
    pairs, ops = [], []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
            raise TypeError(f"an update must be a (shared_var, expression) pair or a (shared_var, "
                            f"expression, op) triple, got {item!r}")
        var, expr = item[0], item[1]
        if not isinstance(var, SharedVariable):
            raise TypeError(f"an update's target must be a shared variable, got {var!r}")
        op = check_op(item[2] if len(item) == 3 else "avg", f"the update of {var}", UPDATE_OPS)
        pairs.append((var, expr))
        ops.append(op)
    return pairs, ops


def _fold_storage_aliases(outs: list[Any], pairs: list[tuple[Any, Any]], update_ops: list[str],
                          given_pairs: list[tuple[Any, Any]], sliceable: list[Any], rt: Runtime) -> None:
    """Make the shared variables of a function that share one storage one variable (in place).

    ``SharedVariable.clone()`` makes an alias: another variable on the same container.  Lasagne's
    batch norm reads its running averages through such an alias, which carries their
    ``default_update``.  The workers hold each distributed variable's own value, so an alias
    becomes (in ``givens``, and as an update's target) the variable of its storage that the
    function slices, that is distributed already, that the function updates, or else the first
    met; the alias's ``default_update`` becomes that variable's update where it has none (PyTensor
    applies a default update only where no update is given).

    Raises
    ------
    ValueError
        If two updates target one storage.
    """
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.basic import Variable

    try:
        from pytensor.graph.traversal import ancestors
    except ImportError:  # PyTensor before 3.3
        from pytensor.graph.basic import ancestors  # type: ignore[no-redef]

    owner: dict[int, Any] = {}
    for var in [*sliceable, *rt.shared_ids]:
        owner.setdefault(id(var.container), var)
    pairs[:] = [(owner.setdefault(id(var.container), var), expr) for var, expr in pairs]
    updated = {id(var) for var, _ in pairs}
    if len(updated) < len(pairs):
        raise ValueError("two updates target one shared variable (or aliases of one, made by SharedVariable.clone()): "
                         "give each variable one update")
    replaced = {v for v, _ in given_pairs}
    roots = [v for v in [*outs, *(e for _, e in pairs), *(g for _, g in given_pairs)] if isinstance(v, Variable)]
    for var in list(ancestors(roots)):
        if not isinstance(var, SharedVariable) or var in replaced:
            continue
        twin = owner.setdefault(id(var.container), var)
        if twin is var:
            continue
        given_pairs.append((var, twin))
        replaced.add(var)
        if var.default_update is not None and id(twin) not in updated:
            more, ops = parse_updates([(twin, var.default_update)])
            pairs += more
            update_ops += ops
            updated.add(id(twin))
