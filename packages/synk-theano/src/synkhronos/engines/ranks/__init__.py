"""The per-rank engine (CPU mode's default, and GPU mode with ``engine="ranks"``): every group
rank, the master included, computes its share of a call with a program of its own
(:mod:`synkhronos.calls`, :mod:`synkhronos.replica`); the master combines the replies
(:mod:`synkhronos.reduce_ops`).  Collectives on shared variables run in every rank over the
group's shared memory (:mod:`synkhronos.collectives`' handlers); in-graph collectives run inside
the ranks' programs (:mod:`synkhronos.ops`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from synkhronos import calls
from synkhronos.calls import _finish_call, _selection_errors
from synkhronos.chain import OPS, Chain, _run
from synkhronos.engines.base import Engine
from synkhronos.protocol import CALL, CHAIN, COLLECTIVE
from synkhronos.reduce_ops import combine, combine_numbers
from synkhronos.replica import Replica
from synkhronos.runtime import Runtime

__all__ = ["RanksEngine"]

_EMPTY = np.empty(0)


class RanksEngine(Engine):
    """The per-rank engine in the master."""

    name = "ranks"
    master_computes = True

    def call(self, rt: Runtime, rep: Replica, plan: calls.CallPlan, known: tuple[str | None] | None,
             defer: bool = False) -> list[Any]:
        rt.group.start_command(CALL)  # the hot path: no context managers
        try:
            own = calls.share(rt, plan)
        except BaseException as exc:
            _finish_call(rt, exc)
            raise  # pragma: no cover - _finish_call raised
        _finish_call(rt, None)
        return combine_replies(rt, rep, own, plan)

    def chain(self, rt: Runtime, chain: Chain, sids: Sequence[int], args: Sequence[Any], kwargs: dict[str, Any],
              output_subset: Any, batch: Any, batch_s: Any, num_slices: Any) -> Any:
        first = chain.first
        subset = first._subset(output_subset)
        if chain.then is not None:
            chain.then._require_current(rt)
        tail = [-1 if chain.then is None else chain.then._spec.fid, OPS.index(chain.op), int(chain.zeros_if_idle),
                len(sids), *sids]
        plan = first._prepare(rt, args, kwargs, subset, batch, batch_s, num_slices, extra_slots=len(tail))
        offset = calls.CallPlan.length(len(plan.data_ids), len(subset or ()), rt.size)
        rt.group.scratch[offset:offset + len(tail)] = tail
        with _selection_errors(), rt.group.command(CHAIN):
            own = _run(rt, plan, offset)
        return first._shape(combine_replies(rt, first._replica, own, plan), plan)

    def collective(self, rt: Runtime, name: str, payload: dict[str, Any], defer: bool = False) -> Any:
        """A collective; submitted ones (``defer``) run as called: the master is a rank, and takes part."""
        return rt.group.run(COLLECTIVE, (name, payload))


def combine_replies(rt: Runtime, rep: Replica, own: list[np.ndarray] | None, plan: calls.CallPlan) -> list[Any]:
    """The combined outputs, from the master's share and the workers' replies (``own`` None:
    every rank replied numbers, :func:`synkhronos.calls.reply`)."""
    if own is None:
        dtypes = rep.value_dtypes(plan.subset)
        assert dtypes is not None
        if not dtypes:
            return []
        parts = rt.group.replied_values()[:, :1 + len(dtypes)].tolist()
        numbers = combine_numbers(rep.output_ops(plan.subset), parts)
        return [np.asarray(v, dtype=d) for v, d in zip(numbers, dtypes)]
    shares = rt.group.replies(copy=False)  # views: combined into new arrays below
    shares[rt.rank] = own
    ordered = [shares[r] for r in range(rt.size)]
    weights = [float(s[0]) for s in ordered]
    results = []
    for i, op in enumerate(rep.output_ops(plan.subset), 1):
        values = [s[i] if len(s) > 1 else _EMPTY for s in ordered]
        out = combine(op, values, weights, what=f"output {i - 1}")
        if out is not values[rt.rank] and any(out is v for v in values):
            out = out.copy()  # a worker's lone part, returned as it is, is a view of its buffer
        results.append(out)
    return results
