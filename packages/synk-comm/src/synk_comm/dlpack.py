"""DLPack both ways, for the device memory that NCCL reads and writes.

* :func:`capsule_address` reads the address out of a capsule that a framework exported (JAX's
  ``__dlpack__``), so that NCCL can use the memory from a stream that waits for it.
* :class:`Exported` offers memory that synk_comm owns to a framework's ``from_dlpack`` without a
  copy.  The framework calls the deleter when it lets go of the memory, and ``release`` runs then.

The structures are those of dlpack.h: ``DLTensor``, ``DLManagedTensor`` (the unversioned capsule
``"dltensor"``, which every consumer takes) and the head of ``DLManagedTensorVersioned``.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["DEVICE_CPU", "DEVICE_CUDA", "Exported", "capsule_address"]

log = logging.getLogger(__name__)

DEVICE_CPU, DEVICE_CUDA = 1, 2  # DLDeviceType: kDLCPU, kDLCUDA


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64)]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


_VERSIONED_HEAD = 32  # DLManagedTensorVersioned: version, manager_ctx, deleter, flags, then the DLTensor
_NAME = b"dltensor"  # lives as long as the module: a capsule keeps a pointer to its name

# The C API of capsules, through prototypes of our own: ctypes.pythonapi's function objects are
# shared by every user in the process, so their argtypes are not ours to set.
_get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_Destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_new_capsule = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, _Destructor)(
    ("PyCapsule_New", ctypes.pythonapi))
# In a capsule's destructor the capsule is being freed: these read it through a plain pointer.
_is_valid_at = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_pointer_at = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def capsule_address(capsule: Any) -> int:
    """The address of the data that a DLPack capsule describes (``data + byte_offset``)."""
    name = _get_name(capsule)
    head = _get_pointer(capsule, name)
    tensor = _DLTensor.from_address(head + (_VERSIONED_HEAD if name == b"dltensor_versioned" else 0))
    return int(tensor.data or 0) + int(tensor.byte_offset)


def _type_code(dtype: np.dtype) -> tuple[int, int]:
    """DLPack's ``(code, bits)`` of a numpy dtype (bfloat16 from ml_dtypes included)."""
    if dtype.name == "bfloat16":
        return 4, 16  # kDLBfloat
    codes = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}  # kDLInt, kDLUInt, kDLFloat, kDLComplex, kDLBool
    if dtype.kind not in codes:
        raise TypeError(f"DLPack has no type for {dtype}")
    return codes[dtype.kind], dtype.itemsize * 8


# Every exported tensor not yet let go of, by the address of its DLManagedTensor: the structure,
# its shape array and what to run when the consumer calls the deleter.
_live: dict[int, tuple[_DLManagedTensor, Any, Callable[[], None]]] = {}


def _let_go(address: int) -> None:
    entry = _live.pop(address, None)
    if entry is None:
        return
    try:
        entry[2]()
    except Exception:  # a deleter has no caller to raise to
        log.exception("synk_comm: releasing exported device memory failed")


@_Deleter
def _deleter(address: int) -> None:
    """DLManagedTensor.deleter: the consumer has let go of the memory (may run in its threads;
    ctypes takes the GIL)."""
    _let_go(address)


@_Destructor
def _capsule_destructor(capsule: int) -> None:
    """A capsule that nobody consumed (still named "dltensor") lets go of its memory; a consumer
    renames the capsule and calls the deleter itself when it is done."""
    if _is_valid_at(capsule, _NAME):
        _let_go(_pointer_at(capsule, _NAME))


class Exported:
    """Memory that synk_comm owns, offered once through the DLPack protocol, e.g. to
    ``jax.dlpack.from_dlpack``: the consumer's array uses the memory in place.

    Parameters
    ----------
    address : int
        The data's address (device or host memory, as ``device`` says), C-contiguous.
    shape, dtype
        What the consumer sees.
    device : tuple of int
        DLPack's ``(device_type, device_id)``: ``(DEVICE_CUDA, 0)`` for the first visible GPU.
    release : callable
        Runs once when the consumer lets go of the memory (or when an unconsumed capsule is
        dropped); it may run in one of the consumer's threads.
    ready : callable, optional
        ``ready(stream)`` runs before the capsule is made, with the stream the consumer will use
        (a CUDA stream handle, or None): it makes that stream wait for the memory's last writer.
    """

    def __init__(self, address: int, shape: Sequence[int], dtype: Any, device: tuple[int, int],
                 release: Callable[[], None], ready: Callable[[int | None], None] | None = None) -> None:
        self.address = int(address)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.device = device
        self._release: Callable[[], None] | None = release
        self._ready = ready

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, *, stream: int | None = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        if self._release is None:
            raise BufferError("this memory was exported already; it is offered once")
        if dl_device is not None and tuple(dl_device) != self.device:
            raise BufferError(f"the memory lives on DLPack device {self.device}, not {dl_device}")
        if copy:
            raise BufferError("the export is never a copy; let the consumer copy it")
        if self._ready is not None:
            self._ready(stream)
        managed = _DLManagedTensor()
        shape = (ctypes.c_int64 * max(1, len(self.shape)))(*self.shape)
        tensor = managed.dl_tensor
        tensor.data = self.address
        tensor.device_type, tensor.device_id = self.device
        tensor.ndim = len(self.shape)
        tensor.code, tensor.bits = _type_code(self.dtype)
        tensor.lanes = 1
        tensor.shape = ctypes.addressof(shape)
        tensor.strides = None  # compact, row-major
        managed.deleter = _deleter
        address = ctypes.addressof(managed)
        _live[address] = (managed, shape, self._release)
        self._release = None
        return _new_capsule(address, _NAME, _capsule_destructor)
