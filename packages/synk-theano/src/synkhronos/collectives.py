"""Collectives on shared variables: every rank's copy of a shared variable, moved and combined.

=============================================  =================================================
``broadcast(vars, values=None)``               every rank gets the master's value (or ``values``)
``scatter(vars, values, batch=None)``          rank ``r`` gets part ``r`` of each value (axis 0,
                                               as even as possible)
``gather(vars, nd_up=1)``                      the master gets every rank's value: stacked on a
                                               new axis 0 (``nd_up=1``) or concatenated on axis
                                               0 (``nd_up=0``, the form for unequal shapes)
``all_gather(vars)``                           every rank's value becomes the concatenation
``reduce(vars, op="avg", in_place=True)``      the master gets ``op`` over the ranks' values
``all_reduce(vars, op="avg")``                 every rank's value becomes ``op`` over all ranks'
``set_value(rank, vars, values, batch=None)``  one rank's value is set
``get_value(rank, vars)``                      one rank's value is read
``get_lengths(vars)``, ``get_shapes(vars)``    every rank's length / shape, in rank order
=============================================  =================================================

Each can also be submitted, as a function's call can (:meth:`synkhronos.Function.submit`):
``synk.all_reduce.submit(params, op="avg")`` returns a :class:`concurrent.futures.Future` of what
the call returns, and the collective runs in submission order with the calls.  Under the JAX engine
a submitted ``all_reduce`` is done once every worker has queued it on its device: the next command
reaches the workers while it runs, so a loop of them keeps the devices busy
(:mod:`synkhronos.engine.collectives`).

``vars`` is one shared variable or a list; one variable gives one result, a list a tuple.  Values
may be :class:`~synk_shm.Data` (every rank then reads its part straight from shared memory: the
master copies nothing) or numpy arrays.  Every check happens in the master before any worker
acts.  ``nccl=`` is accepted everywhere, as in the seed, and changes nothing: under the per-rank
engine values move through host shared memory, under the JAX engine (GPU mode's) device to device
inside programs of its runtime (:mod:`synkhronos.engine.collectives`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, ParamSpec, Protocol, TypeVar, cast

import numpy as np

from synk_comm.ops import as_op
from synk_shm import Data
from synkhronos.calls import as_index_array, normalise_positions
from synkhronos.collectives_local import _LOCAL as _LOCAL
from synkhronos.collectives_local import _agree_on_shapes as _agree_on_shapes
from synkhronos.collectives_local import _all_reduce as _all_reduce
from synkhronos.data_registry import data_id, flush_dropped
from synkhronos.runtime import Runtime, describe, get_runtime
from synkhronos.runtime import submit as submit_to_group

__all__ = ["broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce", "set_value",
           "get_value", "get_lengths", "get_shapes"]


# --- checks in the master -------------------------------------------------------------------------

def _prepare(shared_vars: Any) -> tuple[Runtime, list[Any], list[int], bool]:
    """(runtime, variables, shared ids, single) after every check on the variables."""
    from pytensor.compile.sharedvalue import SharedVariable

    from synkhronos.distribution import ensure_distributed

    rt = get_runtime()
    if not rt.is_master:
        raise RuntimeError("collectives are called in the master")
    single = not isinstance(shared_vars, (list, tuple))
    variables = [shared_vars] if single else list(shared_vars)
    if not variables:
        raise ValueError("no shared variables given")
    for var in variables:
        if not isinstance(var, SharedVariable):
            raise TypeError(f"collectives work on PyTensor shared variables, got {var!r}")
    ensure_distributed(rt)
    flush_dropped(rt)
    sids = []
    for var in variables:
        sid = rt.shared_ids.get(var)
        if sid is None:
            raise ValueError(f"shared variable {describe(var)} is not used by any synkhronos function, so the "
                             "workers do not have it: use it in a synk.function first")
        sids.append(sid)
    return rt, variables, sids, single


def _values(rt: Runtime, variables: list[Any], values: Any, what: str, single: bool) -> list[Any]:
    """Check values: ``("data", Data)`` or ``("array", numpy array cast safely)``, one per variable.

    For one variable (not in a list), ``values`` is its one value, even a Python list.  Nothing
    reaches the workers here: :func:`_encode` registers the Data once every check has passed.
    """
    listed = [values] if single or not isinstance(values, (list, tuple)) else list(values)
    if len(listed) != len(variables):
        raise ValueError(f"{what}: {len(variables)} shared variable(s) but {len(listed)} value(s)")
    out: list[Any] = []
    for var, value in zip(variables, listed):
        dtype = np.dtype(var.type.dtype)
        if isinstance(value, Data):
            if not value.allocated:
                raise ValueError(f"{what}: the Data for {describe(var)} holds no memory (freed or never filled)")
            arr_dtype, arr_ndim = value.dtype, value.ndim
        else:
            value = np.asarray(value)
            arr_dtype, arr_ndim = value.dtype, value.ndim
        if arr_ndim != var.type.ndim:
            raise TypeError(f"{what}: {describe(var)} has ndim {var.type.ndim}, the value has ndim {arr_ndim}")
        if arr_dtype != dtype and not np.can_cast(arr_dtype, dtype, "safe"):
            raise TypeError(f"{what}: {describe(var)} has dtype {dtype}; a {arr_dtype} value cannot be cast "
                            f"safely: cast it first (value.astype('{dtype}'))")
        out.append(("data", value) if isinstance(value, Data) else ("array", value.astype(dtype)))
    return out


def _encode(rt: Runtime, checked: list[Any]) -> list[Any]:
    """Checked values as they travel: a Data as its data id (registered with the workers if new)."""
    return [("data", data_id(rt, v)) if kind == "data" else (kind, v) for kind, v in checked]


def _check_shape(var: Any, shape: Sequence[int], what: str) -> None:
    """TypeError unless ``shape`` fits the variable's static shape (every rank would refuse it)."""
    static = tuple(getattr(var.type, "shape", None) or ())
    if any(s is not None and s != n for s, n in zip(static, shape)):
        raise TypeError(f"{what}: {describe(var)} has static shape {static}; the value would have shape "
                        f"{tuple(shape)}")


def _count(rows: Any, length: int) -> int:
    """Rows that a selection made by :func:`_rows` (or ``...``) takes of ``length``."""
    if rows is ...:
        return length
    return len(range(rows.start, rows.stop, rows.step or 1)) if isinstance(rows, slice) else len(rows)


def _rows(batch: Any, length: int) -> Any:
    """A batch (None, int, slice, indices) as a slice or an index array over ``length`` rows."""
    if batch is None:
        return slice(0, length)
    if isinstance(batch, (int, np.integer)) and not isinstance(batch, bool):
        if not 0 <= batch <= length:
            raise ValueError(f"batch={batch} outside [0, {length}]")
        return slice(0, int(batch))
    if isinstance(batch, slice):
        start, stop, step = batch.indices(length)
        # a negative step that ends at row 0 has stop -1, which as a slice bound means the last row
        return slice(start, stop, step) if step > 0 else np.arange(start, stop, step)
    idx = as_index_array(batch, "batch")
    if len(idx) and (idx.max() >= length or idx.min() < -length):
        raise ValueError(f"batch indices out of range for a value of length {length}")
    return idx


def _shape(checked: tuple[str, Any]) -> tuple[int, ...]:
    return tuple(checked[1].shape)


def _length(checked: tuple[str, Any]) -> int:
    return len(checked[1])


def _run(rt: Runtime, name: str, **payload: Any) -> Any:
    """The engine's collective: submitted (``defer``) when it runs in the window's dispatch thread."""
    return rt.driver.collective(rt, name, payload, rt.window.in_dispatch())


def _result(values: Sequence[Any], single: bool) -> Any:
    return values[0] if single else tuple(values)


# --- submitted collectives ---------------------------------------------------------------------

P = ParamSpec("P")
R = TypeVar("R")


class Submittable(Protocol[P, R]):
    """A collective: called, it runs now; ``submit`` queues it with the submitted calls."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]: ...


def _submittable(fn: Callable[P, R]) -> Submittable[P, R]:
    """``fn`` with a ``submit`` of the same arguments: a Future of its result, in submission order."""

    def submit(*args: P.args, **kwargs: P.kwargs) -> Future[R]:
        return submit_to_group(f"synk.{fn.__name__}", lambda: fn(*args, **kwargs))

    submit.__doc__ = (f"Submit :func:`{fn.__name__}`: the same arguments; returns a :class:`concurrent.futures.Future` "
                      "of its result (see :meth:`synkhronos.Function.submit`).")
    fn.submit = submit  # type: ignore[attr-defined]
    return cast("Submittable[P, R]", fn)


# --- the collectives ---------------------------------------------------------------------------

@_submittable
def broadcast(shared_vars: Any, values: Any = None, nccl: bool = True) -> None:
    """Every rank's value becomes the master's (or the given ``values``: Data or numpy, one per
    variable)."""
    rt, variables, sids, single = _prepare(shared_vars)
    checked = None if values is None else _values(rt, variables, values, "broadcast", single)
    for var, value in zip(variables, checked or ()):
        _check_shape(var, _shape(value), "broadcast")
    _run(rt, "broadcast", sids=sids, values=None if checked is None else _encode(rt, checked), nccl=nccl)


@_submittable
def scatter(shared_vars: Any, values: Any, batch: Any = None) -> None:
    """Rank ``r`` gets part ``r`` of each value (rows of ``batch`` only), split along axis 0 as
    evenly as possible (the first ranks get one row more)."""
    rt, variables, sids, single = _prepare(shared_vars)
    checked = _values(rt, variables, values, "scatter", single)
    for var in variables:
        if var.type.ndim < 1:
            raise ValueError(f"scatter: {describe(var)} is 0-d; it has no rows to split")
    lengths = {_length(c) for c in checked}
    if len(lengths) > 1 and batch is None:
        raise ValueError(f"scatter: values of different lengths {sorted(lengths)}; pass batch= to select rows")
    rows = [_rows(batch, _length(c)) for c in checked]
    for var, value, sel in zip(variables, checked, rows):
        shape = _shape(value)
        for p0, p1 in normalise_positions(_count(sel, shape[0]), rt.size):
            _check_shape(var, (int(p1 - p0), *shape[1:]), "scatter")
    _run(rt, "scatter", sids=sids, values=_encode(rt, checked), rows=rows)


@_submittable
def gather(shared_vars: Any, nd_up: int = 1, nccl: bool = True) -> Any:
    """Every rank's value, in rank order: stacked on a new axis 0 (``nd_up=1``) or concatenated on
    axis 0 (``nd_up=0``).  Values are unchanged.

    Raises
    ------
    ValueError
        For ``nd_up`` not 0 or 1, or ranks holding different shapes under ``nd_up=1``.
    """
    rt, variables, sids, single = _prepare(shared_vars)
    if nd_up not in (0, 1):
        raise ValueError(f"nd_up must be 0 (concatenate) or 1 (stack), got {nd_up!r}")
    if nd_up == 0:
        for var in variables:
            if var.type.ndim < 1:
                raise ValueError(f"gather(nd_up=0): {describe(var)} is 0-d and cannot be concatenated")
    per_rank = _run(rt, "gather", sids=sids, nccl=nccl)
    out = []
    for i, var in enumerate(variables):
        parts = [rank_values[i] for rank_values in per_rank]
        if nd_up == 1:
            shapes = [p.shape for p in parts]
            if len(set(shapes)) > 1:
                raise ValueError(f"gather(nd_up=1): {describe(var)} has different shapes in the ranks {shapes}; "
                                 "use nd_up=0 to concatenate them")
            out.append(np.stack(parts))
        else:
            out.append(np.concatenate(parts, axis=0))
    return _result(out, single)


@_submittable
def all_gather(shared_vars: Any, nccl: bool = True) -> None:
    """Every rank's value becomes the concatenation (axis 0, rank order) of all ranks' values."""
    rt, variables, sids, _ = _prepare(shared_vars)
    for var in variables:
        if var.type.ndim < 1:
            raise ValueError(f"all_gather: {describe(var)} is 0-d and cannot be concatenated")
    _run(rt, "all_gather", sids=sids, nccl=nccl)


@_submittable
def reduce(shared_vars: Any, op: str = "avg", in_place: bool = True, nccl: bool = True) -> Any:
    """``op`` over every rank's value, into the master's value (``in_place``) or returned.

    Workers' values are unchanged.  ``op``: avg, sum, prod, max, min.
    """
    rt, variables, sids, single = _prepare(shared_vars)
    for var in variables:
        as_op(op, var.type.dtype)
    results = _run(rt, "reduce", sids=sids, op=op, in_place=in_place, nccl=nccl)
    return None if in_place else _result(results, single)


@_submittable
def all_reduce(shared_vars: Any, op: str = "avg", nccl: bool = True) -> None:
    """Every rank's value becomes ``op`` over all ranks' values (avg, sum, prod, max, min)."""
    rt, variables, sids, _ = _prepare(shared_vars)
    for var in variables:
        as_op(op, var.type.dtype)
    _run(rt, "all_reduce", sids=sids, op=op, nccl=nccl)


@_submittable
def set_value(rank: int, shared_vars: Any, values: Any, batch: Any = None) -> None:
    """Set the value(s) in one rank (rows of ``batch`` of each value)."""
    rt, variables, sids, single = _prepare(shared_vars)
    _check_rank(rt, rank)
    checked = _values(rt, variables, values, "set_value", single)
    rows = [_rows(batch, _length(c)) if var.type.ndim else ...  # 0-d: the whole value
            for var, c in zip(variables, checked)]
    for var, value, sel in zip(variables, checked, rows):
        shape = _shape(value)
        _check_shape(var, shape if sel is ... else (_count(sel, shape[0]), *shape[1:]), "set_value")
    _run(rt, "set_value", sids=sids, values=_encode(rt, checked), rows=rows, target=int(rank))


@_submittable
def get_value(rank: int, shared_vars: Any) -> Any:
    """The value(s) in one rank."""
    rt, _, sids, single = _prepare(shared_vars)
    _check_rank(rt, rank)
    return _result(_run(rt, "get_value", sids=sids, target=int(rank)), single)


@_submittable
def get_lengths(shared_vars: Any) -> Any:
    """Each variable's length in every rank (a list in rank order)."""
    shapes = get_shapes(shared_vars)
    per_var = [shapes] if not isinstance(shared_vars, (list, tuple)) else list(shapes)
    lengths = [[s[0] if s else 1 for s in var_shapes] for var_shapes in per_var]
    return lengths[0] if not isinstance(shared_vars, (list, tuple)) else tuple(lengths)


@_submittable
def get_shapes(shared_vars: Any) -> Any:
    """Each variable's shape in every rank (a list in rank order)."""
    rt, _, sids, single = _prepare(shared_vars)
    return _result(_run(rt, "get_shapes", sids=sids), single)


def _check_rank(rt: Runtime, rank: Any) -> None:
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or not 0 <= rank < rt.size:
        raise ValueError(f"rank must be an int in [0, {rt.size}), got {rank!r}")

