"""DLPack both ways, for the device memory that NCCL reads and writes.

* :func:`capsule_address` reads the address out of a capsule that a framework exported (JAX's
  ``__dlpack__``), so that NCCL can use the memory from a stream that waits for it.
* :class:`Exported` offers memory that synk_comm owns to a framework's ``from_dlpack`` without a
  copy; :attr:`Exported.released` says when the framework has let go of it.

The structures are those of dlpack.h: ``DLTensor``, ``DLManagedTensor`` (capsule ``"dltensor"``)
and ``DLManagedTensorVersioned`` (``"dltensor_versioned"``, DLPack 1.0, for consumers that ask).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["DEVICE_CPU", "DEVICE_CUDA", "Exported", "capsule_address"]

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
_NAME, _NAME_VERSIONED = b"dltensor", b"dltensor_versioned"  # alive as long as the module: capsules
# keep a pointer to their name

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


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


# The deleter of a versioned export is sem_post, run on the structure's own head.  JAX calls
# deleters from its own threads (once the GPU is done with the memory); a deleter written in
# Python would wait there for the GIL, up to a switch interval (5 ms) each time -- measured on
# 2x H200: 2.4 ms per 256 MiB all-reduce.  sem_post takes no lock and no GIL: on the structure's
# first 8 bytes, DLPackVersion {1, 0}, read as a semaphore (glibc and musl alike: the count in
# the first 32-bit word, waiters in the second), it counts major 1 up to 2 -- and waking no one,
# as minor 0 says there are no waiters.  ``Exported.released`` reads it back.  Consumers read the
# version before they import and never after calling the deleter.
_libc = ctypes.CDLL(None)
_SEM_POST = ctypes.cast(_libc.sem_post, ctypes.c_void_p).value
_sem_post = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(("sem_post", _libc))
_VERSION = (1, 0)  # the DLPack version exported: the structure's head must read (1, 0)

# An exported structure and its shape array live in one block of C memory (malloc), freed when
# its owner sees it released: never by Python's collector, so a consumer that lets go while the
# interpreter shuts down (JAX's arrays at exit) still writes into live memory.
_malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(("malloc", _libc))
_free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(("free", _libc))

# The export of every structure not yet seen released, by the structure's address.
_live: dict[int, Exported] = {}


@_Deleter
def _unversioned_deleter(address: int) -> None:
    """DLManagedTensor.deleter (consumers without DLPack 1.0: numpy < 2.1 and alike)."""
    exported = _live.get(address)
    if exported is not None:
        exported._consumer_done = True


@_Destructor
def _capsule_destructor(capsule: int) -> None:
    """A capsule that nobody consumed calls its deleter; a consumer renames the capsule and calls
    the deleter itself when it is done."""
    for name in (_NAME_VERSIONED, _NAME):
        if _is_valid_at(capsule, name):
            address = _pointer_at(capsule, name)
            if name == _NAME_VERSIONED:
                _sem_post(address)
            else:
                _unversioned_deleter(address)



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
    ready : callable, optional
        ``ready(stream)`` runs before the capsule is made, with the stream the consumer will use
        (a CUDA stream handle, or None): it makes that stream wait for the memory's last writer.

    Notes
    -----
    The owner keeps the memory until :attr:`released` says the consumer has let go of it (the
    consumer called the deleter, or dropped the capsule unconsumed); polling is the owner's job,
    as the deleter may run in any thread of the consumer.
    """

    def __init__(self, address: int, shape: Sequence[int], dtype: Any, device: tuple[int, int],
                 ready: Callable[[int | None], None] | None = None) -> None:
        self.address = int(address)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.device = device
        self._ready = ready
        self._managed: Any = None  # the exported structure, from __dlpack__ until seen released
        self._struct: int | None = None  # its address (kept after it is freed: offered once)
        self._consumer_done = False  # set by the unversioned deleter

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, *, stream: int | None = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        if self._struct is not None:
            raise BufferError("this memory was exported already; it is offered once")
        if dl_device is not None and tuple(dl_device) != self.device:
            raise BufferError(f"the memory lives on DLPack device {self.device}, not {dl_device}")
        if copy:
            raise BufferError("the export is never a copy; let the consumer copy it")
        code, bits = _type_code(self.dtype)
        if self._ready is not None:
            self._ready(stream)
        versioned = max_version is not None and max_version[0] >= _VERSION[0]
        kind: Any = _DLManagedTensorVersioned if versioned else _DLManagedTensor
        head, ndim = ctypes.sizeof(kind), len(self.shape)
        address = _malloc(head + 8 * max(1, ndim))
        if not address:
            raise MemoryError("no host memory left for a DLPack structure")
        ctypes.memset(address, 0, head)
        managed = kind.from_address(address)
        shape = (ctypes.c_int64 * max(1, ndim)).from_address(address + head)
        for i, extent in enumerate(self.shape):
            shape[i] = extent
        tensor = managed.dl_tensor
        tensor.data = self.address
        tensor.device_type, tensor.device_id = self.device
        tensor.ndim = ndim
        tensor.code, tensor.bits, tensor.lanes = code, bits, 1
        tensor.shape = address + head
        tensor.strides = None  # compact, row-major
        if versioned:
            managed.version.major, managed.version.minor = _VERSION
            managed.deleter = _SEM_POST
        else:
            managed.deleter = _unversioned_deleter
        _live[address] = self
        self._managed, self._struct = managed, address
        return _new_capsule(address, _NAME_VERSIONED if versioned else _NAME, _capsule_destructor)

    @property
    def released(self) -> bool:
        """Whether the consumer has let go of the memory (never true before ``__dlpack__``)."""
        managed, struct = self._managed, self._struct
        if managed is None or struct is None:
            return struct is not None  # not exported yet, or released and freed
        if self._consumer_done or (isinstance(managed, _DLManagedTensorVersioned)
                                   and managed.version.major != _VERSION[0]):
            self._managed = None
            del _live[struct]
            _free(struct)
            return True
        return False
