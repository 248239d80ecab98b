"""The collectives that the ops' gradients put in the graph: :class:`WeightShare` (a rank's share of
the call's rows, the factor of ``avg``'s gradient), :class:`AllGatherGrad` and :class:`BroadcastGrad`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from pytensor.graph.basic import Apply

from synkhronos.call_context import CallContext
from synkhronos.ops.base import Collective, _contiguous, _rows


class WeightShare(Collective):
    """This rank's share of the call's rows, ``w_s / sum_r w_r``, as a scalar of ``dtype`` (1 with
    one rank): the factor of ``all_reduce(x, "avg")``'s gradient."""

    __props__ = ("dtype",)

    def __init__(self, dtype: str) -> None:
        self.dtype = str(dtype)

    def make_node(self) -> Apply:  # type: ignore[override]
        import pytensor.tensor as pt

        return Apply(self, [], [pt.scalar(dtype=self.dtype)])

    def identity(self, *arrays: np.ndarray) -> np.ndarray:
        return np.asarray(1, dtype=self.dtype)

    def host(self, ctx: CallContext, *arrays: np.ndarray, even: bool = False) -> np.ndarray:
        return np.asarray(ctx.share(), dtype=self.dtype)

    def infer_shape(self, *args: Any) -> list[Any]:
        return [()]

    def in_program(self, axis_name: str, node: Apply, counts: Sequence[int] | None = None) -> Callable[..., Any]:
        import jax
        import jax.numpy as jnp

        dtype = self.dtype
        if counts is not None:
            total = float(sum(counts))
            return lambda: jnp.asarray(_rows(axis_name, counts) / total, dtype=dtype)
        return lambda: jnp.asarray(1.0 / jax.lax.psum(1, axis_name), dtype=dtype)

    def jax_shape(self, shapes: list[tuple[int, ...]], size: int) -> tuple[int, ...]:
        return ()


class _GradOp(Collective):
    """A gradient's collective ``(x, gy) -> gx``: ``x`` gives the shape only."""

    def make_node(self, x: Any, gy: Any) -> Apply:  # type: ignore[override]
        import pytensor.tensor as pt

        x, gy = pt.as_tensor_variable(x), pt.as_tensor_variable(gy)
        return Apply(self, [x, gy], [x.type.clone(dtype=gy.type.dtype)()])

    def infer_shape(self, *args: Any) -> list[Any]:
        return [args[-1][0]]

    def connection_pattern(self, node: Apply) -> list[list[bool]]:
        return [[False], [True]]

    def pullback(self, inputs: Sequence[Any], outputs: Sequence[Any], output_grads: Sequence[Any]) -> list[Any]:
        from pytensor.gradient import DisconnectedType, grad_not_implemented

        return [DisconnectedType()(), grad_not_implemented(self, 1, inputs[1], "second derivatives through "
                                                           "synkhronos.ops are not implemented")]

    def jax_shape(self, shapes: list[tuple[int, ...]], size: int) -> tuple[int, ...]:
        return shapes[0]


class AllGatherGrad(_GradOp):
    """The gradient of :func:`all_gather`: this rank's block of the all-reduce (sum) of ``gy``."""

    __props__ = ("axis",)

    def __init__(self, axis: int) -> None:
        self.axis = int(axis)

    def host(self, ctx: CallContext, *arrays: np.ndarray, even: bool = False) -> np.ndarray:
        x, gy = arrays
        axis = self.axis % x.ndim
        part = gy if ctx.has_rows else np.zeros_like(gy)
        summed = ctx.group.all_reduce(_contiguous(part), "sum")
        length = x.shape[axis] if ctx.has_rows else 0
        lengths = [int(n[0]) for n in ctx.group.all_gather(np.array([length], dtype=np.int64))]
        if not ctx.has_rows:
            return np.zeros(x.shape, dtype=gy.dtype)
        start = sum(lengths[:ctx.rank])
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, start + length)
        return summed[tuple(index)]

    def in_program(self, axis_name: str, node: Apply, counts: Sequence[int] | None = None) -> Callable[..., Any]:
        import jax
        import jax.numpy as jnp

        lax = jax.lax
        axis = self.axis % node.inputs[0].type.ndim
        if counts is None or 0 not in counts:
            return lambda x, gy: lax.psum_scatter(gy, axis_name, scatter_dimension=axis, tiled=True)
        # the gathered value holds the blocks of the ranks with rows only: this rank's block by its place
        places = np.cumsum([c > 0 for c in counts]) - 1

        def grad(x: Any, gy: Any) -> Any:
            rows = _rows(axis_name, counts)
            summed = lax.psum(jnp.where(rows > 0, gy, jnp.zeros_like(gy)), axis_name)
            length = x.shape[axis]
            place = jnp.asarray(places)[lax.axis_index(axis_name)]
            block = lax.dynamic_slice_in_dim(summed, place * length, length, axis)
            return jnp.where(rows > 0, block, jnp.zeros_like(block))

        return grad

    def in_uneven(self, axis_name: str, node: Apply, counts: Sequence[int],
                  shapes: list[list[tuple[int, ...]]]) -> Callable[..., Any] | None:
        """Blocks whose lengths along ``axis`` differ: this rank's block of the summed gradient
        starts after the earlier ranks' (known when traced), padded to the longest block."""
        import jax
        import jax.numpy as jnp

        lax = jax.lax
        axis = self.axis % node.inputs[0].type.ndim
        lengths = [s[axis] if c > 0 else 0 for s, c in zip(shapes[0], counts)]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        longest = max(lengths)

        def grad(x: Any, gy: Any) -> Any:
            rows = _rows(axis_name, counts)
            summed = lax.psum(jnp.where(rows > 0, gy, jnp.zeros_like(gy)), axis_name)
            widths = [(0, longest if a == axis else 0) for a in range(gy.ndim)]
            start = jnp.asarray(starts)[lax.axis_index(axis_name)]
            block = lax.dynamic_slice_in_dim(jnp.pad(summed, widths), start, longest, axis)
            return jnp.where(rows > 0, block, jnp.zeros_like(block))  # past this rank's length: cut by the reader

        return grad

    def uneven_shape(self, shapes: list[tuple[int, ...]], padded: tuple[int, ...]) -> tuple[int, ...]:
        return shapes[0]


class BroadcastGrad(_GradOp):
    """The gradient of :func:`broadcast`: the root gets the sum of ``gy`` over the ranks, the
    others zero."""

    __props__ = ("root",)

    def __init__(self, root: int) -> None:
        self.root = int(root)

    def host(self, ctx: CallContext, *arrays: np.ndarray, even: bool = False) -> np.ndarray:
        x, gy = arrays
        part = gy if ctx.has_rows else np.zeros_like(gy)
        summed = ctx.group.reduce(_contiguous(part), "sum", root=self.root)
        return summed if ctx.rank == self.root else np.zeros(x.shape, dtype=gy.dtype)

    def in_program(self, axis_name: str, node: Apply, counts: Sequence[int] | None = None) -> Callable[..., Any]:
        import jax
        import jax.numpy as jnp

        lax, root = jax.lax, self.root

        def grad(x: Any, gy: Any) -> Any:
            if counts is not None and 0 in counts:  # a rank without rows puts in nothing
                gy = jnp.where(_rows(axis_name, counts) > 0, gy, jnp.zeros_like(gy))
            return jnp.where(lax.axis_index(axis_name) == root, lax.psum(gy, axis_name), jnp.zeros_like(gy))

        return grad


