"""``RowWindow``: rows ``start:start + count`` of a value, ``start`` given at call time.

In GPU mode a call with ``batch_s`` selects rows of the sliceable shared variables, which live on
the GPU.  Selected by the rank before the call, each selection is one more dispatch of a JAX
computation (measured at about 0.4 ms of the host's time per call on the H200 machine, in the
critical path of every training step).  Compiled into the function itself, it needs no dispatch
of its own: the function takes the whole value and the start, and XLA reads the window from it.

PyTensor cannot express such a window with its own ops under JAX (``x[a:a + n]`` with a symbolic
``a`` has a symbolic length, which JAX's tracing refuses), so this module defines a small Op whose
length is a constant of the Op: ``RowWindow(count)(x, start)``.  Its JAX form is
``jax.lax.dynamic_slice_in_dim``; its Python form (other backends) is numpy slicing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

try:
    from pytensor.link.jax.dispatch import jax_funcify as _jax_funcify
except ImportError:  # no JAX installed: CPU mode only, where ``perform`` serves
    _jax_funcify = None  # type: ignore[assignment]

__all__ = ["RowWindow"]


class RowWindow(Op):
    """``x[start:start + count]`` along axis 0, ``count`` fixed, ``start`` an int32 scalar input.

    Parameters
    ----------
    count : int
        Rows in the window; ``0 <= start`` and ``start + count <= len(x)`` are the caller's to keep
        (the rank checks its selection before any call).
    """

    __props__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = int(count)

    def make_node(self, *inputs: Any) -> Apply:
        """``inputs`` are ``(x, start)``."""
        import pytensor.tensor as pt

        x = pt.as_tensor_variable(inputs[0])
        start = pt.as_tensor_variable(inputs[1])
        if x.ndim < 1:
            raise TypeError(f"RowWindow needs a value of 1 or more dimensions, got {x.type}")
        out = x.type.clone(shape=(self.count, *x.type.shape[1:]))()
        return Apply(self, [x, start], [out])

    def perform(self, node: Apply, inputs: Sequence[Any], output_storage: list[list[Any]]) -> None:
        """The window as a new numpy array (backends other than JAX)."""
        x, start = inputs
        output_storage[0][0] = np.array(x[int(start):int(start) + self.count])

    def infer_shape(self, *args: Any) -> list[tuple[Any, ...]]:
        """``(count, *x.shape[1:])``.  PyTensor before 3.3 passes ``(fgraph, node, input_shapes)``,
        3.3 on ``(node, input_shapes)`` (and warns about the old form)."""
        input_shapes = args[-1]
        return [(self.count, *input_shapes[0][1:])]


def _jax_row_window(op: RowWindow, **_kwargs: Any) -> Any:
    import jax

    count = op.count

    def row_window(x: Any, start: Any) -> Any:
        return jax.lax.dynamic_slice_in_dim(x, start, count, axis=0)

    return row_window


if _jax_funcify is not None:
    _jax_funcify.register(RowWindow)(_jax_row_window)
