"""Layers that change shape: :class:`FlattenLayer`, :class:`ReshapeLayer`."""

from __future__ import annotations

from typing import Any

import numpy as np

from synk_lasagne.layers.base import Layer

__all__ = ["DimshuffleLayer", "FlattenLayer", "PadLayer", "ReshapeLayer", "SliceLayer", "dimshuffle", "flatten",
           "pad", "reshape"]


class FlattenLayer(Layer):
    """The trailing axes merged so that the output has ``outdim`` dimensions (default 2)."""

    def __init__(self, incoming: Any, outdim: int = 2, **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        if outdim < 1:
            raise ValueError(f"outdim must be >= 1, got {outdim}")
        self.outdim = outdim

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        rest = input_shape[self.outdim - 1:]
        merged = None if None in rest else int(np.prod(rest))
        return (*input_shape[:self.outdim - 1], merged)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        return merge_trailing(input, self.outdim, self.input_shape)


def merge_trailing(input: Any, outdim: int, input_shape: tuple[Any, ...]) -> Any:
    """``input.flatten(outdim)``, with the merged length written out where ``input_shape`` knows
    the merged axes: a reshape to ``-1`` cannot infer it from a batch of zero rows (a data-parallel
    rank without rows), nor can JAX."""
    rest = input_shape[outdim - 1:]
    if outdim < 1 or len(rest) != input.ndim - outdim + 1 or any(not isinstance(n, int) for n in rest):
        return input.flatten(outdim)
    return input.reshape((*(input.shape[i] for i in range(outdim - 1)), int(np.prod(rest))), ndim=outdim)


class ReshapeLayer(Layer):
    """The input reshaped: ``shape`` of ints, ``-1`` (inferred, at most once), ``[i]`` (the
    input's length along axis ``i``) and scalar expressions (lengths known at run time), as
    Lasagne's, e.g. ``([0], -1)``.

    Raises
    ------
    ValueError
        For an invalid entry, or known sizes that do not match the input's.
    """

    def __init__(self, incoming: Any, shape: Any, **kwargs: Any) -> None:
        from pytensor.graph.basic import Variable

        super().__init__(incoming, **kwargs)
        shape = tuple(shape)
        for s in shape:
            ok = (isinstance(s, (int, np.integer)) and (s > 0 or s == -1)) or (
                isinstance(s, list) and len(s) == 1 and isinstance(s[0], int) and 0 <= s[0] < len(self.input_shape)
            ) or (isinstance(s, Variable) and getattr(s, "ndim", None) == 0)
            if not ok:
                raise ValueError(f"ReshapeLayer shape entries must be positive ints, -1, [axis of the input] or "
                                 f"scalar expressions, got {s!r} in {shape}")
        if sum(1 for s in shape if isinstance(s, (int, np.integer)) and s == -1) > 1:
            raise ValueError(f"ReshapeLayer shape {shape} has more than one -1")
        self.shape = shape
        self.get_output_shape_for(self.input_shape)  # checks the sizes

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        from pytensor.graph.basic import Variable

        def length(n: Any) -> Any:
            return None if isinstance(n, Variable) else n

        input_shape = [length(n) for n in input_shape]
        out = [input_shape[s[0]] if isinstance(s, list) else length(s) for s in self.shape]
        # an unknown length copied by [i] cancels out of the sizes once (Lasagne's rule)
        masked_in, masked_out = list(input_shape), list(out)
        for position, s in enumerate(self.shape):
            if isinstance(s, list) and masked_in[s[0]] is None:
                masked_in[s[0]], masked_out[position] = 1, 1
        known_out = [n for n in masked_out if n != -1]
        if None in masked_in or None in known_out:
            return tuple(None if n == -1 else n for n in out)
        size_in, size_out = int(np.prod(masked_in)), int(np.prod(known_out))
        if -1 in out:
            if size_in % size_out:
                raise ValueError(f"ReshapeLayer: the input shape {tuple(input_shape)} does not match the shape "
                                 f"{self.shape} (its known sizes do not divide the input's size)")
            out[out.index(-1)] = size_in // size_out
        elif size_in != size_out:
            raise ValueError(f"ReshapeLayer: the input shape {tuple(input_shape)} does not match the shape "
                             f"{self.shape} (sizes {size_in} and {size_out})")
        return tuple(out)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        shape = [input.shape[s[0]] if isinstance(s, list) else s for s in self.shape]
        return input.reshape(shape, ndim=len(shape))


flatten = FlattenLayer
reshape = ReshapeLayer


class DimshuffleLayer(Layer):
    """The input's axes reordered by ``pattern``: axis indices, and ``"x"`` for new axes of length 1.

    Axes left out must have length 1 (or be unknown); each index may appear once.
    """

    def __init__(self, incoming: Any, pattern: Any, **kwargs: Any) -> None:
        from synk_lasagne.utils import int_types

        super().__init__(incoming, **kwargs)
        used: set[int] = set()
        for p in pattern:
            if isinstance(p, int_types):
                if p in used:
                    raise ValueError(f"pattern contains dimension {p} more than once")
                used.add(int(p))
            elif p != "x":
                raise ValueError(f"pattern should only contain dimension indices or 'x', not {p!r}")
        self.pattern = tuple(pattern)
        self.get_output_shape_for(self.input_shape)  # checks the pattern against the input

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        out = []
        used = [False] * len(input_shape)
        for p in self.pattern:
            if p == "x":
                out.append(1)
                continue
            if p < 0 or p >= len(input_shape):
                raise ValueError(f"pattern contains {p}, but input shape has {len(input_shape)} dimensions only")
            out.append(input_shape[p])
            used[p] = True
        for axis, (length, kept) in enumerate(zip(input_shape, used)):
            if not kept and length not in (1, None):
                raise ValueError(f"pattern attempted to collapse dimension {axis} of size {length}; dimensions "
                                 "with size != 1/None are not broadcastable and cannot be collapsed")
        return tuple(out)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        dropped = [a for a in range(input.ndim) if a not in self.pattern]
        if dropped:  # lengths of 1 (or unknown: checked when run) the pattern leaves out
            input = pt.specify_broadcastable(input, *dropped)
        return input.dimshuffle(self.pattern)


dimshuffle = DimshuffleLayer


class PadLayer(Layer):
    """The input padded with ``val`` along every axis after the first ``batch_ndim``
    (:func:`synk_lasagne.theano_extensions.padding.pad`)."""

    def __init__(self, incoming: Any, width: Any, val: float = 0, batch_ndim: int = 2, **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.width, self.val, self.batch_ndim = width, val, batch_ndim

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        from synk_lasagne.utils import int_types

        out = list(input_shape)
        widths = [self.width] * (len(input_shape) - self.batch_ndim) if isinstance(self.width, int_types) \
            else self.width
        for k, w in enumerate(widths):
            axis = k + self.batch_ndim
            if out[axis] is not None:
                before, after = (w, w) if isinstance(w, int_types) else w
                out[axis] = out[axis] + before + after
        return tuple(out)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        from synk_lasagne.theano_extensions.padding import pad as pad_tensor

        return pad_tensor(input, self.width, self.val, self.batch_ndim)


pad = PadLayer


class SliceLayer(Layer):
    """``input[..., indices]`` along ``axis``: an int drops the axis, a slice keeps it."""

    def __init__(self, incoming: Any, indices: Any, axis: int = -1, **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.slice, self.axis = indices, axis

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        from synk_lasagne.utils import int_types

        out = list(input_shape)
        if isinstance(self.slice, int_types):
            del out[self.axis]
        elif input_shape[self.axis] is not None:
            out[self.axis] = len(range(*self.slice.indices(input_shape[self.axis])))
        else:
            out[self.axis] = None
        return tuple(out)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        axis = self.axis % input.ndim
        return input[(slice(None),) * axis + (self.slice,)]
