"""1-d convolutions under Lasagne's names (``lasagne.theano_extensions.conv``).

Lasagne offers six ways of computing a 1-d convolution on Theano; on PyTensor every one is the
same computation, :func:`synk_lasagne.conv.conv2d` over ``(batch, channels, 1, length)``, kept
under each name with its signature and its checks.  ``filter_flip=True`` is a true convolution
(the filters flipped), False a cross-correlation.
"""

from __future__ import annotations

from typing import Any

__all__ = ["conv1d_mc0", "conv1d_mc1", "conv1d_md", "conv1d_sc", "conv1d_sd", "conv1d_unstrided"]


def _conv1d(name: str, input: Any, filters: Any, border_mode: Any, subsample: Any, filter_flip: bool,
            pads_allowed: bool, filter_shape: Any = None, needs_multiple: bool = False) -> Any:
    from synk_lasagne.conv import conv2d
    from synk_lasagne.utils import int_types

    if isinstance(border_mode, str) and border_mode in ("valid", "full"):
        pad: Any = border_mode
    elif pads_allowed and isinstance(border_mode, int_types):
        pad = ((0, 0), (int(border_mode), int(border_mode)))
    elif pads_allowed and isinstance(border_mode, tuple) and len(border_mode) == 1:
        pad = ((0, 0), (int(border_mode[0]), int(border_mode[0])))
    else:
        raise RuntimeError(f"Unsupported border_mode for {name}: {border_mode}")
    (stride,) = tuple(subsample)
    if needs_multiple and filter_shape is not None and filter_shape[2] % stride:
        raise RuntimeError(f"Filter length ({filter_shape[2]}) is not a multiple of the stride ({stride}) "
                           f"({name} needs it)")
    kernel = filters[:, :, None, ::-1] if filter_flip else filters[:, :, None, :]
    return conv2d(input[:, :, None, :], kernel, stride=(1, int(stride)), pad=pad)[:, :, 0, :]


def conv1d_sc(input: Any, filters: Any, image_shape: Any = None, filter_shape: Any = None,
              border_mode: Any = "valid", subsample: Any = (1,), filter_flip: bool = True) -> Any:
    """1-d convolution of ``(batch, channels, length)`` by ``(filters, channels, length)``;
    ``border_mode`` "valid" or "full"."""
    return _conv1d("conv1d_sc", input, filters, border_mode, subsample, filter_flip, False)


def conv1d_mc0(input: Any, filters: Any, image_shape: Any = None, filter_shape: Any = None,
               border_mode: Any = "valid", subsample: Any = (1,), filter_flip: bool = True) -> Any:
    """As :func:`conv1d_sc`; ``border_mode`` may also be an int (or ``(int,)``) of zero padding."""
    return _conv1d("conv1d_mc0", input, filters, border_mode, subsample, filter_flip, True)


def conv1d_mc1(input: Any, filters: Any, image_shape: Any = None, filter_shape: Any = None,
               border_mode: Any = "valid", subsample: Any = (1,), filter_flip: bool = True) -> Any:
    """As :func:`conv1d_mc0`."""
    return _conv1d("conv1d_mc1", input, filters, border_mode, subsample, filter_flip, True)


def conv1d_unstrided(input: Any, filters: Any, image_shape: Any, filter_shape: Any, border_mode: Any = "valid",
                     subsample: Any = (1,), filter_flip: bool = True) -> Any:
    """As :func:`conv1d_sc`; the filter length must be a multiple of the stride (Lasagne's check)."""
    return _conv1d("conv1d_unstrided", input, filters, border_mode, subsample, filter_flip, False, filter_shape,
                   True)


def conv1d_sd(input: Any, filters: Any, image_shape: Any, filter_shape: Any, border_mode: Any = "valid",
              subsample: Any = (1,), filter_flip: bool = True) -> Any:
    """As :func:`conv1d_unstrided`."""
    return _conv1d("conv1d_sd", input, filters, border_mode, subsample, filter_flip, False, filter_shape, True)


def conv1d_md(input: Any, filters: Any, image_shape: Any, filter_shape: Any, border_mode: Any = "valid",
              subsample: Any = (1,), filter_flip: bool = True) -> Any:
    """As :func:`conv1d_unstrided`."""
    return _conv1d("conv1d_md", input, filters, border_mode, subsample, filter_flip, False, filter_shape, True)
