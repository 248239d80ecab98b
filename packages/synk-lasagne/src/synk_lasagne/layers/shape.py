"""Layers that change shape: :class:`FlattenLayer`, :class:`ReshapeLayer`."""

from __future__ import annotations

from typing import Any

import numpy as np

from synk_lasagne.layers.base import Layer

__all__ = ["FlattenLayer", "ReshapeLayer", "flatten", "reshape"]


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
        return input.flatten(self.outdim)


class ReshapeLayer(Layer):
    """The input reshaped: ``shape`` of ints, ``-1`` (inferred, at most once) and ``[i]`` (the
    input's length along axis ``i``), as Lasagne's, e.g. ``([0], -1)``."""

    def __init__(self, incoming: Any, shape: Any, **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        shape = tuple(shape)
        for s in shape:
            ok = (isinstance(s, (int, np.integer)) and (s > 0 or s == -1)) or (
                isinstance(s, list) and len(s) == 1 and isinstance(s[0], int) and 0 <= s[0] < len(self.input_shape))
            if not ok:
                raise ValueError(f"ReshapeLayer shape entries must be positive ints, -1 or [axis of the input], "
                                 f"got {s!r} in {shape}")
        if sum(1 for s in shape if s == -1) > 1:
            raise ValueError(f"ReshapeLayer shape {shape} has more than one -1")
        self.shape = shape

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        out = [input_shape[s[0]] if isinstance(s, list) else s for s in self.shape]
        if -1 not in out:
            return tuple(out)
        # an unknown length copied by [i] cancels out of the sizes (Lasagne's rule)
        masked_in, masked_out = list(input_shape), list(out)
        for position, s in enumerate(self.shape):
            if isinstance(s, list) and input_shape[s[0]] is None:
                masked_in[s[0]], masked_out[position] = 1, 1
        known = [n for n in masked_out if n != -1]
        unknown = None in masked_in or None in known
        out[out.index(-1)] = None if unknown else int(np.prod(masked_in)) // int(np.prod(known))
        return tuple(out)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        shape = [input.shape[s[0]] if isinstance(s, list) else s for s in self.shape]
        return input.reshape(shape, ndim=len(shape))


flatten = FlattenLayer
reshape = ReshapeLayer
