"""``synk_comm.dlpack`` on host memory, with numpy as the other side of the protocol: the same
structures carry NCCL's results to JAX on a GPU (tests in ``test_comm_gpu.py``)."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

from synk_comm.dlpack import DEVICE_CPU, Exported, capsule_address


def _owned(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Memory that outlives every import (the test's stand-in for a device buffer of ours)."""
    return np.zeros(shape, dtype=dtype)


def _export(memory: np.ndarray, ready: Any = None) -> Exported:
    return Exported(memory.ctypes.data, memory.shape, memory.dtype, (DEVICE_CPU, 0), ready=ready)


class _Unversioned:
    """A consumer's view of a producer from before DLPack 1.0 (no ``max_version``)."""

    def __init__(self, exported: Exported) -> None:
        self.exported = exported

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.exported.__dlpack_device__()

    def __dlpack__(self, stream: Any = None) -> Any:
        return self.exported.__dlpack__(stream=stream)


@pytest.mark.parametrize("versioned", [True, False], ids=["dlpack1", "unversioned"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int8", "int64", "uint16", "bool", "complex64"])
@pytest.mark.parametrize("shape", [(3, 4), (7,), (), (2, 0, 3)])
def test_numpy_imports_the_memory_in_place(dtype: str, shape: tuple[int, ...], versioned: bool) -> None:
    memory = _owned(shape, dtype)
    memory[...] = (np.arange(memory.size) % 2).reshape(shape)
    exported = _export(memory)
    view = np.from_dlpack(exported if versioned else _Unversioned(exported))
    assert view.dtype == memory.dtype and view.shape == memory.shape
    np.testing.assert_array_equal(view, memory)
    if memory.size:
        memory.flat[0] = 1 - memory.flat[0]
        assert view.flat[0] == memory.flat[0], "the import is a copy, not the memory itself"
    assert not exported.released
    del view
    gc.collect()
    assert exported.released


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_an_unconsumed_capsule_releases_the_memory_when_dropped(max_version: Any) -> None:
    exported = _export(_owned((4,), "float32"))
    assert not exported.released
    capsule = exported.__dlpack__(max_version=max_version)
    assert not exported.released
    del capsule
    gc.collect()
    assert exported.released


def test_memory_is_offered_once() -> None:
    exported = _export(_owned((2,), "float32"))
    first = np.from_dlpack(exported)
    with pytest.raises(BufferError, match="offered once"):
        exported.__dlpack__()
    with pytest.raises(BufferError, match="never a copy"):
        _export(_owned((2,), "float32")).__dlpack__(copy=True)
    del first
    gc.collect()
    assert exported.released


def test_ready_runs_with_the_consumers_stream_before_the_capsule_is_made() -> None:
    streams: list[Any] = []
    exported = _export(_owned((2,), "int32"), ready=streams.append)
    capsule = exported.__dlpack__(stream=None)
    assert streams == [None]
    del capsule
    gc.collect()
    assert exported.released


def test_types_dlpack_cannot_carry_are_refused() -> None:
    with pytest.raises(TypeError, match="DLPack has no type"):
        _export(_owned((2,), "U3")).__dlpack__()


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_capsule_address_reads_a_producers_capsule(max_version: Any) -> None:
    array = np.arange(10, dtype=np.float64)[3:]  # an offset into a larger buffer
    capsule = array.__dlpack__() if max_version is None else array.__dlpack__(max_version=max_version)
    assert capsule_address(capsule) == array.ctypes.data


def test_the_consumer_may_let_go_after_the_owner_dropped_the_export() -> None:
    """The structure the consumer calls back into is C memory of its own, kept until released:
    a consumer that lets go late (JAX's arrays at interpreter exit) never writes into freed
    memory."""
    memory = _owned((5,), "float64")
    exported = _export(memory)
    view = np.from_dlpack(exported)
    del exported
    gc.collect()
    view[...] = 7.0
    np.testing.assert_array_equal(memory, 7.0)
    del view
    gc.collect()
