"""Convolution layers: :class:`BaseConvLayer`, :class:`Conv1DLayer`, :class:`Conv2DLayer`, :class:`Conv3DLayer`,
:class:`TransposedConv2DLayer` (:class:`Deconv2DLayer`), :class:`TransposedConv3DLayer` (:class:`Deconv3DLayer`),
:class:`DilatedConv2DLayer` (on
:func:`synk_lasagne.conv.conv2d`)."""

from __future__ import annotations

from typing import Any

from synk_lasagne import nonlinearities
from synk_lasagne.conv import PAD_MODES, _pair, conv2d, normalize_pad, resolve_pad
from synk_lasagne.conv import conv_output_length as _padded_length
from synk_lasagne.init import GLOROT_UNIFORM, ZEROS
from synk_lasagne.layers.base import Layer

__all__ = ["BaseConvLayer", "Conv1DLayer", "Conv2DLayer", "Conv3DLayer", "Deconv2DLayer", "Deconv3DLayer",
           "DilatedConv2DLayer", "TransposedConv2DLayer", "TransposedConv3DLayer", "conv_input_length",
           "conv_output_length"]


def conv_output_length(input_length: Any, filter_size: int, stride: int, pad: Any = 0) -> Any:
    """The output length of a convolution along one axis (Lasagne's): ``pad`` ``"valid"`` (0),
    ``"full"`` (``filter_size - 1``), ``"same"`` (the input's length at stride 1) or an int;
    ``ceil(unstrided_length / stride)``.  None for None.

    Raises
    ------
    ValueError
        For another ``pad``.
    """
    if input_length is None:
        return None
    if pad == "valid":
        length = input_length - filter_size + 1
    elif pad == "full":
        length = input_length + filter_size - 1
    elif pad == "same":
        length = input_length
    elif isinstance(pad, int):
        length = input_length + 2 * pad - filter_size + 1
    else:
        raise ValueError(f"Invalid pad: {pad!r} (use 'valid', 'full', 'same' or an int)")
    return (length + stride - 1) // stride


def conv_input_length(output_length: Any, filter_size: int, stride: int, pad: Any = 0) -> Any:
    """The input length of a convolution along one axis whose output is ``output_length`` long
    (Lasagne's; the output length of the transposed convolution): ``(output_length - 1) * stride
    - 2 * pad + filter_size``, ``pad`` as for :func:`conv_output_length` ("same": ``filter_size //
    2``).  The smallest such input: a strided convolution also maps up to ``stride - 1`` longer
    inputs to ``output_length``.  None for None.

    Raises
    ------
    ValueError
        For another ``pad``.
    """
    if output_length is None:
        return None
    pads = {"valid": 0, "full": filter_size - 1, "same": filter_size // 2}
    if isinstance(pad, str) and pad in pads:
        pad = pads[pad]
    elif isinstance(pad, str) or not isinstance(pad, int):
        raise ValueError(f"Invalid pad: {pad!r} (use 'valid', 'full', 'same' or an int)")
    return (output_length - 1) * stride - 2 * pad + filter_size


def _check_same(pad: Any, sizes: Any) -> Any:
    """``pad`` for a layer whose (dilated) filters are ``sizes`` long: "same" with an even size
    raises ``NotImplementedError`` (Lasagne 0.2), or under Lasagne 0.1's behaviour
    (:func:`synk_lasagne.set_lasagne_api`) becomes 0.1's explicit padding, ``size // 2`` before
    and ``(size - 1) // 2`` after (the output as long as the input)."""
    from synk_lasagne.api import lasagne_api

    if not (isinstance(pad, str) and pad == "same") or all(int(k) % 2 for k in sizes):
        return pad
    if lasagne_api() == "0.1":
        return tuple((int(k) // 2, (int(k) - 1) // 2) for k in sizes)
    raise NotImplementedError(f"`same` padding requires odd filter size, got filters of {tuple(sizes)}: pad "
                              "explicitly, or follow Lasagne 0.1 (one less after than before: "
                              "synk_lasagne.set_lasagne_api('0.1'))")


def _add_bias(layer: Any, b: Any, untie_biases: bool) -> Any:
    """A convolution layer's bias parameter (None for ``b=None``): one per filter, or with
    ``untie_biases`` one per filter and output position."""
    if b is None:
        return None
    shape = (layer.num_filters, *layer.output_shape[2:]) if untie_biases else (layer.num_filters,)
    return layer.add_param(b, shape, name="b", regularizable=False)


class BaseConvLayer(Layer):
    """An ``n``-d convolution layer (Lasagne's base class): ``nonlinearity(convolve(input) + b)``
    over ``(batch, channels, *n spatial axes)`` input.  Its subclasses give :meth:`convolve`
    (:class:`Conv1DLayer`, :class:`Conv2DLayer`, :class:`Conv3DLayer`); this class checks the
    settings, makes ``W`` and ``b`` and infers the output shape.

    Parameters
    ----------
    incoming : Layer or tuple
    num_filters : int
    filter_size, stride : int or n ints
    pad : {"valid", "full", "same"}, int or n ints
        "same" needs odd filter sizes (``NotImplementedError``; Lasagne 0.1's behaviour, see
        :func:`synk_lasagne.set_lasagne_api`, pads them one less after than before).
    untie_biases : bool
    W : initialiser, array or shared variable
        ``(num_filters, channels // num_groups, *filter_size)``.
    b, nonlinearity, flip_filters
        As for :class:`Conv2DLayer`.
    n : int, optional
        The number of spatial axes (default: the input's axes less 2).
    num_groups : int
        Channels and filters in this many independent groups; it must divide both.

    Raises
    ------
    ValueError
        For an input of other than ``n + 2`` axes, or ``num_groups`` that is not positive or does
        not divide the channels and the filters.
    """

    def __init__(self, incoming: Any, num_filters: int, filter_size: Any, stride: Any = 1, pad: Any = 0,
                 untie_biases: bool = False, W: Any = GLOROT_UNIFORM, b: Any = ZEROS,
                 nonlinearity: Any = nonlinearities.rectify, flip_filters: bool = True, n: int | None = None,
                 num_groups: int = 1, **kwargs: Any) -> None:
        from synk_lasagne.utils import as_tuple, int_types

        super().__init__(incoming, **kwargs)
        if n is None:
            n = len(self.input_shape) - 2
        elif n != len(self.input_shape) - 2:
            raise ValueError(f"Tried to create a {n}D convolution layer with input shape {self.input_shape}. "
                             f"Expected {n + 2} input dimensions (batchsize, channels, {n} spatial dimensions).")
        self.n = int(n)
        self.nonlinearity = nonlinearities.identity if nonlinearity is None else nonlinearity
        self.num_filters = int(num_filters)
        self.filter_size: Any = tuple(int(k) for k in as_tuple(filter_size, self.n, int_types))
        self.stride: Any = tuple(int(k) for k in as_tuple(stride, self.n, int_types))
        self.untie_biases, self.flip_filters = untie_biases, flip_filters
        if isinstance(pad, str) and pad not in PAD_MODES:
            raise TypeError(f"pad must be 'valid', 'full', 'same', an int or an iterable of int, got {pad!r}")
        if isinstance(pad, str):
            _check_same(pad, self.filter_size)
            self.pad: Any = (0,) * self.n if pad == "valid" else pad
        else:
            self.pad = tuple(int(p) for p in as_tuple(pad, self.n, int_types))
        channels = self.input_shape[1]
        if channels is None:
            raise ValueError(f"{type(self).__name__} needs the number of input channels: give it to the InputLayer")
        if num_groups <= 0:
            raise ValueError(f"num_groups={num_groups} must be positive")
        if channels % num_groups or self.num_filters % num_groups:
            raise ValueError(f"num_groups={num_groups} must evenly divide the input channels ({channels}) and the "
                             f"filters ({self.num_filters})")
        self.num_groups = int(num_groups)
        self.W = self.add_param(W, self.get_W_shape(), name="W")
        self.b = _add_bias(self, b, untie_biases)

    def get_W_shape(self) -> tuple[int, ...]:
        """``W``'s shape: ``(num_filters, channels // num_groups, *filter_size)``."""
        return (self.num_filters, self.input_shape[1] // self.num_groups, *self.filter_size)

    def _axis_pads(self) -> tuple[int, ...]:
        """The zeros on each side of each spatial axis."""
        if self.pad == "full":
            return tuple(k - 1 for k in self.filter_size)
        if self.pad == "same":
            return tuple(k // 2 for k in self.filter_size)
        return tuple(self.pad)

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        spatial = (conv_output_length(length, k, s, p) for length, k, s, p in
                   zip(input_shape[2:], self.filter_size, self.stride, self._axis_pads()))
        return (input_shape[0], self.num_filters, *spatial)

    def convolve(self, input: Any, **kwargs: Any) -> Any:
        """The convolution alone (no bias, no nonlinearity): given by the subclasses.

        Raises
        ------
        NotImplementedError
            Here.
        """
        raise NotImplementedError(f"{type(self).__name__} has no convolve(): use Conv1DLayer, Conv2DLayer or "
                                  "Conv3DLayer, or subclass BaseConvLayer with one")

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        activation = self.convolve(input, **kwargs)
        if self.b is not None:
            bias = self.b[None] if self.untie_biases else self.b.dimshuffle("x", 0, *("x",) * self.n)
            activation = activation + bias
        return self.nonlinearity(activation)


class Conv2DLayer(BaseConvLayer):
    """``nonlinearity(conv2d(input, W) + b)`` over ``(batch, channels, rows, columns)`` input.

    Parameters
    ----------
    incoming : Layer or tuple
    num_filters : int
    filter_size : int or (int, int)
    stride : int or (int, int)
    pad : {"valid", "full", "same"}, int, (int, int)
        Lasagne's padding: ``"same"`` pads ``filter_size // 2`` (the input's size at stride 1; it
        needs odd (dilated) filter sizes, see :class:`BaseConvLayer`), ``"full"``
        ``filter_size - 1``; ints are zeros on both sides.
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
        Layer.__init__(self, incoming, **kwargs)
        if isinstance(pad, str) and pad not in PAD_MODES:
            raise TypeError(f"pad must be 'valid', 'full', 'same', an int or an iterable of int, got {pad!r}")
        if len(self.input_shape) != 4:
            raise ValueError(f"Conv2DLayer needs 4-d input (batch, channels, rows, columns), got shape "
                             f"{self.input_shape}")
        filter_size, dilation = _pair(filter_size, "filter_size"), _pair(dilation, "dilation")
        pad = _check_same(pad, [d * (k - 1) + 1 for k, d in zip(filter_size, dilation)])
        self._setup(num_filters, filter_size, _pair(stride, "stride"), normalize_pad(pad), dilation, untie_biases,
                    W, b, nonlinearity, flip_filters, num_groups)

    def _setup(self, num_filters: int, filter_size: tuple[int, int], stride: tuple[int, int], pad: Any,
               dilation: tuple[int, int], untie_biases: bool, W: Any, b: Any, nonlinearity: Any,
               flip_filters: bool, num_groups: int, filter_axes: int = 2, channels_first: bool = False) -> None:
        """What Conv2DLayer and Conv1DLayer share, on 2-d sizes: attributes, ``W`` (its last
        ``filter_axes`` sizes of ``filter_size``; ``channels_first``: ``(channels, num_filters, ...)``)
        and ``b``."""
        channels = self.input_shape[1]
        if channels is None:
            raise ValueError(f"{type(self).__name__} needs the number of input channels: give it to the InputLayer")
        if num_groups <= 0:
            raise ValueError(f"num_groups={num_groups} must be positive")
        if channels % num_groups or num_filters % num_groups:
            raise ValueError(f"num_groups={num_groups} must evenly divide the input channels ({channels}) and the "
                             f"filters ({num_filters})")
        self.n = filter_axes
        self.nonlinearity = nonlinearities.identity if nonlinearity is None else nonlinearity
        self.num_filters = int(num_filters)
        self.filter_size = filter_size
        self.stride = stride
        self.dilation = dilation
        self.pad = pad
        self.untie_biases = untie_biases
        self.flip_filters = flip_filters
        self.num_groups = int(num_groups)
        axes = (self.num_filters, channels // self.num_groups)
        self._W_shape = (*(axes[::-1] if channels_first else axes), *filter_size[2 - filter_axes:])
        self.W = self.add_param(W, self._W_shape, name="W")
        self.b = _add_bias(self, b, untie_biases)

    def get_W_shape(self) -> tuple[int, ...]:
        """``W``'s shape."""
        return self._W_shape

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        pads = resolve_pad(self.pad, self.filter_size, self.dilation)
        spatial = (_padded_length(n, k, s, p, d)
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


def _single_pad(pad: Any) -> Any:
    """A 1-d layer's ``pad`` as :func:`~synk_lasagne.conv.normalize_pad` takes it for ``(1, length)`` images."""
    from synk_lasagne.utils import as_tuple, int_types

    if isinstance(pad, str):
        if pad not in ("valid", "full", "same"):
            raise TypeError(f"pad must be 'valid', 'full', 'same', an int or an iterable of int, got {pad!r}")
        return pad
    (p,) = as_tuple(pad, 1, int_types)
    return ((0, 0), (int(p), int(p)))


class Conv1DLayer(Conv2DLayer):
    """``nonlinearity(conv1d(input, W) + b)`` over ``(batch, channels, length)`` input (Lasagne's).

    The convolution of :class:`Conv2DLayer` over ``(batch, channels, 1, length)``.

    Parameters
    ----------
    incoming : Layer or tuple
    num_filters : int
    filter_size : int or (int,)
    stride : int or (int,)
    pad : {"valid", "full", "same"}, int or (int,)
    untie_biases : bool
    W : initialiser, array or shared variable
        ``(num_filters, channels // num_groups, filter_size)``.
    b, nonlinearity, flip_filters, num_groups
        As for :class:`Conv2DLayer`.
    dilation : int or (int,)
    """

    def __init__(self, incoming: Any, num_filters: int, filter_size: Any, stride: Any = 1, pad: Any = 0,
                 untie_biases: bool = False, W: Any = GLOROT_UNIFORM, b: Any = ZEROS,
                 nonlinearity: Any = nonlinearities.rectify, flip_filters: bool = True, dilation: Any = 1,
                 num_groups: int = 1, **kwargs: Any) -> None:
        from synk_lasagne.utils import as_tuple, int_types

        Layer.__init__(self, incoming, **kwargs)
        if len(self.input_shape) != 3:
            raise ValueError(f"Tried to create a 1D convolution layer with input shape {self.input_shape}. "
                             "Expected 3 input dimensions (batchsize, channels, 1 spatial dimensions).")
        (size,), (spacing,) = as_tuple(filter_size, 1, int_types), as_tuple(dilation, 1, int_types)
        pad = _check_same(pad, (spacing * (size - 1) + 1,))
        pad = ((0, 0), pad[0]) if isinstance(pad, tuple) and isinstance(pad[0], tuple) else _single_pad(pad)
        self._setup(num_filters, (1, size), (1, *as_tuple(stride, 1, int_types)), normalize_pad(pad),
                    (1, spacing), untie_biases, W, b, nonlinearity, flip_filters, num_groups, filter_axes=1)

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        batch, _, *spatial = super().get_output_shape_for((*input_shape[:2], 1, input_shape[2]))
        return (batch, self.num_filters, spatial[1])

    def convolve(self, input: Any, **kwargs: Any) -> Any:
        """The convolution alone (no bias, no nonlinearity)."""
        filters = self.W[:, :, None, ::-1] if self.flip_filters else self.W[:, :, None, :]
        out = conv2d(input[:, :, None, :], filters, stride=self.stride, pad=self.pad, dilation=self.dilation,
                     groups=self.num_groups)
        return out[:, :, 0, :]

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        activation = self.convolve(input, **kwargs)
        if self.b is not None:
            activation = activation + (self.b[None] if self.untie_biases else self.b[None, :, None])
        return self.nonlinearity(activation)


def _transposed_length(length: Any, filter_size: int, stride: int, crop: tuple[Any, Any]) -> Any:
    """The input length of a convolution whose output has ``length``: ``(length - 1) * stride +
    filter_size - crop_before - crop_after`` (None for None)."""
    if length is None:
        return None
    return (length - 1) * stride + filter_size - crop[0] - crop[1]


class TransposedConv2DLayer(Conv2DLayer):
    """The transpose of a convolution (a "deconvolution", Zeiler et al. 2010; upsampling by
    ``stride``): the gradient of ``conv2d(z, W, stride, pad=crop)`` with respect to ``z``,
    applied to the input.

    ``W`` is ``(channels, num_filters, rows, columns)`` -- the filters of the convolution this
    layer transposes, which maps ``num_filters`` channels to the input's ``channels``.  The
    output is ``(in - 1) * stride + filter_size - 2 * crop`` long (``crop`` as a convolution's
    ``pad``: "valid" 0, "full" ``filter_size - 1``, "same" ``filter_size // 2``), or
    ``output_size`` (which may add up to ``stride - 1`` rows or columns).

    Parameters
    ----------
    incoming : Layer or tuple
    num_filters : int
    filter_size, stride : int or (int, int)
    crop : {"valid", "full", "same"}, int or (int, int)
    untie_biases : bool
    W, b, nonlinearity
        As for :class:`Conv2DLayer`.
    flip_filters : bool
        False (Lasagne's default here): the transpose of a true convolution (flipped filters);
        True: of a cross-correlation.
    output_size : int, (int, int) or symbolic vector of 2 ints, optional
        The output's rows and columns; a symbolic one (e.g. a shared variable) is read when the
        graph runs (the output shape then has None there).
    """

    def __init__(self, incoming: Any, num_filters: int, filter_size: Any, stride: Any = (1, 1), crop: Any = 0,
                 untie_biases: bool = False, W: Any = GLOROT_UNIFORM, b: Any = ZEROS,
                 nonlinearity: Any = nonlinearities.rectify, flip_filters: bool = False, output_size: Any = None,
                 **kwargs: Any) -> None:
        Layer.__init__(self, incoming, **kwargs)
        if len(self.input_shape) != 4:
            raise ValueError(f"TransposedConv2DLayer needs 4-d input (batch, channels, rows, columns), got shape "
                             f"{self.input_shape}")
        self.crop = normalize_pad(crop)
        from pytensor.graph.basic import Variable

        self.output_size: Any = (output_size if output_size is None or isinstance(output_size, Variable)
                            else _pair(output_size, "output_size"))
        self._setup(num_filters, _pair(filter_size, "filter_size"), _pair(stride, "stride"), self.crop, (1, 1),
                    untie_biases, W, b, nonlinearity, flip_filters, 1, channels_first=True)

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        from pytensor.graph.basic import Variable

        if isinstance(self.output_size, Variable):  # known when the graph runs
            return (input_shape[0], self.num_filters, None, None)
        if self.output_size is not None:
            return (input_shape[0], self.num_filters, *self.output_size)
        crops = resolve_pad(self.crop, self.filter_size, self.dilation)
        spatial = (_transposed_length(n, k, s, c) for n, k, s, c in zip(input_shape[2:], self.filter_size,
                                                                          self.stride, crops))
        return (input_shape[0], self.num_filters, *spatial)

    def convolve(self, input: Any, **kwargs: Any) -> Any:
        """The transposed convolution alone (no bias, no nonlinearity)."""
        import pytensor
        import pytensor.tensor as pt

        input = pt.as_tensor_variable(input)
        if self.output_size is not None:
            rows, cols = self.output_size[0], self.output_size[1]
        else:
            rows, cols = self.get_output_shape_for((None, None, input.shape[2], input.shape[3]))[2:]
        z = pt.zeros((input.shape[0], self.num_filters, rows, cols), dtype=input.dtype)
        filters = self.W if self.flip_filters else self.W[:, :, ::-1, ::-1]
        forward = conv2d(z, filters, stride=self.stride, pad=self.crop)
        return pytensor.grad(None, wrt=z, known_grads={forward: input})


Deconv2DLayer = TransposedConv2DLayer


class DilatedConv2DLayer(Conv2DLayer):
    """A dilated ("atrous") convolution with Lasagne's DilatedConv2DLayer interface: ``W`` is
    ``(channels, num_filters, rows, columns)``, no padding, stride 1, and ``flip_filters=False``
    (a cross-correlation) by default.  :class:`Conv2DLayer` takes ``dilation=`` too.

    Parameters
    ----------
    incoming : Layer or tuple
    num_filters : int
    filter_size, dilation : int or (int, int)
    pad : 0 or "valid"
    untie_biases, W, b, nonlinearity
        As for :class:`Conv2DLayer` (W's first two axes swapped).
    flip_filters : False
        A cross-correlation, as Lasagne's (``Conv2DLayer(dilation=...)`` flips).

    Raises
    ------
    NotImplementedError
        For any padding, or ``flip_filters=True``.
    """

    def __init__(self, incoming: Any, num_filters: int, filter_size: Any, dilation: Any = (1, 1), pad: Any = 0,
                 untie_biases: bool = False, W: Any = GLOROT_UNIFORM, b: Any = ZEROS,
                 nonlinearity: Any = nonlinearities.rectify, flip_filters: bool = False, **kwargs: Any) -> None:
        Layer.__init__(self, incoming, **kwargs)
        if pad not in (0, (0, 0), [0, 0], "valid"):
            raise NotImplementedError(f"DilatedConv2DLayer requires pad=0 / (0,0) / 'valid', got {pad!r}: use "
                                      "Conv2DLayer(dilation=...) for a padded dilated convolution")
        if flip_filters:
            raise NotImplementedError("DilatedConv2DLayer requires flip_filters=False (as Lasagne's): for a dilated "
                                      "true convolution use Conv2DLayer(dilation=..., flip_filters=True)")
        if len(self.input_shape) != 4:
            raise ValueError(f"DilatedConv2DLayer needs 4-d input (batch, channels, rows, columns), got shape "
                             f"{self.input_shape}")
        self._setup(num_filters, _pair(filter_size, "filter_size"), (1, 1), normalize_pad(0),
                    _pair(dilation, "dilation"), untie_biases, W, b, nonlinearity, flip_filters, 1,
                    channels_first=True)

    def convolve(self, input: Any, **kwargs: Any) -> Any:
        """The dilated convolution alone (no bias, no nonlinearity)."""
        return conv2d(input, self.W.dimshuffle(1, 0, 2, 3), dilation=self.dilation)


class Conv3DLayer(BaseConvLayer):
    """``nonlinearity(conv3d(input, W) + b)`` over ``(batch, channels, depth, rows, columns)`` input:
    one :func:`~synk_lasagne.conv.conv2d` per depth tap of the filters, over every output depth
    at once (the depths folded into the batch), summed.

    Parameters
    ----------
    incoming : Layer or tuple
    num_filters : int
    filter_size, stride : int or (int, int, int)
    pad : {"valid", "full", "same"}, int or (int, int, int)
        "same" needs odd filter sizes.
    untie_biases : bool
    W : initialiser, array or shared variable
        ``(num_filters, channels // num_groups, depth, rows, columns)``.
    b, nonlinearity, flip_filters, num_groups
        As for :class:`Conv2DLayer`.
    """

    def __init__(self, incoming: Any, num_filters: int, filter_size: Any, stride: Any = (1, 1, 1), pad: Any = 0,
                 untie_biases: bool = False, W: Any = GLOROT_UNIFORM, b: Any = ZEROS,
                 nonlinearity: Any = nonlinearities.rectify, flip_filters: bool = True, num_groups: int = 1,
                 **kwargs: Any) -> None:
        super().__init__(incoming, num_filters, filter_size, stride, pad, untie_biases, W, b, nonlinearity,
                         flip_filters, n=3, num_groups=num_groups, **kwargs)
        self._pads = self._axis_pads()

    def convolve(self, input: Any, **kwargs: Any) -> Any:
        """The convolution alone (no bias, no nonlinearity)."""
        W = self.W[:, :, ::-1, ::-1, ::-1] if self.flip_filters else self.W
        return _correlate3d(input, W, (self.num_filters, *self.filter_size), self.stride, self._pads, self.num_groups)


def _correlate3d(input: Any, W: Any, sizes: tuple[int, ...], stride: tuple[int, ...], pads: tuple[int, ...],
                 groups: int) -> Any:
    """The 3-d cross-correlation of ``input`` ``(batch, channels, depth, rows, columns)`` with ``W``
    ``(filters, channels // groups, depth, rows, columns)`` (``sizes``: the filters and their
    depth, rows and columns), ``pads`` zeros on both sides of each
    spatial axis: one :func:`~synk_lasagne.conv.conv2d` per depth tap, over every output depth at
    once (the depths folded into the batch), summed."""
    import pytensor.tensor as pt

    depth_pad, row_pad, col_pad = pads
    if depth_pad:
        input = pt.pad(input, [(0, 0), (0, 0), (depth_pad, depth_pad), (0, 0), (0, 0)])
    batch, channels = input.shape[0], input.shape[1]
    filters, kd, sd = sizes[0], sizes[1], stride[0]
    depth = (input.shape[2] - kd) // sd + 1
    total = None
    for k in range(kd):
        taps = input[:, :, k:k + sd * (depth - 1) + 1:sd]  # (batch, channels, depth, rows, columns)
        folded = taps.dimshuffle(0, 2, 1, 3, 4).reshape((-1, channels, taps.shape[3], taps.shape[4]))
        conved = conv2d(folded, W[:, :, k], stride=stride[1:], pad=(row_pad, col_pad), groups=groups)
        term = conved.reshape((batch, depth, filters, conved.shape[2], conved.shape[3]))
        total = term if total is None else total + term
    assert total is not None
    return total.dimshuffle(0, 2, 1, 3, 4)


class TransposedConv3DLayer(BaseConvLayer):
    """The transpose of a 3-d convolution (Lasagne's; upsampling by ``stride``): the gradient of
    :class:`Conv3DLayer`'s convolution of ``z`` (``pad=crop``) with respect to ``z``, applied to the
    input.

    ``W`` is ``(channels, num_filters, depth, rows, columns)``, the filters of the convolution this
    layer transposes.  The output is ``(in - 1) * stride + filter_size - 2 * crop`` long along each
    spatial axis (``synk_lasagne.layers.conv.conv_input_length``), or ``output_size``.

    Parameters
    ----------
    incoming : Layer or tuple
    num_filters : int
    filter_size, stride : int or (int, int, int)
    crop : {"valid", "full", "same"}, int or (int, int, int)
        As a convolution's ``pad``.
    untie_biases, b, nonlinearity
        As for :class:`Conv2DLayer`.
    W : initialiser, array or shared variable
        ``(channels, num_filters, depth, rows, columns)``.
    flip_filters : bool
        False (Lasagne's default): the transpose of a true convolution; True: of a cross-correlation.
    output_size : int, 3 ints or symbolic vector of 3 ints, optional
        As for :class:`TransposedConv2DLayer`.
    """

    def __init__(self, incoming: Any, num_filters: int, filter_size: Any, stride: Any = (1, 1, 1), crop: Any = 0,
                 untie_biases: bool = False, W: Any = GLOROT_UNIFORM, b: Any = ZEROS,
                 nonlinearity: Any = nonlinearities.rectify, flip_filters: bool = False, output_size: Any = None,
                 **kwargs: Any) -> None:
        from pytensor.graph.basic import Variable

        from synk_lasagne.utils import as_tuple, int_types

        self.output_size: Any = (output_size if output_size is None or isinstance(output_size, Variable)
                                 else tuple(int(s) for s in as_tuple(output_size, 3, int_types)))
        super().__init__(incoming, num_filters, filter_size, stride, crop, untie_biases, W, b, nonlinearity,
                         flip_filters, n=3, **kwargs)
        self.crop = self.pad

    def get_W_shape(self) -> tuple[int, ...]:
        """``W``'s shape: ``(channels, num_filters, *filter_size)``."""
        return (self.input_shape[1], self.num_filters, *self.filter_size)

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        from pytensor.graph.basic import Variable

        if isinstance(self.output_size, Variable):  # known when the graph runs
            return (input_shape[0], self.num_filters, None, None, None)
        if self.output_size is not None:
            return (input_shape[0], self.num_filters, *self.output_size)
        spatial = (conv_input_length(length, k, s, p) for length, k, s, p in
                   zip(input_shape[2:], self.filter_size, self.stride, self._axis_pads()))
        return (input_shape[0], self.num_filters, *spatial)

    def convolve(self, input: Any, **kwargs: Any) -> Any:
        """The transposed convolution alone (no bias, no nonlinearity)."""
        import pytensor
        import pytensor.tensor as pt

        input = pt.as_tensor_variable(input)
        if self.output_size is not None:
            size = [self.output_size[i] for i in range(3)]
        else:
            size = list(self.get_output_shape_for((None, None, *(input.shape[i] for i in range(2, 5))))[2:])
        z = pt.zeros((input.shape[0], self.num_filters, *size), dtype=input.dtype)
        filters = self.W if self.flip_filters else self.W[:, :, ::-1, ::-1, ::-1]
        forward = _correlate3d(z, filters, (self.input_shape[1], *self.filter_size), self.stride,
                               self._axis_pads(), 1)
        return pytensor.grad(None, wrt=z, known_grads={forward: input})


Deconv3DLayer = TransposedConv3DLayer
