"""The input of a network: :class:`InputLayer`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from synk_lasagne.layers.base import Layer

__all__ = ["InputLayer"]


class InputLayer(Layer):
    """The network's input: a symbolic variable of a known shape (None for the batch).

    Parameters
    ----------
    shape : tuple of int or None
        E.g. ``(None, 1, 28, 28)``: the lengths given are the variable's static shape, which lets
        every layer above know its own (and PyTensor's JAX backend keep shapes concrete).
    input_var : variable, optional
        Default: a new floatX tensor of ``len(shape)`` dimensions.
    name : str, optional
    """

    def __init__(self, shape: Sequence[int | None], input_var: Any = None, name: str | None = None) -> None:
        import pytensor
        import pytensor.tensor as pt

        self.shape = tuple(None if s is None else int(s) for s in shape)
        if any(s is not None and s <= 0 for s in self.shape):
            raise ValueError(f"InputLayer shape {tuple(shape)} has a length <= 0")
        if input_var is None:
            input_var = pt.tensor(name=f"{name}.input" if name else "input", dtype=pytensor.config.floatX,
                                  shape=self.shape)
        elif input_var.ndim != len(self.shape):
            raise ValueError(f"input_var has {input_var.ndim} dimensions; the InputLayer's shape {self.shape} "
                             f"has {len(self.shape)}")
        self.input_var = input_var
        self.input_layer = None
        self.input_shape = self.shape
        self.name = name
        self.params = OrderedDict()

    @property
    def output_shape(self) -> tuple[int | None, ...]:
        return self.shape
