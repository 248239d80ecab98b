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
  through DLPack (:class:`~synk_comm.dlpack.Exported`): ``jax.dlpack.from_dlpack`` records the
  new array's ready event on ``s`` after NCCL, and every JAX reader waits for that event.

When JAX lets go of a result, its memory is *retired*, not free: JAX readers queued before may
still be running on the compute stream.  Before retired memory is used again, ``s`` waits for a
tiny JAX program queued after them (JAX runs its programs in order), and only then does the
memory take a new result.
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Any

import numpy as np

from synk_comm.dlpack import DEVICE_CUDA, Exported, capsule_address

__all__ = ["CudaPointer", "JaxStream", "Results"]

log = logging.getLogger(__name__)


class CudaPointer:
    """A CUDA Array Interface v3 view of ``shape`` x ``dtype`` at ``address``, for NCCL work on a
    stream that is ordered with the memory's other users by other means."""

    def __init__(self, address: int, shape: tuple[int, ...], dtype: Any) -> None:
        self.__cuda_array_interface__ = {"data": (int(address), False), "shape": tuple(shape),
                                         "typestr": np.dtype(dtype).str, "version": 3, "stream": None,
                                         "strides": None}


class Results:
    """Device memory for results handed to JAX, reused once JAX is done with it.

    Memory is kept by size in bytes: a training step all-reduces the same gradients every time,
    so a few buffers serve every step.  At most ``keep`` free buffers of each size are kept; the
    rest go back to CUDA's memory pool, in the stream's order.
    """

    keep = 2

    def __init__(self, stream: JaxStream) -> None:
        self._stream = stream
        self._free: dict[int, list[Any]] = {}
        self._retired: collections.deque[Any] = collections.deque()  # appended by JAX's deleters

    def take(self, nbytes: int) -> Any:
        """A buffer of ``nbytes`` that ``stream`` may write from now on."""
        if self._retired:
            self._recycle()
        bucket = self._free.get(nbytes)
        if bucket:
            return bucket.pop()
        return self._stream.cuda_device.allocate(max(1, nbytes), stream=self._stream.stream)

    def retire(self, buffer: Any) -> None:
        """JAX has let go of ``buffer`` (its DLPack deleter: any thread)."""
        self._retired.append(buffer)

    def _recycle(self) -> None:
        """Order the stream after every JAX program queued so far, then free the retired buffers."""
        self._stream.after_jax()
        while self._retired:
            buffer = self._retired.popleft()
            bucket = self._free.setdefault(buffer.size, [])
            if len(bucket) < self.keep:
                bucket.append(buffer)
            else:
                buffer.close(self._stream.stream)

    def close(self) -> None:
        """Give every free and retired buffer back to CUDA (results JAX still holds stay valid)."""
        self._stream.after_jax()
        buffers = [b for bucket in self._free.values() for b in bucket] + list(self._retired)
        self._free.clear()
        self._retired.clear()
        for buffer in buffers:
            buffer.close(self._stream.stream)


class JaxStream:
    """The stream on which a JAX GPU takes in outside work, and NCCL's use of it.

    Parameters
    ----------
    device : jax.Device
        A GPU (``JaxStream.open`` returns None for devices without such a stream).
    """

    def __init__(self, device: Any) -> None:
        from cuda.core import Device, Stream

        self.handle = int(device.get_stream_for_external_ready_events())
        self.stream = Stream.from_handle(self.handle)
        self.device_id = int(device.local_hardware_id)
        self.cuda_device = Device(self.device_id)
        self.results = Results(self)
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
        """Keep ``objects`` (capsules, arrays) alive until the stream has passed this point."""
        self._release_passed()
        self._held.append((self.stream.record(), objects))

    def _release_passed(self) -> None:
        while self._held and self._held[0][0].is_done:
            self._held.popleft()

    def result(self, shape: tuple[int, ...], dtype: Any) -> tuple[CudaPointer, Any]:
        """Memory for a result that the stream writes next, as NCCL's view and the buffer."""
        buffer = self.results.take(math.prod(shape) * np.dtype(dtype).itemsize)
        return CudaPointer(int(buffer.handle), shape, dtype), buffer

    def to_jax(self, buffer: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        """The JAX array of ``buffer`` after the work queued so far on the stream: JAX's readers
        wait for it on the GPU."""
        import jax

        results = self.results
        exported = Exported(int(buffer.handle), shape, dtype, (DEVICE_CUDA, self.device_id),
                            release=lambda: results.retire(buffer), ready=self._ready_for)
        return jax.dlpack.from_dlpack(exported)

    def _ready_for(self, consumer: int | None) -> None:
        """DLPack's ``stream`` argument: the consumer's stream waits for ours unless it is ours."""
        if consumer is None or consumer == self.handle:
            return
        if consumer in (1, 2):  # the legacy and per-thread default streams
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
