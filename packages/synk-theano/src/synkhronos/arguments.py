"""A call's arguments checked and turned into its plan (:class:`CallArguments`, a base of
:class:`~synkhronos.function.Function`): the Data bound to the inputs (by position, then by the
variable's name), ``output_subset``, ``batch`` as each rank's rows and ``batch_s`` as each rank's
selection, then the :class:`~synkhronos.calls.CallPlan` written into the shared scratch slots.
Every check runs in the master before any worker is told to act."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from synk_shm import Data
from synkhronos import calls, data_registry
from synkhronos.distribution import ensure_distributed
from synkhronos.runtime import Runtime, describe

if TYPE_CHECKING:
    from synkhronos.replica import Replica
    from synkhronos.spec import FunctionSpec

__all__ = ["CallArguments"]


def _row_limit(scattered: list[Data]) -> int | None:
    """The rows a batch's indices may address: the shortest scattered input that is not a
    minibatch Data (None when every one is: there the batch's positions read its rows)."""
    return min((len(d) for d in scattered if not d.minibatch), default=None)


class CallArguments:
    """The checks of a call's arguments and its plan (the part of :class:`~synkhronos.function.Function`
    that runs before the command starts)."""

    _spec: FunctionSpec
    _replica: Replica
    _by_name: dict[str, int]

    def _prepare(self, rt: Runtime, args: Sequence[Any], kwargs: Mapping[str, Any], subset: tuple[int, ...] | None,
                 batch: Any, batch_s: Any, num_slices: Any, extra_slots: int = 0) -> calls.CallPlan:
        """Every check of a call, then its plan written into the shared scratch slots (after which
        the command may start).  ``extra_slots``: scratch slots the caller writes after the plan."""
        if not rt.is_master:
            raise RuntimeError("synkhronos functions are called in the master only")
        self._require_current(rt)
        ensure_distributed(rt)
        data_registry.flush_dropped(rt)
        datas = self._bind(args, kwargs)
        group = rt.group
        length = calls.CallPlan.length(len(datas), len(subset or ()), rt.size) + extra_slots
        if length > len(group.scratch):  # before _plan, which may register Data with the workers
            raise ValueError(f"this call needs {length} argument slots; fork(max_n_var=...) reserved "
                             f"{len(group.scratch)}: fork with a larger max_n_var")
        plan = self._plan(rt, datas, subset, batch, batch_s, num_slices)
        calls.encode(plan, group.scratch, rt.size)
        return plan

    def _require_current(self, rt: Runtime) -> None:
        if rt.replicas.get(self._spec.fid) is not self._replica:  # its id may name another function now
            raise RuntimeError(f"{self!r} was built for a group that is closed: build it again with "
                               "synk.function() after synk.fork()")

    # -- argument checks ------------------------------------------------------------------------
    def _bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Data]:
        spec = self._spec
        variables = spec.all_inputs
        slots: list[Any] = [None] * len(variables)
        if len(args) > len(variables):
            raise TypeError(f"{self!r} takes {len(variables)} Data arguments ({len(spec.inputs)} inputs, "
                            f"{len(spec.bcast_inputs)} broadcast inputs); got {len(args) + len(kwargs)}")
        for i, a in enumerate(args):
            slots[i] = a
        for key, value in kwargs.items():
            i = self._by_name.get(key, -1)
            if i < 0:
                raise TypeError(f"{self!r} has no input named {key!r}; its inputs are "
                                f"{[v.name for v in variables]}")
            if slots[i] is not None:
                raise TypeError(f"input {key!r} given twice (by position and by keyword)")
            slots[i] = value
        missing = [describe(v) for v, s in zip(variables, slots) if s is None]
        if missing:
            raise TypeError(f"{self!r}: missing Data for input(s) {', '.join(missing)}")
        for var, value in zip(variables, slots):
            data_registry.check_input(value, var)
        return slots

    def _subset(self, output_subset: Sequence[int] | None) -> tuple[int, ...] | None:
        if output_subset is None:
            return None
        n = len(self._spec.outputs)
        if isinstance(output_subset, (str, bytes)) or not isinstance(output_subset, (Sequence, np.ndarray)):
            raise TypeError(f"output_subset must be a list of output indices, got {output_subset!r}")
        subset = []
        for i in output_subset:
            if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
                raise TypeError(f"output_subset must hold ints, got {i!r}")
            if not 0 <= i < n:
                raise ValueError(f"output_subset index {i} out of range: the function has {n} outputs")
            subset.append(int(i))
        if len(set(subset)) != len(subset):
            raise ValueError(f"output_subset has repeated indices: {list(output_subset)}")
        return tuple(subset)

    def _plan(self, rt: Runtime, datas: list[Data], subset: tuple[int, ...] | None, batch: Any,
              batch_s: Any, num_slices: Any) -> calls.CallPlan:
        spec = self._spec
        if not isinstance(num_slices, (int, np.integer)) or isinstance(num_slices, bool) or num_slices < 1:
            raise ValueError(f"num_slices must be an int >= 1, got {num_slices!r}")
        if num_slices > 1 and self._replica.has_collectives:
            raise ValueError("this function's graph holds in-graph collectives (synkhronos.ops), which run once per "
                             "call in every rank: call it with num_slices=1")
        if num_slices > 1 and not spec.inputs and not spec.sliceable:
            raise ValueError("num_slices > 1 needs something to slice: this function has no scattered "
                             "inputs and no sliceable_shareds")
        if batch_s is not None and not spec.sliceable:
            raise ValueError("batch_s selects rows of sliceable shared variables; this function has none "
                             "(declare them with synk.function(..., sliceable_shareds=[...]))")
        scattered = datas[:len(spec.inputs)]
        index_parts: list[np.ndarray] = []
        kind, start, total = self._batch(scattered, batch, index_parts)
        if scattered and total == 0:
            raise ValueError("the call selects no rows of the scattered inputs (empty Data or an empty batch): "
                             "nothing to compute")
        bs_kind, bs = self._batch_s(rt, batch_s, index_parts)
        index_did = -1
        if index_parts:
            indices = index_parts[0] if len(index_parts) == 1 else np.concatenate(index_parts)
            index_did = data_registry.write_indices(rt, indices)
        return calls.CallPlan(spec.fid, int(num_slices), kind, start,
                              [data_registry.data_id(rt, d) for d in datas], subset,
                              calls.normalise_positions(total, rt.size), bs_kind, bs, index_did)

    def _batch(self, scattered: list[Data], batch: Any, index_parts: list[np.ndarray]) -> tuple[int, int, int]:
        """(kind, start, total) of the scattered rows; index batches go into ``index_parts``."""
        if not scattered:
            if batch is not None:
                raise ValueError("batch selects rows of scattered inputs; this function has none")
            return 0, 0, 0
        if batch is None:
            n = len(scattered[0])
            if any(len(d) != n for d in scattered):
                raise ValueError(f"the scattered inputs have different lengths {self._lengths(scattered)}; pass "
                                 "batch= to select the same rows of each")
            return 0, 0, n
        limit = _row_limit(scattered)
        if isinstance(batch, (bool, np.bool_)):
            raise TypeError(f"batch must be an int, a slice, or integer indices, got {batch!r}")
        if isinstance(batch, (int, np.integer)):
            batch = slice(0, int(batch)) if batch >= 0 else batch
            if not isinstance(batch, slice):
                raise ValueError(f"batch={batch} is negative; it must be a count of rows >= 0")
            if limit is not None and batch.stop > limit:
                raise ValueError(f"batch={batch.stop} asks for more rows than the inputs have "
                                 f"({self._lengths(scattered)})")
            self._check_minibatch(scattered, batch.stop)  # batch=k needs k rows, not fewer after clipping
        if isinstance(batch, slice):
            if limit is None:  # only minibatch inputs: the slice counts positions
                limit = min(len(d) for d in scattered)
            start, stop, step = batch.indices(limit)
            rows = range(start, stop, step)
            total = len(rows)
            self._check_minibatch(scattered, total)
            if step == 1:
                return 0, start, total
            index = np.arange(start, stop, step, dtype=np.int64)
        else:
            if isinstance(batch, (float, np.floating, str, bytes)):
                raise TypeError(f"batch must be an int, a slice, or integer indices, got {batch!r}")
            index = calls.as_index_array(batch, "batch")
            total = len(index)
            if limit is not None and total:
                index = self._in_range(index, limit, scattered)
            self._check_minibatch(scattered, total)
        index_parts.append(index)
        return 1, 0, total

    def _in_range(self, index: np.ndarray, limit: int, scattered: list[Data]) -> np.ndarray:
        """``index`` (not empty) with its negative indices counted from the end, as in numpy;
        ValueError for an index out of range of ``limit`` rows."""
        low = int(index.min())
        if int(index.max()) >= limit or low < -limit:
            bad = index[(index >= limit) | (index < -limit)][:5].tolist()
            raise ValueError(f"batch indices {bad} out of range for inputs of lengths {self._lengths(scattered)}")
        return np.where(index < 0, index + limit, index) if low < 0 else index

    def _lengths(self, scattered: list[Data]) -> dict[str, int]:
        return {describe(v): len(d) for v, d in zip(self._spec.inputs, scattered)}

    def _check_minibatch(self, scattered: list[Data], total: int) -> None:
        for var, d in zip(self._spec.inputs, scattered):
            if d.minibatch and len(d) < total:
                raise ValueError(f"minibatch Data for input {describe(var)} has {len(d)} rows; the batch "
                                 f"selects {total} (a minibatch Data holds the batch: row i is position i)")

    def _batch_s(self, rt: Runtime, batch_s: Any, index_parts: list[np.ndarray]) -> tuple[int, np.ndarray | None]:
        if batch_s is None:
            return 0, None
        size = rt.size

        def is_one(sel: Any) -> bool:
            if isinstance(sel, slice):
                return True
            if isinstance(sel, np.ndarray):
                return True
            return isinstance(sel, (list, tuple)) and all(isinstance(i, (int, np.integer)) for i in sel)

        selections = [batch_s] * size if is_one(batch_s) else list(batch_s)
        if len(selections) != size or not all(is_one(s) for s in selections):
            raise TypeError(f"batch_s must be a slice, a list or 1-d int array of rows, or a list of {size} "
                            f"of those (one per rank); got {batch_s!r}")
        kinds = {isinstance(s, slice) for s in selections}
        if len(kinds) > 1:
            raise TypeError("batch_s per rank must be all slices or all index lists")
        bs = np.zeros((size, 3), dtype=np.int64)
        if kinds == {True}:
            for r, s in enumerate(selections):
                for j, v in enumerate((s.start, s.stop, s.step)):
                    if v is not None and not isinstance(v, (int, np.integer)):
                        raise TypeError(f"batch_s slice bounds must be ints or None, got {s!r}")
                    bs[r, j] = calls.NONE if v is None else int(v)
                if s.step == 0:
                    raise ValueError("batch_s slice step cannot be zero")
            return 1, bs
        offset = sum(len(p) for p in index_parts)
        for r, s in enumerate(selections):
            idx = calls.as_index_array(s, "batch_s")
            index_parts.append(idx)
            bs[r] = (offset, len(idx), 0)
            offset += len(idx)
        return 2, bs

