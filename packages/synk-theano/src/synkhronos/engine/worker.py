"""The engine's call path in a worker: joining the runtime, running calls, reading and setting values.

Command handlers (names in :mod:`synkhronos.engine`; registered in every process, the workers
import this module through :mod:`synkhronos.worker`):

* ``JOIN`` -- the first command of an engine run: join JAX's runtime, make this rank's
  :class:`~synkhronos.runtime.Runtime` (compute rank = group rank - 1: the master is group rank 0
  and computes nothing).
* ``CALL`` -- a call: the plan is in the shared scratch slots (:mod:`synkhronos.calls`).
  The one program (:mod:`synkhronos.engine.program`) when the call allows it, else the
  per-rank program of :mod:`synkhronos.replica`.  Every worker replies ``[form, weight,
  *outputs]``: ``form`` ``PROGRAM`` (compute rank 0 alone carries the combined outputs) or
  ``PER_RANK`` (each rank its own share, combined by the master).
  A *pipelined* call (bit :data:`~synkhronos.calls.DEFER` of the plan's flags slot, a submitted
  call: :mod:`synkhronos.inflight`) is dispatched and held (:class:`Pending`); the rank replies
  the outputs of the pipelined call before it, which it waits for only after this call's program
  is queued behind it (:func:`_call_pipelined`).
* ``FETCH`` -- the outputs of the pipelined call held, when no call follows it (``_fetch``).
* ``VALUE`` -- shared variables' values: read one rank's (``get``) or every rank's (``read``),
  set them (``assign``: the same in every rank, or one per rank); or every rank's device memory
  figures (``memory``).
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from synk_comm import Group, handler
from synkhronos import calls
from synkhronos.engine import CALL, FETCH, JOIN, PER_RANK, PROGRAM, RESHAPED, VALUE, launch, phases
from synkhronos.engine.device import EngineDevice
from synkhronos.engine.phases import PHASES
from synkhronos.engine.program import (
    AXIS,
    Program,
    ShapesDiffer,
    fit_reason,
    per_rank_reason,
    shapes_of,
    shares,
    window,
)
from synkhronos.runtime import Runtime, current, set_current

__all__ = ["PIN_ENV", "QUEUED_COLLECTIVES", "Pending", "Ranks", "pins_inputs", "queue_collective"]

log = logging.getLogger("synkhronos")

PIN_ENV = "SYNK_PIN_INPUTS"
"""``0``: never register the inputs' memory with the device; ``1``: always try (and fall back,
logged, where it fails: JAX's CPU device); unset: on GPUs."""


PIN_MIN_BYTES = 1 << 20
"""Data allocations smaller than this are not registered (:meth:`Ranks.pin`): a small copy costs less
through the driver's staging buffer (measured on an H100: an 8-float input's round trip 670 us from
shared memory, 800 us from the same memory registered)."""


def pins_inputs(on_gpu: bool) -> bool:
    """Whether the workers register the memory of their inputs with the device (:meth:`Ranks.pin`)."""
    value = os.environ.get(PIN_ENV, "").strip()
    return on_gpu if value == "" else value != "0"


class Ranks:
    """A worker's engine state: the mesh of every rank's device, the compiled programs, and the
    Data whose memory is registered with the device (:meth:`pin`)."""

    def __init__(self, device: Any, pin: bool = False) -> None:
        import jax
        from jax.sharding import Mesh

        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        self.mesh = Mesh(np.array(devices), (AXIS,))
        self.device = device
        self.programs: dict[tuple[int, tuple[int, ...] | None, int, tuple[int, ...]], Program | None] = {}
        self.pinning = pin
        """Whether :meth:`pin` registers memory (off where the device cannot, after the first failure)."""
        self.pinned: dict[int, int] = {}
        """Data id -> the address of its memory, registered with the device (0: too small to register)."""
        self.pending: Pending | None = None
        """The last pipelined call, dispatched and not replied yet (:func:`_call_pipelined`)."""
        self.ready: list[Any] | None = None
        """What a failed pipelined command left for the master's fetch (``_fetch``)."""
        self.queued: collections.deque[Pending] = collections.deque()
        """Submitted collectives queued on the device and not waited for (:func:`queue_collective`)."""
        self.known: dict[bytes, tuple[calls.CallPlan, Any, Program, Any, np.ndarray]] = {}
        """A call's plan (its scratch slots, as bytes) -> what it decoded to: (plan, replica, program,
        batch_s window, the weight replied), for plans that ran as one program and need no check
        between the ranks."""

    def remember(self, key: bytes, known: tuple[calls.CallPlan, Any, Program, Any, np.ndarray], fits: bool) -> None:
        """Keep what a call's plan decoded to (:attr:`known`): the next call of the same plan looks it up.
        Not for uneven calls, nor for calls of functions with sliceable shared variables unless the
        master found that they fit (:data:`synkhronos.calls.FITS`; else each call compares their shapes
        between the ranks, a collective the master takes part in): ``fits``, the master's word."""
        if (known[1].spec.sliceable and not fits) or known[2].branches:  # (uneven calls: rare, and may turn
            return  # per rank)
        if len(self.known) >= 256:
            self.known.clear()
        self.known[key] = known

    def pin(self, rt: Runtime, data_ids: list[int]) -> None:
        """Register the memory of the call's Data with the device once (``dma_map`` of JAX's client,
        CUDA's ``cudaHostRegister``): the device then reads a call's rows from shared memory by DMA
        at the link's full speed, where pageable memory goes through a staging copy in host memory
        first.  Only allocations of :data:`PIN_MIN_BYTES` or more.  Where registration is impossible
        (JAX's CPU device, a driver that refuses), it is logged once and the rows go the pageable way
        (:data:`PIN_ENV` switches it)."""
        if not self.pinning:
            return
        for did in data_ids:
            if did in self.pinned:
                continue
            values = rt.data[did].data
            if values is None:
                continue
            if rt.data[did].alloc_size * values.itemsize < PIN_MIN_BYTES:
                self.pinned[did] = 0  # looked at: too small (looked at again after it changes)
                continue
            nbytes = rt.data[did].alloc_size * values.itemsize
            address = int(values.__array_interface__["data"][0])
            try:
                self.device.client.dma_map(address, nbytes)
            except Exception as exc:  # any refusal means: the pageable way
                self.pinning = False
                log.info("synkhronos: inputs are not registered with the device (%s: %s); they reach it "
                         "through pageable memory", type(exc).__name__, exc)
                return
            self.pinned[did] = address

    def unpin(self, did: int) -> None:
        """Before Data ``did``'s memory changes or goes (:mod:`synkhronos.data_registry`): undo its
        registration (a registration outliving its mapping would let the device read stale pages)."""
        address = self.pinned.pop(did, 0)
        if address:
            try:
                self.device.client.dma_unmap(address)
            except Exception as exc:  # the mapping is gone either way
                log.debug("synkhronos: dma_unmap of Data %d failed: %s", did, exc)

    def program(self, rt: Runtime, fid: int, subset: tuple[int, ...] | None, count: int,
                counts: list[int] | None = None) -> Program | None:
        """The function's program for ``subset`` (made on first use; ``count``: rows of its
        sliceable variables' window, 0 without; ``counts``: each rank's rows of an uneven call,
        None for an even one); None if its JAX form takes shape arguments
        (``scalar_shape_inputs``), which one program cannot.

        An uneven program is kept per set of row counts (its branches), and with in-graph
        collectives per rank's row counts (its collectives know every rank's, see
        :meth:`synkhronos.ops.Collective.in_program`)."""
        rep = rt.replicas[fid]
        branches = tuple(sorted(set(counts))) if counts else ()
        ranks = tuple(counts) if counts and rep.has_collectives else ()
        key = (fid, subset, count, ranks or branches)
        if key not in self.programs:
            program = Program(rep, subset, self.mesh, count, branches, ranks)
            self.programs[key] = None if program.takes_shapes else program
        return self.programs[key]


def _runtime(group: Group) -> Runtime:
    rt = current()
    if rt is None or rt.group is not group or rt.engine is None:
        raise RuntimeError("this worker has not joined the engine's runtime (the JOIN command comes first)")
    return rt


@handler(JOIN)
def _join(group: Group, payload: tuple[str, bool]) -> None:
    if group.is_master:
        return
    coordinator, on_gpu = payload
    size = group.span_size - 1  # every host's ranks where the group spans hosts (synkhronos.multinode)
    device = launch.join(coordinator, size, group.rank + group.span_offset - 1, on_gpu)
    phases.start(f"rank{group.rank + group.span_offset - 1}")
    rt = Runtime(group, EngineDevice(device), engine=Ranks(device, pin=pins_inputs(on_gpu)))
    set_current(rt)


@handler(CALL)
def _call(group: Group, _payload: None) -> None:
    if group.is_master:
        return
    rt = _runtime(group)
    if int(group.scratch[calls.FITS]) & calls.DEFER:
        _call_pipelined(group, rt)
        return
    done = _start(group, rt, pipelined=False)
    group.reply(done.finish() if isinstance(done, Pending) else done)
    if PHASES is not None:
        PHASES.mark("reply")


class Pending:
    """A call dispatched by this rank and not replied yet (a pipelined call, or a synchronous one
    between its dispatch and its reply): ``head`` (its form, and on compute rank 0 its weight),
    compute rank 0's ``outputs`` (their copies to the host started), and everything the program
    returns (``wait_for``: a rank without outputs to read waits for them, so that a failure inside
    the program surfaces as this rank's exception; an updated value that a later call took over,
    donated, is left to that call)."""

    def __init__(self, head: list[np.ndarray], outputs: list[Any], wait_for: Any) -> None:
        self.head = head
        self.outputs = outputs
        self.wait_for = wait_for

    def finish(self) -> list[Any]:
        """Wait for the call; its reply: the head, then the outputs as host arrays."""
        if self.outputs:
            values = [np.asarray(o) for o in self.outputs]
            if PHASES is not None:
                PHASES.mark("outputs")
        else:
            import jax

            values = []
            # an updated value donated to a later call is gone: that call's end implies this one's
            jax.block_until_ready([x for x in self.wait_for if not x.is_deleted()])
            if PHASES is not None:
                PHASES.mark("wait")
        self.wait_for = self.outputs = ()  # type: ignore[assignment]
        return [*self.head, *values]


_NOTHING = np.array(2)
_FAILED = np.array(1)
_READY = np.array(0)


def _call_pipelined(group: Group, rt: Runtime) -> None:
    """A pipelined call: dispatch it, then reply the previous pipelined call's outputs (waiting for
    them while this call's program waits in the device queue behind it) and this call's head.

    The reply: ``[lengths, *previous, *this]``, ``lengths`` = (parts of the previous call's reply,
    parts of this call's, whether this call is still pending).  A call that runs per rank (not one
    program) is run here and replied whole.  On a failure the rank raises (the command fails) and
    keeps what the master fetches next (``_fetch``): the previous call's reply, or that the
    previous call is what failed (this call is then dropped)."""
    ranks = rt.engine
    previous, ranks.pending, ranks.ready = ranks.pending, None, None
    try:
        this = _start(group, rt, pipelined=True)
    except BaseException:
        if previous is not None:
            try:
                ranks.ready = [_READY, *previous.finish()]
            except BaseException:
                ranks.ready = [_FAILED]
                raise  # the earlier failure is the one to report
        raise
    before: list[Any] = []
    if previous is not None:
        try:
            before = previous.finish()
        except BaseException:
            ranks.ready = [_FAILED]  # this call ran on what the failed one left: dropped
            raise
    if isinstance(this, Pending):
        ranks.pending = this
        group.reply([np.array([len(before), len(this.head), 1]), *before, *this.head])
    else:
        group.reply([np.array([len(before), len(this), 0]), *before, *this])
    if PHASES is not None:
        PHASES.mark("reply")


QUEUED_COLLECTIVES = 2
"""Submitted collectives a worker keeps queued on its device and unfinished (it waits for the oldest
before it replies to a newer one): enough that the next command arrives while one runs, few enough
to bound the memory their results hold."""


def queue_collective(group: Group, rt: Runtime, start: Callable[[], Pending]) -> None:
    """A submitted collective: dispatch it (``start``), reply the outputs of the pipelined call held
    before it, if any (``[lengths, *its reply]`` as :func:`_call_pipelined`), and keep it queued: done,
    as far as the master knows, since everything after it runs after it on this device.  On a
    failure the rank raises and keeps what :func:`_call_pipelined` keeps for the master's fetch."""
    ranks = rt.engine
    previous, ranks.pending, ranks.ready = ranks.pending, None, None
    before: list[Any] = []
    try:
        this = start()
        if previous is not None:
            before = previous.finish()
            previous = None
        ranks.queued.append(this)
        while len(ranks.queued) > QUEUED_COLLECTIVES:
            ranks.queued.popleft().finish()
    except BaseException:
        if previous is not None:  # not finished yet: whether it failed is what the master asks next
            try:
                before = previous.finish()
            except BaseException:
                ranks.ready = [_FAILED]
                raise
        ranks.ready = [_READY, *before] if before else None
        raise
    group.reply([np.array([len(before), 0, 0]), *before])


@handler(FETCH)
def _fetch(group: Group, _payload: None) -> None:
    """The outputs of the last pipelined call (``[0, *reply]``), or what a failed pipelined command
    left (:func:`_call_pipelined`: ``[0, *reply]`` of the call before it, ``[1]`` that call
    failed), or ``[2]``: nothing held."""
    if group.is_master:
        return
    ranks = _runtime(group).engine
    pending, ready = ranks.pending, ranks.ready
    ranks.pending = ranks.ready = None
    if pending is not None:
        group.reply([_READY, *pending.finish()])
    else:
        group.reply(ready if ready is not None else [_NOTHING])


def _start(group: Group, rt: Runtime, pipelined: bool) -> Pending | list[Any]:
    """Start the call whose plan is in the scratch slots: dispatched as one program (a
    :class:`Pending`; its outputs' copies to the host start at once where ``pipelined``), or run
    per rank (its reply, whole)."""
    ph = PHASES
    if ph is not None:
        ph.begin()
    scratch = group.scratch
    fits = bool(int(scratch[calls.FITS]) & 1)
    key = scratch[:calls.CallPlan.length_of(scratch, rt.size)].tobytes()
    known = rt.engine.known.get(key)
    if known is not None:  # the same plan as an earlier call that ran as one program
        plan, rep, program, found, weight = known
    else:
        plan = calls.decode(scratch, rt.size)
        rep = rt.replicas[plan.fid]
        reason = per_rank_reason(rep, plan)
        if reason is None and rep.spec.sliceable and not fits:  # do the sliceable variables fit
            # one program in every rank?  (Known when the master says so: their shapes are as when it was checked)
            reason = fit_reason(group.host.all_gather(shapes_of(rep, rt.device))[1:], plan)
        found = window(plan) if rep.spec.sliceable else None
        counts = shares(rep, plan)
        program = None if reason else rt.engine.program(rt, plan.fid, plan.subset, found[1] if found else 0,
                                                         counts)
        if program is not None and program.shapes_differ:
            reason = program.shapes_differ  # shapes that follow the rows: per rank, where the master says what differs
            program = None
        if program is None:
            return _per_rank(rt, rep, plan, reason or "its JAX form takes shapes as arguments "
                                                      "(scalar_shape_inputs), which one program cannot")
        rows = (found[1] * rt.size if found else sum(int(p1 - p0) for p0, p1 in plan.positions)
                if rep.spec.inputs else rt.size)
        weight = np.array(float(rows))  # the call's rows over every rank
        rt.engine.remember(key, (plan, rep, program, found, weight), fits)
    if ph is not None:
        ph.mark("plan")
    scattered, bcast = calls.rank_inputs(rt, plan)
    rt.engine.pin(rt, plan.data_ids)
    if ph is not None:
        ph.mark("rows")
    try:
        outputs = program(rt.device, scattered, bcast, found[0][rt.rank] if found else 0)
    except ShapesDiffer as exc:  # found when tracing, alike in every rank: they all run it per rank instead
        program.shapes_differ = str(exc)  # (the next call of the plan knows it before tracing)
        return _per_rank(rt, rep, plan, str(exc))
    if ph is not None:
        ph.mark("dispatch")
    local: list[Any] = []
    if rt.rank == 0 and outputs:
        local = outputs if rt.size == 1 else [o.addressable_data(0) for o in outputs]
        if pipelined or len(local) > 1:  # every output starts its way to the host as soon as the program
            for o in local:  # ends (measured: for a single output read at once, np.asarray alone is faster)
                o.copy_to_host_async()
    head = [_RESHAPED if program.reshaped else _FORM, weight] if rt.rank == 0 else [_FORM]
    pending = Pending(head, local, program.last)
    program.forget()  # the Pending holds what is left to wait for
    return pending


_FORM = np.array(PROGRAM)
_RESHAPED = np.array(RESHAPED)


def _per_rank(rt: Runtime, rep: Any, plan: calls.CallPlan, reason: str) -> list[Any]:
    """Run the call as this rank's own program (``reason``: why not one program over the ranks);
    returns its reply, this rank's share.  A function with in-graph collectives cannot, and raises
    (in every rank alike)."""
    if rep.has_collectives:
        raise ValueError(f"{rep.spec.name or 'this function'} uses in-graph collectives, which run only "
                         f"in one program over the ranks, and this call cannot run as one: {reason}")
    weight, outputs = calls.execute(rt, plan)
    return [np.array(PER_RANK), np.array(weight), *(np.asarray(o) for o in outputs)]


@handler(VALUE)
def _value(group: Group, payload: tuple[str, Any, Any]) -> None:
    if group.is_master:
        return
    rt = _runtime(group)
    action, sids, arg = payload
    if action == "memory":
        stats = rt.engine.device.memory_stats() or {}
        group.reply([np.array([stats.get("peak_bytes_in_use", 0), stats.get("bytes_in_use", 0)], dtype=np.int64)])
        return
    variables = [rt.shared_var(sid) for sid in sids]
    if action == "get":  # compute rank ``arg``'s values
        group.reply([rt.device.get(var) for var in variables] if rt.rank == arg else [])
    elif action == "read":  # every rank's
        group.reply([rt.device.get(var) for var in variables])
    else:  # "assign": (per_rank, every)
        per_rank, every = arg
        values = every if every is not None else per_rank[rt.rank]
        for var, value in zip(variables, values or ()):
            rt.device.set(var, value)
