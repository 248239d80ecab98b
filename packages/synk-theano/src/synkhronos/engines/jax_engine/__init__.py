"""The JAX engine (GPU mode's default; CPU mode with ``engine="jax"``, and GPU mode emulated on
JAX's CPU devices with ``SYNK_EMULATE_GPUS``): a call is one program over every rank on JAX's
multi-process runtime; the master computes nothing.  This class is its face to the public API;
the machinery (master and worker call paths, programs, uneven shares, collectives, launch) is in
:mod:`synkhronos.engine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from synk_comm import WorkerError
from synkhronos import calls
from synkhronos.calls import SelectionError, _raise_selection_error, _selection_errors
from synkhronos.chain import Chain
from synkhronos.engine import collectives as engine_collectives
from synkhronos.engine import master
from synkhronos.engines.base import Engine
from synkhronos.replica import Replica
from synkhronos.runtime import Runtime

__all__ = ["JaxEngine"]


def _translated(exc: BaseException) -> BaseException:
    """What the synchronous call raises for ``exc`` (a bad ``batch_s`` selection in every failing rank:
    one SelectionError)."""
    if isinstance(exc, WorkerError):
        try:
            _raise_selection_error(exc)
        except SelectionError as error:
            return error
    return exc


class JaxEngine(Engine):
    """The JAX engine in the master (its state: ``Runtime.engine``, an
    :class:`~synkhronos.engine.master.Orchestrator`)."""

    name = "jax"
    master_computes = False

    def known_reason(self, rep: Replica, plan: calls.CallPlan) -> tuple[str | None] | None:
        return (master.reason_of(rep, plan),)

    def call(self, rt: Runtime, rep: Replica, plan: calls.CallPlan, known: tuple[str | None] | None,
             defer: bool = False) -> Any:
        """A call; ``defer``: pipelined (see :func:`synkhronos.engine.master.call`)."""
        with _selection_errors():
            return master.call(rt, rep, plan, known, defer, _translated)

    def chain(self, rt: Runtime, chain: Chain, sids: Sequence[int], args: Sequence[Any], kwargs: dict[str, Any],
              output_subset: Any, batch: Any, batch_s: Any, num_slices: Any) -> Any:
        """The three operations one by one (the all-reduce a program over the ranks,
        :mod:`synkhronos.engine.collectives`); the same results."""
        out = chain.first._run_now(rt, args, kwargs, output_subset, batch, batch_s, num_slices)
        if chain.zeros_if_idle:
            engine_collectives.zero_ranks(rt, list(sids), [r for r, w in enumerate(rt.engine.last_weights) if w == 0])
        if rt.size > 1:
            engine_collectives.run(rt, "all_reduce", {"sids": list(sids), "op": chain.op})
        if chain.then is not None:
            chain.then._run_now(rt, (), {}, None, None, None, 1)
        return out

    def collective(self, rt: Runtime, name: str, payload: dict[str, Any], defer: bool = False) -> Any:
        """A collective; ``defer``: a submitted all-reduce is only queued (see
        :mod:`synkhronos.engine.collectives`)."""
        return engine_collectives.run(rt, name, payload, defer)

    def close(self, rt: Runtime) -> None:
        """Read every shared value (compute rank 0's) into the master's variables."""
        master.settle(rt)
