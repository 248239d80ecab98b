"""What every rank does for a collective on shared variables (:mod:`synkhronos.collectives`) under the
per-rank engine: the ``COLLECTIVE`` handler, and each collective's part in a rank (:data:`_LOCAL`),
through the group's shared-memory collectives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from synk_comm import Group, handler
from synkhronos.calls import normalise_positions
from synkhronos.protocol import COLLECTIVE
from synkhronos.runtime import Runtime, rank_runtime


def _decode(rt: Runtime, encoded: tuple[str, Any]) -> np.ndarray:
    kind, value = encoded
    if kind == "data":
        arr = rt.data[value].data
        assert arr is not None
        return arr
    return value


@handler(COLLECTIVE)
def _collective(group: Group, payload: tuple[str, dict[str, Any]]) -> Any:
    rt = rank_runtime(group)
    name, args = payload
    variables = [rt.shared[sid] for sid in args["sids"]]
    return _LOCAL[name](rt, variables, **{k: v for k, v in args.items() if k != "sids"})


def _broadcast(rt: Runtime, variables: list[Any], values: list[Any] | None, nccl: bool) -> None:
    host, device = rt.group, rt.device
    for i, var in enumerate(variables):
        if values is not None and values[i][0] == "data":
            device.set(var, _decode(rt, values[i]))
            continue
        source = (device.get(var) if values is None else values[i][1]) if rt.is_master else None
        device.set(var, host.broadcast(source))


def _scatter(rt: Runtime, variables: list[Any], values: list[Any], rows: list[Any]) -> None:
    host, device = rt.group, rt.device
    for var, encoded, sel in zip(variables, values, rows):
        n = len(range(sel.start, sel.stop, sel.step or 1)) if isinstance(sel, slice) else len(sel)
        p0, p1 = (int(v) for v in normalise_positions(n, rt.size)[rt.rank])
        if encoded[0] == "data":
            source = _decode(rt, encoded)
            device.set(var, source[sel][p0:p1] if isinstance(sel, slice) else source[sel[p0:p1]])
        else:
            parts = None
            if rt.is_master:
                selected = encoded[1][sel]
                bounds = normalise_positions(n, rt.size)
                parts = [selected[a:b] for a, b in bounds]
            device.set(var, host.scatter(parts))


def _gather(rt: Runtime, variables: list[Any], nccl: bool) -> Any:
    return rt.group.host.gather_arrays([rt.device.get(var) for var in variables], root=rt.group.master_rank)


def _all_gather(rt: Runtime, variables: list[Any], nccl: bool) -> None:
    for var in variables:
        rt.device.set(var, np.concatenate(rt.group.all_gather(rt.device.get(var)), axis=0))


def _agree_on_shapes(rt: Runtime, variables: list[Any], what: str) -> None:
    """Before reducing a list of variables, every rank checks every variable's shape in every rank
    (one small exchange), so that a mismatch in any of them changes nothing anywhere."""
    if len(variables) < 2:
        return  # one variable: the collective itself checks before it writes
    shapes_here = [rt.device.get(var).shape for var in variables]
    mine = np.array([d for shape in shapes_here for d in (len(shape), *shape)], dtype=np.int64)
    shapes = rt.group.host.all_gather(mine)
    for r, theirs in enumerate(shapes):
        if theirs.shape != mine.shape or not np.array_equal(theirs, shapes[0]):
            raise ValueError(f"{what}: every rank must give the same shape for each variable; rank {r} differs "
                             "from rank 0 (nothing was reduced)")


def _reduce(rt: Runtime, variables: list[Any], op: str, in_place: bool, nccl: bool) -> list[Any] | None:
    _agree_on_shapes(rt, variables, "reduce")
    results = []
    for var in variables:
        result = rt.group.reduce(rt.device.get(var), op)
        if rt.is_master:
            assert result is not None
            if in_place:
                rt.device.set(var, result)
            results.append(result)
    return results if rt.is_master else None


def _all_reduce(rt: Runtime, variables: list[Any], op: str, nccl: bool) -> None:
    _agree_on_shapes(rt, variables, "all_reduce")
    for var in variables:
        value = rt.device.get(var)
        # In place where the value is the variable's own numpy buffer, referenced by nothing
        # else (the host copy of a device value is read-only).
        in_place = isinstance(value, np.ndarray) and value.flags.writeable
        result = rt.group.all_reduce(value, op, out=value if in_place else None)
        if result is not value:
            rt.device.put_update(var, result)  # a new array, this rank's own: stored as it is


def _set_value(rt: Runtime, variables: list[Any], values: list[Any], rows: list[Any], target: int) -> None:
    host, device = rt.group, rt.device
    for var, encoded, sel in zip(variables, values, rows):
        if encoded[0] == "data":
            if rt.rank == target:
                device.set(var, _decode(rt, encoded)[sel])
            continue
        value = host.broadcast(encoded[1][sel] if rt.is_master else None)
        if rt.rank == target:
            device.set(var, value)


def _get_value(rt: Runtime, variables: list[Any], target: int) -> list[Any] | None:
    mine = [rt.device.get(var) for var in variables] if rt.rank == target else []
    per_rank = rt.group.host.gather_arrays(mine, root=rt.group.master_rank)
    return None if per_rank is None else per_rank[target]


def _get_shapes(rt: Runtime, variables: list[Any]) -> list[list[tuple[int, ...]]] | None:
    shapes = [tuple(rt.device.get(var).shape) for var in variables]
    per_rank = rt.group.gather_object(shapes)
    if per_rank is None:
        return None
    return [[tuple(rank_shapes[i]) for rank_shapes in per_rank] for i in range(len(variables))]  # type: ignore[index]


_LOCAL: dict[str, Callable[..., Any]] = {
    "broadcast": _broadcast, "scatter": _scatter, "gather": _gather, "all_gather": _all_gather, "reduce": _reduce,
    "all_reduce": _all_reduce, "set_value": _set_value, "get_value": _get_value, "get_shapes": _get_shapes,
}
