"""Collectives on CUDA arrays through NCCL (nccl4py), one GPU per rank.

Works on any array that exposes the CUDA Array Interface (CuPy, PyTorch) and on JAX arrays.
JAX publishes the interface as version 2 and its DLPack export fails under nccl4py, so every
buffer goes to NCCL through a view whose ``__cuda_array_interface__`` says ``version=3``
(:class:`CudaBuffer`).  PyTorch tensors and CuPy arrays have streams of their own: NCCL runs on
the framework's current stream and the call returns as soon as it is queued, as
torch.distributed's collectives do; the framework's later work on that stream (and any read to
the host) waits for it.

JAX arrays: the collective waits for the input on the host (JAX cannot be told to wait for a
stream of ours), runs NCCL on this backend's own stream and waits for it before returning, so
JAX's later readers see the result.  That host wait is the price of moving JAX arrays outside
JAX: processes that compute in JAX are better joined by JAX's own runtime, whose collectives run
inside the compiled program (Synkhronos' GPU engine, :mod:`synkhronos.engine`, does so).
``all_reduce(x, out=y)`` writes into ``y``'s memory instead of a new array.

The communicator is built on first use: the master rank makes the unique id and the group's
shared-memory broadcast carries it to the others.  Shapes that differ between ranks (gather,
all_gather) are exchanged first through shared memory, so nothing is ever silently padded or cut.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from synk_comm.collectives import Collectives
from synk_comm.ops import ReduceOp, as_op

if TYPE_CHECKING:
    from synk_comm.group import Group

__all__ = ["CudaBuffer", "NcclCollectives", "empty", "empty_like", "to_host"]

log = logging.getLogger(__name__)


class CudaBuffer:
    """A CUDA Array Interface v3 view of ``array`` (waits for JAX to finish writing it)."""

    def __init__(self, array: Any) -> None:
        if hasattr(array, "block_until_ready"):
            array.block_until_ready()
        cai = dict(array.__cuda_array_interface__)
        cai["version"] = 3
        cai["stream"] = None
        cai.setdefault("strides", None)
        self.__cuda_array_interface__ = cai


def _framework(array: Any) -> str:
    module = type(array).__module__.split(".")[0]
    if module in ("jax", "jaxlib"):
        return "jax"
    if module == "cupy":
        return "cupy"
    if module == "torch":
        return "torch"
    raise TypeError(f"NCCL collectives take JAX, CuPy or PyTorch CUDA arrays, got {type(array).__name__}")


def empty(kind: str, shape: Sequence[int], dtype: Any, like: Any = None) -> Any:
    """A new uninitialised device array of framework ``kind`` ("jax", "cupy", "torch")."""
    shape = tuple(int(s) for s in shape)
    if kind == "jax":
        import jax.numpy as jnp

        return jnp.empty(shape, dtype=dtype)
    if kind == "cupy":
        import cupy

        return cupy.empty(shape, dtype=dtype)
    import torch

    if not isinstance(dtype, torch.dtype):
        dtype = getattr(torch, np.dtype(dtype).name)
    return torch.empty(shape, dtype=dtype, device=like.device if like is not None else "cuda")


def empty_like(array: Any, shape: Sequence[int] | None = None) -> Any:
    """A new uninitialised device array of ``array``'s framework and dtype (and ``shape``)."""
    return empty(_framework(array), array.shape if shape is None else shape, array.dtype, like=array)


def _dtype_name(array: Any) -> str:
    return str(array.dtype).replace("torch.", "")


def to_host(array: Any) -> np.ndarray:
    """Copy a device array to a numpy array."""
    kind = _framework(array)
    if kind == "cupy":
        return array.get()
    if kind == "torch":
        return array.detach().cpu().numpy()
    return np.asarray(array)


class NcclCollectives(Collectives):
    """The NCCL backend of a :class:`~synk_comm.group.Group` (see :mod:`synk_comm.collectives`)."""

    def __init__(self, group: Group) -> None:
        import nccl.core as nc
        from cuda.core import Device

        self.group = group
        self.rank = group.rank
        self.size = group.size
        self._nc = nc
        uid = nc.get_unique_id() if group.is_master else None
        uid_bytes = group.broadcast_object(bytes(uid) if uid is not None else None)
        if uid is None:
            uid = nc.UniqueId.from_bytes(uid_bytes)
        self._device = Device(0)
        self._device.set_current()
        self._stream = self._device.create_stream()
        self.comm = nc.Communicator.init(self.size, self.rank, uid)
        self._ops = {ReduceOp.SUM: nc.SUM, ReduceOp.PROD: nc.PROD, ReduceOp.MAX: nc.MAX, ReduceOp.MIN: nc.MIN,
                     ReduceOp.AVG: nc.AVG}
        log.info("synk_comm: NCCL communicator ready in rank %d of %d", self.rank, self.size)

    def close(self) -> None:
        """Forget the communicator; the process's exit releases it (ncclCommDestroy can wait on
        peers that are already gone)."""
        self.comm = None

    def _sync(self) -> None:
        self._stream.sync()

    def synchronize(self) -> None:
        """Wait until every collective queued so far has finished (JAX, PyTorch and CuPy arrays
        alike), e.g. before timing or before reading a result through a pointer of your own."""
        self._sync()
        import sys

        if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
            sys.modules["torch"].cuda.synchronize()
        if "cupy" in sys.modules:
            sys.modules["cupy"].cuda.get_current_stream().synchronize()

    def _stream_for(self, kind: str) -> tuple[Any, bool]:
        """Where NCCL runs for arrays of framework ``kind``, and whether that framework orders its
        later work after it: the current stream of torch or CuPy (ordered), else this backend's own."""
        if kind == "torch":
            import torch

            return torch.cuda.current_stream().cuda_stream, True
        if kind == "cupy":
            import cupy

            return cupy.cuda.get_current_stream().ptr, True
        return self._stream, False

    def _done(self, ordered: bool) -> None:
        """Wait for the queued NCCL work unless the array's framework orders what follows."""
        if not ordered:
            self._sync()

    def _shapes(self, array: Any, what: str) -> list[tuple[int, ...]]:
        """Every rank's shape, in rank order; ValueError (in every rank) if the dtypes differ:
        NCCL would move a different number of bytes in each rank, and hang or mix them up."""
        dtype = _dtype_name(array)
        mine = np.array([zlib.crc32(dtype.encode()), len(array.shape), *array.shape], dtype=np.int64)
        seen = [tuple(int(v) for v in s) for s in self.group.host.all_gather(mine)]
        if len({s[0] for s in seen}) > 1:
            raise ValueError(f"{what}: every rank must give the same dtype; they differ (rank {self.rank}: {dtype})")
        return [s[2:] for s in seen]

    def broadcast(self, array: Any, *, root: int = 0) -> Any:
        meta = (_framework(array), tuple(array.shape), _dtype_name(array)) if self.rank == root else None
        received: Any = self.group.broadcast_object(meta, root=root)
        kind, shape, dtype = received
        stream, ordered = self._stream_for(kind)  # the root's framework: every rank allocates its kind
        out = empty(kind, shape, dtype, like=array)
        source = array if self.rank == root else out
        self.comm.broadcast(CudaBuffer(source), CudaBuffer(out), root, stream=stream)
        self._done(ordered)
        return out

    def reduce(self, array: Any, op: ReduceOp | str = "sum", *, root: int = 0) -> Any:
        stream, ordered = self._stream_for(_framework(array))
        rop = as_op(op, array.dtype)
        self._agree(array, "reduce")
        out = empty_like(array)
        self.comm.reduce(CudaBuffer(array), CudaBuffer(out), self._ops[rop], root, stream=stream)
        self._done(ordered)
        return out if self.rank == root else None

    def all_reduce(self, array: Any, op: ReduceOp | str = "sum", *, out: Any = None) -> Any:
        rop = as_op(op, array.dtype)
        self._agree(array, "all_reduce")  # NCCL given different counts would hang or mix up data
        stream, ordered = self._stream_for(_framework(array))
        if out is None:
            out = empty_like(array)
        self.comm.allreduce(CudaBuffer(array), CudaBuffer(out), self._ops[rop], stream=stream)
        self._done(ordered)
        return out

    def _agree(self, array: Any, what: str) -> None:
        """Every rank gives the same shape and dtype (else NCCL would hang or mix up bytes)."""
        shapes = self._shapes(array, what)
        if len(set(shapes)) > 1:
            raise ValueError(f"{what}: every rank must give the same shape; got {shapes} in rank order")

    def all_gather(self, array: Any) -> list[Any]:
        stream, ordered = self._stream_for(_framework(array))
        shapes = self._shapes(array, "all_gather")
        if len(set(shapes)) == 1:
            n = int(np.prod(shapes[0]))
            flat = empty_like(array, (self.size * n,))
            self.comm.allgather(CudaBuffer(array), CudaBuffer(flat), stream=stream)
            self._done(ordered)
            return [flat[r * n:(r + 1) * n].reshape(shapes[0]) for r in range(self.size)]
        # Unequal shapes: one exact-size broadcast per rank (never padded or cut).
        parts = []
        for r, shape in enumerate(shapes):
            buf = array if r == self.rank else empty_like(array, shape)
            out = empty_like(array, shape)
            self.comm.broadcast(CudaBuffer(buf), CudaBuffer(out), r, stream=stream)
            parts.append(out)
        self._done(ordered)
        return parts

    def gather(self, array: Any, *, root: int = 0) -> list[Any] | None:
        parts = self.all_gather(array)
        return parts if self.rank == root else None

    def scatter(self, arrays: Sequence[Any] | None, *, root: int = 0) -> Any:
        if self.rank == root and (arrays is None or len(arrays) != self.size):
            raise ValueError(f"scatter: the root must give {self.size} arrays, one per rank")
        mine = None
        for r in range(self.size):  # one exact-size broadcast per rank: shapes may differ
            got = self.broadcast(arrays[r] if self.rank == root and arrays is not None else None, root=root)
            if r == self.rank:
                mine = got
        return mine

    def reduce_scatter(self, array: Any, op: ReduceOp | str = "sum") -> Any:
        stream, ordered = self._stream_for(_framework(array))
        rop = as_op(op, array.dtype)
        self._agree(array, "reduce_scatter")
        if array.shape[0] % self.size:
            raise ValueError(f"NCCL reduce_scatter needs axis 0 ({array.shape[0]}) divisible by {self.size}")
        rows = array.shape[0] // self.size
        out = empty_like(array, (rows, *array.shape[1:]))
        self.comm.reduce_scatter(CudaBuffer(array), CudaBuffer(out), self._ops[rop], stream=stream)
        self._done(ordered)
        return out
