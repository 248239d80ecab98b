"""Collectives on numpy arrays through shared memory: each rank writes, one barrier, each reads.

Every rank publishes its array in its own buffer (zero-copy views for the readers), passes one
barrier, and computes what it needs from the others' buffers.  Large all-reduces split the work
(see :meth:`ShmCollectives._all_reduce_chunked`): rank ``r`` reduces chunk ``r`` of every rank's
values into its own buffer, a second barrier, then every rank copies all chunks out.  Each chunk
is reduced once, so every rank ends with bit-identical values.  Buffers alternate between two per
rank, so no collective needs a trailing barrier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from synk_comm.collectives import Collectives
from synk_comm.ops import ReduceOp, as_op

if TYPE_CHECKING:
    from synk_comm.group import Group

__all__ = ["ShmCollectives"]

CHUNKED_MIN_BYTES = 1 << 18
"""All-reduces of at least this many bytes split the reduction among the ranks."""


def _reduce_into(op: ReduceOp, parts: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
    """``out := op(parts[0], ..., parts[-1])`` in the order given (``out`` may be ``parts[0]``)."""
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


class ShmCollectives(Collectives):
    """Host collectives of a :class:`~synk_comm.group.Group` (numpy arrays, any dtype and shape)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.rank = group.rank
        self.size = group.size

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
        if a.nbytes < CHUNKED_MIN_BYTES or a.size < self.size:
            k = self._exchange([a])
            views = self._peers(k)
            self._agree(views, "all_reduce")
            return _reduce_into(rop, views, np.empty_like(a) if out is None else out)
        return self._all_reduce_chunked(np.ascontiguousarray(a), rop, out)

    def _all_reduce_chunked(self, a: np.ndarray, op: ReduceOp, out: np.ndarray | None) -> np.ndarray:
        """Rank ``r`` reduces chunk ``r`` and shares it: each rank moves about 2 copies of the data.

        1. copy the chunks that the others reduce into this rank's buffer; barrier
        2. reduce chunk ``r`` (own values straight from ``a``, the others' from their buffers,
           in rank order) into this rank's buffer; barrier
        3. copy every reduced chunk out
        """
        k = self.group._next_buffer()
        (mine,) = self.group.buffers.reserve(k, [a])
        af, mf = a.reshape(-1), mine.reshape(-1)
        bounds = np.linspace(0, a.size, self.size + 1).astype(np.int64)
        spans = [(int(bounds[r]), int(bounds[r + 1])) for r in range(self.size)]
        for r, (lo, hi) in enumerate(spans):
            if r != self.rank:
                mf[lo:hi] = af[lo:hi]
        self.group.barrier()
        views = self._peers(k)
        self._agree(views, "all_reduce")
        lo, hi = spans[self.rank]
        parts = [af[lo:hi] if r == self.rank else v.reshape(-1)[lo:hi] for r, v in enumerate(views)]
        _reduce_into(op, parts, mf[lo:hi])
        self.group.barrier()
        if out is None:
            out = np.empty_like(a)
        # reshape(-1) of a non-contiguous ``out`` would be a copy: gather into a temporary then
        dest = out if out.flags.c_contiguous else np.empty_like(a)
        of = dest.reshape(-1)
        for r, (lo, hi) in enumerate(spans):
            of[lo:hi] = views[r].reshape(-1)[lo:hi]
        if dest is not out:
            out[...] = dest
        return out

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
        k = self._exchange([np.asarray(array)])
        return [v.copy() for v in self._peers(k)]

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
