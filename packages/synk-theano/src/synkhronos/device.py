"""Where a rank keeps shared-variable values and how it compiles: the CPU template.

A :class:`Device` answers the few questions that differ between CPU mode and GPU mode:
how to compile (``mode``), how to read a shared variable's value to host memory, how to set it
from host memory, and how to turn an input array into what the compiled function takes.  CPU
mode keeps values as numpy arrays in the variables' own containers.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

__all__ = ["Device", "CpuDevice"]


class Device:
    """Template; see :class:`CpuDevice`."""

    kind = "abstract"
    use_gpu = False
    xp: Any = np
    """The array module of values computed in this rank (numpy; jax.numpy on GPUs)."""
    nccl_capable = False
    """Whether values may move between ranks through NCCL (GPU mode with values on a GPU)."""

    def compile_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments for ``pytensor.function`` in this mode."""
        raise NotImplementedError

    def get(self, var: SharedVariable) -> np.ndarray:
        """The variable's value in this rank, as a numpy array (no copy where possible)."""
        raise NotImplementedError

    def set(self, var: SharedVariable, value: Any) -> None:
        """Set the variable's value in this rank from host memory (copies ``value``; GPU mode
        also takes a value already on its GPU)."""
        raise NotImplementedError

    def take(self, var: SharedVariable, rows: Any) -> Any:
        """``value[rows]`` of a sliceable shared variable, as the compiled function's input."""
        raise NotImplementedError

    def length(self, var: SharedVariable) -> int:
        raise NotImplementedError

    def raw(self, var: SharedVariable) -> Any:
        """The value as it is stored in this rank (what the device collectives move)."""
        raise NotImplementedError

    def adopt(self, var: SharedVariable) -> None:
        """Take charge of a shared variable when it is first distributed (GPU: move it there)."""

    def put_update(self, var: SharedVariable, value: Any) -> None:
        """Store a value computed by a compiled function (already in this device's memory)."""
        raise NotImplementedError

    def wait(self, values: Sequence[Any]) -> None:
        """Return when ``values`` (computed by compiled functions) are ready: JAX arrays (any
        ``mode="JAX"`` function; JAX dispatches asynchronously) are waited for, numpy ones are."""
        jax = sys.modules.get("jax")
        if jax is None:
            return
        pending = [v for v in values if isinstance(v, jax.Array)]
        if pending:
            jax.block_until_ready(pending)


class CpuDevice(Device):
    """CPU mode: numpy values in the shared variables' containers, PyTensor's configured mode."""

    kind = "cpu"

    def compile_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return dict(kwargs)

    def get(self, var: SharedVariable) -> np.ndarray:
        return np.asarray(var.get_value(borrow=True))

    def set(self, var: SharedVariable, value: Any) -> None:
        var.set_value(np.array(value, dtype=var.type.dtype, copy=True), borrow=True)

    def take(self, var: SharedVariable, rows: Any) -> Any:
        return var.get_value(borrow=True)[rows]

    def raw(self, var: SharedVariable) -> Any:
        return self.get(var)

    def length(self, var: SharedVariable) -> int:
        return len(var.get_value(borrow=True))

    def put_update(self, var: SharedVariable, value: Any) -> None:
        if not hasattr(var.type, "dtype"):  # a random generator: stored as it is
            var.set_value(value, borrow=True)
            return
        var.set_value(np.asarray(value, dtype=var.type.dtype), borrow=True)
