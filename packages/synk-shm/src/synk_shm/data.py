"""Data: a typed, resizable array in OS shared memory that every process of a group sees in place.

A :class:`Data` has a fixed ``dtype`` and ``ndim`` (like a PyTensor variable) and a shape that
may change.  Its values live in a :class:`~synk_shm.segment.SharedArray`; :attr:`Data.data` is a
numpy view of the first ``size`` items of that allocation.  Another process attaches to it from a
small picklable :class:`DataHandle` and reads and writes the same memory.

Allocation::

    alloc_size >= size                     (items; oversize in [1, 2] reserves room to grow)
    reallocate when a new shape needs more than alloc_size items; existing rows are kept

Every change of the handle (a new allocation, a new shape, :meth:`Data.free_memory`) is reported
to the callbacks registered with :meth:`Data.on_change`, so the layer above can forward it to
other processes eagerly.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from synk_shm.segment import SharedArray, check_dtype

__all__ = ["Data", "DataHandle"]


class DataHandle(NamedTuple):
    """What another process needs to attach to a :class:`Data` (small and picklable).

    ``segment`` and ``shape`` are None while the Data holds no memory; ``tag`` changes with every
    reallocation, so a process that holds an older tag knows it must re-attach.
    """

    segment: str | None
    dtype: str
    shape: tuple[int, ...] | None
    tag: int
    minibatch: bool
    name: str | None
    ndim: int | None = None  # None in handles built by hand: len(shape) then


def _check_oversize(oversize: float) -> float:
    if not 1 <= oversize <= 2:
        raise ValueError(f"oversize must be in [1, 2], got {oversize!r}")
    return float(oversize)


class Data:
    """An array in OS shared memory, with fixed dtype and ndim, shared in place between processes.

    Parameters
    ----------
    value : array_like, optional
        Initial values; dtype and ndim are inferred from it when not given.
    dtype : dtype, optional
        Element type; required (with ``ndim``) when there is no ``value``.
    ndim : int, optional
        Number of dimensions; required when it cannot be inferred.
    shape : tuple of int, optional
        Allocate this shape (zero-filled) when there is no ``value``.
    minibatch : bool, optional
        Mark as minibatch data: under a function call's ``batch=`` indices, position ``i`` of the
        batch reads row ``i`` of this Data (see :mod:`synkhronos`).
    force_cast : bool, optional
        Cast ``value`` to ``dtype`` even when the cast loses information.
    oversize : float in [1, 2], optional
        Allocate this many times the needed memory, so that growing later does not reallocate.
    name : str, optional
        A name for messages and for keyword arguments of functions.

    Raises
    ------
    TypeError
        If dtype or ndim can be neither given nor inferred, the dtype holds Python objects, or
        ``value`` cannot be cast safely.
    ValueError
        If ``oversize`` is outside [1, 2] or ``ndim`` is negative.
    SharedMemoryFullError
        If ``/dev/shm`` has too little room (see :class:`~synk_shm.SharedMemoryFullError`).

    Examples
    --------
    >>> d = Data(np.arange(6, dtype="float32").reshape(3, 2), name="x")
    >>> d.shape, d.dtype, len(d)
    ((3, 2), dtype('float32'), 3)
    >>> d[1]
    array([2., 3.], dtype=float32)
    >>> d.set_length(4)        # grows in place or reallocates; the first rows are kept
    >>> d[:2].tolist()
    [[0.0, 1.0], [2.0, 3.0]]
    >>> d.free_memory()
    """

    def __init__(self, value: ArrayLike | None = None, *, dtype: DTypeLike | None = None,
                 ndim: int | None = None, shape: Sequence[int] | None = None,
                 minibatch: bool = False, force_cast: bool = False, oversize: float = 1,
                 name: str | None = None) -> None:
        _check_oversize(oversize)
        if value is not None and not isinstance(value, np.ndarray):
            value = np.asarray(value)  # a Data: through __array__
        if dtype is None:
            if value is None:
                raise TypeError("Data needs a dtype: give value=, dtype= (or var= in synkhronos.data)")
            dtype = value.dtype  # type: ignore[union-attr]
        if ndim is None:
            if value is not None:
                ndim = value.ndim  # type: ignore[union-attr]
            elif shape is not None:
                ndim = len(shape)
            else:
                raise TypeError("Data needs an ndim: give value=, shape=, ndim= (or var= in "
                                "synkhronos.data)")
        self.dtype: np.dtype[Any] = check_dtype(dtype)
        try:
            self.ndim: int = operator.index(ndim)
        except TypeError:
            raise TypeError(f"ndim must be an integer, got {ndim!r}") from None
        if self.ndim < 0:
            raise ValueError(f"ndim must be >= 0, got {self.ndim}")
        self.minibatch: bool = bool(minibatch)
        self.name: str | None = name
        self._segment: SharedArray | None = None
        self._data: np.ndarray | None = None
        self._tag = 0
        self._owner = True
        self._callbacks: list[Callable[[Data], None]] = []
        self._before: list[Callable[[Data], None]] = []
        if value is not None:
            self.set_value(value, force_cast=force_cast, oversize=oversize)
        elif shape is not None:
            self.set_shape(shape, oversize=oversize)

    # -- numpy-like read access ---------------------------------------------------------------
    @property
    def data(self) -> np.ndarray | None:
        """The numpy view of the values (None while no memory is held).  Write through it freely;
        change the shape only through :meth:`set_value`, :meth:`set_length` or :meth:`set_shape`."""
        return self._data

    @property
    def shape(self) -> tuple[int, ...] | None:
        """Shape of the values, or None while no memory is held."""
        return None if self._data is None else self._data.shape

    @property
    def size(self) -> int:
        """Number of items (0 while no memory is held)."""
        return 0 if self._data is None else self._data.size

    @property
    def alloc_size(self) -> int:
        """Items that the current allocation holds (>= size)."""
        return 0 if self._segment is None else self._segment.capacity // self.dtype.itemsize

    @property
    def allocated(self) -> bool:
        """True while the Data holds shared memory."""
        return self._segment is not None

    @property
    def tag(self) -> int:
        """Changes with every reallocation (see :class:`DataHandle`)."""
        return self._tag

    def __len__(self) -> int:
        return 0 if self._data is None else len(self._data)

    def __getitem__(self, key: Any) -> Any:
        return self._values()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._values()[key] = value

    def __array__(self, dtype: DTypeLike | None = None, copy: bool | None = None) -> np.ndarray:
        values = self._values()
        if dtype is not None and np.dtype(dtype) != values.dtype:
            if copy is False:
                raise ValueError(f"{self._what()} has dtype {self.dtype}: reading it as "
                                 f"{np.dtype(dtype)} needs a copy, and copy=False forbids one")
            return values.astype(dtype)
        return values.copy() if copy else values

    def __repr__(self) -> str:
        label = f"{self.name!r}, " if self.name else ""
        return f"Data({label}shape={self.shape}, dtype={self.dtype}, minibatch={self.minibatch})"

    def _values(self) -> np.ndarray:
        if self._data is None:
            what = f"Data {self.name!r}" if self.name else "this Data"
            raise ValueError(f"{what} holds no memory (never filled, or freed): call "
                             "set_value(), set_shape() or set_length() first")
        return self._data

    # -- writing and resizing -----------------------------------------------------------------
    def condition_data(self, value: ArrayLike, force_cast: bool = False) -> np.ndarray:
        """The numpy array that :meth:`set_value` would store for ``value``.

        A safe cast (``numpy.can_cast(..., "safe")``) is applied silently; any other cast needs
        ``force_cast=True``.  The number of dimensions must equal :attr:`ndim`.

        Raises
        ------
        TypeError
            If the cast is not safe and ``force_cast`` is False, or ndim differs.
        """
        arr = np.asarray(value)  # a Data: through __array__
        if arr.ndim != self.ndim:
            raise TypeError(f"{self._what()} has ndim={self.ndim}; the value has ndim={arr.ndim} "
                            f"(shape {arr.shape})")
        if arr.dtype != self.dtype:
            if not force_cast and not np.can_cast(arr.dtype, self.dtype, "safe"):
                raise TypeError(f"{self._what()} has dtype {self.dtype}; casting the value's "
                                f"{arr.dtype} to it is not safe. Cast it first "
                                f"(value.astype('{self.dtype}')) or pass force_cast=True")
            arr = arr.astype(self.dtype)
        return arr

    def set_value(self, value: ArrayLike, force_cast: bool = False, oversize: float = 1) -> None:
        """(Over)write all values; the shape becomes the value's, reallocating if needed.

        Parameters
        ----------
        value : array_like
            New values (a :class:`Data` is read through its ``data``).
        force_cast : bool, optional
            See :meth:`condition_data`.
        oversize : float in [1, 2], optional
            Used only if a reallocation is needed.
        """
        _check_oversize(oversize)
        arr = self.condition_data(value, force_cast)
        self._about_to_change()
        if self._data is not None and np.shares_memory(arr, self._data):
            arr = arr.copy()  # e.g. d.set_value(d[::-1])
        self._resize(arr.shape, oversize, keep=False)
        self._values()[...] = arr

    def set_length(self, length: int, oversize: float = 1) -> None:
        """Change the length (axis 0); the first ``min(old, new)`` rows are kept, new rows are 0."""
        if self.ndim == 0:
            raise TypeError(f"{self._what()} is 0-d: it has no length; use set_value()")
        old = self.shape
        tail = old[1:] if old is not None else () if self.ndim == 1 else None
        if tail is None:
            raise ValueError(f"{self._what()} has no shape yet: use set_shape() or set_value() first")
        self.set_shape((length, *tail), oversize)

    def set_shape(self, shape: Sequence[int], oversize: float = 1) -> None:
        """Change the shape; values at indices inside both shapes are kept, the rest are 0."""
        _check_oversize(oversize)
        shape = tuple(int(s) for s in shape)
        if len(shape) != self.ndim:
            raise TypeError(f"{self._what()} has ndim={self.ndim}; shape {shape} has {len(shape)}")
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        self._about_to_change()
        self._resize(shape, oversize, keep=True)

    def free_memory(self) -> None:
        """Release the shared memory (in every process, through the change callbacks).

        The Data keeps its dtype and ndim; :meth:`set_value` or :meth:`set_shape` fills it again.
        """
        if self._segment is None:
            return
        self._require_owner("free its memory")
        self._about_to_change()
        self._drop_segment()
        self._data = None
        self._tag += 1
        self._changed()

    # -- sharing with other processes ---------------------------------------------------------
    def handle(self) -> DataHandle:
        """A picklable description of this Data for :meth:`attach` in another process."""
        return DataHandle(None if self._segment is None else self._segment.name, self.dtype.str,
                          self.shape, self._tag, self.minibatch, self.name, self.ndim)

    @classmethod
    def attach(cls, handle: DataHandle) -> Data:
        """The Data that ``handle`` describes, mapped in this process (no copy).

        An attached Data reads and writes the same memory as its creator but cannot change the
        shape or allocation: only the creator can, and :meth:`update` follows it here.
        """
        ndim = handle.ndim if handle.ndim is not None else len(handle.shape or ())
        obj = cls(dtype=handle.dtype, ndim=ndim, minibatch=handle.minibatch, name=handle.name)
        obj._owner = False
        obj.update(handle)
        return obj

    def update(self, handle: DataHandle) -> None:
        """Follow the creator's change (reallocation, new shape or free) in this process."""
        if self._owner:
            raise RuntimeError("update() is for an attached Data; the creator changes its own")
        self.minibatch, self.name = handle.minibatch, handle.name
        if handle.segment is None:
            self._drop_segment()
            self._data = None
        else:
            if self._segment is None or self._segment.name != handle.segment:
                self._drop_segment()
                self._segment = SharedArray.attach(handle.segment, 0, self.dtype)
            assert handle.shape is not None
            self.ndim = len(handle.shape)
            self._data = self._segment.view(handle.shape, self.dtype)
        self._tag = handle.tag

    def on_change(self, callback: Callable[[Data], None]) -> None:
        """Call ``callback(data)`` after every change of :meth:`handle` (reallocation, new shape,
        free).  Writes of values do not count: other processes see them in place."""
        self._callbacks.append(callback)

    def before_change(self, callback: Callable[[Data], None]) -> None:
        """Call ``callback(data)`` before :meth:`set_value`, :meth:`set_shape` (and
        :meth:`set_length`) or :meth:`free_memory` changes anything (after their checks): e.g. to
        wait until no pending computation reads the old values."""
        self._before.append(callback)

    def _about_to_change(self) -> None:
        for callback in list(self._before):
            callback(self)

    def close(self) -> None:
        """Unmap (and, for the creator, unlink) the memory in this process without notifying
        anyone; used when a group shuts down."""
        self._drop_segment()
        self._data = None

    # -- internals ------------------------------------------------------------------------------
    def _what(self) -> str:
        return f"Data {self.name!r}" if self.name else "the Data"

    def _require_owner(self, action: str) -> None:
        if not self._owner:
            raise RuntimeError(f"{self._what()} is attached from another process, which cannot "
                               f"{action}: do it in the process that created it")

    def _drop_segment(self) -> None:
        seg, self._segment = self._segment, None
        if seg is not None:
            if self._owner and seg.pid == os.getpid():  # not in a forked child: the parent's
                seg.unlink()
            seg.close()

    def _resize(self, shape: tuple[int, ...], oversize: float, keep: bool) -> None:
        if self.shape == shape:
            return
        self._require_owner("change its shape")
        count = math.prod(shape)
        old = self._data
        if self._segment is not None and count <= self.alloc_size:
            new = self._segment.view(shape, self.dtype)
            if keep and old is not None:
                if old.shape[1:] == shape[1:]:  # same rows: they are already in place
                    new[len(old):] = 0
                else:  # the rows move in memory: copy the overlap out, zero, copy it back
                    region = tuple(slice(0, min(a, b)) for a, b in zip(old.shape, shape))
                    kept = old[region].copy()
                    new[...] = 0
                    new[region] = kept
            self._data = new
        else:
            nbytes = count * self.dtype.itemsize
            segment = SharedArray.create(shape, self.dtype, capacity=math.ceil(nbytes * oversize),
                                         purpose=f"{self._what()} of shape {shape}, dtype "
                                                 f"{self.dtype}, oversize {oversize:g}")
            if keep and old is not None:
                region = tuple(slice(0, min(a, b)) for a, b in zip(old.shape, shape))
                segment.array[region] = old[region]
            self._drop_segment()
            self._segment = segment
            self._data = segment.array
            self._tag += 1
        self._changed()

    def _changed(self) -> None:
        for callback in list(self._callbacks):
            callback(self)

    def __del__(self) -> None:
        try:
            self._drop_segment()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
