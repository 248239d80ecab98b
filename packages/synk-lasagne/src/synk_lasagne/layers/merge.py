"""Layers that combine several inputs: :class:`ElemwiseSumLayer`, :class:`ConcatLayer`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from synk_lasagne.layers.base import MergeLayer

__all__ = ["ConcatLayer", "ElemwiseSumLayer", "concat"]


def _merged_shape(shapes: Sequence[tuple[Any, ...]], what: str) -> tuple[Any, ...]:
    """The common shape (a known length wins over None); ValueError for lengths that differ."""
    if len({len(s) for s in shapes}) != 1:
        raise ValueError(f"{what}: the inputs have different numbers of dimensions: {list(shapes)}")
    out = []
    for lengths in zip(*shapes):
        known = {n for n in lengths if n is not None}
        if len(known) > 1:
            raise ValueError(f"{what}: the input shapes {list(shapes)} differ")
        out.append(known.pop() if known else None)
    return tuple(out)


class ElemwiseSumLayer(MergeLayer):
    """``sum_i coeffs[i] * inputs[i]`` (inputs of one shape; e.g. a residual connection).

    Parameters
    ----------
    incomings : list of Layer or tuple
    coeffs : float or list of float
    """

    def __init__(self, incomings: Sequence[Any], coeffs: Any = 1, **kwargs: Any) -> None:
        super().__init__(incomings, **kwargs)
        self.coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(incomings)
        if len(self.coeffs) != len(incomings):
            raise ValueError(f"{len(self.coeffs)} coefficients for {len(incomings)} inputs")

    def get_output_shape_for(self, input_shapes: Any) -> tuple[Any, ...]:
        return _merged_shape(input_shapes, "ElemwiseSumLayer")

    def get_output_for(self, inputs: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        total = None
        for coeff, value in zip(self.coeffs, inputs):
            term = value if coeff == 1 else coeff * value
            total = term if total is None else total + term
        return total


class ConcatLayer(MergeLayer):
    """The inputs concatenated along ``axis`` (default 1: channels or features)."""

    def __init__(self, incomings: Sequence[Any], axis: int = 1, **kwargs: Any) -> None:
        super().__init__(incomings, **kwargs)
        self.axis = axis

    def get_output_shape_for(self, input_shapes: Any) -> tuple[Any, ...]:
        ndim = len(input_shapes[0])
        axis = self.axis % ndim
        others = [tuple(None if i == axis else n for i, n in enumerate(s)) for s in input_shapes]
        shape = list(_merged_shape(others, "ConcatLayer"))
        lengths = [s[axis] for s in input_shapes]
        shape[axis] = None if None in lengths else sum(lengths)
        return tuple(shape)

    def get_output_for(self, inputs: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        import pytensor.tensor as pt

        return pt.concatenate(inputs, axis=self.axis)


concat = ConcatLayer
