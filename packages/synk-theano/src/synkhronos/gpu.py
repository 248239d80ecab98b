"""GPU mode: PyTensor's JAX backend on one GPU per rank, shared values resident on the GPU.

Every rank sees one GPU (``CUDA_VISIBLE_DEVICES`` set at launch; rank ``r`` gets the ``r``-th
entry of the devices the master could see) and no XLA preallocation.  A shared variable lives on
its rank's GPU as a ``jax.Array`` in its container (``set_value`` would copy it to the host);
the compiled JAX functions read and update it there.  GPU mode runs on the JAX engine
(:mod:`synkhronos.engine`, whose workers keep their values in :class:`GpuDevice`'s way); this
module is also the per-rank engine's GPU device (``fork(engine="ranks")``), whose ranks move
values between them, and outputs to the master, through host shared memory.

In the master, ``get_value()`` of a distributed shared variable returns numpy and
``set_value(v)`` puts ``v`` on the master's GPU (the variables' own methods are replaced for
that).  ``fork`` makes ``"JAX"`` the master's default PyTensor mode, so that plain PyTensor
functions built in the master read those GPU-resident values too (a function compiled earlier
with a CPU mode cannot: rebuild it after ``fork``).

Developer aid: ``SYNK_EMULATE_GPUS=<n>`` runs GPU mode without GPUs (:mod:`synkhronos.emulation`):
the machine counts as having ``n`` GPUs (``CUDA_VISIBLE_DEVICES`` narrows them as usual) and each
rank's JAX runs on its CPU backend: GPU mode's engine (:mod:`synkhronos.engine`) runs on JAX's CPU
devices, its collectives over gloo.  With it the synkhronos test suite runs in GPU mode on any
machine::

    SYNK_EMULATE_GPUS=2 SYNK_TEST_GPU=1 PYTENSOR_FLAGS=floatX=float64 python -m pytest packages/synk-theano/tests
"""

from __future__ import annotations

import os
import sys
import types
from typing import TYPE_CHECKING, Any

import numpy as np

from synk_comm import devices
from synkhronos import emulation
from synkhronos.device import Device

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

__all__ = ["GpuDevice", "prepare_master", "visible_devices"]


def visible_devices() -> list[str]:
    """The GPUs this run may use, as CUDA_VISIBLE_DEVICES entries (as they were before the first
    group -- a fork, or a ``synk_comm`` group -- narrowed the master's own variable to its GPU)."""
    visible = devices.visible_before_pin()
    if visible is not None:
        return [v.strip() for v in visible.split(",") if v.strip() and v.strip() != "-1"]
    count = emulation.emulated_gpus()  # SYNK_EMULATE_GPUS: a developer aid (see above)
    if not count:
        try:
            count = len(os.listdir("/proc/driver/nvidia/gpus"))
        except OSError:
            count = 0
    return [str(i) for i in range(count)]


def _jax_backend_initialised() -> bool:
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    try:
        from jax._src import xla_bridge

        return bool(getattr(xla_bridge, "_backends", None))
    except Exception:
        return True


def prepare_master(n_parallel: int, master_rank: int) -> list[str]:
    """Pin the master to its GPU before JAX starts; returns the device entry of every rank."""
    gpus = visible_devices()[:n_parallel]
    own = devices.pinned_device() or os.environ.get("CUDA_VISIBLE_DEVICES")  # what this process's JAX sees
    sees_one_gpu = own is not None and len([d for d in own.split(",") if d.strip()]) == 1
    if _jax_backend_initialised() and not sees_one_gpu and len(gpus) > 1:
        raise RuntimeError(
            "JAX's GPU backend is already initialised in this process with every GPU visible: it would "
            "preallocate memory on all of them and leave none to the workers. Call synk.fork() before "
            "anything runs JAX (creating arrays, compiling a mode='JAX' function), or set "
            "CUDA_VISIBLE_DEVICES to the GPUs Synkhronos may use before starting Python.")
    if devices.pinned() and own != gpus[master_rank] and "jax" in sys.modules:
        raise RuntimeError(f"this process already runs JAX on GPU {own}; fork again with the same master_rank")
    devices.pin(gpus[master_rank])
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import pytensor

    pytensor.config.mode = "JAX"  # plain functions in the master read the GPU-resident shared values
    return gpus


class GpuDevice(Device):
    """GPU mode: ``mode="JAX"``, values as ``jax.Array`` on this rank's (only visible) GPU."""

    kind = "gpu"
    use_gpu = True
    computes_in_jax = True

    def __init__(self) -> None:
        import jax
        import pytensor

        emulation.select_platform(jax)
        if pytensor.config.floatX == "float64":
            jax.config.update("jax_enable_x64", True)
        self.jax = jax
        self.xp = jax.numpy
        self.device = jax.devices()[0]

    def compile_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        mode = kwargs.get("mode")
        if mode is not None and str(mode).upper() != "JAX" and getattr(mode, "linker", None).__class__.__name__ \
                != "JAXLinker":
            raise ValueError(f"GPU mode compiles every synkhronos function with mode='JAX'; got mode={mode!r}")
        return {**kwargs, "mode": "JAX"}

    def adopt(self, var: SharedVariable) -> None:
        """Move the value to the GPU and make the master's get/set_value speak numpy."""
        self.set(var, np.asarray(var.container.storage[0]))
        device = self

        def get_value(self_: Any, borrow: bool = False, return_internal_type: bool = False) -> Any:
            value = self_.container.storage[0]
            return value if return_internal_type else np.asarray(value)

        def set_value(self_: Any, value: Any, borrow: bool = False) -> None:
            device.set(self_, np.asarray(value))

        var.get_value = types.MethodType(get_value, var)  # type: ignore[method-assign]
        var.set_value = types.MethodType(set_value, var)  # type: ignore[method-assign]

    def get(self, var: SharedVariable) -> np.ndarray:
        return np.asarray(var.container.storage[0])

    def raw(self, var: SharedVariable) -> Any:
        """The value as it sits on the GPU (a jax.Array)."""
        value = var.container.storage[0]
        if not isinstance(value, self.jax.Array):
            value = self.jax.device_put(np.asarray(value), self.device)
            var.container.storage[0] = value
        return value

    def set(self, var: SharedVariable, value: Any) -> None:
        dtype = var.type.dtype
        if isinstance(value, self.jax.Array):
            var.container.storage[0] = value.astype(dtype) if value.dtype != dtype else value
        else:
            var.container.storage[0] = self.jax.device_put(np.asarray(value, dtype=dtype), self.device)

    def take(self, var: SharedVariable, rows: Any) -> Any:
        """Rows selected by JAX's own indexing (one dispatch each: calls select slices of step 1
        and index arrays inside the compiled function instead, see :meth:`Replica.selected
        <synkhronos.replica.Replica.selected>`)."""
        value = self.raw(var)
        if isinstance(rows, slice):
            return value[rows]
        return value[self.jax.numpy.asarray(rows)]

    def length(self, var: SharedVariable) -> int:
        return int(self.raw(var).shape[0])

    def put_update(self, var: SharedVariable, value: Any) -> None:
        if not hasattr(var.type, "dtype"):  # a random generator: stored as it is
            var.container.storage[0] = value
            return
        self.set(var, value)
