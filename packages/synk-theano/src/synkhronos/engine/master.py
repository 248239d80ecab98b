"""The engine's call path in the master: start the call, take the result.

The master computes nothing (it never joins JAX's runtime, see :mod:`synkhronos.engine`): a call
is one command to the workers (``CALL``, handled in :mod:`synkhronos.engine.worker`) whose plan
the master wrote into the scratch slots, then the replies: compute rank 0's combined outputs when the call
ran as one program, else every rank's share, combined here as the per-rank engine does
(:func:`synkhronos.reduce_ops.combine`).  A call that runs per rank is logged once per function
and reason at INFO.

Shared variables: the master holds no value of its own; compute rank 0's value stands for it:
``var.get_value()`` reads it (:func:`read_value`), ``var.set_value(v)`` sets it
(:func:`write_value`).  Collectives on shared variables: :mod:`synkhronos.engine.collectives`.  The last
value read stays in the master's variable, which is what ``get_value`` returns after
:func:`synkhronos.close` (:func:`settle` reads every value before the workers stop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from typing import Any

import numpy as np

from synkhronos import calls
from synkhronos.engine import CALL, FETCH, PER_RANK, PROGRAM, VALUE, NotOneProgramError
from synkhronos.engine.launch import ABORT_GRACE_S
from synkhronos.engine.phases import PHASES
from synkhronos.engine.program import STACKED, _output_form, fit_reason, per_rank_reason, shares
from synkhronos.inflight import Deferred
from synkhronos.reduce_ops import combine
from synkhronos.replica import Replica
from synkhronos.runtime import Runtime, settled

__all__ = ["Orchestrator", "after_failure", "call", "device_memory", "fetch", "read_value",
           "settle", "write_value"]

log = logging.getLogger("synkhronos")


class Orchestrator:
    """The master's engine state (``Runtime.engine`` in the master)."""

    def __init__(self) -> None:
        self.last_weights: list[float] = []
        """Each compute rank's rows in the last call (0: the rank computed nothing)."""
        self.logged: set[tuple[int, str]] = set()
        """(function id, reason) of the per-rank runs logged already."""
        self.outputs: dict[tuple[int, tuple[int, ...] | None], tuple[Sequence[str], list[bool]]] = {}
        """(function id, output subset) -> each output's op and whether it leaves the program stacked
        (the master combines it)."""
        self.fits: set[bytes] = set()
        """The plans (scratch slots) of calls whose sliceable shared variables the ranks found to fit
        one program, valid while :attr:`quiet_at` says that nothing has changed them since."""
        self.pipelined: _Pipelined | None = None
        """The last pipelined call, whose outputs the workers still hold (:func:`call` with ``defer``)."""
        self.agreed: set[int] = set()
        """Shared ids whose shape every rank is known to hold alike (found by a collective's
        shape check), valid while :attr:`agreed_at` equals the group's command count."""
        self.agreed_at = -1
        """The command count after the last command known to change no shared variable's shape."""
        self.quiet_at = -1
        """The group's command count (:attr:`synk_comm.Group.commands`) at the end of the last call that
        ran as one program and changed no shared variable's shape; -1 when the last command was another.
        Only such calls came in between while it equals the count: every rank's sliceable variables
        still have the shapes that they had when a plan in :attr:`fits` was checked."""

    def fit_known(self, group: Any, size: int, sliceable: bool) -> bytes | None:
        """Before a call of a function with sliceable shared variables (``sliceable``): whether the
        ranks may skip comparing their shapes, written into the plan (:data:`synkhronos.calls.FITS`);
        returns the plan's key (None: no such function, or the check is skipped)."""
        scratch = group.scratch
        scratch[calls.FITS] = 0
        if not sliceable:
            return None
        key = scratch[:calls.CallPlan.length_of(scratch, size)].tobytes()
        if self.quiet_at != group.commands:
            self.fits.clear()
        elif key in self.fits:
            scratch[calls.FITS] = 1
            return None
        return key

    def outputs_of(self, rep: Replica, subset: tuple[int, ...] | None) -> tuple[Sequence[str], list[bool]]:
        """The ops of ``rep``'s outputs in ``subset`` and which leave the program stacked (cached)."""
        key = (rep.spec.fid, subset)
        found = self.outputs.get(key)
        if found is None:
            ops = rep.output_ops(subset)
            dtypes = [np.dtype(v.type.dtype) for v in rep.output_variables(subset)]
            found = self.outputs[key] = (ops, [_output_form(op, dt) == STACKED for op, dt in zip(ops, dtypes)])
        return found


def reason_of(rep: Replica, plan: calls.CallPlan) -> str | None:
    """Why the call cannot run as one program, as far as the master knows before the call
    (:func:`~synkhronos.engine.program.per_rank_reason`; None: it may)."""
    return per_rank_reason(rep, plan)


class _Pipelined:
    """The master's record of a pipelined call whose outputs the workers still hold."""

    def __init__(self, deferred: Deferred, rep: Replica, plan: calls.CallPlan, reason: str | None,
                 translate: Callable[[BaseException], BaseException]) -> None:
        self.deferred, self.rep, self.plan, self.reason, self.translate = deferred, rep, plan, reason, translate

    def resolve(self, rt: Runtime, parts: list[list[Any]]) -> None:
        """Its outputs came (every compute rank's reply, in rank order)."""
        try:
            results = _results(rt, self.rep, self.plan, self.reason, parts)
        except BaseException as exc:
            self.deferred.fail(exc)
        else:
            self.deferred.resolve(results)

    def fail(self, exc: BaseException) -> None:
        self.deferred.fail(self.translate(exc))


def _same(exc: BaseException) -> BaseException:
    return exc


def call(rt: Runtime, rep: Replica, plan: calls.CallPlan, known: tuple[str | None] | None = None,
         defer: bool = False, translate: Callable[[BaseException], BaseException] = _same) -> Any:
    """Run a planned call on the workers; returns its outputs, combined, in the call's order.
    ``known``: the plan's :func:`reason_of`, from an earlier call of the same plan.

    ``defer`` (the window's dispatch thread, :mod:`synkhronos.inflight`): the call is pipelined, and
    where it runs as one program the result is a :class:`~synkhronos.inflight.Deferred`, resolved
    with the next pipelined call's command or by :func:`fetch`.  The command of a pipelined call
    brings back the outputs of the one before it.  ``translate``: how a worker's failure reaches the
    future of a deferred call (what the synchronous call would raise).

    Raises
    ------
    NotOneProgramError
        A ValueError: the call cannot run as one program and the function's graph holds in-graph collectives
        (Ops marked ``synk_collective = True``), which only mean something inside the program.
    concurrent.futures.CancelledError
        A pipelined call whose previous call failed (its ``__cause__``); the previous call's future
        raises the failure.
    """
    ph = PHASES
    if ph is not None:
        ph.mark("prepare")
    spec = rep.spec
    reason = per_rank_reason(rep, plan) if known is None else known[0]
    if reason is not None and rep.has_collectives:
        raise NotOneProgramError(f"{spec.name or 'this function'} uses in-graph collectives, which run only in one "
                         f"program over the ranks, and this call cannot run as one: {reason}. Call it so that "
                         "one program can run it (the reason says what stops it), or build the step without "
                         "in-graph collectives (synk.chain)")
    orchestrator = rt.engine
    previous = orchestrator.pipelined
    if previous is not None and not defer:
        fetch(rt)
        previous = None
    checking = orchestrator.fit_known(rt.group, rt.size, reason is None and bool(spec.sliceable))
    if defer:
        rt.group.scratch[calls.FITS] |= calls.DEFER
    orchestrator.pipelined = None
    try:
        with rt.group.command(CALL):
            if checking is not None:  # the workers compare their sliceable variables' shapes
                reason = fit_reason(rt.group.host.all_gather(np.empty(0, dtype=np.int64))[1:], plan)
            # One program: a rank that fails leaves the others inside its collectives, to be stopped after
            # a grace.  Per-rank programs: the others finish their shares, however long they take.
            rt.group.abort_grace_s = ABORT_GRACE_S if reason is None else None
            if reason is not None and calls.needs_selection_barrier(spec, plan):
                rt.group.barrier()  # the workers check their sliceable rows, then meet (calls.execute)
    except BaseException as exc:
        if previous is not None:
            after_failure(rt, previous, exc)
        raise
    if ph is not None:
        ph.mark("command")
    replies = rt.group.replies()
    parts = [replies[r + 1] for r in range(rt.size)]  # compute rank r is group rank r + 1
    pending = False
    if defer:  # [lengths, *previous call's reply, *this call's]
        lengths = [p[0] for p in parts]
        if previous is not None:
            previous.resolve(rt, [p[1:1 + int(n[0])] for p, n in zip(parts, lengths)])
        pending = bool(lengths[0][2])
        parts = [p[1 + int(n[0]):] for p, n in zip(parts, lengths)]
    form = int(parts[0][0])
    orchestrator.quiet_at = rt.group.commands if form == PROGRAM else -1
    if checking is not None and form == PROGRAM:
        orchestrator.fits.add(checking)
    if pending:
        deferred = Deferred(lambda: fetch(rt))
        orchestrator.pipelined = _Pipelined(deferred, rep, plan, reason, translate)
        return deferred
    return _results(rt, rep, plan, reason, parts)


def fetch(rt: Runtime) -> None:
    """Bring back the outputs of the last pipelined call (:func:`call` with ``defer``) and resolve
    its :class:`~synkhronos.inflight.Deferred`; nothing to do without one."""
    previous = rt.engine.pipelined
    if previous is None:
        return
    rt.engine.pipelined = None
    quiet = rt.engine.quiet_at == rt.group.commands
    agreed = rt.engine.agreed_at == rt.group.commands
    try:
        with rt.group.command(FETCH):
            pass
        replies = rt.group.replies()
    except BaseException as exc:
        previous.fail(exc)
        return
    if quiet:  # a fetch changes no shared variable: the plans known to fit still do
        rt.engine.quiet_at = rt.group.commands
    if agreed:  # ... and the shapes known equal still are
        rt.engine.agreed_at = rt.group.commands
    previous.resolve(rt, [replies[r + 1][1:] for r in range(rt.size)])


def after_failure(rt: Runtime, previous: _Pipelined, exc: BaseException) -> None:
    """A pipelined call's command failed (``exc``) while the call before it was pending: which one
    failed?  The workers kept the answer (the worker's ``FETCH`` handler).  If the earlier
    one: it fails with ``exc`` and this one raises CancelledError; else the earlier one resolves and
    ``exc`` is this call's (the caller raises it)."""
    replies = None
    if not rt.group.closed:
        try:
            with rt.group.command(FETCH):
                pass
            replies = rt.group.replies()
        except BaseException as error:  # e.g. a worker died meanwhile
            exc = error
    if replies is None or any(int(replies[r + 1][0]) != 0 for r in range(rt.size)):
        previous.fail(exc)
        cancelled = CancelledError("cancelled: a call submitted before it failed")
        raise cancelled from exc
    previous.resolve(rt, [replies[r + 1][1:] for r in range(rt.size)])


def _results(rt: Runtime, rep: Replica, plan: calls.CallPlan, reason: str | None, parts: list[list[Any]]) -> list[Any]:
    """A call's outputs from every compute rank's reply (``[form, weight, *outputs]``; ``reason``:
    why it may run per rank)."""
    ph = PHASES
    form = int(parts[0][0])
    if form != PER_RANK:
        counts = shares(rep, plan)
        if counts is None:  # every rank the same rows: the output forms are cached per subset
            ops, stacked = rt.engine.outputs_of(rep, plan.subset)
            rt.engine.last_weights = [float(parts[0][1]) / rt.size] * rt.size
            results = [combine(op, list(value), [1.0] * rt.size, what=f"output {i}") if stack else value
                       for i, (op, stack, value) in enumerate(zip(ops, stacked, parts[0][2:]))]
        else:
            rt.engine.last_weights = [float(c) for c in counts]
            results = _program_outputs(rep, plan, rep.output_ops(plan.subset), parts[0][2:], counts)
        if ph is not None:
            ph.mark("results")
        return results
    ops = rep.output_ops(plan.subset)
    rt.engine.last_weights = [float(s[1]) for s in parts]
    _log_per_rank(rt, rep, reason)
    weights = [float(s[1]) for s in parts]
    return [combine(op, [s[2 + i] if len(s) > 2 else np.empty(0) for s in parts], weights, what=f"output {i}")
            for i, op in enumerate(ops)]


def _program_outputs(rep: Replica, plan: calls.CallPlan, ops: Sequence[str], values: list[Any],
                     counts: list[int] | None) -> list[Any]:
    """The outputs of a call that ran as one program (compute rank 0's reply): reduced in the
    program, or stacked per rank (see :mod:`synkhronos.engine.program`) and combined here.  An uneven
    call (``counts``: each rank's rows) stacks every ``gather`` output too, padded along axis 0, and
    ends with each rank's length of them."""
    dtypes = [np.dtype(v.type.dtype) for v in rep.output_variables(plan.subset)]
    weights = [float(c) for c in counts] if counts is not None else [1.0] * len(plan.positions)
    lengths = values[len(ops)] if counts is not None else None
    out, g = [], 0
    for i, (op, dtype, value) in enumerate(zip(ops, dtypes, values)):
        form = _output_form(op, dtype)
        if form == STACKED or (lengths is not None and form == "gather"):
            stacked = list(value)
            if lengths is not None and form == "gather" and np.ndim(value) > 1:
                stacked = [v[:int(n)] for v, n in zip(value, lengths[:, g])]
            g += 1
            out.append(combine(op, stacked, weights, what=f"output {i}"))
        else:
            out.append(value)
    return out



def _log_per_rank(rt: Runtime, rep: Replica, reason: str | None) -> None:
    reason = reason or ("its JAX form takes shape arguments, or (uneven shares) an output's shape follows the rows "
                        "under an op that needs one shape")
    key = (rep.spec.fid, reason)
    if key not in rt.engine.logged:
        rt.engine.logged.add(key)
        log.info("synkhronos: %s runs as per-rank programs (not one program over the ranks): %s",
                 rep.spec.name or f"function {rep.spec.fid}", reason)


def _engine_runtime() -> Runtime | None:
    rt = settled()
    if rt is None or rt.engine is None or rt.group.closed:
        return None
    return rt


def read_value(var: Any, rank: int = 0) -> np.ndarray:
    """Compute rank ``rank``'s value of a distributed shared variable (a copy, in host memory).

    Without a running engine (after close, or a worker's death), the value last read."""
    rt = _engine_runtime()
    sid = rt.shared_ids.get(var) if rt is not None else None
    if rt is None or sid is None:
        return np.array(var.container.storage[0])
    with rt.group.command(VALUE, ("get", [sid], rank)):
        pass
    value = rt.group.replies()[rank + 1][0]
    if rank == 0:
        var.container.storage[0] = value
    return np.array(value)


def write_value(var: Any, value: np.ndarray) -> None:
    """Set compute rank 0's value of a distributed shared variable (the master's, in the seed's
    terms: the other ranks keep theirs; :func:`synkhronos.broadcast` passes it on)."""
    var.container.storage[0] = np.array(value)
    rt = _engine_runtime()
    sid = rt.shared_ids.get(var) if rt is not None else None
    if rt is not None and sid is not None:
        per_rank = [[value]] + [None] * (rt.size - 1)
        with rt.group.command(VALUE, ("assign", [sid], (per_rank, None))):
            pass


def device_memory() -> list[dict[str, int]]:
    """Every compute rank's device memory, in rank order: ``peak_bytes_in_use`` and ``bytes_in_use``
    as JAX reports them (0 where the device keeps no statistics, e.g. JAX's CPU device).

    Raises
    ------
    RuntimeError
        Without a running JAX engine.
    """
    rt = _engine_runtime()
    if rt is None:
        raise RuntimeError("device_memory() needs a running JAX engine: synk.fork(..., engine='jax')")
    with rt.group.command(VALUE, ("memory", [], None)):
        pass
    replies = rt.group.replies()
    return [{"peak_bytes_in_use": int(replies[r + 1][0][0]), "bytes_in_use": int(replies[r + 1][0][1])}
            for r in range(rt.size)]


def settle(rt: Runtime) -> None:
    """Before the workers stop: read every shared variable's value (compute rank 0's) into the
    master's variable, so that ``get_value`` after :func:`synkhronos.close` returns it."""
    if rt.engine is None or rt.group.closed:
        return
    variables = [var for var in rt.shared_ids if hasattr(var.type, "dtype")]
    if not variables:
        return
    with rt.group.command(VALUE, ("get", [rt.shared_ids[var] for var in variables], 0)):
        pass
    for var, value in zip(variables, rt.group.replies()[1]):
        var.container.storage[0] = value
