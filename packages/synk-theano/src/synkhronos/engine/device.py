"""Where the engine keeps values: :class:`EngineDevice` in each worker, :class:`HostDevice` in the master.

A worker keeps each shared variable's value on its one device, as a ``jax.Array`` in the
variable's container (as GPU mode does, :class:`~synkhronos.gpu.GpuDevice`), and for the
program also as a *global* array over the mesh: the rank's own value seen as the replicated
operand of the program (``P()``).  Inside ``shard_map`` each rank reads its own buffer, so values
that differ between ranks (updates apply locally) stay each rank's own.  The global form is
cached and made again only when the container holds another value (``make_array`` costs about
10 us per variable, a call would pay it for every parameter).

The master holds no value of a distributed shared variable: compute rank 0's stands for it, which
its ``get_value()`` reads and its ``set_value(v)`` sets (:mod:`synkhronos.engine.master`).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from synkhronos.device import CpuDevice
from synkhronos.engine import master
from synkhronos.gpu import GpuDevice

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

__all__ = ["EngineDevice", "HostDevice"]


class EngineDevice(GpuDevice):
    """A worker of the engine: values as ``jax.Array`` on this rank's device (GPU or JAX CPU)."""

    kind = "engine"

    def __init__(self, device: Any) -> None:
        import jax

        self.jax = jax
        self.xp = jax.numpy
        self.device = device
        self._global: dict[Any, tuple[Any, Any]] = {}  # var -> (local value, its global form)

    def global_value(self, var: SharedVariable, sharding: Any) -> Any:
        """The variable's value as the program's replicated operand (cached)."""
        local = self.raw(var)
        cached = self._global.get(var)
        if cached is not None and cached[0] is local:
            return cached[1]
        glob = self.jax.make_array_from_single_device_arrays(local.shape, sharding, [local])
        self._global[var] = (local, glob)
        return glob

    def store(self, var: SharedVariable, glob: Any) -> Any:
        """Keep an updated value that the program returned (its global form); returns the local value."""
        local = glob.addressable_data(0)
        var.container.storage[0] = local
        self._global[var] = (local, glob)
        return local


class HostDevice(CpuDevice):
    """The master of the engine: it compiles for checks only and holds no value of its own."""

    kind = "engine-master"

    def __init__(self, use_gpu: bool = False) -> None:
        super().__init__()
        self.use_gpu = use_gpu  # the run's mode (its workers' devices), for the user's checks

    def compile_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The master never runs a function: the cheapest compilation that keeps the graph (Python
        linker, the fast_compile rewrites), whatever mode the function asks for (the workers honour it)."""
        from pytensor.compile.mode import Mode

        if self.use_gpu:  # the workers compile in JAX mode: refuse another mode here, before any worker acts
            GpuDevice.compile_kwargs(cast(GpuDevice, self), kwargs)
        return {**kwargs, "mode": Mode(linker="py", optimizer="fast_compile")}

    def adopt(self, var: SharedVariable) -> None:
        """Make ``var.get_value()`` read compute rank 0's value and ``set_value`` set it."""
        def get_value(self_: Any, borrow: bool = False, return_internal_type: bool = False) -> Any:
            return master.read_value(self_)

        def set_value(self_: Any, value: Any, borrow: bool = False) -> None:
            master.write_value(self_, np.asarray(value, dtype=self_.type.dtype))

        var.get_value = types.MethodType(get_value, var)  # type: ignore[method-assign]
        var.set_value = types.MethodType(set_value, var)  # type: ignore[method-assign]
