"""2-d pooling over the last two axes as PyTensor Ops: :func:`pool2d` and its gradient Op.

===========================  ====================================================================
:func:`pool2d`               max or average over windows of the last two axes (stride, padding)
:class:`Pool2D`              the Op of :func:`pool2d`
:class:`Pool2DGrad`          its gradient with respect to the input
:func:`pool_output_length`   the output length along one axis
===========================  ====================================================================

Modes (Theano's and Lasagne's names):

``"max"``              the largest value of each window (padding never wins: it is ``-inf``)
``"average_inc_pad"``  the window's sum / its full size (padding counts as zeros)
``"average_exc_pad"``  the window's sum / the number of its values inside the input

Each Op runs under ``mode="JAX"`` as ``jax.lax.reduce_window`` (the gradient as its
``jax.vjp``), and under every other backend through ``perform`` (one strided numpy view per
window tap).  Windows that would cross the padded border are dropped (Lasagne's
``ignore_border=True``).  Global pooling is a plain mean or max over the axes
(:class:`synk_lasagne.layers.GlobalPoolLayer`).

Example
-------
>>> import numpy as np, pytensor, pytensor.tensor as pt
>>> from synk_lasagne.pool import pool2d
>>> x = pt.tensor4("x")
>>> f = pytensor.function([x], pool2d(x, (2, 2)))
>>> f(np.arange(16.0).reshape(1, 1, 4, 4))[0, 0]
array([[ 5.,  7.],
       [13., 15.]])
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.tensor import as_tensor_variable
from pytensor.tensor.type import TensorType

from synk_lasagne._backends import register_jax, register_perform
from synk_lasagne.conv import _pair, _static_first

__all__ = ["MODES", "Pool2D", "Pool2DGrad", "pool2d", "pool_output_length"]

MODES = ("max", "average_inc_pad", "average_exc_pad")


def pool_output_length(input_length: Any, pool_size: int, stride: int, pad: int) -> Any:
    """``floor((input + 2 * pad - pool_size) / stride) + 1`` (None for an unknown length)."""
    if input_length is None:
        return None
    return (input_length + 2 * pad - pool_size) // stride + 1


class _PoolBase(Op):
    """Parameters shared by :class:`Pool2D` and :class:`Pool2DGrad`."""

    __props__ = ("ws", "stride", "pad", "mode")

    def __init__(self, ws: Any, stride: Any = None, pad: Any = 0, mode: str = "max") -> None:
        self.ws = _pair(ws, "pool_size")
        self.stride = self.ws if stride is None else _pair(stride, "stride")
        self.pad = _pair(pad, "pad")
        if min(self.ws) < 1 or min(self.stride) < 1:
            raise ValueError(f"pool_size and stride must be >= 1, got {ws!r} and {stride!r}")
        if any(p >= w for p, w in zip(self.pad, self.ws)):
            raise ValueError(f"pad {self.pad} must be smaller than pool_size {self.ws} (a window of padding only)")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode

    def _output_hw(self, hw: Any) -> tuple[Any, Any]:
        return tuple(pool_output_length(n, w, s, p)  # type: ignore[return-value]
                     for n, w, s, p in zip(hw, self.ws, self.stride, self.pad))

    def _jax_pool(self) -> Any:
        """``pool(x)`` in JAX."""
        import jax
        import jax.numpy as jnp

        ws, stride, pad, mode = self.ws, self.stride, self.pad, self.mode

        def pool(x: Any) -> Any:
            lead = x.ndim - 2
            window, strides = (1,) * lead + ws, (1,) * lead + stride
            padding = ((0, 0),) * lead + tuple((p, p) for p in pad)
            if mode == "max":
                return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, window, strides, padding)
            sums = jax.lax.reduce_window(x, 0.0, jax.lax.add, window, strides, padding)
            if mode == "average_inc_pad" or pad == (0, 0):
                return sums / (ws[0] * ws[1])
            ones = jnp.ones(x.shape[-2:], dtype=x.dtype)
            counts = jax.lax.reduce_window(ones, 0.0, jax.lax.add, ws, stride, tuple((p, p) for p in pad))
            return sums / counts

        return pool


def _check_input(x: Any) -> None:
    if x.type.ndim < 2:
        raise TypeError(f"pool2d pools the last two axes: it needs an input of 2 or more dimensions, got "
                        f"{x.type.ndim}-d")


class Pool2D(_PoolBase):
    """``pool2d(x)``: see :func:`pool2d`."""

    def make_node(self, *inputs: Any) -> Apply:
        (x,) = (as_tensor_variable(v) for v in inputs)
        _check_input(x)
        shape = (*x.type.shape[:-2], *self._output_hw(x.type.shape[-2:]))
        return Apply(self, [x], [TensorType(x.type.dtype, shape=shape)()])

    def perform(self, node: Any, inputs: Any, output_storage: Any) -> None:
        """The pooling in numpy: one strided view per window tap."""
        (x,) = inputs
        output_storage[0][0] = _pool_forward(x, self.ws, self.stride, self.pad, self.mode)

    def infer_shape(self, *args: Any) -> Any:
        """PyTensor before 3.3 passes ``(fgraph, node, input_shapes)``, 3.3 ``(node, input_shapes)``."""
        node, (x_shape,) = args[-2], args[-1]
        shape = (*x_shape[:-2], *self._output_hw(tuple(x_shape[-2:])))
        return [_static_first(node.outputs[0].type.shape, shape)]

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> Any:
        (x,) = inputs
        (gz,) = cotangents
        return [Pool2DGrad(self.ws, self.stride, self.pad, self.mode)(x, gz)]


class Pool2DGrad(_PoolBase):
    """The gradient of :class:`Pool2D` with respect to its input: inputs ``(x, output_gradient)``.

    For max pooling the gradient of each window goes to its first largest value."""

    def make_node(self, *inputs: Any) -> Apply:
        x, gz = (as_tensor_variable(v) for v in inputs)
        _check_input(x)
        return Apply(self, [x, gz], [TensorType(x.type.dtype, shape=x.type.shape)()])

    def perform(self, node: Any, inputs: Any, output_storage: Any) -> None:
        """The gradient in numpy: each output's gradient added back to its window's taps."""
        x, gz = inputs
        output_storage[0][0] = _pool_grad(x, gz, self.ws, self.stride, self.pad, self.mode)

    def infer_shape(self, *args: Any) -> Any:
        return [args[-1][0]]


def pool2d(x: Any, ws: Any, stride: Any = None, pad: Any = 0, mode: str = "max") -> Any:
    """Max or average pooling over windows of the last two axes.

    ``out[..., i, j] = reduce(x_pad[..., i*sh : i*sh + wh, j*sw : j*sw + ww])``

    Parameters
    ----------
    x : tensor of 2 or more dimensions (``(batch, channels, height, width)`` for images)
    ws : int or (int, int)
        The window (pool size).
    stride : int or (int, int), optional
        Default: the window (non-overlapping windows).
    pad : int or (int, int)
        Added on both sides of each of the two axes (smaller than the window).
    mode : {"max", "average_inc_pad", "average_exc_pad"}

    Returns
    -------
    tensor
        ``(..., out_height, out_width)`` with ``out = floor((in + 2 pad - ws) / stride) + 1``.
    """
    return Pool2D(ws, stride, pad, mode)(x)


# --- numpy ------------------------------------------------------------------------------------------

def _windows(shape: tuple[int, ...], ws: tuple[int, int], stride: tuple[int, int],
             pad: tuple[int, int]) -> tuple[int, int, list[tuple[slice, slice]]]:
    """Output size and, for every window tap, the strided slices of the padded input it reads."""
    oh, ow = (pool_output_length(n, w, s, p) for n, w, s, p in zip(shape[-2:], ws, stride, pad))
    if oh < 1 or ow < 1:
        raise ValueError(f"the pool window {ws} does not fit the input {shape[-2:]} padded by {pad}")
    taps = [(slice(a, a + stride[0] * (oh - 1) + 1, stride[0]), slice(b, b + stride[1] * (ow - 1) + 1, stride[1]))
            for a in range(ws[0]) for b in range(ws[1])]
    return oh, ow, taps


def _padded(x: np.ndarray, pad: tuple[int, int], value: float) -> np.ndarray:
    widths = ((0, 0),) * (x.ndim - 2) + ((pad[0], pad[0]), (pad[1], pad[1]))
    return np.pad(x, widths, constant_values=value) if any(pad) else x


def _counts(shape: tuple[int, ...], ws: tuple[int, int], stride: tuple[int, int], pad: tuple[int, int],
            mode: str, dtype: Any) -> Any:
    """The divisor of each output: the window's size, or its number of values inside the input."""
    if mode == "average_inc_pad" or not any(pad):
        return np.asarray(ws[0] * ws[1], dtype=dtype)
    ones = _padded(np.ones(shape[-2:], dtype=dtype), pad, 0)
    _, _, taps = _windows(shape, ws, stride, pad)
    return sum(ones[rows, cols] for rows, cols in taps)


def _pool_forward(x: np.ndarray, ws: tuple[int, int], stride: tuple[int, int], pad: tuple[int, int],
                  mode: str) -> np.ndarray:
    _, _, taps = _windows(x.shape, ws, stride, pad)
    if mode == "max":
        xp = _padded(x, pad, -np.inf)
        out = xp[(..., *taps[0])].copy()
        for rows, cols in taps[1:]:
            np.maximum(out, xp[..., rows, cols], out=out)
        return out.astype(x.dtype, copy=False)
    xp = _padded(x, pad, 0)
    total = xp[(..., *taps[0])].copy()
    for rows, cols in taps[1:]:
        total += xp[..., rows, cols]
    return (total / _counts(x.shape, ws, stride, pad, mode, x.dtype)).astype(x.dtype, copy=False)


def _pool_grad(x: np.ndarray, gz: np.ndarray, ws: tuple[int, int], stride: tuple[int, int], pad: tuple[int, int],
               mode: str) -> np.ndarray:
    _, _, taps = _windows(x.shape, ws, stride, pad)
    height, width = x.shape[-2:]
    grad_xp = np.zeros((*x.shape[:-2], height + 2 * pad[0], width + 2 * pad[1]), dtype=x.dtype)
    if mode == "max":
        xp = _padded(x, pad, -np.inf)
        best = np.argmax(np.stack([xp[..., rows, cols] for rows, cols in taps]), axis=0)
        for k, (rows, cols) in enumerate(taps):
            grad_xp[..., rows, cols] += np.where(best == k, gz, 0)
    else:
        share = gz / _counts(x.shape, ws, stride, pad, mode, x.dtype)
        for rows, cols in taps:
            grad_xp[..., rows, cols] += share
    return grad_xp[..., pad[0]:pad[0] + height, pad[1]:pad[1] + width]


# --- backends ---------------------------------------------------------------------------------------

def _jax_pool2d(op: Pool2D, node: Any = None, **kwargs: Any) -> Any:
    pool = op._jax_pool()
    dtype = node.outputs[0].type.dtype

    def pool2d(x: Any) -> Any:  # in the declared dtype
        return pool(x.astype(dtype))

    return pool2d


def _jax_pool2d_grad(op: Pool2DGrad, node: Any = None, **kwargs: Any) -> Any:
    import jax

    pool = op._jax_pool()
    dtype = node.outputs[0].type.dtype

    def grad(x: Any, gz: Any) -> Any:
        _, vjp = jax.vjp(pool, x.astype(dtype))
        return vjp(gz.astype(dtype))[0]

    return grad


def _register_backends() -> None:
    """JAX (``lax.reduce_window``, its vjp) and Numba (``perform``), registered when PyTensor
    first imports each backend (see :mod:`synk_lasagne._backends`)."""
    register_perform(Pool2D, Pool2DGrad)
    register_jax(Pool2D, _jax_pool2d)
    register_jax(Pool2DGrad, _jax_pool2d_grad)


_register_backends()
