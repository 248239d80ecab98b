"""Layers that combine several inputs: :class:`ElemwiseMergeLayer`, :class:`ElemwiseSumLayer`,
:class:`ConcatLayer`; and :func:`autocrop` / :func:`autocrop_array_shapes`, which crop inputs of
different lengths to a common one first (``cropping=`` of each layer: per axis None, ``"lower"``
(keep the start), ``"center"`` or ``"upper"`` (keep the end))."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from synk_lasagne.layers.base import MergeLayer

__all__ = ["ConcatLayer", "ElemwiseMergeLayer", "ElemwiseSumLayer", "autocrop", "autocrop_array_shapes", "concat"]

CROP_MODES = (None, "lower", "center", "upper")


def _crop_modes(cropping: Any, ndims: set[Any]) -> list[Any] | None:
    """``cropping`` padded with None to the inputs' number of dimensions (None: no cropping)."""
    if cropping is None:
        return None
    if len(ndims) != 1:
        raise ValueError(f"cannot crop inputs of different numbers of dimensions ({sorted(ndims)})")
    modes = list(cropping) + [None] * (ndims.pop() - len(cropping))
    bad = [m for m in modes if m not in CROP_MODES]
    if bad:
        raise ValueError(f"unknown cropping mode(s) {bad}: use None, 'lower', 'center' or 'upper'")
    return modes


def autocrop_array_shapes(input_shapes: Sequence[tuple[Any, ...]], cropping: Any) -> list[tuple[Any, ...]]:
    """The shapes of :func:`autocrop`'s outputs: each axis with a mode cut to the shortest input's
    length (None if any input's is unknown).

    Raises
    ------
    ValueError
        For an unknown mode or inputs of different numbers of dimensions.
    """
    modes = _crop_modes(cropping, {len(s) for s in input_shapes})
    if modes is None:
        return [tuple(s) for s in input_shapes]
    shapes = [list(s) for s in input_shapes]
    for axis, mode in enumerate(modes):
        if mode is None:
            continue
        lengths = [s[axis] for s in input_shapes]
        common = None if None in lengths else min(lengths)
        for shape in shapes:
            shape[axis] = common
    return [tuple(s) for s in shapes]


def autocrop(inputs: Sequence[Any], cropping: Any) -> list[Any]:
    """``inputs`` (expressions) cropped to a common length along each axis that ``cropping`` names:
    ``"lower"`` keeps the first ``m`` entries (``m`` the shortest input's length), ``"upper"`` the
    last ``m``, ``"center"`` the middle ``m`` (starting at ``(length - m) // 2``).

    Raises
    ------
    ValueError
        For an unknown mode or inputs of different numbers of dimensions.
    """
    import pytensor.tensor as pt

    modes = _crop_modes(cropping, {getattr(x, "ndim", None) for x in inputs})
    if modes is None:
        return list(inputs)
    inputs = [pt.as_tensor_variable(x) for x in inputs]
    slices: list[list[slice]] = [[] for _ in inputs]
    for axis, mode in enumerate(modes):
        lengths = [x.shape[axis] for x in inputs]
        common = lengths[0]
        for n in lengths[1:]:
            common = pt.minimum(common, n)
        for cut, n in zip(slices, lengths):
            if mode is None:
                cut.append(slice(None))
            elif mode == "lower":
                cut.append(slice(0, common))
            elif mode == "upper":
                cut.append(slice(n - common, None))
            else:
                start = (n - common) // 2
                cut.append(slice(start, start + common))
    return [x[tuple(cut)] for x, cut in zip(inputs, slices)]


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


class ElemwiseMergeLayer(MergeLayer):
    """``merge_function`` folded over the inputs (of one shape, after ``cropping``):
    ``f(f(x0, x1), x2) ...``, e.g. ``pytensor.tensor.mul`` or ``maximum``.

    Parameters
    ----------
    incomings : list of Layer or tuple
    merge_function : callable
        Of two expressions.
    cropping : None or list of {None, "lower", "center", "upper"}
        See :func:`autocrop`.
    """

    def __init__(self, incomings: Sequence[Any], merge_function: Any, cropping: Any = None, **kwargs: Any) -> None:
        super().__init__(incomings, **kwargs)
        self.merge_function = merge_function
        self.cropping = cropping

    def get_output_shape_for(self, input_shapes: Any) -> tuple[Any, ...]:
        return _merged_shape(autocrop_array_shapes(input_shapes, self.cropping), type(self).__name__)

    def get_output_for(self, inputs: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        inputs = autocrop(inputs, self.cropping)
        total = inputs[0]
        for value in inputs[1:]:
            total = self.merge_function(total, value)
        return total


class ElemwiseSumLayer(ElemwiseMergeLayer):
    """``sum_i coeffs[i] * inputs[i]`` (inputs of one shape after ``cropping``; e.g. a residual
    connection).

    Parameters
    ----------
    incomings : list of Layer or tuple
    coeffs : float or list of float
    cropping : None or list of {None, "lower", "center", "upper"}
        See :func:`autocrop`.
    """

    def __init__(self, incomings: Sequence[Any], coeffs: Any = 1, cropping: Any = None, **kwargs: Any) -> None:
        import pytensor.tensor as pt

        super().__init__(incomings, pt.add, cropping=cropping, **kwargs)
        self.coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(incomings)
        if len(self.coeffs) != len(incomings):
            raise ValueError(f"{len(self.coeffs)} coefficients for {len(incomings)} inputs")

    def get_output_for(self, inputs: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        inputs = autocrop(inputs, self.cropping)
        total = None
        for coeff, value in zip(self.coeffs, inputs):
            term = value if coeff == 1 else coeff * value
            total = term if total is None else total + term
        return total


class ConcatLayer(MergeLayer):
    """The inputs concatenated along ``axis`` (default 1: channels or features), the other axes
    cropped to a common length first by ``cropping`` (see :func:`autocrop`; never the axis
    ``axis``)."""

    def __init__(self, incomings: Sequence[Any], axis: int = 1, cropping: Any = None, **kwargs: Any) -> None:
        super().__init__(incomings, **kwargs)
        self.axis = axis
        if cropping is not None:
            cropping = list(cropping)
            if -len(cropping) <= axis < len(cropping):
                cropping[axis] = None
        self.cropping = cropping

    def get_output_shape_for(self, input_shapes: Any) -> tuple[Any, ...]:
        input_shapes = autocrop_array_shapes(input_shapes, self.cropping)
        ndim = len(input_shapes[0])
        axis = self.axis % ndim
        others = [tuple(None if i == axis else n for i, n in enumerate(s)) for s in input_shapes]
        shape = list(_merged_shape(others, "ConcatLayer"))
        lengths = [s[axis] for s in input_shapes]
        shape[axis] = None if None in lengths else sum(lengths)
        return tuple(shape)

    def get_output_for(self, inputs: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        import pytensor.tensor as pt

        return pt.concatenate(autocrop(inputs, self.cropping), axis=self.axis)


concat = ConcatLayer
