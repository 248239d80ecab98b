"""Collectives on numpy arrays through shared memory: each rank writes, one barrier, each reads.

Every rank publishes its array in its own buffer (zero-copy views for the readers), passes one
barrier, and computes what it needs from the others' buffers.  Large all-reduces split the work
(see :meth:`ShmCollectives._all_reduce_chunked`): rank ``r`` reduces span ``r`` of every rank's
values in rank order, in place in the shared buffer that already holds one of its operands, and
every rank copies all reduced spans out -- pipelined in blocks paced by progress counters where
every rank has a core of its own, else in steps between two barriers.  Each span is reduced
once, so every rank ends with bit-identical values.  Buffers alternate between two per rank, so
no collective needs a trailing barrier.
"""

from __future__ import annotations

import functools
import platform
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from synk_comm.collectives import Collectives
from synk_comm.lockstep import POLL_S
from synk_comm.ops import ReduceOp, as_op

if TYPE_CHECKING:
    from synk_comm.group import Group

__all__ = ["ShmCollectives"]

CHUNKED_MIN_BYTES = 1 << 18
"""All-reduces of at least this many bytes split the reduction among the ranks."""
REDUCE_BLOCK_BYTES = 1 << 20
"""Unpipelined, a rank reduces its span in blocks of this many bytes and copies each block to
``out`` while it is still in its cache (a second pass would read the span from memory again)."""
PIPELINE_BLOCK_BYTES = 1 << 18
"""Pipelined, the ranks move and reduce blocks of this many bytes of every span in step."""
PIPELINE = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
"""Whether large all-reduces may be pipelined: the progress counters that pace the pipeline are
plain stores, which x86 makes visible to other cores in program order (after the data they
count); elsewhere every all-reduce takes the path between two barriers."""
PAGE_BYTES = 4096
"""Touching one byte in every this many maps every page of a new array (the smallest page size)."""
_COUNTERS = np.zeros(16, np.int64)
_PUBLISHED, _REDUCED = 0, 8  # the two counters, a cache line apart


def _reduce_into(op: ReduceOp, parts: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
    """``out := op(parts[0], ..., parts[-1])`` in the order given (``out`` may be ``parts[0]`` or ``parts[1]``)."""
    ufunc = op.ufunc
    if len(parts) == 1:
        out[...] = parts[0]
    else:
        ufunc(parts[0], parts[1], out=out)
        for p in parts[2:]:
            ufunc(out, p, out=out)
    if op is ReduceOp.AVG:
        np.divide(out, len(parts), out=out)
    return out


@functools.lru_cache(maxsize=256)
def _spans(n: int, size: int) -> tuple[tuple[int, int], ...]:
    """``[lo, hi)`` of the span of ``n`` elements that each of ``size`` ranks reduces (rank ``r``
    from ``r * n // size``; cached: a training loop all-reduces the same sizes every step)."""
    bounds = [r * n // size for r in range(size + 1)]
    return tuple((bounds[r], bounds[r + 1]) for r in range(size))


def _home(r: int) -> int:
    """The rank whose buffer accumulates span ``r`` of a chunked all-reduce.

    It holds rank 0's or rank 1's values of span ``r`` (published in step 1), so that the first
    operation of the rank-order reduction ``op(x_0, x_1)`` writes over one of its own operands.
    """
    return 1 if r == 0 else 0


def _new_like(a: np.ndarray, touch: bool) -> np.ndarray:
    """A new array like ``a``; ``touch``: with every page already mapped.

    The pages of a new array are mapped (and zeroed by the kernel) when first written.  A
    pipeline that meets those faults block by block stalls the ranks that wait for it (measured:
    36 ms against 27 ms with the pages touched first, for 64 MiB in 2 ranks).
    """
    new = np.empty_like(a)
    if touch and new.size:
        flat = new.reshape(-1).view(np.uint8)
        flat[::PAGE_BYTES] = 0
    return new


class _Blocks:
    """Block ``j`` of span ``r``: the spans cut into blocks of ``step`` elements (the last ones
    shorter, or empty where a span has fewer blocks than the longest)."""

    def __init__(self, spans: Sequence[tuple[int, int]], step: int) -> None:
        self.spans = spans
        self.step = step
        self.count = max(-(-(hi - lo) // step) for lo, hi in spans)

    def of(self, r: int, j: int) -> slice:
        lo, hi = self.spans[r]
        return slice(min(lo + j * self.step, hi), min(lo + (j + 1) * self.step, hi))


class ShmCollectives(Collectives):
    """Host collectives of a :class:`~synk_comm.group.Group` (numpy arrays, any dtype and shape).

    Attributes
    ----------
    pipeline : bool
        Whether large all-reduces are pipelined (:meth:`_pipelined`); by default where
        :data:`PIPELINE` allows and every rank has a core of its own (a rank waits for the
        others by polling).  Every rank of the group must agree (a mismatch is a ValueError in
        every rank).
    """

    def __init__(self, group: Group) -> None:
        self.group = group
        self.rank = group.rank
        self.size = group.size
        self._pipeline: bool | None = None

    @property
    def pipeline(self) -> bool:
        if self._pipeline is None:
            return PIPELINE and self.group._spin > 0
        return self._pipeline

    @pipeline.setter
    def pipeline(self, value: bool | None) -> None:
        """True or False forces the choice in this rank; None restores the default."""
        self._pipeline = value

    # -- helpers ------------------------------------------------------------------------------
    def _exchange(self, arrays: Sequence[np.ndarray]) -> int:
        """Publish ``arrays`` in this rank's next buffer and pass a barrier; returns the buffer."""
        k = self.group._next_buffer()
        self.group.buffers.publish(k, arrays)
        self.group.barrier()
        return k

    def _peers(self, k: int) -> list[np.ndarray]:
        return [self.group.buffers.read(r, k)[0] for r in range(self.size)]

    @staticmethod
    def _agree(views: Sequence[np.ndarray], what: str) -> None:
        first = views[0]
        for r, v in enumerate(views):
            if v.shape != first.shape or v.dtype != first.dtype:
                raise ValueError(f"{what}: every rank must give the same shape and dtype; rank 0 gave "
                                 f"{first.shape} {first.dtype}, rank {r} gave {v.shape} {v.dtype}")

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"root must be a rank in [0, {self.size}), got {root}")

    # -- the collectives ------------------------------------------------------------------------
    def broadcast(self, array: np.ndarray | None, *, root: int = 0) -> np.ndarray:
        self._check_root(root)
        if self.rank == root:
            if array is None:
                raise TypeError("broadcast: the root must give an array")
            self._exchange([np.asarray(array)])
            return array
        k = self._exchange([])
        src = self.group.buffers.read(root, k)[0]
        if isinstance(array, np.ndarray) and array.shape == src.shape and array.dtype == src.dtype \
                and array.flags.writeable:
            array[...] = src
            return array
        return src.copy()

    def reduce(self, array: np.ndarray, op: ReduceOp | str = "sum", *, root: int = 0) -> np.ndarray | None:
        self._check_root(root)
        a = np.asarray(array)
        rop = as_op(op, a.dtype)
        k = self._exchange([a])
        if self.rank != root:
            return None
        views = self._peers(k)
        self._agree(views, "reduce")
        return _reduce_into(rop, views, np.empty_like(views[0]))

    def all_reduce(self, array: np.ndarray, op: ReduceOp | str = "sum", *,
                   out: np.ndarray | None = None) -> np.ndarray:
        a = np.asarray(array)
        rop = as_op(op, a.dtype)
        if out is not None and (out.shape != a.shape or out.dtype != a.dtype):
            raise ValueError(f"all_reduce: out has {out.shape} {out.dtype}, array has {a.shape} {a.dtype}")
        if self.group.spans_hosts:  # one host's part of a group spanning hosts: SpanGroup.all_reduce
            self.reduce(a, ReduceOp.SUM if rop is ReduceOp.AVG else rop, root=self.group.master_rank)
            return self.broadcast(out, root=self.group.master_rank)
        if a.nbytes < CHUNKED_MIN_BYTES or a.size < self.size or self.size == 1:
            k = self._exchange([a])
            views = self._peers(k)
            self._agree(views, "all_reduce")
            return _reduce_into(rop, views, np.empty_like(a) if out is None else out)
        return self._all_reduce_chunked(np.ascontiguousarray(a), rop, out)

    def _all_reduce_chunked(self, a: np.ndarray, op: ReduceOp, out: np.ndarray | None) -> np.ndarray:
        """All-reduce of a large contiguous ``a``: rank ``r`` reduces span ``r`` of every rank's values.

        Span ``r`` is reduced in rank order, in place in the buffer that holds one of its first
        two operands (:func:`_home`), then every rank copies every span out.  Each rank writes its
        share of the data and ``out`` once and reduces in place (a ufunc that writes where it
        reads costs about half of one that writes to a third array), and writes into another
        rank's buffer only in its own span.  Pipelined in blocks where every rank has a core and
        stores are seen in program order (:meth:`_pipelined`), else in three steps between two
        barriers (:meth:`_stepwise`).
        """
        if out is None:
            out = _new_like(a, touch=self.pipeline)
        # reshape(-1) of a non-contiguous ``out`` would be a copy, and an ``out`` that overlaps
        # ``a`` other than exactly would be read after it was written: go through a temporary
        direct = out.flags.c_contiguous and (out.ctypes.data == a.ctypes.data
                                              or not np.may_share_memory(out, a))
        dest = out if direct else np.empty_like(a)
        if self.pipeline:
            self._pipelined(a, op, dest)
        else:
            self._stepwise(a, op, dest)
        if dest is not out:
            out[...] = dest
        return out

    def _messages(self, k: int, n_arrays: int) -> list[list[np.ndarray]]:
        """Every rank's message in buffer ``k``, checked: same shape and dtype, same algorithm."""
        msgs = [self.group.buffers.read(r, k) for r in range(self.size)]
        self._agree([m[0] if m else np.empty(0) for m in msgs], "all_reduce")
        if any(len(m) != n_arrays for m in msgs):
            raise ValueError("all_reduce: the ranks chose different algorithms (pipelined or not): "
                             "every rank must have a core of its own, or none")
        return msgs

    def _stepwise(self, a: np.ndarray, op: ReduceOp, dest: np.ndarray) -> None:
        """1. copy the spans that the others reduce into this rank's buffer; barrier
        2. reduce span ``r``, block by block, in its home buffer, and copy each reduced block to
           ``dest`` while it is in the cache; barrier
        3. copy the other spans, reduced, out of their home buffers
        """
        k = self.group._next_buffer()
        (mine,) = self.group.buffers.reserve(k, [a])
        af, mf, of = a.reshape(-1), mine.reshape(-1), dest.reshape(-1)
        spans = _spans(a.size, self.size)
        for r, (lo, hi) in enumerate(spans):
            if r != self.rank:
                mf[lo:hi] = af[lo:hi]
        self.group.barrier()
        flat = [m[0].reshape(-1) for m in self._messages(k, 1)]
        lo, hi = spans[self.rank]
        acc = flat[_home(self.rank)]
        sources = [af if r == self.rank else flat[r] for r in range(self.size)]
        step = max(1, REDUCE_BLOCK_BYTES // a.itemsize)
        for start in range(lo, hi, step):
            block = slice(start, min(start + step, hi))
            _reduce_into(op, [src[block] for src in sources], acc[block])
            of[block] = acc[block]
        self.group.barrier()
        for r, (lo, hi) in enumerate(spans):
            if r != self.rank:
                of[lo:hi] = flat[_home(r)][lo:hi]

    def _pipelined(self, a: np.ndarray, op: ReduceOp, dest: np.ndarray) -> None:
        """The steps of :meth:`_stepwise` block by block, paced by per-rank progress counters.

        Each rank's message is ``a`` and two counters (published, reduced), reset before one
        barrier.  For block ``j`` of every span: copy block ``j`` of the others' spans into this
        rank's buffer and count it published; when every rank published ``j``, reduce block ``j``
        of span ``r`` in its home buffer, copy it to ``dest`` and count it reduced; copy block
        ``j - 1`` of the other spans out as soon as their ranks reduced it.  A block is read by
        the next rank while it is still in the cache that its writer filled.
        """
        k = self.group._next_buffer()
        mine, counters = self.group.buffers.reserve(k, [a, _COUNTERS])
        counters[:] = 0
        self.group.barrier()
        msgs = self._messages(k, 2)
        flat = [m[0].reshape(-1) for m in msgs]
        progress = [m[1] for m in msgs]
        af, mf, of = a.reshape(-1), mine.reshape(-1), dest.reshape(-1)
        blocks = _Blocks(_spans(a.size, self.size), max(1, PIPELINE_BLOCK_BYTES // a.itemsize))
        rank = self.rank
        others = [r for r in range(self.size) if r != rank]
        acc = flat[_home(rank)]
        sources = [af if r == rank else flat[r] for r in range(self.size)]
        for j in range(blocks.count):
            for r in others:
                b = blocks.of(r, j)
                mf[b] = af[b]
            counters[_PUBLISHED] = j + 1
            for r in others:
                self._wait_progress(progress[r], _PUBLISHED, j + 1)
            b = blocks.of(rank, j)
            _reduce_into(op, [src[b] for src in sources], acc[b])
            of[b] = acc[b]
            counters[_REDUCED] = j + 1
            if j:
                self._copy_reduced(blocks, j - 1, others, progress, flat, of)
        self._copy_reduced(blocks, blocks.count - 1, others, progress, flat, of)

    def _copy_reduced(self, blocks: _Blocks, j: int, others: Sequence[int], progress: Sequence[np.ndarray],
                      flat: Sequence[np.ndarray], of: np.ndarray) -> None:
        """Copy block ``j`` of the others' spans, once reduced, out of their home buffers."""
        for r in others:
            self._wait_progress(progress[r], _REDUCED, j + 1)
            b = blocks.of(r, j)
            of[b] = flat[_home(r)][b]

    def _wait_progress(self, counters: np.ndarray, slot: int, value: int) -> None:
        """Wait until another rank's ``counters[slot]`` reaches ``value``: poll without sleeping
        for the group's spin time, then sleep between polls and check the group's health (a dead
        peer or an aborted command raises) every :data:`~synk_comm.lockstep.POLL_S` seconds."""
        if counters[slot] >= value:
            return
        end = time.perf_counter() + self.group._spin
        while time.perf_counter() < end:
            if counters[slot] >= value:
                return
        next_check = time.monotonic() + POLL_S
        while counters[slot] < value:
            time.sleep(0)
            if time.monotonic() > next_check:
                self.group._check()
                next_check = time.monotonic() + POLL_S

    def gather(self, array: np.ndarray, *, root: int = 0) -> list[np.ndarray] | None:
        self._check_root(root)
        k = self._exchange([np.asarray(array)])
        if self.rank != root:
            return None
        return [v.copy() for v in self._peers(k)]

    def gather_arrays(self, arrays: Sequence[np.ndarray], *, root: int = 0) -> list[list[np.ndarray]] | None:
        """``root`` returns, per rank, a copy of the list of arrays that rank gave (any number, any
        shapes: one exchange for many small arrays); the others return None."""
        self._check_root(root)
        k = self._exchange([np.asarray(a) for a in arrays])
        if self.rank != root:
            return None
        return [[v.copy() for v in self.group.buffers.read(r, k)] for r in range(self.size)]

    def all_gather(self, array: np.ndarray) -> list[np.ndarray]:
        if self.group.spans_hosts:  # one host's part of a group spanning hosts (synk_comm.net)
            return self._all_gather_spanned(array)
        k = self._exchange([np.asarray(array)])
        return [v.copy() for v in self._peers(k)]

    def _all_gather_spanned(self, array: np.ndarray) -> list[np.ndarray]:
        """A worker of one host's part of a group spanning hosts: its master (the span's, or the
        host's agent) gathers this host's arrays, exchanges them with the other hosts, and
        broadcasts every rank's back (:meth:`synk_comm.net.SpanGroup.all_gather`)."""
        self.gather(array, root=self.group.master_rank)
        everything = self.broadcast_object(None, root=self.group.master_rank)
        assert isinstance(everything, list)
        return everything

    def scatter(self, arrays: Sequence[np.ndarray] | None, *, root: int = 0) -> np.ndarray:
        self._check_root(root)
        if self.rank == root:
            if arrays is None or len(arrays) != self.size:
                raise ValueError(f"scatter: the root must give {self.size} arrays, one per rank")
            self._exchange([np.asarray(a) for a in arrays])
            return np.array(arrays[root], copy=True)
        k = self._exchange([])
        return self.group.buffers.read(root, k)[self.rank].copy()

    def reduce_scatter(self, array: np.ndarray, op: ReduceOp | str = "sum") -> np.ndarray:
        a = np.asarray(array)
        rop = as_op(op, a.dtype)
        k = self._exchange([a])
        views = self._peers(k)
        self._agree(views, "reduce_scatter")
        chunks = [np.array_split(v, self.size, axis=0)[self.rank] if v.ndim else v for v in views]
        return _reduce_into(rop, chunks, np.empty_like(chunks[0]))

    # -- Python objects -----------------------------------------------------------------------
    def broadcast_object(self, obj: object = None, *, root: int = 0) -> object:
        """Every rank returns (an unpickled copy of) ``root``'s object."""
        import pickle

        self._check_root(root)
        if self.rank == root:
            self._exchange([np.frombuffer(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), np.uint8)])
            return obj
        k = self._exchange([])
        return pickle.loads(self.group.buffers.read(root, k)[0].tobytes())

    def gather_object(self, obj: object, *, root: int = 0) -> list[object] | None:
        """``root`` returns every rank's object in rank order; the others None."""
        import pickle

        self._check_root(root)
        k = self._exchange([np.frombuffer(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), np.uint8)])
        if self.rank != root:
            return None
        return [pickle.loads(v.tobytes()) for v in self._peers(k)]
