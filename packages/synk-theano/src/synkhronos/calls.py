"""One call of a Synkhronos function: the master plans it, every rank runs its share.

The plan travels through the group's shared int64 scratch slots -- no pickling on the hot path:

====================  ==========================================================================
``fid``               which function
``num_slices``        slices per rank
``batch kind``        0: rows ``start + [p0, p1)`` of each scattered input; 1: rows
                      ``index[p0:p1]`` (the master wrote the batch indices into the shared index
                      buffer; each rank gathers its own rows straight from the Data)
``positions``         per rank ``(p0, p1)``: its positions in the batch (even split, the first
                      ``total % n`` ranks one more).  A minibatch Data reads rows ``[p0, p1)``.
``batch_s kind``      0: none; 1: per rank ``(start, stop, step)`` of its sliceable shareds
                      (bounds normalised in the rank, by its own length); 2: per rank
                      ``(offset, length, 0)`` into the shared index buffer
``data ids``          the Data arguments, inputs then broadcast inputs
``subset``            output indices, or none for all
====================  ==========================================================================
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from synk_comm import WorkerError
from synk_comm.errors import GroupAborted
from synk_comm.xla_cpu import ABORTED as ABORTED_IN_PROGRAM
from synkhronos import call_context
from synkhronos.errors import SelectionError
from synkhronos.replica import Replica
from synkhronos.runtime import Runtime

__all__ = ["DEFER", "CallPlan", "SelectionError", "compute", "decode", "encode", "execute", "needs_selection_barrier",
           "rank_inputs"]



NONE = np.iinfo(np.int64).min
"""Stands for ``None`` in a slice bound."""
HEADER = 9
FITS = 8
"""The header slot the JAX engine's master sets to 1 when a call's sliceable shared variables are
known to fit it in every rank, so that the ranks skip comparing them (:func:`synkhronos.engine.master.call`);
0 as :func:`encode` writes it.  Bit :data:`DEFER` of the same slot: the call is pipelined (see
:mod:`synkhronos.engine.worker`).  Only bit 1 means "fits"."""
DEFER = 2
"""The bit of slot :data:`FITS` that marks a pipelined call of the JAX engine: the workers dispatch it
and reply its outputs with the next command (:mod:`synkhronos.inflight`)."""


@dataclass
class CallPlan:
    fid: int
    num_slices: int
    batch_kind: int
    batch_start: int
    data_ids: Sequence[int]
    subset: tuple[int, ...] | None
    positions: np.ndarray  # (size, 2)
    bs_kind: int = 0
    bs: np.ndarray | None = None  # (size, 3)
    index_did: int = -1  # the shared index buffer holding batch / batch_s indices

    @staticmethod
    def length(n_data: int, n_subset: int, size: int) -> int:
        """Scratch slots of a plan with ``n_data`` Data and ``n_subset`` output indices."""
        return HEADER + n_data + n_subset + 5 * size

    @staticmethod
    def length_of(scratch: np.ndarray, size: int) -> int:
        """Scratch slots of the plan that :func:`encode` wrote into ``scratch``."""
        return CallPlan.length(int(scratch[5]), max(int(scratch[6]), 0), size)


def encode(plan: CallPlan, scratch: np.ndarray, size: int) -> None:
    """Write ``plan`` into the scratch slots (the caller checked that it fits)."""
    head = [plan.fid, plan.num_slices, plan.batch_kind, plan.batch_start, plan.bs_kind, len(plan.data_ids),
            -1 if plan.subset is None else len(plan.subset), plan.index_did, 0, *plan.data_ids]
    if plan.subset is not None:
        head.extend(plan.subset)
    i = len(head)
    scratch[:i] = head
    scratch[i:i + 2 * size] = plan.positions.reshape(-1)
    if plan.bs_kind:
        assert plan.bs is not None
        scratch[i + 2 * size:i + 5 * size] = plan.bs.reshape(-1)
    else:  # every slot of a plan written: equal plans, equal slots (the workers' cache key, :func:`decode`)
        scratch[i + 2 * size:i + 5 * size] = 0


def decode(scratch: np.ndarray, size: int) -> CallPlan:
    """Read the plan that :func:`encode` wrote.  A plan read before (a training loop calls the same
    plan again and again) comes from a cache whose key is the plan's slots, bytes for bytes: one
    comparison instead of a decoding.  Its arrays are read-only: every call of the plan shares them."""
    return _decode_slots(scratch[:CallPlan.length_of(scratch, size)].tobytes(), size)


@functools.lru_cache(maxsize=64)
def _decode_slots(slots: bytes, size: int) -> CallPlan:
    scratch = np.frombuffer(slots, dtype=np.int64)  # read-only: so are the plan's arrays, views of it
    fid, num_slices, batch_kind, batch_start, bs_kind, n_data, n_sub, index_did, _ = scratch[:HEADER].tolist()
    i = HEADER
    data_ids = tuple(scratch[i:i + n_data].tolist())
    i += n_data
    subset = None
    if n_sub >= 0:
        subset = tuple(scratch[i:i + n_sub].tolist())
        i += n_sub
    positions = scratch[i:i + 2 * size].reshape(size, 2)
    i += 2 * size
    bs = scratch[i:i + 3 * size].reshape(size, 3) if bs_kind else None
    return CallPlan(fid, num_slices, batch_kind, batch_start, data_ids, subset, positions, bs_kind, bs,
                    index_did)


def _sliceable_rows(rt: Runtime, rep: Replica, plan: CallPlan) -> tuple[list[Any] | None, int | None]:
    """This rank's row selection of each sliceable shared (None without batch_s) and its row count."""
    spec = rep.spec
    if not spec.sliceable:
        return ([] if plan.num_slices > 1 else None), None
    device = rt.device
    lengths = [device.length(var) for var in spec.sliceable]
    if plan.bs_kind == 0:
        if plan.num_slices == 1:  # every row, in one pass: the weight is the rows this rank holds
            return None, lengths[0]
        if len(set(lengths)) > 1:
            names = ", ".join(f"{v.name or v}: {n}" for v, n in zip(spec.sliceable, lengths))
            raise SelectionError(f"rank {rt.rank}: the sliceable shared variables have different lengths "
                             f"({names}); pass batch_s= to select the same number of rows from each")
        return [slice(0, n, 1) for n in lengths], lengths[0]
    assert plan.bs is not None
    a, b, c = (int(v) for v in plan.bs[rt.rank])
    if plan.bs_kind == 1:
        sel = slice(None if a == NONE else a, None if b == NONE else b, None if c == NONE else c)
        rows: list[Any] = [slice(*sel.indices(n)) for n in lengths]
        counts = [len(range(r.start, r.stop, r.step)) for r in rows]
    else:
        idx = _indices(rt, plan)[a:a + b]
        for var, n in zip(spec.sliceable, lengths):
            if len(idx) and (idx.max() >= n or idx.min() < -n):
                raise SelectionError(f"rank {rt.rank}: batch_s index out of range for {var.name or var} "
                                 f"of length {n}")
        rows = [idx] * len(lengths)
        counts = [len(idx)] * len(lengths)
    return rows, counts[0]


def _indices(rt: Runtime, plan: CallPlan) -> np.ndarray:
    values = rt.data[plan.index_did].data
    assert values is not None
    return values


def rank_inputs(rt: Runtime, plan: CallPlan) -> tuple[list[np.ndarray], list[Any]]:
    """This rank's rows of each scattered input, and the whole broadcast inputs (host arrays,
    read from the Data in place where the rows are contiguous)."""
    rep = rt.replicas[plan.fid]
    datas = [rt.data[d] for d in plan.data_ids]
    n_in = len(rep.spec.inputs)
    p0, p1 = plan.positions[rt.rank].tolist()
    scattered: list[np.ndarray] = []
    if n_in:
        index = None
        if plan.batch_kind == 1:
            index = _indices(rt, plan)[p0:p1]
        start = plan.batch_start
        for d in datas[:n_in]:
            arr = d.data
            assert arr is not None
            if d.minibatch:
                scattered.append(arr[p0:p1])
            elif index is None:
                scattered.append(arr[start + p0:start + p1])
            else:  # np.take: half the time of arr[index] for rows of a matrix (512 x 64 float32: 7 against 14 us)
                scattered.append(np.take(arr, index, axis=0))
    return scattered, [d.data for d in datas[n_in:]]


def needs_selection_barrier(spec: Any, plan: CallPlan) -> bool:
    """Whether the ranks meet at a barrier between checking their sliceable rows and computing
    (only each rank knows its rows; no rank may compute when another rank's check failed)."""
    return bool(spec.sliceable) and bool(plan.bs_kind or plan.num_slices > 1)


def execute(rt: Runtime, plan: CallPlan) -> tuple[float, list[Any]]:
    """Run this rank's share of a call; returns (weight, outputs combined over its slices), the
    outputs where they were computed (on a GPU: not waited for)."""
    rep = rt.replicas[plan.fid]
    spec = rep.spec
    n_in = len(spec.inputs)
    p0, p1 = plan.positions[rt.rank].tolist()
    scattered, bcast = rank_inputs(rt, plan)
    sliceable_rows, s_rows = _sliceable_rows(rt, rep, plan)
    if n_in:
        n_rows = p1 - p0
        if s_rows is not None and s_rows != n_rows and (plan.num_slices > 1 or plan.bs_kind):
            raise SelectionError(f"rank {rt.rank}: {n_rows} scattered rows but {s_rows} rows of the sliceable "
                                 "shared variables; under num_slices/batch_s they must match in every rank")
        weight = float(n_rows)
    elif s_rows is not None:
        n_rows = s_rows
        weight = float(n_rows)
    else:
        n_rows, weight = 1, 1.0
    if needs_selection_barrier(spec, plan):
        rt.group.barrier()
    if weight == 0 and not rep.has_collectives:
        return 0.0, []
    outputs = compute(rt, rep, weight, lambda: rep.run(scattered, bcast, sliceable_rows, plan.subset,
                                                        plan.num_slices, n_rows))
    if weight == 0:  # it took part in the in-graph collectives and applied its updates; no outputs of its own
        return 0.0, []
    return weight, outputs


def compute(rt: Runtime, rep: Replica, weight: float, run: Callable[[], list[Any]]) -> list[Any]:
    """``run()`` (this rank's compute of ``rep``), inside the call's context when the graph holds
    in-graph collectives (:mod:`synkhronos.ops`), until its results are ready: under JAX the
    collectives run in host callbacks or inside the program, which must end before this rank's
    next use of the group.  With one rank the collectives are the identity: nothing to enter.

    Every call ends with its program, collectives or not: JAX may still be copying an input from
    the Data's shared memory when the call returns (jaxlib 0.10: a function without outputs, whose
    Data the user rewrote right after the call, summed some of the next call's rows).  Without
    collectives, reading the outputs (:func:`reply`) waits for it: one execution's values are ready
    together; a call without outputs waits for its updated values here
    (:meth:`synkhronos.device.Device.wait`; a batched wait costs about 7 us even for one value)."""
    if not rep.has_collectives or rt.size == 1:
        outputs = run()
        if not outputs:
            rep.wait(outputs)
        return outputs
    segment = rt.device.all_reduce_segment if rep.all_reduces_in_program else None
    if segment is not None:  # all-reduces inside the JAX program read this rank's weight there
        segment.set_weight(rt.rank, weight)
        rt.group.barrier()  # every rank enters the program, or none: none is left waiting inside it
    with call_context.running(rt.group, weight) as ctx:
        try:
            outputs = run()
            rep.wait(outputs)
        except Exception as exc:
            if ctx.failure is not None:
                raise ctx.failure from None
            if segment is not None and ABORTED_IN_PROGRAM in str(exc):  # a peer failed: its error is the news
                raise GroupAborted(f"rank {rt.rank} stopped in an all-reduce: another rank failed") from exc
            raise
        finally:
            if segment is not None:
                segment.clear_weight(rt.rank)
    return outputs


def share(rt: Runtime, plan: CallPlan) -> list[np.ndarray] | None:
    """Execute this rank's share and :func:`reply` it."""
    return reply(rt, plan, *execute(rt, plan))


def reply(rt: Runtime, plan: CallPlan, weight: float, outputs: Sequence[Any]) -> list[np.ndarray] | None:
    """This rank's ``[weight, *outputs]`` for the master (a rank without rows has no outputs of
    its own: ``[weight]`` alone).

    Where the outputs are real scalars (:meth:`~synkhronos.replica.Replica.value_dtypes`: a loss,
    an accuracy), every rank, the master included, leaves them as numbers in its row of the
    control block (:meth:`synk_comm.Group.reply_values`), which the master combines in one
    array whatever the number of ranks; returns None.  Otherwise they are host arrays, which a
    worker replies as a message (:meth:`synk_comm.Group.reply`); returns them."""
    if rt.replicas[plan.fid].value_dtypes(plan.subset) is not None:
        rt.group.reply_values([weight, *[np.asarray(o).item() for o in outputs]])
        return None
    result = [np.array(weight), *(np.asarray(o) for o in outputs)]
    if not rt.is_master:
        rt.group.reply(result)
    return result


@functools.lru_cache(maxsize=64)
def normalise_positions(total: int, size: int) -> np.ndarray:
    """Even split of ``total`` rows over ``size`` ranks: per rank ``(p0, p1)``; the first
    ``total % size`` ranks get one row more.  Read-only (one array per ``(total, size)``, cached:
    a training loop asks for the same split every call)."""
    base, extra = divmod(total, size)
    bounds, end = [], 0
    for r in range(size):
        start, end = end, end + base + (r < extra)
        bounds.append((start, end))
    out = np.array(bounds, dtype=np.int64)
    out.flags.writeable = False
    return out


def as_index_array(batch: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    """A 1-d int64 index array from a list or array; TypeError for floats, bools or 2-d."""
    arr = np.asarray(batch)
    if arr.ndim != 1:
        raise TypeError(f"{what} indices must be 1-d, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{what} indices must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


@contextmanager
def _selection_errors() -> Iterator[None]:
    """A command whose every failing rank found a bad ``batch_s`` selection raises one
    :class:`~synkhronos.calls.SelectionError` (not a WorkerError)."""
    try:
        yield
    except WorkerError as exc:
        _raise_selection_error(exc)
        raise


def _raise_selection_error(exc: WorkerError) -> None:
    """Raise one :class:`~synkhronos.calls.SelectionError` where every failing rank found a bad
    ``batch_s`` selection (else return: the caller raises ``exc``)."""
    if all(e.type_name == "SelectionError" for e in exc.errors):
        raise SelectionError("; ".join(e.message for e in exc.errors)) from None


def _finish_call(rt: Runtime, own_exc: BaseException | None) -> None:
    """End a call's command (:meth:`synk_comm.Group.finish_command`), a selection error as one."""
    try:
        rt.group.finish_command(own_exc)
    except WorkerError as exc:
        _raise_selection_error(exc)
        raise
