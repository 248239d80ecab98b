"""SharedArray: a named POSIX shared-memory segment seen as a numpy array.

One process creates the segment (:meth:`SharedArray.create`), any other attaches to it by name
(:meth:`SharedArray.attach`) and both see every write in place, with no copy.  The creator
unlinks the name when done (:meth:`SharedArray.unlink`); the memory stays valid in every process
that still maps it, until that process closes its mapping.

tmpfs hands out pages lazily, so a segment larger than the free room of ``/dev/shm`` would only
fail later, with SIGBUS, when a page is first touched.  :meth:`SharedArray.create` therefore
reserves every page up front (``posix_fallocate``) and turns a shortage into
:class:`SharedMemoryFullError`, which says how much was asked for, how much is free and how to
get more.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
from typing import Any

import numpy as np
import posix_ipc
from numpy.typing import DTypeLike

from synk_shm import naming

__all__ = ["SharedArray", "SharedMemoryFullError", "shm_free_bytes", "format_bytes", "check_dtype"]


class SharedMemoryFullError(MemoryError):
    """``/dev/shm`` has too little room for a new segment."""


def shm_free_bytes() -> int:
    """Bytes free in ``/dev/shm`` for this user."""
    st = os.statvfs(naming.SHM_DIR)
    return st.f_bavail * st.f_frsize


def check_dtype(dtype: DTypeLike) -> np.dtype[Any]:
    """``numpy.dtype(dtype)``, refusing Python objects: their pointers mean nothing in another
    process."""
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise TypeError(f"dtype {dt} holds Python objects, which cannot live in shared memory: use a "
                        "numeric, bool, fixed-width string ('U10', 'S10') or structured dtype")
    return dt


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _full_error(nbytes: int, purpose: str) -> SharedMemoryFullError:
    st = os.statvfs(naming.SHM_DIR)
    total = st.f_blocks * st.f_frsize
    what = f" for {purpose}" if purpose else ""
    return SharedMemoryFullError(
        f"cannot allocate {format_bytes(nbytes)} of shared memory{what}: /dev/shm has "
        f"{format_bytes(shm_free_bytes())} free of {format_bytes(total)}. Free room in /dev/shm "
        "(delete Data you no longer need with free_memory()) or enlarge it: in docker, "
        "`docker run --shm-size=8g ...`; on a host, `mount -o remount,size=8G /dev/shm` as root."
    )


class SharedArray:
    """A numpy array whose memory is a named POSIX shared-memory segment.

    Parameters are not given directly: use :meth:`create` or :meth:`attach`.

    Attributes
    ----------
    name : str
        The segment's name (``/synk...``): pass it to another process to attach.
    capacity : int
        Bytes mapped; at least ``array.nbytes``.
    array : numpy.ndarray
        The view of the segment with the shape and dtype given at creation or attachment.
    owner : bool
        True in the process that created the segment (the one that unlinks it).
    pid : int
        The process that created or attached this mapping; a child forked later inherits the
        object but not the duty to unlink it.

    Examples
    --------
    >>> a = SharedArray.create((2, 3), "float32")
    >>> a.array[:] = 1.0
    >>> b = SharedArray.attach(a.name, (2, 3), "float32")   # typically in another process
    >>> float(b.array.sum())
    6.0
    >>> b.close(); a.unlink(); a.close()
    """

    def __init__(self, name: str, mm: mmap.mmap | None, capacity: int, owner: bool,
                 shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.name = name
        self.capacity = capacity
        self.owner = owner
        self.pid = os.getpid()
        self._mmap = mm
        self.array: np.ndarray = self.view(shape, dtype)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def create(cls, shape: tuple[int, ...] | int, dtype: DTypeLike, *, capacity: int | None = None,
               name: str | None = None, purpose: str = "") -> SharedArray:
        """Create a zero-filled segment and map it.

        Parameters
        ----------
        shape, dtype
            Of the array view.
        capacity : int, optional
            Bytes to reserve, at least the array's size (room to grow without reallocating).
        name : str, optional
            Segment name; default a fresh name of this run (:func:`synk_shm.naming.new_name`).
        purpose : str, optional
            Words for the error message if ``/dev/shm`` is full (e.g. ``"Data 'x'"``).

        Raises
        ------
        SharedMemoryFullError
            If ``/dev/shm`` has less free room than ``capacity``.
        TypeError
            If the dtype holds Python objects (:func:`check_dtype`).
        """
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dt = check_dtype(dtype)
        need = math.prod(shape) * dt.itemsize
        capacity = max(need, capacity or 0, 1)  # a segment cannot be empty
        if capacity > shm_free_bytes():
            raise _full_error(capacity, purpose)
        name = name or naming.new_name("a")
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        naming.register(name, "shm")
        try:
            try:
                os.posix_fallocate(shm.fd, 0, capacity)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise _full_error(capacity, purpose) from None
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(shm.fd, capacity)  # filesystems without fallocate
            mm = mmap.mmap(shm.fd, capacity)
        except BaseException:
            naming.unlink_name(name)
            raise
        finally:
            shm.close_fd()
        try:
            return cls(name, mm, capacity, True, shape, dt)
        except BaseException:  # a view that numpy refuses: leave no segment behind
            mm.close()
            naming.unlink_name(name)
            raise

    @classmethod
    def attach(cls, name: str, shape: tuple[int, ...] | int, dtype: DTypeLike) -> SharedArray:
        """Map an existing segment by name; writes are seen by every process that maps it.

        Raises
        ------
        FileNotFoundError
            If no segment has that name (it was unlinked, or never created).
        """
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"no shared-memory segment named {name!r}: it was freed or "
                                    "its creator exited") from None
        try:
            mm = mmap.mmap(shm.fd, shm.size)
            capacity = shm.size
        finally:
            shm.close_fd()
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return cls(name, mm, capacity, False, shape, np.dtype(dtype))

    # -- use ----------------------------------------------------------------------------------
    def view(self, shape: tuple[int, ...] | int, dtype: DTypeLike, offset: int = 0) -> np.ndarray:
        """A new numpy view of the segment (no copy); raises ValueError if it does not fit."""
        if self._mmap is None:
            raise ValueError(f"shared array {self.name!r} is closed")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dt = np.dtype(dtype)
        count = math.prod(shape)
        if offset + count * dt.itemsize > self.capacity:
            raise ValueError(f"a {shape} {dt} view needs {count * dt.itemsize} bytes at offset "
                             f"{offset}; segment {self.name!r} has {self.capacity}")
        return np.frombuffer(self._mmap, dtype=dt, count=count, offset=offset).reshape(shape)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        """Unmap the segment in this process (idempotent).

        Numpy views handed out earlier keep the mapping alive until they are garbage-collected.
        """
        mm, self._mmap = self._mmap, None
        self.array = np.empty(0, dtype=self.array.dtype)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views still exported: the mapping goes with the last of them

    def unlink(self) -> None:
        """Remove the name (idempotent); processes that map the segment keep their memory."""
        naming.unlink_name(self.name)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.array.shape} {self.array.dtype}"
        return f"SharedArray({self.name!r}, {state}, capacity={self.capacity})"
