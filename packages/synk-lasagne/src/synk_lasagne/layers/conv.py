"""Convolution layers: :class:`Conv2DLayer` (on :func:`synk_lasagne.conv.conv2d`)."""

from __future__ import annotations

from typing import Any

from synk_lasagne import nonlinearities
from synk_lasagne.conv import _pair, conv2d, conv_output_length, normalize_pad, resolve_pad
from synk_lasagne.init import GLOROT_UNIFORM, ZEROS
from synk_lasagne.layers.base import Layer

__all__ = ["Conv2DLayer"]


class Conv2DLayer(Layer):
    """``nonlinearity(conv2d(input, W) + b)`` over ``(batch, channels, rows, columns)`` input.

    Parameters
    ----------
    incoming : Layer or tuple
    num_filters : int
    filter_size : int or (int, int)
    stride : int or (int, int)
    pad : {"valid", "full", "same"}, int, (int, int)
        Lasagne's padding: ``"same"`` pads ``filter_size // 2`` (the input's size at stride 1 for
        odd filters), ``"full"`` ``filter_size - 1``; ints are zeros on both sides.
    untie_biases : bool
        One bias per filter and output position instead of per filter.
    W : initialiser, array or shared variable
        ``(num_filters, channels // num_groups, rows, columns)``; default GlorotUniform.
    b : initialiser, array, shared variable or None
        None: no bias (e.g. before a batch norm).
    nonlinearity : callable or None
    flip_filters : bool
        Flip the filters (a true convolution, Lasagne's default, as Theano's ``conv2d``); False for
        a cross-correlation (what the model zoo's weights expect, and a little faster).
    dilation : int or (int, int)
        Spacing of the filter taps (Lasagne's DilatedConv2DLayer).
    num_groups : int
        Grouped convolution: channels and filters in this many independent groups.
    """

    def __init__(self, incoming: Any, num_filters: int, filter_size: Any, stride: Any = (1, 1), pad: Any = 0,
                 untie_biases: bool = False, W: Any = GLOROT_UNIFORM, b: Any = ZEROS,
                 nonlinearity: Any = nonlinearities.rectify, flip_filters: bool = True, dilation: Any = (1, 1),
                 num_groups: int = 1, **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        if len(self.input_shape) != 4:
            raise ValueError(f"Conv2DLayer needs 4-d input (batch, channels, rows, columns), got shape "
                             f"{self.input_shape}")
        channels = self.input_shape[1]
        if channels is None:
            raise ValueError("Conv2DLayer needs the number of input channels: give it to the InputLayer")
        if channels % num_groups or num_filters % num_groups:
            raise ValueError(f"{channels} channels and {num_filters} filters must both split into num_groups="
                             f"{num_groups} groups")
        self.nonlinearity = nonlinearities.identity if nonlinearity is None else nonlinearity
        self.num_filters = int(num_filters)
        self.filter_size = _pair(filter_size, "filter_size")
        self.stride = _pair(stride, "stride")
        self.dilation = _pair(dilation, "dilation")
        self.pad = normalize_pad(pad)
        self.untie_biases = untie_biases
        self.flip_filters = flip_filters
        self.num_groups = int(num_groups)
        self.W = self.add_param(W, (self.num_filters, channels // self.num_groups, *self.filter_size), name="W")
        if b is None:
            self.b = None
        else:
            shape = (self.num_filters, *self.output_shape[2:]) if untie_biases else (self.num_filters,)
            self.b = self.add_param(b, shape, name="b", regularizable=False)

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        pads = resolve_pad(self.pad, self.filter_size, self.dilation)
        spatial = (conv_output_length(n, k, s, p, d)
                   for n, k, s, p, d in zip(input_shape[2:], self.filter_size, self.stride, pads, self.dilation))
        return (input_shape[0], self.num_filters, *spatial)

    def convolve(self, input: Any, **kwargs: Any) -> Any:
        """The convolution alone (no bias, no nonlinearity)."""
        filters = self.W[:, :, ::-1, ::-1] if self.flip_filters else self.W
        return conv2d(input, filters, stride=self.stride, pad=self.pad, dilation=self.dilation,
                      groups=self.num_groups)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        activation = self.convolve(input, **kwargs)
        if self.b is not None:
            activation = activation + (self.b[None] if self.untie_biases else self.b[None, :, None, None])
        return self.nonlinearity(activation)
