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
* ``VALUE`` -- shared variables' values: read one rank's (``get``) or every rank's (``read``),
  set them (``assign``: the same in every rank, or one per rank); or every rank's device memory
  figures (``memory``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from synk_comm import Group, handler
from synkhronos import calls
from synkhronos.engine import CALL, JOIN, PER_RANK, PROGRAM, VALUE, launch
from synkhronos.engine.device import EngineDevice
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

__all__ = ["Ranks"]


class Ranks:
    """A worker's engine state: the mesh of every rank's device and the compiled programs."""

    def __init__(self, device: Any) -> None:
        import jax
        from jax.sharding import Mesh

        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        self.mesh = Mesh(np.array(devices), (AXIS,))
        self.device = device
        self.programs: dict[tuple[int, tuple[int, ...] | None, int, tuple[int, ...]], Program | None] = {}

    def program(self, rt: Runtime, fid: int, subset: tuple[int, ...] | None, count: int,
                branches: tuple[int, ...] = ()) -> Program | None:
        """The function's program for ``subset`` (made on first use; ``count``: rows of its
        sliceable variables' window, 0 without; ``branches``: the distinct row counts of an uneven
        call, () for an even one); None if its JAX form takes shape arguments
        (``scalar_shape_inputs``), which one program cannot."""
        key = (fid, subset, count, branches)
        if key not in self.programs:
            program = Program(rt.replicas[fid], subset, self.mesh, count, branches)
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
    size = group.size - 1
    device = launch.join(coordinator, size, group.rank - 1, on_gpu)
    rt = Runtime(group, EngineDevice(device), engine=Ranks(device))
    set_current(rt)


@handler(CALL)
def _call(group: Group, _payload: None) -> None:
    if group.is_master:
        return
    rt = _runtime(group)
    plan = calls.decode(group.scratch, rt.size)
    rep = rt.replicas[plan.fid]
    reason = per_rank_reason(rep, plan)
    if reason is None and rep.spec.sliceable:  # do the sliceable variables fit one program in every rank?
        reason = fit_reason(group.host.all_gather(shapes_of(rep, rt.device))[1:], plan)
    found = window(plan) if rep.spec.sliceable else None
    counts = shares(rep, plan)
    branches = tuple(sorted(set(counts))) if counts else ()
    program = None if reason else rt.engine.program(rt, plan.fid, plan.subset, found[1] if found else 0, branches)
    if program is not None and branches and program.shapes_differ:
        program = None  # outputs whose shapes follow the rows: per rank, where the master says what differs
    if program is None:
        if rep.has_collectives:
            raise ValueError(f"{rep.spec.name or 'this function'} uses in-graph collectives, which run only in one "
                             f"program over the ranks, and this call cannot run as one: {reason}")
        weight, outputs = calls.execute(rt, plan)
        group.reply([np.array(PER_RANK), np.array(weight), *(np.asarray(o) for o in outputs)])
        return
    scattered, bcast = calls.rank_inputs(rt, plan)
    try:
        outputs = program(rt.device, scattered, bcast, found[0][rt.rank] if found else 0)
    except ShapesDiffer:  # found when tracing, alike in every rank: they all run it per rank instead
        program.shapes_differ = True
        _call(group, _payload)
        return
    # Every rank waits for its program: a failure inside it (an error, or a peer gone from a
    # collective) then surfaces in this call, as the rank's exception.
    program.wait()
    if rt.rank == 0:
        rows = (found[1] * rt.size if found else sum(int(p1 - p0) for p0, p1 in plan.positions)
                if rep.spec.inputs else rt.size)
        group.reply([np.array(PROGRAM), np.array(float(rows)),
                     *(np.asarray(o.addressable_data(0)) for o in outputs)])
    else:
        group.reply([np.array(PROGRAM)])



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
