"""Locally connected layers: :class:`LocallyConnected2DLayer` (a convolution whose filters differ at
every output position)."""

from __future__ import annotations

from typing import Any

from synk_lasagne import nonlinearities
from synk_lasagne.conv import _pair
from synk_lasagne.init import GLOROT_UNIFORM, ZEROS
from synk_lasagne.layers.base import Layer

__all__ = ["LocallyConnected2DLayer"]


class LocallyConnected2DLayer(Layer):
    """``out[b, f, y, x] = nonlinearity(sum_{c, i, j} in[b, c, y + i - kh//2, x + j - kw//2] *
    W[f, c, i, j, y, x] + b)``: unshared filters, stride 1, ``"same"`` zero padding.

    Parameters
    ----------
    incoming : Layer or tuple
        ``(batch, channels, rows, columns)``, all but the batch known.
    num_filters : int
    filter_size : int or (int, int)
        Odd lengths.
    stride : 1 or (1, 1)
        The only stride there is.
    pad : "same"
        The only padding there is.
    untie_biases : bool
        One bias per filter and position instead of per filter.
    W : initialiser, array or shared variable
        ``(num_filters, channels, kh, kw, rows, columns)``; with ``channelwise``
        ``(num_filters, kh, kw, rows, columns)`` (channel ``f`` to filter ``f``).
    b : initialiser, array, shared variable or None
    nonlinearity : callable or None
    flip_filters : bool
        Flip the filters' ``kh, kw`` axes (a convolution), as :class:`Conv2DLayer`.
    channelwise : bool
        Each filter reads its own channel only (``num_filters == channels``).

    Raises
    ------
    NotImplementedError
        For another padding or stride.
    ValueError
        For unknown input lengths, or ``channelwise`` with ``num_filters != channels``.
    """

    def __init__(self, incoming: Any, num_filters: int, filter_size: Any, stride: Any = (1, 1), pad: Any = "same",
                 untie_biases: bool = False, W: Any = GLOROT_UNIFORM, b: Any = ZEROS,
                 nonlinearity: Any = nonlinearities.rectify, flip_filters: bool = True, channelwise: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        if len(self.input_shape) != 4:
            raise ValueError(f"LocallyConnected2DLayer needs 4-d input (batch, channels, rows, columns), got "
                             f"{self.input_shape}")
        if pad != "same":
            raise NotImplementedError(f"LocallyConnected2DLayer requires pad='same', got pad={pad!r}")
        if _pair(stride, "stride") != (1, 1):
            raise NotImplementedError(f"LocallyConnected2DLayer requires stride=1 / (1, 1), got stride={stride!r}")
        if any(s is None for s in self.input_shape[1:]):
            raise ValueError("A LocallyConnected2DLayer requires a fixed input shape (except for the batch size); "
                             f"got {self.input_shape}")
        channels, rows, columns = self.input_shape[1:]
        self.num_filters = int(num_filters)
        if channelwise and self.num_filters != channels:
            raise ValueError(f"with channelwise=True, num_filters and the number of input channels should match "
                             f"({num_filters} filters, {channels} channels)")
        self.filter_size = _pair(filter_size, "filter_size")
        self.stride, self.pad = (1, 1), "same"
        self.untie_biases, self.flip_filters, self.channelwise = untie_biases, flip_filters, channelwise
        self.nonlinearity = nonlinearities.identity if nonlinearity is None else nonlinearity
        filters = () if channelwise else (channels,)
        self.W = self.add_param(W, (self.num_filters, *filters, *self.filter_size, rows, columns), name="W")
        if b is None:
            self.b = None
        else:
            self.b = self.add_param(b, (self.num_filters, rows, columns) if untie_biases else (self.num_filters,),
                                    name="b", regularizable=False)

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        return (input_shape[0], self.num_filters, *input_shape[2:])

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        kh, kw = self.filter_size
        rows, columns = self.input_shape[2:]
        top, left = (kh - 1) // 2, (kw - 1) // 2
        padded = pt.zeros((input.shape[0], input.shape[1], rows + kh - 1, columns + kw - 1), dtype=input.dtype)
        padded = pt.set_subtensor(padded[:, :, top:top + rows, left:left + columns], input)
        # patches[b, c, i, j, y, x] = padded[b, c, y + i, x + j]
        patches = pt.stack([pt.stack([padded[:, :, i:i + rows, j:j + columns] for j in range(kw)], axis=2)
                            for i in range(kh)], axis=2)
        W = self.W[..., ::-1, ::-1, :, :] if self.flip_filters else self.W
        if self.channelwise:
            activation = pt.sum(patches * W[None], axis=(2, 3))
        else:
            activation = pt.sum(patches[:, None] * W[None], axis=(2, 3, 4))
        if self.b is not None:
            activation = activation + (self.b[None] if self.untie_biases else self.b[None, :, None, None])
        return self.nonlinearity(activation)
