"""Known plans (:class:`KnownPlans`, a base of :class:`~synkhronos.function.Function`): a call like an
earlier one -- the same Data objects, output subset and batch -- reuses that call's checked plan and
scratch slots instead of checking its arguments again."""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from synk_shm import Data
from synkhronos import calls, data_registry
from synkhronos.arguments import CallArguments, _row_limit
from synkhronos.distribution import ensure_distributed
from synkhronos.runtime import Runtime

__all__ = ["KnownPlans"]


class KnownPlans(CallArguments):
    """The plans of earlier calls, kept by their arguments (see :meth:`_known_plan`)."""

    _plans: dict[tuple[Any, ...], tuple[Any, ...]]

    # -- known plans: a call like an earlier one skips its checks --------------------------------
    @staticmethod
    def _plan_key(args: Sequence[Any], kwargs: Mapping[str, Any], output_subset: Any, batch: Any, batch_s: Any,
                  num_slices: Any) -> tuple[Any, ...] | None:
        """The key under which a call's checked plan is kept (see :meth:`_known_plan`), or None for a
        call whose plan is not kept: keywords, ``num_slices`` > 1, a batch other than None, an int, a
        slice or a 1-d numpy array of indices (a training loop's shuffled batch: the plan is kept for
        its length, each call writes its indices), or a ``batch_s`` other than None or one slice of
        int bounds (a training loop's window: the plan holds it whole, and the ranks check it against
        their rows)."""
        if kwargs or type(num_slices) is not int or num_slices != 1:
            return None
        if batch_s is not None and not (type(batch_s) is slice and all(
                v is None or type(v) is int for v in (batch_s.start, batch_s.stop, batch_s.step))):
            return None
        if type(batch) is np.ndarray:
            if batch.ndim != 1 or batch.dtype.kind not in "iu" or not len(batch):
                return None  # the full checks say what is wrong (or that an empty batch is)
            batch_key: Any = ("indices", len(batch))
        elif batch is not None and type(batch) not in (int, slice):
            return None
        else:
            batch_key = (batch.start, batch.stop, batch.step) if type(batch) is slice else batch
        if output_subset is not None and not (type(output_subset) in (list, tuple)
                                              and all(type(i) is int for i in output_subset)):
            return None
        subset_key = None if output_subset is None else tuple(output_subset)
        window_key = None if batch_s is None else (batch_s.start, batch_s.stop, batch_s.step)
        return (subset_key, batch_key, window_key, *map(id, args))

    def _known_plan(self, rt: Runtime, key: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The kept plan of a call like an earlier one -- the same Data objects, still registered and
        of the same shapes, the same output subset and batch -- with its scratch slots copied back
        into the group's (a dict lookup instead of every check and the plan); None if there is none."""
        known = self._plans.get(key)
        if known is None or known[0]() is not rt or rt.dropped or not self._still(rt, known[1]):
            return None
        self._require_current(rt)
        ensure_distributed(rt)
        slots = known[3]
        rt.group.scratch[:len(slots)] = slots
        return known

    def _remember(self, rt: Runtime, key: tuple[Any, ...], plan: calls.CallPlan,
                  index_batch: bool = False) -> tuple[Any, ...] | None:
        """Keep a checked plan under ``key`` (:meth:`_known_plan`); returns what is kept.

        A plan that reads the shared index buffer is kept only for a batch of indices
        (``index_batch``, a numpy array): each later call checks its own indices against the rows
        of the scattered inputs (kept here, ``known[5]``) and writes them there.  A slice with a
        step (an index batch too) is not kept."""
        index_rows = None
        if plan.index_did >= 0:
            if not index_batch or plan.bs_kind:
                return None
            limit = _row_limit([rt.data[did] for did in plan.data_ids[:len(self._spec.inputs)]])
            index_rows = -1 if limit is None else limit
        if len(self._plans) >= 64:
            self._plans.clear()
        datas = [(did, weakref.ref(rt.data[did]), rt.data[did].shape, rt.data[did].minibatch)
                 for did in plan.data_ids]
        slots = rt.group.scratch[:calls.CallPlan.length_of(rt.group.scratch, rt.size)].copy()
        reason = rt.driver.known_reason(self._replica, plan)
        known = (weakref.ref(rt), datas, plan, slots, reason, index_rows)
        self._plans[key] = known
        return known

    def _write_index_batch(self, rt: Runtime, batch: np.ndarray, plan: calls.CallPlan, rows: int) -> None:
        """A known plan's batch of indices (:meth:`_remember`): checked against ``rows`` (-1: only
        minibatch inputs, whose rows the batch's positions read) and written into the shared
        index buffer, where the plan's ranks read it."""
        index = calls.as_index_array(batch, "batch")
        if rows >= 0:
            index = self._in_range(index, rows, [rt.data[did] for did in plan.data_ids[:len(self._spec.inputs)]])
        data_registry.write_indices(rt, index)

    @staticmethod
    def _still(rt: Runtime, datas: list[tuple[int, weakref.ref[Data], Any, bool]]) -> bool:
        """Whether the Data of a known plan are still registered, of the same shapes and kinds."""
        for did, ref, shape, minibatch in datas:
            d = ref()
            if d is None:
                return False
            if rt.data.get(did) is not d or d.shape != shape or d.minibatch != minibatch:
                return False
        return True

