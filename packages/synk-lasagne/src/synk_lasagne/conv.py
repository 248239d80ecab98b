"""2-d convolution of networks (NCHW) as PyTensor Ops: :func:`conv2d` and its gradient Ops.

PyTensor 3 has no convolution for networks (Theano's ``nnet.conv2d`` is gone;
``pytensor.tensor.signal.convolve2d`` is single-channel signal convolution).  These Ops fill the
gap, for :class:`synk_lasagne.layers.Conv2DLayer` and for graphs written by hand:

===========================  ====================================================================
:func:`conv2d`               ``out[n, f] = sum_c x[n, c] (*) w[f, c]`` (cross-correlation, as every
                             deep-learning library), stride, padding, dilation, groups
:class:`Conv2D`              the Op of :func:`conv2d`
:class:`Conv2DGradInputs`    its gradient with respect to the input (a transposed convolution)
:class:`Conv2DGradWeights`   its gradient with respect to the filters
:func:`conv_output_length`   the output length along one axis
===========================  ====================================================================

Each Op runs

* under ``mode="JAX"`` (GPU, and XLA on CPUs) as ``jax.lax.conv_general_dilated``; the gradient
  Ops as its ``jax.vjp``, which XLA compiles to the same convolutions that ``jax.grad`` would;
* under every other backend (PyTensor's default Numba or C linkers) through ``perform``: im2col
  (one strided copy per filter tap) and one batched BLAS matrix product per group.

Shapes: ``x`` is ``(batch, channels, height, width)``; ``w`` is ``(filters, channels // groups,
filter_height, filter_width)``.  Padding is ``"valid"`` (none), ``"full"`` (``dilated_size - 1``
each side), ``"same"`` (``dilated_size // 2`` each side, as Lasagne and Theano's ``"half"``: the
input's size at stride 1 for odd filters, one more for even ones), an int, a pair
``(pad_h, pad_w)``, or ``((top, bottom), (left, right))``.

Example
-------
>>> import numpy as np, pytensor, pytensor.tensor as pt
>>> from synk_lasagne.conv import conv2d
>>> x, w = pt.tensor4("x"), pt.tensor4("w")
>>> f = pytensor.function([x, w], conv2d(x, w, pad="same"))
>>> f(np.ones((1, 1, 3, 3)), np.ones((1, 1, 3, 3)))[0, 0]
array([[4., 6., 4.],
       [6., 9., 6.],
       [4., 6., 4.]])
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.tensor import as_tensor_variable
from pytensor.tensor.type import TensorType

from synk_lasagne._backends import register_jax, register_perform

__all__ = ["Conv2D", "Conv2DGradInputs", "Conv2DGradWeights", "conv2d", "conv_output_length"]

PadSpec = str | tuple[tuple[int, int], tuple[int, int]]
"""Padding held by the Ops: ``"full"``/``"same"`` (resolved from the filter size) or explicit
``((top, bottom), (left, right))``."""

PAD_MODES = ("valid", "full", "same")


def _pair(value: Any, what: str) -> tuple[int, int]:
    """An int or a pair of ints as a pair of ints >= 0."""
    if isinstance(value, (int, np.integer)):
        pair = (int(value), int(value))
    else:
        try:
            pair = tuple(int(v) for v in value)  # type: ignore[assignment]
        except TypeError:
            raise TypeError(f"{what} must be an int or a pair of ints, got {value!r}") from None
        if len(pair) != 2:
            raise ValueError(f"{what} must be an int or a pair of ints, got {value!r}")
    if min(pair) < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return pair


def normalize_pad(pad: Any) -> PadSpec:
    """``pad`` as the Ops hold it: ``"full"``, ``"same"`` or ``((top, bottom), (left, right))``.

    Parameters
    ----------
    pad : {"valid", "full", "same"}, int, (int, int) or ((int, int), (int, int))

    Returns
    -------
    str or tuple of two pairs
    """
    if isinstance(pad, str):
        if pad not in PAD_MODES:
            raise ValueError(f"pad must be one of {PAD_MODES}, an int or a pair of ints, got {pad!r}")
        return ((0, 0), (0, 0)) if pad == "valid" else pad
    if isinstance(pad, (tuple, list)) and len(pad) == 2 and all(isinstance(p, (tuple, list)) for p in pad):
        top_bottom, left_right = (_pair(p, "pad") for p in pad)
        return (top_bottom, left_right)
    ph, pw = _pair(pad, "pad")
    return ((ph, ph), (pw, pw))


def resolve_pad(pad: PadSpec, filter_size: tuple[Any, Any], dilation: tuple[int, int]) -> tuple[tuple[Any, Any], ...]:
    """Explicit ``((top, bottom), (left, right))`` of ``pad`` for filters of ``filter_size``.

    ``filter_size`` may be ints or symbolic scalars (for shape inference)."""
    if isinstance(pad, str):
        dilated = [d * (k - 1) + 1 for k, d in zip(filter_size, dilation)]
        if pad == "full":
            return tuple((s - 1, s - 1) for s in dilated)
        return tuple((s // 2, s // 2) for s in dilated)
    return pad


def conv_output_length(input_length: Any, filter_size: Any, stride: int, pad: tuple[Any, Any],
                       dilation: int = 1) -> Any:
    """``floor((input + pad_before + pad_after - dilation * (filter - 1) - 1) / stride) + 1``.

    Works on ints and on symbolic scalars; None in, None out (unknown lengths)."""
    if input_length is None or filter_size is None:
        return None
    return (input_length + pad[0] + pad[1] - dilation * (filter_size - 1) - 1) // stride + 1


class _ConvBase(Op):
    """Parameters shared by the convolution Op and its gradient Ops."""

    __props__ = ("stride", "pad", "dilation", "groups")

    def __init__(self, stride: Any = 1, pad: Any = "valid", dilation: Any = 1, groups: int = 1) -> None:
        self.stride = _pair(stride, "stride")
        self.pad = normalize_pad(pad)
        self.dilation = _pair(dilation, "dilation")
        if min(self.stride) < 1 or min(self.dilation) < 1:
            raise ValueError(f"stride and dilation must be >= 1, got {stride!r} and {dilation!r}")
        if not isinstance(groups, (int, np.integer)) or groups < 1:
            raise ValueError(f"groups must be an int >= 1, got {groups!r}")
        self.groups = int(groups)

    def _pads(self, filter_size: tuple[Any, Any]) -> tuple[tuple[Any, Any], ...]:
        return resolve_pad(self.pad, filter_size, self.dilation)

    def _output_hw(self, hw: tuple[Any, Any], filter_size: tuple[Any, Any]) -> tuple[Any, Any]:
        pads = self._pads(filter_size)
        return tuple(conv_output_length(n, k, s, p, d)  # type: ignore[return-value]
                     for n, k, s, p, d in zip(hw, filter_size, self.stride, pads, self.dilation))

    def _jax_conv(self) -> Any:
        """``conv(x, w)`` in JAX (padding resolved from the traced filter shape)."""
        import jax

        def conv(x: Any, w: Any) -> Any:
            pads = self._pads(w.shape[2:])
            return jax.lax.conv_general_dilated(x, w, window_strides=self.stride, padding=pads,
                                                rhs_dilation=self.dilation,
                                                dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                                feature_group_count=self.groups)

        return conv


def _static_first(static: tuple[int | None, ...], symbolic: tuple[Any, ...]) -> tuple[Any, ...]:
    """The output's static lengths where known, else the symbolic ones: constants keep the
    gradient's shapes concrete under JAX (PyTensor 3.0 computes ``Alloc`` shapes from them)."""
    return tuple(symbolic[i] if length is None else length for i, length in enumerate(static))


def _make_node_checks(x: Any, w: Any, groups: int) -> None:
    if x.type.ndim != 4 or w.type.ndim != 4:
        raise TypeError(f"conv2d needs 4-d input (batch, channels, rows, columns) and 4-d filters "
                        f"(filters, channels // groups, rows, columns); got {x.type.ndim}-d and {w.type.ndim}-d")
    channels, filters, per_group = x.type.shape[1], w.type.shape[0], w.type.shape[1]
    if channels is not None and per_group is not None and channels != per_group * groups:
        raise ValueError(f"the input has {channels} channels but the filters expect {per_group} x {groups} groups")
    if filters is not None and filters % groups:
        raise ValueError(f"{filters} filters do not split into {groups} groups")


class Conv2D(_ConvBase):
    """``conv2d(x, w)``: see :func:`conv2d`."""

    def make_node(self, *inputs: Any) -> Apply:
        x, w = (as_tensor_variable(v) for v in inputs)
        _make_node_checks(x, w, self.groups)
        dtype = np.result_type(x.type.dtype, w.type.dtype).name
        static_hw = self._output_hw(x.type.shape[2:], w.type.shape[2:]) \
            if None not in w.type.shape[2:] else (None, None)
        shape = (x.type.shape[0], w.type.shape[0], *static_hw)
        return Apply(self, [x, w], [TensorType(dtype, shape=shape)()])

    def perform(self, node: Any, inputs: Any, output_storage: Any) -> None:
        """The convolution in numpy: im2col and one batched matrix product per group."""
        x, w = inputs
        out = _conv_forward(x, w, self.stride, self._pads(w.shape[2:]), self.dilation, self.groups)
        output_storage[0][0] = out.astype(node.outputs[0].type.dtype, copy=False)

    def infer_shape(self, *args: Any) -> Any:
        """PyTensor before 3.3 passes ``(fgraph, node, input_shapes)``, 3.3 ``(node, input_shapes)``."""
        node, (x_shape, w_shape) = args[-2], args[-1]
        shape = (x_shape[0], w_shape[0], *self._output_hw(tuple(x_shape[2:]), tuple(w_shape[2:])))
        return [_static_first(node.outputs[0].type.shape, shape)]

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> Any:
        x, w = inputs
        (gz,) = cotangents
        params = (self.stride, self.pad, self.dilation, self.groups)
        return [Conv2DGradInputs(*params)(x, w, gz), Conv2DGradWeights(*params)(x, w, gz)]


class _ConvGrad(_ConvBase):
    """A gradient of :class:`Conv2D`: inputs ``(x, w, output_gradient)``."""

    wrt = 0

    def make_node(self, *inputs: Any) -> Apply:
        x, w, gz = (as_tensor_variable(v) for v in inputs)
        _make_node_checks(x, w, self.groups)
        like = (x, w)[self.wrt]
        dtype = np.result_type(like.type.dtype, gz.type.dtype).name
        return Apply(self, [x, w, gz], [TensorType(dtype, shape=like.type.shape)()])

    def infer_shape(self, *args: Any) -> Any:
        return [args[-1][self.wrt]]

    def perform(self, node: Any, inputs: Any, output_storage: Any) -> None:
        """The gradient in numpy: matrix products with the im2col columns (and col2im for ``x``)."""
        x, w, gz = inputs
        pads = self._pads(w.shape[2:])
        grad = _conv_grad(x, w, gz, self.stride, pads, self.dilation, self.groups, self.wrt)
        output_storage[0][0] = grad.astype(node.outputs[0].type.dtype, copy=False)


class Conv2DGradInputs(_ConvGrad):
    """The gradient of :class:`Conv2D` with respect to its input ``x`` (shape of ``x``):
    ``J^T gz``, a transposed convolution (``x`` gives only the shape)."""

    wrt = 0

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> Any:
        """``<g, J^T gz> = <conv2d(g, w), gz>``: linear in ``w`` and in ``gz``."""
        x, w, gz = inputs
        (g,) = cotangents
        params = (self.stride, self.pad, self.dilation, self.groups)
        return [x.zeros_like(), Conv2DGradWeights(*params)(g, w, gz), Conv2D(*params)(g, w)]


class Conv2DGradWeights(_ConvGrad):
    """The gradient of :class:`Conv2D` with respect to its filters ``w`` (shape of ``w``)."""

    wrt = 1

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> Any:
        """``<g, dW(x, gz)> = <conv2d(x, g), gz>``: linear in ``x`` and in ``gz``."""
        x, w, gz = inputs
        (g,) = cotangents
        params = (self.stride, self.pad, self.dilation, self.groups)
        return [Conv2DGradInputs(*params)(x, g, gz), w.zeros_like(), Conv2D(*params)(x, g)]


def conv2d(x: Any, w: Any, stride: Any = 1, pad: Any = "valid", dilation: Any = 1, groups: int = 1) -> Any:
    """2-d convolution (cross-correlation) of a batch of images with a bank of filters.

    ``out[n, f, i, j] = sum_{c, a, b} x_pad[n, g*C_g + c, i*sh + a*dh, j*sw + b*dw] * w[f, c, a, b]``
    where ``g = f // (filters // groups)`` is the filter's group.

    Parameters
    ----------
    x : 4-d tensor ``(batch, channels, height, width)``
    w : 4-d tensor ``(filters, channels // groups, filter_height, filter_width)``
    stride : int or (int, int)
    pad : {"valid", "full", "same"}, int, (int, int) or ((int, int), (int, int))
        Zeros added around the images (see the module's docstring).
    dilation : int or (int, int)
        Spacing between filter taps (1: dense filters).
    groups : int
        Channels and filters split into this many independent groups (``channels`` for a
        depthwise convolution).

    Returns
    -------
    4-d tensor ``(batch, filters, out_height, out_width)``

    Notes
    -----
    The filters are not flipped (Theano's and Lasagne's ``conv2d`` flip them by default:
    ``flip_filters=True`` of :class:`synk_lasagne.layers.Conv2DLayer` does it in the graph).
    """
    return Conv2D(stride, pad, dilation, groups)(x, w)


# --- numpy: im2col + BLAS ---------------------------------------------------------------------------

def _out_hw(shape: tuple[int, ...], k: tuple[int, int], stride: tuple[int, int], pads: Any,
            dilation: tuple[int, int]) -> tuple[int, int]:
    oh, ow = (conv_output_length(n, kk, s, p, d) for n, kk, s, p, d in zip(shape[2:], k, stride, pads, dilation))
    if oh < 1 or ow < 1:
        raise ValueError(f"the filters ({k[0]}x{k[1]}, dilation {dilation}) do not fit the padded input "
                         f"{shape[2:]} (pad {pads}): the output would be {oh}x{ow}")
    return oh, ow


def _taps(k: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int], oh: int, ow: int) -> Any:
    """For every filter tap ``(a, b)``: the strided slices of the padded input it reads."""
    for a in range(k[0]):
        for b in range(k[1]):
            rows = slice(a * dilation[0], a * dilation[0] + stride[0] * (oh - 1) + 1, stride[0])
            cols = slice(b * dilation[1], b * dilation[1] + stride[1] * (ow - 1) + 1, stride[1])
            yield a, b, rows, cols


def _im2col(x: np.ndarray, k: tuple[int, int], stride: tuple[int, int], pads: Any, dilation: tuple[int, int],
            groups: int) -> tuple[np.ndarray, int, int]:
    """``(batch, groups, channels_per_group * kh * kw, oh * ow)`` columns of the padded input."""
    n, c = x.shape[:2]
    oh, ow = _out_hw(x.shape, k, stride, pads, dilation)
    xp = np.pad(x, ((0, 0), (0, 0), tuple(pads[0]), tuple(pads[1])))
    cols = np.empty((n, c, k[0], k[1], oh, ow), dtype=x.dtype)
    for a, b, rows, columns in _taps(k, stride, dilation, oh, ow):
        cols[:, :, a, b] = xp[:, :, rows, columns]
    return cols.reshape(n, groups, (c // groups) * k[0] * k[1], oh * ow), oh, ow


def _conv_forward(x: np.ndarray, w: np.ndarray, stride: tuple[int, int], pads: Any, dilation: tuple[int, int],
                  groups: int) -> np.ndarray:
    dtype = np.result_type(x, w)
    cols, oh, ow = _im2col(x.astype(dtype, copy=False), w.shape[2:], stride, pads, dilation, groups)
    f = w.shape[0]
    kernels = w.astype(dtype, copy=False).reshape(groups, f // groups, -1)
    out = np.matmul(kernels, cols)  # (batch, groups, filters per group, oh * ow)
    return out.reshape(x.shape[0], f, oh, ow)


def _conv_grad(x: np.ndarray, w: np.ndarray, gz: np.ndarray, stride: tuple[int, int], pads: Any,
               dilation: tuple[int, int], groups: int, wrt: int) -> np.ndarray:
    """The gradient of :func:`_conv_forward` with respect to ``x`` (wrt 0) or ``w`` (wrt 1)."""
    dtype = np.result_type(x, w, gz)
    n, c, h, width = x.shape
    f, k = w.shape[0], w.shape[2:]
    oh, ow = _out_hw(x.shape, k, stride, pads, dilation)
    gz_cols = gz.astype(dtype, copy=False).reshape(n, groups, f // groups, oh * ow)
    if wrt == 1:
        cols, _, _ = _im2col(x.astype(dtype, copy=False), k, stride, pads, dilation, groups)
        grad_w = np.matmul(gz_cols.transpose(1, 2, 0, 3).reshape(groups, f // groups, n * oh * ow),
                           cols.transpose(1, 0, 3, 2).reshape(groups, n * oh * ow, -1))
        return grad_w.reshape(w.shape)
    kernels = w.astype(dtype, copy=False).reshape(groups, f // groups, -1)
    grad_cols = np.matmul(kernels.transpose(0, 2, 1), gz_cols).reshape(n, c, k[0], k[1], oh, ow)
    grad_xp = np.zeros((n, c, h + pads[0][0] + pads[0][1], width + pads[1][0] + pads[1][1]), dtype=dtype)
    for a, b, rows, columns in _taps(k, stride, dilation, oh, ow):
        grad_xp[:, :, rows, columns] += grad_cols[:, :, a, b]
    return grad_xp[:, :, pads[0][0]:pads[0][0] + h, pads[1][0]:pads[1][0] + width]


# --- backends -------------------------------------------------------------------------------------------

def _jax_conv2d(op: Conv2D, node: Any = None, **kwargs: Any) -> Any:
    conv = op._jax_conv()
    dtype = node.outputs[0].type.dtype

    def conv2d(x: Any, w: Any) -> Any:  # in the declared dtype
        return conv(x.astype(dtype), w.astype(dtype))

    return conv2d


def _jax_conv2d_grad(op: _ConvGrad, node: Any = None, **kwargs: Any) -> Any:
    import jax

    conv = op._jax_conv()
    wrt = op.wrt
    dtype = node.outputs[0].type.dtype

    def grad(x: Any, w: Any, gz: Any) -> Any:
        x, w, gz = x.astype(dtype), w.astype(dtype), gz.astype(dtype)
        if wrt == 0:
            _, vjp = jax.vjp(lambda a: conv(a, w), x)
        else:
            _, vjp = jax.vjp(lambda b: conv(x, b), w)
        return vjp(gz)[0]

    return grad


def _register_backends() -> None:
    """JAX (``lax.conv_general_dilated``, its vjp) and Numba (``perform``), registered when
    PyTensor first imports each backend (see :mod:`synk_lasagne._backends`)."""
    register_perform(Conv2D, Conv2DGradInputs, Conv2DGradWeights)
    register_jax(Conv2D, _jax_conv2d)
    register_jax(Conv2DGradInputs, _jax_conv2d_grad)
    register_jax(Conv2DGradWeights, _jax_conv2d_grad)


_register_backends()
