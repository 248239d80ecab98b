"""Per-rank shared-memory buffers through which ranks exchange arrays and objects.

Each rank owns ``NBUF`` growable segments: two that collectives use in turn (so that a collective
never needs a trailing barrier: the buffer it wrote is written again only two collectives later,
after a barrier that every reader has passed) and a mailbox for command payloads and errors.  The
owner grows a buffer by creating a larger segment under a new tag, recorded in its control row;
a reader compares tags and re-attaches when the owner moved.  Every new message layout (a new
segment's first included) also counts up one header slot per buffer index, shared by all ranks:
a reader of many ranks' messages (:meth:`Buffers.read_each`) keeps its views while that count
stands still, one comparison whatever the number of ranks.

A published message is a set of arrays laid out as::

    [int64 meta_len][pickle of [(dtype, shape, offset), ...]][pad][array 0][pad][array 1]...

so that readers get zero-copy numpy views of every array.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from synk_comm.lockstep import LAYOUTS, NBUF, ControlBlock
from synk_shm import SharedArray

__all__ = ["Buffers"]

ALIGN = 64
MIN_CAPACITY = 1 << 16


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


VIEW_LAYOUTS = 16
"""Message layouts whose views a mapped buffer keeps (a training loop alternates a few: the train
step's reply, the evaluation's)."""


class _Mapped:
    """A buffer segment with cached views of its message header and of each layout seen."""

    __slots__ = ("meta", "meta_len", "seg", "views", "written")

    def __init__(self, seg: SharedArray) -> None:
        self.seg = seg
        self.meta_len = seg.view(1, np.int64)
        self.meta = seg.view(seg.capacity - 8, np.uint8, 8)
        self.views: dict[bytes, list[np.ndarray]] = {}  # message layout (its pickled meta) -> its views
        self.written: bytes | None = None  # owner: the layout in the header now

    def views_of(self, meta: bytes, make: Any) -> list[np.ndarray]:
        """The views of layout ``meta``, made by ``make()`` the first time."""
        views = self.views.get(meta)
        if views is None:
            if len(self.views) >= VIEW_LAYOUTS:
                self.views.clear()
            views = self.views[meta] = make()
        return views

    def close(self) -> None:
        self.views = {}
        del self.meta_len, self.meta
        self.seg.close()


class Buffers:
    """The buffers of every rank, as seen from rank ``rank``."""

    def __init__(self, control: ControlBlock, prefix: str, rank: int, size: int) -> None:
        self.control = control
        self.prefix = prefix
        self.rank = rank
        self.size = size
        self._tags = control.rows["buf_tag"]  # (size, NBUF) int64 view
        self._caps = control.rows["buf_cap"]
        self._layouts_written = control.header[LAYOUTS:LAYOUTS + NBUF]  # by any rank, per buffer index
        self._each: dict[int, tuple[Sequence[int], int, list[list[np.ndarray]]]] = {}
        self._own: list[_Mapped | None] = [None] * NBUF
        self._peers: dict[tuple[int, int], tuple[int, _Mapped]] = {}
        self._layouts: dict[tuple[tuple[Any, tuple[int, ...]], ...], tuple[bytes, int, list[int]]] = {}

    # -- owner side ---------------------------------------------------------------------------
    def own(self, k: int, nbytes: int) -> SharedArray:
        """This rank's buffer ``k``, grown to hold at least ``nbytes``."""
        return self._own_mapped(k, nbytes).seg

    def _own_mapped(self, k: int, nbytes: int) -> _Mapped:
        mapped = self._own[k]
        if mapped is None or mapped.seg.capacity < nbytes:
            old = None if mapped is None else mapped.seg.capacity
            tag = int(self._tags[self.rank, k]) + 1
            capacity = max(MIN_CAPACITY, nbytes, 0 if old is None else min(2 * old, 2 * nbytes))
            seg = SharedArray.create(capacity, np.uint8, name=f"{self.prefix}b{self.rank}.{k}.{tag}",
                                     purpose=f"rank {self.rank}'s exchange buffer")
            if mapped is not None:
                mapped.seg.unlink()
                mapped.close()
            self._own[k] = mapped = _Mapped(seg)
            self._caps[self.rank, k] = capacity
            self._tags[self.rank, k] = tag
            self._layouts_written[k] += 1  # a new segment: read_each's views of the old one are stale
        return mapped

    def _layout(self, arrays: Sequence[np.ndarray]) -> tuple[bytes, int, list[int]]:
        key = tuple([(a.dtype, a.shape) for a in arrays])
        layout = self._layouts.get(key)
        if layout is None:
            offsets, offset = [], 0
            for a in arrays:
                offsets.append(offset)
                offset = _align(offset + a.nbytes)
            meta = pickle.dumps([(d, s, o) for (d, s), o in zip(key, offsets)], pickle.HIGHEST_PROTOCOL)
            base = _align(8 + len(meta))
            if len(self._layouts) > 256:
                self._layouts.clear()
            layout = self._layouts[key] = (meta, base, [base + o for o in offsets] + [base + offset])
        return layout

    def reserve(self, k: int, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Lay out a message of arrays shaped like ``arrays`` in buffer ``k``; return the views to
        fill (nothing is copied: for writers that fill the message piece by piece)."""
        meta, _, offsets = self._layout(arrays)
        mapped = self._own_mapped(k, offsets[-1])
        if mapped.written is not meta:  # another layout than the last message's: a new header
            mapped.meta_len[0] = len(meta)
            mapped.meta[: len(meta)] = np.frombuffer(meta, np.uint8)
            mapped.written = meta
            self._layouts_written[k] += 1  # read_each's readers look again (ranks racing here still count up)
        seg = mapped.seg
        return mapped.views_of(meta, lambda: [seg.view(a.shape, a.dtype, off) for a, off in zip(arrays, offsets)])

    def publish(self, k: int, arrays: Sequence[np.ndarray]) -> None:
        """Write ``arrays`` (with their dtypes and shapes) into this rank's buffer ``k``."""
        for view, a in zip(self.reserve(k, arrays), arrays):
            if a.nbytes:
                view[...] = a

    def publish_bytes(self, k: int, data: bytes) -> None:
        """Write raw bytes (a pickle) into this rank's buffer ``k``."""
        self.publish(k, [np.frombuffer(data, np.uint8)])

    # -- reader side --------------------------------------------------------------------------
    def _mapped(self, rank: int, k: int) -> _Mapped:
        if rank == self.rank:
            mapped = self._own[k]
            assert mapped is not None, "read of an own buffer that was never written"
            return mapped
        tag = int(self._tags[rank, k])
        cached = self._peers.get((rank, k))
        if cached is None or cached[0] != tag:
            if cached is not None:
                cached[1].close()
            seg = SharedArray.attach(f"{self.prefix}b{rank}.{k}.{tag}", 0, np.uint8)
            self._peers[(rank, k)] = cached = (tag, _Mapped(seg))
        return cached[1]

    def segment(self, rank: int, k: int) -> SharedArray:
        """Rank ``rank``'s buffer ``k`` mapped here (re-attached if its owner grew it)."""
        return self._mapped(rank, k).seg

    def read(self, rank: int, k: int) -> list[np.ndarray]:
        """Zero-copy views of the arrays that ``rank`` published in its buffer ``k``."""
        mapped = self._mapped(rank, k)
        meta = mapped.meta[: int(mapped.meta_len[0])].tobytes()
        seg = mapped.seg

        def make() -> list[np.ndarray]:
            base = _align(8 + len(meta))
            return [seg.view(shape, dtype, base + off) if math.prod(shape) else np.empty(shape, dtype)
                    for dtype, shape, off in pickle.loads(meta)]

        return mapped.views_of(meta, make)

    def read_each(self, ranks: Sequence[int], k: int) -> list[list[np.ndarray]]:
        """:meth:`read` of buffer ``k`` of each of ``ranks`` (the same sequence object from call to
        call), after every rank wrote its message: while no rank wrote a new layout into a buffer
        ``k`` since the last call, the views of then, after one comparison (a master reading
        every worker's reply: no Python per rank)."""
        written = int(self._layouts_written[k])
        last = self._each.get(k)
        if last is not None and last[0] is ranks and last[1] == written:
            return last[2]
        views = [self.read(r, k) for r in ranks]
        self._each[k] = (ranks, written, views)
        return views

    def read_bytes(self, rank: int, k: int) -> bytes:
        return self.read(rank, k)[0].tobytes()

    def close(self) -> None:
        for mapped in self._own:
            if mapped is not None:
                mapped.seg.unlink()
                mapped.close()
        for _, mapped in self._peers.values():
            mapped.close()
        self._own = [None] * NBUF
        self._peers.clear()
        self._each.clear()
