"""NCCL on JAX arrays without host waits: the stream, the inputs and the results.

JAX queues its programs on a compute stream that nobody outside can name; what it offers is a
stream for outside work (``device.get_stream_for_external_ready_events()``) and the DLPack
protocol, which orders the two both ways:

* **Inputs.**  ``x.__dlpack__(stream=s)`` makes ``s`` wait, on the GPU, until JAX has written
  ``x``.  NCCL queued on ``s`` then starts when the input is ready; the host does not wait.  The
  capsule keeps ``x``'s memory from being reused by JAX, so it is held until ``s`` has passed
  the NCCL call (an event per call, checked on later calls).
* **Results.**  JAX cannot be told to wait for a stream of ours, and an array it allocated itself
  comes back as its own buffer, whose readers do not wait (measured on 2x H200: stale reads).
  So results live in memory that synk_comm allocates (:class:`Results`) and are handed to JAX
  through DLPack (:class:`~synk_comm.dlpack.Exported`): ``jax.dlpack.from_dlpack`` names the
  stream on which it records the new array's ready event, our export makes that stream wait for
  ``s`` (after NCCL), and every JAX reader waits for the event on the GPU.

When JAX lets go of a result (the DLPack deleter, in any thread: :attr:`Exported.released
<synk_comm.dlpack.Exported.released>`), its memory is *retired*, not free: JAX readers queued
before may still be running on the compute stream.  When memory of that size is wanted and none is
free, ``s`` waits for a tiny JAX program queued after those readers (JAX runs its programs in
order), and only then does retired memory take a new result.  Which results take this path is
:data:`synk_comm.nccl.ASYNC_MIN_BYTES`'s business.
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Any

import numpy as np

from synk_comm.dlpack import DEVICE_CUDA, Exported, capsule_address

__all__ = ["CudaPointer", "JaxStream", "Results", "size_in_bytes"]

log = logging.getLogger(__name__)


def size_in_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """The size in bytes of a compact array of ``shape`` x ``dtype``."""
    return math.prod(shape) * np.dtype(dtype).itemsize


class CudaPointer:
    """A CUDA Array Interface v3 view of ``shape`` x ``dtype`` at ``address``, for NCCL work on a
    stream that is ordered with the memory's other users by other means."""

    def __init__(self, address: int, shape: tuple[int, ...], dtype: Any) -> None:
        self.__cuda_array_interface__ = {"data": (int(address), False), "shape": tuple(shape),
                                         "typestr": np.dtype(dtype).str, "version": 3, "stream": None,
                                         "strides": None}


class Results:
    """Device memory for results handed to JAX, reused once JAX is done with it.

    Memory comes from CUDA's stream-ordered pool and is kept by size in bytes: a training step
    all-reduces the same gradients every time, so a few buffers serve every step.  At most
    ``keep`` free buffers of each size are kept; the rest go back to the pool in the stream's
    order.  Memory that JAX still holds when the process exits is left to the exit.
    """

    keep = 4

    def __init__(self, stream: JaxStream) -> None:
        self._stream = stream
        self._free: dict[int, list[int]] = {}  # size in bytes -> addresses
        self._lent: list[tuple[Exported, int, int]] = []  # results JAX may hold: (export, address, size)
        self._retired: list[tuple[int, int]] = []  # let go of by JAX, not yet ordered after its readers
        self.allocations = 0  # how many times memory came from CUDA (for tests and benchmarks)

    def take(self, nbytes: int) -> int:
        """The address of ``nbytes`` that the stream may write from now on."""
        bucket = self._free.get(nbytes)
        if not bucket:  # order the stream after JAX's readers only when the memory is wanted
            self._collect()
            if self._retired:
                self._recycle()
            bucket = self._free.get(nbytes)
        if bucket:
            return bucket.pop()
        self.allocations += 1
        return _cuda_call("cuMemAllocAsync", max(1, nbytes), self._stream.handle)

    def lend(self, exported: Exported, address: int, nbytes: int) -> None:
        """JAX holds the memory at ``address`` through ``exported`` until it says it let go."""
        self._lent.append((exported, address, nbytes))

    def _collect(self) -> None:
        """Move what JAX has let go of (its DLPack deleter ran, in any thread) to the retired."""
        still = []
        for entry in self._lent:
            if entry[0].released:
                self._retired.append(entry[1:])
            else:
                still.append(entry)
        self._lent = still

    def _recycle(self) -> None:
        """Order the stream after every JAX program queued so far, then free the retired memory."""
        self._stream.after_jax()
        retired, self._retired = self._retired, []
        for address, nbytes in retired:
            bucket = self._free.setdefault(nbytes, [])
            if len(bucket) < self.keep:
                bucket.append(address)
            else:
                _cuda_call("cuMemFreeAsync", address, self._stream.handle)

    def close(self) -> None:
        """Give every free and retired buffer back to CUDA (results JAX still holds stay valid)."""
        self._collect()
        self._stream.after_jax()
        addresses = [a for bucket in self._free.values() for a in bucket] + [a for a, _ in self._retired]
        self._free.clear()
        self._retired.clear()
        for address in addresses:
            _cuda_call("cuMemFreeAsync", address, self._stream.handle)


def _cuda_call(name: str, *args: Any) -> Any:
    """Call a CUDA driver function of cuda.bindings; its value, or RuntimeError naming the error."""
    from cuda.bindings import driver

    err, *value = getattr(driver, name)(*args)
    if err != driver.CUresult.CUDA_SUCCESS:
        hint = " (out of GPU memory: free device arrays, or use smaller ones)" if "Alloc" in name else ""
        raise RuntimeError(f"synk_comm: {name}{args} failed: {err.name}{hint}")
    return int(value[0]) if value else None


class JaxStream:
    """The stream on which a JAX GPU takes in outside work, and NCCL's use of it.

    Parameters
    ----------
    device : jax.Device
        A GPU (``JaxStream.open`` returns None for devices without such a stream).
    """

    def __init__(self, device: Any) -> None:
        from cuda.core import Stream

        self.handle = int(device.get_stream_for_external_ready_events())
        self.stream = Stream.from_handle(self.handle)
        self.device_id = int(device.local_hardware_id)
        self.results = Results(self)
        self.depth = 2
        self._held: collections.deque[tuple[Any, tuple[Any, ...]]] = collections.deque()
        self._tick: Any = None

    @staticmethod
    def open(array: Any) -> JaxStream | None:
        """The stream of ``array``'s device, or None where JAX offers none (CPU backend)."""
        try:
            (device,) = array.devices()
            return JaxStream(device) if device.platform == "gpu" else None
        except Exception as exc:  # UNIMPLEMENTED, or a jax without the method
            log.info("synk_comm: JAX offers no stream for outside work (%s); JAX arrays take the synchronous path",
                     exc)
            return None

    def export(self, array: Any) -> tuple[CudaPointer, Any]:
        """NCCL's view of JAX ``array``, ready on the stream once JAX has written it, and the
        capsule that keeps its memory from JAX until the work queued on the stream is done."""
        capsule = array.__dlpack__(stream=self.handle)
        return CudaPointer(capsule_address(capsule), tuple(array.shape), array.dtype), capsule

    def hold(self, *objects: Any) -> None:
        """Keep ``objects`` (capsules, arrays) alive until the stream has passed this point.  At
        most ``depth`` points are pending: beyond that the host waits for the oldest, so that a
        host far ahead of the GPU does not pile up inputs and results in memory."""
        while self._held and (self._held[0][0].is_done or len(self._held) >= self.depth):
            event, _ = self._held.popleft()
            event.sync()
        self._held.append((self.stream.record(), objects))

    def result(self, shape: tuple[int, ...], dtype: Any) -> tuple[CudaPointer, int]:
        """Memory for a result that the stream writes next: NCCL's view of it, and its address."""
        address = self.results.take(size_in_bytes(shape, dtype))
        return CudaPointer(address, shape, dtype), address

    def to_jax(self, address: int, shape: tuple[int, ...], dtype: Any) -> Any:
        """The JAX array of the memory at ``address`` after the work queued so far on the
        stream: JAX's readers wait for it on the GPU."""
        import jax

        exported = Exported(address, shape, dtype, (DEVICE_CUDA, self.device_id), ready=self._ready_for)
        array = jax.dlpack.from_dlpack(exported)
        self.results.lend(exported, address, size_in_bytes(shape, dtype))
        return array

    def _ready_for(self, consumer: int | None) -> None:
        """DLPack's ``stream`` argument: the consumer's stream waits for ours unless it is ours
        (-1: the consumer asks for no ordering; None, 1, 2: a default stream -- the host waits)."""
        if consumer == -1 or consumer == self.handle:
            return
        if consumer in (None, 1, 2):
            self.stream.sync()
            return
        from cuda.core import Stream

        Stream.from_handle(consumer).wait(self.stream)

    def after_jax(self) -> None:
        """Make the stream wait for every JAX program queued so far on this device."""
        if self._tick is None:
            import jax
            import jax.numpy as jnp

            self._tick = jax.jit(lambda: jnp.zeros((), jnp.uint8))
        token = self._tick()
        token.__dlpack__(stream=self.handle)  # the stream waits for the token's program

    def sync(self) -> None:
        """Wait until the work queued on the stream is done."""
        self.stream.sync()
        self._held.clear()

    def close(self) -> None:
        """Wait for the stream and give the free result memory back to CUDA."""
        self.sync()
        self.results.close()
