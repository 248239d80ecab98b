"""Data known to every rank: :func:`data`, and how the master keeps the workers' copies current.

Every :class:`~synk_shm.Data` that reaches a function or a collective gets a data id.  The master
sends its handle to the workers when it registers it and again after every change of the handle
(reallocation, new shape, :meth:`~synk_shm.Data.free_memory`), under a barrier, so a worker
always maps what the master maps.  Writes of values need nothing: every rank sees them in place.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from synk_comm import Group, handler
from synk_shm import Data, DataHandle
from synkhronos.protocol import DATA_UPDATE as UPDATE
from synkhronos.runtime import Runtime, current, describe, get_runtime, rank_runtime, settled

__all__ = ["data", "check_input", "data_id"]



def data(value: ArrayLike | None = None, var: Any = None, dtype: DTypeLike | None = None,
         ndim: int | None = None, shape: Any = None, minibatch: bool = False, force_cast: bool = False,
         oversize: float = 1, name: str | None = None) -> Data:
    """A :class:`~synk_shm.Data` in OS shared memory, known to every rank: the input of functions.

    Parameters
    ----------
    value : array_like, optional
        Initial values.
    var : PyTensor variable, optional
        Gives dtype, ndim and name.
    dtype, ndim : optional
        When not implied by ``var`` or ``value``.
    shape : tuple, optional
        Allocate this shape (zero-filled) when there is no value.
    minibatch : bool
        Holds only a batch: under ``batch=``, position ``i`` of the batch reads row ``i``.
    force_cast : bool
        Cast ``value`` to the dtype even when unsafe.
    oversize : float in [1, 2]
        Reserve this factor of memory so that growing later needs no reallocation.
    name : str, optional

    Raises
    ------
    TypeError
        If dtype or ndim can be neither given nor inferred, or the value cannot be cast safely.
    RuntimeError
        If Synkhronos is not forked.
    """
    rt = get_runtime()
    if var is not None:
        vtype = getattr(var, "type", None)
        if vtype is None or not hasattr(vtype, "dtype"):
            raise TypeError(f"var must be a PyTensor tensor variable, got {var!r}")
        if dtype is not None and np.dtype(dtype) != np.dtype(vtype.dtype):
            raise TypeError(f"dtype={dtype} contradicts var {describe(var)} of dtype {vtype.dtype}")
        if ndim is not None and ndim != vtype.ndim:
            raise TypeError(f"ndim={ndim} contradicts var {describe(var)} of ndim {vtype.ndim}")
        dtype, ndim, name = vtype.dtype, vtype.ndim, name or var.name
    d = Data(value, dtype=dtype, ndim=ndim, shape=shape, minibatch=minibatch, force_cast=force_cast,
             oversize=oversize, name=name)
    data_id(rt, d)
    return d


def check_input(value: Any, var: Any) -> None:
    """TypeError/ValueError unless ``value`` can be the argument for input ``var``."""
    if not isinstance(value, Data):
        raise TypeError(f"input {describe(var)} needs a synkhronos Data, got {type(value).__name__}: wrap "
                        "the values with synk.data(value) (inputs live in shared memory)")
    if value.dtype != var.type.numpy_dtype:
        raise TypeError(f"input {describe(var)} has dtype {var.type.dtype}, the Data has {value.dtype}: cast "
                        f"it in synk.data(..., dtype='{var.type.dtype}') or data.set_value(..., force_cast=True)")
    if value.ndim != var.type.ndim:
        raise TypeError(f"input {describe(var)} has ndim {var.type.ndim}, the Data has ndim {value.ndim}")
    if not value.allocated:
        raise ValueError(f"the Data for input {describe(var)} holds no memory (never filled, or freed): "
                         "set_value() first")


def data_id(rt: Runtime, d: Data) -> int:
    """The data id of ``d``, registering it with every rank first if it is new."""
    did = rt.data_ids.get(id(d))
    if did is not None and rt.data.get(did) is d:
        return did
    did = next_data_id(rt)
    rt.data[did] = d
    rt.data_ids[id(d)] = did
    _push(rt, [(did, d.handle())])
    d.before_change(_settle_first)
    d.on_change(_make_callback(rt, did))
    weakref.finalize(d, _forget, weakref.ref(rt), did, id(d))
    return did


def _settle_first(_d: Data) -> None:
    """Before a Data changes: the calls in flight, which may read it, finish (:mod:`synkhronos.inflight`)."""
    settled()


def _make_callback(rt: Runtime, did: int) -> Any:
    ref = weakref.ref(rt)

    def changed(d: Data) -> None:
        live = ref()
        if live is not None and live is current() and not live.group.closed:
            _push(live, [(did, d.handle())])

    return changed


def _forget(ref: weakref.ref[Runtime], did: int, key: int) -> None:
    rt = ref()
    if rt is not None:
        rt.data.pop(did, None)
        if rt.data_ids.get(key) == did:
            del rt.data_ids[key]
        rt.dropped.append(did)


def _push(rt: Runtime, items: list[tuple[int, DataHandle | None]]) -> None:
    dropped, rt.dropped = rt.dropped, []
    items = items + [(did, None) for did in dropped]
    rt.group.run(UPDATE, items)


def flush_dropped(rt: Runtime) -> None:
    """Tell the workers to unmap Data that the master no longer holds."""
    if rt.dropped:
        _push(rt, [])


@handler(UPDATE)
def _update(group: Group, items: list[tuple[int, DataHandle | None]]) -> None:
    if group.is_master:
        return
    rt = rank_runtime(group)
    unpin = getattr(rt.engine, "unpin", None)  # the JAX engine registers Data memory with its device
    for did, handle in items:
        if unpin is not None:
            unpin(did)
        if handle is None:
            old = rt.data.pop(did, None)
            if old is not None:
                old.close()
        elif did in rt.data:
            rt.data[did].update(handle)
        else:
            rt.data[did] = Data.attach(handle)


def write_indices(rt: Runtime, indices: np.ndarray) -> int:
    """Put a call's batch / batch_s indices in the shared index buffer; returns its data id.

    The buffer grows by doubling (each growth reaches the workers like any Data change).
    """
    d = rt.index_data
    if d is None or len(d) < len(indices):
        n = max(1024, 2 * len(indices))
        if d is None:
            d = rt.index_data = Data(dtype=np.int64, ndim=1, name="synkhronos batch indices")
        d.set_length(n)
    assert d.data is not None
    d.data[:len(indices)] = indices
    return data_id(rt, d)


def next_function_id(rt: Runtime) -> int:
    rt.counter += 1
    return rt.counter


def next_data_id(rt: Runtime) -> int:
    rt.counter += 1
    return rt.counter
