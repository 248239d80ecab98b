"""Layers without a family: :class:`NonlinearityLayer`, :class:`ExpressionLayer`,
:class:`BiasLayer`, :class:`ScaleLayer`, :class:`ParametricRectifierLayer` (:func:`prelu`),
:class:`RandomizedRectifierLayer` (:func:`rrelu`), :class:`InverseLayer`, :class:`TransformerLayer`,
:class:`TPSTransformerLayer`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from synk_lasagne import nonlinearities
from synk_lasagne.init import ONES, ZEROS
from synk_lasagne.layers.base import Layer, MergeLayer

__all__ = ["BiasLayer", "ExpressionLayer", "InverseLayer", "NonlinearityLayer", "ParametricRectifierLayer",
           "RandomizedRectifierLayer", "ScaleLayer", "TPSTransformerLayer", "TransformerLayer", "prelu", "rrelu",
           "standardize"]


class NonlinearityLayer(Layer):
    """``nonlinearity(input)`` (default rectify; None: identity)."""

    def __init__(self, incoming: Any, nonlinearity: Any = nonlinearities.rectify, **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.nonlinearity = nonlinearities.identity if nonlinearity is None else nonlinearity

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        return self.nonlinearity(input)


class ExpressionLayer(Layer):
    """``function(input)`` for any expression; ``output_shape`` a tuple, a callable of the input
    shape, None (the input's shape) or ``"auto"`` (found by applying ``function`` to a variable of
    the input's shape: the lengths PyTensor can tell, None for the others)."""

    def __init__(self, incoming: Any, function: Callable[[Any], Any], output_shape: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.function = function
        self._output_shape = output_shape

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        if self._output_shape is None:
            return tuple(input_shape)
        if isinstance(self._output_shape, str) and self._output_shape == "auto":
            return _auto_shape(self.function, tuple(input_shape))
        if callable(self._output_shape):
            return tuple(self._output_shape(input_shape))
        return tuple(self._output_shape)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        return self.function(input)


def _auto_shape(function: Callable[[Any], Any], input_shape: tuple[Any, ...]) -> tuple[Any, ...]:
    """The output shape of ``function`` for an input of ``input_shape``: computed on zeros when
    every length is known, else the static shape PyTensor infers (None where it cannot)."""
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    x = pt.tensor(dtype=pytensor.config.floatX, shape=input_shape)
    out = pt.as_tensor_variable(function(x))
    if all(n is not None for n in input_shape):
        shape_of = pytensor.function([x], out.shape, mode="FAST_COMPILE", on_unused_input="ignore")
        return tuple(int(n) for n in shape_of(np.zeros(input_shape, dtype=x.dtype)))
    return tuple(out.type.shape)


def _shared_axes(shared_axes: Any, ndim: int) -> tuple[int, ...]:
    from synk_lasagne.utils import int_types

    if shared_axes == "auto":  # every axis but the second (the channels)
        return (0, *range(2, ndim))
    if shared_axes == "all":
        return tuple(range(ndim))
    if isinstance(shared_axes, int_types):
        return (int(shared_axes),)
    return tuple(shared_axes)


def _broadcast(param: Any, shared_axes: tuple[int, ...], ndim: int) -> Any:
    """``param`` (the axes not shared) dimshuffled to ``ndim`` axes, broadcast along ``shared_axes``."""
    axes = iter(range(param.ndim))
    return param.dimshuffle(*("x" if axis in shared_axes else next(axes) for axis in range(ndim)))


class BiasLayer(Layer):
    """``input + b``, ``b`` shared along ``shared_axes`` (default: every axis but the second)."""

    def __init__(self, incoming: Any, b: Any = ZEROS, shared_axes: Any = "auto", **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.shared_axes = _shared_axes(shared_axes, len(self.input_shape))
        if b is None:
            self.b = None
            return
        shape = [n for axis, n in enumerate(self.input_shape) if axis not in self.shared_axes]
        if any(n is None for n in shape):
            raise ValueError("BiasLayer needs specified input sizes for all axes that biases are not shared over.")
        self.b = self.add_param(b, shape, name="b", regularizable=False)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        return input if self.b is None else input + _broadcast(self.b, self.shared_axes, input.ndim)


class ScaleLayer(Layer):
    """``input * scales``, ``scales`` shared along ``shared_axes`` (default: every axis but the second)."""

    def __init__(self, incoming: Any, scales: Any = ONES, shared_axes: Any = "auto", **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.shared_axes = _shared_axes(shared_axes, len(self.input_shape))
        shape = [n for axis, n in enumerate(self.input_shape) if axis not in self.shared_axes]
        if any(n is None for n in shape):
            raise ValueError("ScaleLayer needs specified input sizes for all axes that scales are not shared over.")
        self.scales = self.add_param(scales, shape, name="scales", regularizable=False)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        return input * _broadcast(self.scales, self.shared_axes, input.ndim)


def standardize(layer: Any, offset: Any, scale: Any, shared_axes: Any = "auto") -> Any:
    """``(layer's output - offset) / scale`` as a :class:`BiasLayer` then a :class:`ScaleLayer`,
    their parameters not trainable (e.g. the training data's mean and standard deviation)."""
    from synk_lasagne.utils import floatX

    layer = BiasLayer(layer, -offset, shared_axes)
    layer.params[layer.b].discard("trainable")
    layer = ScaleLayer(layer, floatX(1.0) / scale, shared_axes)
    layer.params[layer.scales].discard("trainable")
    return layer


def _unshared_shape(layer: Layer, what: str) -> list[Any]:
    shape = [n for axis, n in enumerate(layer.input_shape) if axis not in layer.shared_axes]  # type: ignore[attr-defined]
    if any(n is None for n in shape):
        raise ValueError(f"{type(layer).__name__} needs specified input sizes for all axes that {what} are not shared "
                         f"over (input shape {layer.input_shape})")
    return shape


class ParametricRectifierLayer(Layer):
    """PReLU (He et al. 2015): ``max(x, 0) + alpha * min(x, 0)`` with a learned ``alpha``.

    Parameters
    ----------
    incoming : Layer or tuple
    alpha : initialiser, array or shared variable
        Default 0.25; shape: the input's axes not in ``shared_axes`` (a scalar for ``"all"``).
    shared_axes : "auto", "all", int or tuple of int
        Axes sharing one alpha: ``"auto"`` every axis but the second (one per channel).
    """

    def __init__(self, incoming: Any, alpha: Any = None, shared_axes: Any = "auto", **kwargs: Any) -> None:
        from synk_lasagne.init import Constant

        super().__init__(incoming, **kwargs)
        self.shared_axes = _shared_axes(shared_axes, len(self.input_shape))
        self.alpha = self.add_param(Constant(0.25) if alpha is None else alpha, _unshared_shape(self, "alphas"),
                                    name="alpha", regularizable=False)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        input = pt.as_tensor_variable(input)
        alpha = _broadcast(self.alpha, self.shared_axes, input.ndim)
        return pt.maximum(input, 0) + alpha * pt.minimum(input, 0)


def _without_nonlinearity(layer: Any) -> Any:
    from synk_lasagne.nonlinearities import identity

    if getattr(layer, "nonlinearity", None) is not None:
        layer.nonlinearity = identity
    return layer


def prelu(layer: Any, **kwargs: Any) -> ParametricRectifierLayer:
    """``layer`` with its nonlinearity (if any) replaced by a :class:`ParametricRectifierLayer` on top."""
    return ParametricRectifierLayer(_without_nonlinearity(layer), **kwargs)


class RandomizedRectifierLayer(Layer):
    """RReLU (Xu et al. 2015): ``max(x, 0) + a * min(x, 0)`` with ``a ~ U(lower, upper)`` drawn
    each call in training, ``(lower + upper) / 2`` when ``deterministic``.

    Parameters
    ----------
    incoming : Layer or tuple
    lower, upper : float
        ``0 <= lower <= upper < 1``.
    shared_axes : "auto", "all", int or tuple of int
        Axes sharing one draw (``"auto"``: every axis but the second).
    """

    def __init__(self, incoming: Any, lower: float = 0.3, upper: float = 0.8, shared_axes: Any = "auto",
                 **kwargs: Any) -> None:
        import numpy as np

        from synk_lasagne.random import get_rng

        super().__init__(incoming, **kwargs)
        if not 0 <= lower <= upper < 1:
            raise ValueError(f"RandomizedRectifierLayer needs 0 <= lower <= upper < 1, got lower={lower}, "
                             f"upper={upper}")
        self.lower, self.upper = lower, upper
        self.shared_axes = _shared_axes(shared_axes, len(self.input_shape))
        self._seeds = np.random.SeedSequence(get_rng().randint(1, 2147462579))

    def get_output_for(self, input: Any, deterministic: bool = False, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        from synk_lasagne.layers.base import add_state_updates, draw_generator

        input = pt.as_tensor_variable(input)
        if deterministic or self.upper == self.lower:
            return pt.maximum(input, 0) + (self.lower + self.upper) / 2 * pt.minimum(input, 0)
        shape = tuple(1 if axis in self.shared_axes else input.shape[axis] for axis in range(input.ndim))
        rng = draw_generator(self._seeds, f"{self.name}.rng" if self.name else "rrelu.rng")
        next_rng, slopes = pt.random.uniform(self.lower, self.upper, size=shape, rng=rng, return_next_rng=True)
        slopes = pt.specify_broadcastable(pt.cast(slopes, input.dtype), *self.shared_axes)
        output = pt.maximum(input, 0) + slopes * pt.minimum(input, 0)
        add_state_updates(output, [(rng, next_rng)], [rng])
        return output


def rrelu(layer: Any, **kwargs: Any) -> RandomizedRectifierLayer:
    """``layer`` with its nonlinearity (if any) replaced by a :class:`RandomizedRectifierLayer` on top."""
    return RandomizedRectifierLayer(_without_nonlinearity(layer), **kwargs)


class InverseLayer(MergeLayer):
    """The transpose of ``layer``'s linearisation applied to ``incoming``: ``J^T g`` where ``J`` is
    the Jacobian of ``layer``'s output with respect to its input (e.g. ``g W^T`` for a dense
    layer without nonlinearity; an unpooling for a max pooling layer).

    Parameters
    ----------
    incoming : Layer or tuple
        Shaped as ``layer``'s output.
    layer : Layer
        The layer to invert; its output shape is ``layer.input_shape``.
    """

    def __init__(self, incoming: Any, layer: Layer, **kwargs: Any) -> None:
        super().__init__([incoming, layer, layer.input_layer], **kwargs)

    def get_output_shape_for(self, input_shapes: Any) -> tuple[Any, ...]:
        return tuple(input_shapes[2])

    def get_output_for(self, inputs: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        import pytensor

        given, layer_out, layer_in = inputs
        return pytensor.grad(None, wrt=layer_in, known_grads={layer_out: given})


BORDER_MODES = ("nearest", "mirror", "wrap")


def _border(index: Any, length: Any, mode: str) -> Any:
    """Integer pixel positions brought inside ``[0, length)`` by ``mode``: clipped (``nearest``),
    reflected about the edges (``mirror``) or periodic (``wrap``)."""
    import pytensor.tensor as pt

    if mode == "nearest":
        index = pt.clip(index, 0, length - 1)
    elif mode == "mirror":
        period = 2 * (length - 1)
        index = pt.minimum(index % period, -index % period)
    else:
        index = index % length
    return pt.cast(index, "int64")


def _bilinear(images: Any, x: Any, y: Any, mode: str) -> Any:
    """``images`` ``(batch, rows, columns, channels)`` sampled at ``(x, y)`` in ``[-1, 1]``
    (``(batch, points)``, the corners are the corner pixels' centres) by bilinear interpolation;
    ``(batch, points, channels)``."""
    import pytensor.tensor as pt

    batch, rows, cols, channels = (images.shape[i] for i in range(4))
    dtype = x.dtype
    x = (x + 1) / 2 * pt.cast(cols - 1, dtype)
    y = (y + 1) / 2 * pt.cast(rows - 1, dtype)
    x0, y0 = pt.floor(x), pt.floor(y)
    x1, y1 = x0 + 1, y0 + 1
    flat = images.reshape((-1, channels))
    base = (pt.arange(batch) * rows * cols)[:, None]

    def pixels(yi: Any, xi: Any) -> Any:
        return flat[base + _border(yi, rows, mode) * cols + _border(xi, cols, mode)]  # (batch, points, channels)

    return ((((x1 - x) * (y1 - y))[..., None] * pixels(y0, x0)) + (((x1 - x) * (y - y0))[..., None] * pixels(y1, x0))
            + (((x - x0) * (y1 - y))[..., None] * pixels(y0, x1)) + (((x - x0) * (y - y0))[..., None] * pixels(y1, x1)))


def _scaled_length(length: Any, factor: float) -> Any:
    """``int(length / factor)`` for an int, None for None, an int expression for an expression."""
    import pytensor.tensor as pt
    from pytensor.graph.basic import Variable

    if length is None:
        return None
    if isinstance(length, Variable):
        return pt.cast(pt.true_div(length, factor), "int64")
    return int(length / factor)


class TransformerLayer(MergeLayer):
    """A spatial transformer (Jaderberg et al. 2015): each image resampled on the grid that an
    affine map ``theta`` (``(batch, 6)`` from ``localization_network``, row-major ``2 x 3``)
    takes the output's coordinates to, with bilinear interpolation.

    Coordinates run over ``[-1, 1]`` on both axes (``theta = [1, 0, 0, 0, 1, 0]`` is the identity);
    source pixels outside the image are taken by ``border_mode``.

    Parameters
    ----------
    incoming : Layer or tuple
        ``(batch, channels, rows, columns)``.
    localization_network : Layer
        Output shape ``(batch, 6)``.
    downsample_factor : float or (float, float)
        The output is ``int(rows / factor[0]) x int(columns / factor[1])``.
    border_mode : {"nearest", "mirror", "wrap"}

    Raises
    ------
    ValueError
        For a wrong input or localization shape, or an unknown border mode.
    """

    def __init__(self, incoming: Any, localization_network: Any, downsample_factor: Any = 1,
                 border_mode: str = "nearest", **kwargs: Any) -> None:
        from synk_lasagne.utils import as_tuple

        super().__init__([incoming, localization_network], **kwargs)
        self.downsample_factor = as_tuple(downsample_factor, 2)
        if border_mode not in BORDER_MODES:
            raise ValueError(f"border_mode must be one of {BORDER_MODES}, got {border_mode!r}")
        self.border_mode = border_mode
        input_shp, loc_shp = self.input_shapes
        if len(input_shp) != 4:
            raise ValueError(f"The input network must have a 4-dimensional output shape: (batch_size, "
                             f"num_input_channels, input_rows, input_columns); got {input_shp}")
        if len(loc_shp) != 2 or loc_shp[1] != 6:
            raise ValueError(f"The localization network must have output shape: (batch_size, 6); got {loc_shp}")

    def get_output_shape_for(self, input_shapes: Any) -> tuple[Any, ...]:
        shape = input_shapes[0]
        return (shape[0], shape[1], *(_scaled_length(n, f) for n, f in zip(shape[2:], self.downsample_factor)))

    def get_output_for(self, inputs: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        import pytensor.tensor as pt

        images, theta = (pt.as_tensor_variable(v) for v in inputs)
        rows, cols = (_scaled_length(images.shape[i], f) for i, f in zip((2, 3), self.downsample_factor))
        dtype = theta.dtype

        def axis(n: Any) -> Any:  # n points evenly over [-1, 1]
            return pt.cast(pt.arange(n), dtype) * (2 / pt.cast(n - 1, dtype)) - 1

        gx, gy = pt.tile(axis(cols)[None, :], (rows, 1)), pt.tile(axis(rows)[:, None], (1, cols))
        grid = pt.stack([gx.flatten(), gy.flatten(), pt.ones_like(gx.flatten())])  # (3, points)
        source = pt.dot(theta.reshape((-1, 2, 3)), grid)  # (batch, 2, points)
        sampled = _bilinear(images.dimshuffle(0, 2, 3, 1), source[:, 0], source[:, 1], self.border_mode)
        return sampled.reshape((images.shape[0], rows, cols, images.shape[1])).dimshuffle(0, 3, 1, 2)


def _tps_kernel(squared_distance: Any, log: Any, maximum: Any) -> Any:
    """The thin-plate-spline radial basis ``U = r^2 log(r^2)`` (0 at ``r = 0``), for numpy or PyTensor."""
    return squared_distance * log(maximum(squared_distance, 1e-30))


class TPSTransformerLayer(MergeLayer):
    """A spatial transformer with a thin-plate spline (Jaderberg et al. 2015; Bookstein 1989):
    ``localization_network`` gives, per example, the offsets ``(batch, 2 * control_points)`` (all
    x, then all y) of a square grid of control points over ``[-1, 1]^2``; each output pixel
    samples the input (bilinearly) where the spline through the moved control points takes it.

    Zero offsets give the identity; equal offsets a translation (a spline reproduces affine maps).

    Parameters
    ----------
    incoming : Layer or tuple
        ``(batch, channels, rows, columns)``.
    localization_network : Layer
        Output shape ``(batch, 2 * control_points)``.
    downsample_factor : float or (float, float)
        The output is ``int(rows / factor[0]) x int(columns / factor[1])``.
    control_points : int
        A square number (default 16: a 4 x 4 grid).
    precompute_grid : "auto" or bool
        Compute the output grid's spline basis once in numpy (needs known rows and columns;
        "auto": when they are known) or in the graph.
    border_mode : {"nearest", "mirror", "wrap"}

    Raises
    ------
    ValueError
        For a wrong input or localization shape, a number of control points that is not a
        square, ``precompute_grid=True`` with unknown lengths, or an unknown border mode.
    """

    def __init__(self, incoming: Any, localization_network: Any, downsample_factor: Any = 1,
                 control_points: int = 16, precompute_grid: Any = "auto", border_mode: str = "nearest",
                 **kwargs: Any) -> None:
        import math

        import numpy as np

        from synk_lasagne.utils import as_tuple

        super().__init__([incoming, localization_network], **kwargs)
        self.downsample_factor = as_tuple(downsample_factor, 2)
        if border_mode not in BORDER_MODES:
            raise ValueError(f"border_mode must be one of {BORDER_MODES}, got {border_mode!r}")
        self.border_mode = border_mode
        self.control_points = int(control_points)
        side = math.isqrt(self.control_points)
        if side * side != self.control_points:
            raise ValueError(f"control_points must be a square number (a grid), got {control_points}")
        input_shp, loc_shp = self.input_shapes
        if len(input_shp) != 4:
            raise ValueError(f"The input network must have a 4-dimensional output shape: (batch_size, "
                             f"num_input_channels, input_rows, input_columns); got {input_shp}")
        if len(loc_shp) != 2 or loc_shp[1] != 2 * self.control_points:
            raise ValueError(f"The localization network must have output shape: (batch_size, "
                             f"2*control_points) = (batch_size, {2 * self.control_points}); got {loc_shp}")
        known = all(n is not None for n in input_shp[2:])
        if precompute_grid is True and not known:
            raise ValueError(f"precompute_grid=True needs the input's rows and columns (shape {input_shp}); use "
                             "'auto' or False")
        self.precompute_grid = known if precompute_grid == "auto" else bool(precompute_grid)
        gx, gy = np.meshgrid(np.linspace(-1, 1, side), np.linspace(-1, 1, side))
        self.source_points = np.stack([gx.ravel(), gy.ravel()])  # (2, N)
        # the spline's system [[K, P], [P^T, 0]] [w; a] = [v; 0], K_ij = U(|c_i - c_j|), P = [1, x, y]
        n = self.control_points
        d2 = ((self.source_points[:, :, None] - self.source_points[:, None, :]) ** 2).sum(axis=0)
        P = np.concatenate([np.ones((n, 1)), self.source_points.T], axis=1)
        system = np.zeros((n + 3, n + 3))
        system[:n, :n] = _tps_kernel(d2, np.log, np.maximum)
        system[:n, n:], system[n:, :n] = P, P.T
        self.inverse_system = np.linalg.inv(system)
        if self.precompute_grid:
            rows, cols = self.get_output_shape_for(self.input_shapes)[2:]
            self.basis = self._basis(np.arange(rows), np.arange(cols), rows, cols, np)

    def get_output_shape_for(self, input_shapes: Any) -> tuple[Any, ...]:
        shape = input_shapes[0]
        return (shape[0], shape[1], *(_scaled_length(n, f) for n, f in zip(shape[2:], self.downsample_factor)))

    def _basis(self, row_index: Any, col_index: Any, rows: Any, cols: Any, xp: Any) -> Any:
        """``[U(|g - c_i|) for each control point; 1; x; y]`` of every output grid point ``g``:
        ``(control_points + 3, rows * columns)`` (``xp``: numpy, or a namespace of PyTensor's)."""
        x = col_index * (2.0 / (cols - 1)) - 1
        y = row_index * (2.0 / (rows - 1)) - 1
        gx = (xp.zeros_like(y)[:, None] + x[None, :]).flatten()
        gy = (y[:, None] + xp.zeros_like(x)[None, :]).flatten()
        d2 = (gx[None, :] - self.source_points[0][:, None]) ** 2 + (gy[None, :] - self.source_points[1][:, None]) ** 2
        kernel = _tps_kernel(d2, xp.log, xp.maximum)
        return xp.concatenate([kernel, xp.ones_like(gx)[None, :], gx[None, :], gy[None, :]], axis=0)

    def get_output_for(self, inputs: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        import types

        import pytensor.tensor as pt

        images, offsets = (pt.as_tensor_variable(v) for v in inputs)
        dtype = offsets.dtype
        rows, cols = (_scaled_length(images.shape[i], f) for i, f in zip((2, 3), self.downsample_factor))
        basis: Any
        if self.precompute_grid:
            basis = pt.constant(self.basis.astype(dtype))
        else:
            xp = types.SimpleNamespace(zeros_like=pt.zeros_like, ones_like=pt.ones_like, log=pt.log,
                                       maximum=pt.maximum, concatenate=pt.concatenate)
            basis = pt.cast(self._basis(pt.cast(pt.arange(rows), dtype), pt.cast(pt.arange(cols), dtype),
                                        pt.cast(rows, dtype), pt.cast(cols, dtype), xp), dtype)
        n = self.control_points
        targets = pt.constant(self.source_points.astype(dtype))[None] + offsets.reshape((-1, 2, n))
        padded = pt.concatenate([targets, pt.zeros((targets.shape[0], 2, 3), dtype=dtype)], axis=2)
        coefficients = pt.dot(padded, pt.constant(self.inverse_system.T.astype(dtype)))  # (batch, 2, n + 3)
        source = pt.dot(coefficients, basis)  # (batch, 2, points)
        sampled = _bilinear(images.dimshuffle(0, 2, 3, 1), source[:, 0], source[:, 1], self.border_mode)
        return sampled.reshape((images.shape[0], rows, cols, images.shape[1])).dimshuffle(0, 3, 1, 2)
