"""Embedding layer: :class:`EmbeddingLayer` (Lasagne's)."""

from __future__ import annotations

from typing import Any

from synk_lasagne.init import Normal
from synk_lasagne.layers.base import Layer

__all__ = ["EmbeddingLayer"]


class EmbeddingLayer(Layer):
    """Rows of ``W`` (``(input_size, output_size)``) indexed by the integer input: the output has
    the input's shape plus a last axis of ``output_size``."""

    def __init__(self, incoming: Any, input_size: int, output_size: int, W: Any = None, **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.input_size, self.output_size = int(input_size), int(output_size)
        self.W = self.add_param(Normal() if W is None else W, (self.input_size, self.output_size), name="W")

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        return (*input_shape, self.output_size)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        return self.W[input]
