"""Functions over whole networks: outputs, layers, parameters and their values.

=================================  ================================================================
:func:`get_output`                 the output expression(s) of a network for its input variables
                                   (or given expressions), ``deterministic=`` for evaluation
:func:`get_output_shape`           the output shape(s)
:func:`get_all_layers`             every layer below the given ones, inputs first
:func:`get_all_params`             their parameters, filtered by tags (``trainable=True``...)
:func:`count_params`               the number of parameter values
:func:`get_all_param_values`       the parameters' values (numpy arrays)
:func:`set_all_param_values`       set them
=================================  ================================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.graph.rewriting.basic import node_rewriter
from pytensor.tensor.rewriting.basic import register_canonicalize, register_specialize

from synk_lasagne._backends import register_jax, register_perform
from synk_lasagne.layers.base import Layer, MergeLayer
from synk_lasagne.layers.input import InputLayer

__all__ = ["count_params", "get_all_layers", "get_all_param_values", "get_all_params", "get_output",
           "get_output_shape", "set_all_param_values"]


class InputKeyError(TypeError, ValueError):
    """A key of ``get_output``'s ``inputs`` that is not a layer (a TypeError as Lasagne 0.2 raises,
    and a ValueError as Lasagne 0.1 did)."""


def _as_list(layer_or_layers: Any) -> tuple[list[Any], bool]:
    if isinstance(layer_or_layers, (list, tuple)):
        return list(layer_or_layers), False
    return [layer_or_layers], True


def _incoming(layer: Layer) -> list[Layer]:
    if isinstance(layer, InputLayer):
        return []
    if isinstance(layer, MergeLayer):
        return [lay for lay in layer.input_layers if lay is not None]
    return [] if layer.input_layer is None else [layer.input_layer]


def get_all_layers(layer: Any, treat_as_input: Sequence[Layer] | None = None) -> list[Layer]:
    """Every layer that ``layer`` (or a list of layers) depends on, each after its inputs.

    Parameters
    ----------
    layer : Layer or list of Layer
    treat_as_input : list of Layer, optional
        Layers whose inputs are not followed.

    Returns
    -------
    list of Layer
        In topological order (inputs first, the given layers last), each once.
    """
    todo, _ = _as_list(layer)
    stop = set(treat_as_input or [])
    done: dict[Layer, None] = {}
    stack = [(lay, False) for lay in reversed(todo)]
    while stack:
        current, expanded = stack.pop()
        if current in done:
            continue
        if expanded or current in stop:
            done[current] = None
            continue
        stack.append((current, True))
        stack.extend((lay, False) for lay in reversed(_incoming(current)) if lay not in done)
    return list(done)


def get_output(layer_or_layers: Any, inputs: Any = None, **kwargs: Any) -> Any:
    """The output expression of a layer (or a list of them).

    Parameters
    ----------
    layer_or_layers : Layer or list of Layer
    inputs : expression, or dict ``{InputLayer or Layer: expression}``, optional
        What the network reads: by default each :class:`InputLayer`'s ``input_var``.  A single
        expression replaces the only InputLayer's variable; a dict maps layers (InputLayers or
        any layer, whose output is then replaced) to expressions.
    **kwargs
        Passed to every layer's ``get_output_for``: ``deterministic=True`` for evaluation
        (dropout off, batch norm with its running averages).

    Returns
    -------
    expression, or list of expressions
        The outputs of the layers computed here have a Lasagne expression's type: it knows which
        lengths are 1 (Theano's broadcastable pattern) and no other length, so that, as in
        Lasagne, a value of another shape can stand for one (``out.eval({out: value})``,
        ``givens``), whatever the parameters' static shapes say.  The graph below keeps the
        static shapes, and compiled functions see them (a rewrite removes the retyping view).
        The InputLayers' variables and the given expressions are returned as they are.
    """
    return _get_output(layer_or_layers, inputs, True, **kwargs)


def _get_output(layer_or_layers: Any, inputs: Any, typed: bool, **kwargs: Any) -> Any:
    """:func:`get_output`; ``typed=False``: the layers' outputs as they are (for the recurrent
    layers' networks, whose outputs build the loop's step)."""
    from synk_lasagne.utils import as_theano_expression

    layers, single = _as_list(layer_or_layers)
    treat_as_input = list(inputs) if isinstance(inputs, dict) else []
    all_layers = get_all_layers(layers, treat_as_input)
    if isinstance(inputs, dict):
        wrong = [key for key in inputs if key is not None and not isinstance(key, Layer)]
        if wrong:
            raise InputKeyError(f"the keys of inputs are layers (or None for the input of layers made from a shape); "
                                f"got {wrong}")
    given = inputs if isinstance(inputs, dict) else {}
    outputs: dict[Any, Any] = {lay: lay.input_var for lay in all_layers
                               if isinstance(lay, InputLayer) and lay not in given}
    if isinstance(inputs, dict):
        outputs.update({lay: as_theano_expression(expr) for lay, expr in inputs.items()})
    elif inputs is not None:
        input_layers = [lay for lay in all_layers if isinstance(lay, InputLayer)]
        if len(input_layers) != 1:
            raise ValueError(f"get_output got one input expression for {len(input_layers)} InputLayers: pass a "
                             "dict {input_layer: expression}")
        outputs[input_layers[0]] = as_theano_expression(inputs)
    for lay in outputs:
        if isinstance(lay, InputLayer):
            _check_ndim(outputs[lay], lay.shape)
    for lay in all_layers:
        if lay in outputs:
            continue
        if isinstance(lay, MergeLayer):
            layer_inputs: Any = [_given(outputs, i, lay, "inputs={layer: expression}") for i in lay.input_layers]
        else:
            layer_inputs = _given(outputs, lay.input_layer, lay, "inputs={layer: expression}")
        outputs[lay] = lay.get_output_for(layer_inputs, **kwargs)
    if kwargs:
        _warn_unused(kwargs, all_layers)
    results = [outputs[lay] if lay in given or isinstance(lay, InputLayer) or not typed else
               _lasagne_typed(outputs[lay]) for lay in layers]
    return results[0] if single else results


class LasagneTypedOp(Op):  # type: ignore[misc]
    """``x`` itself (a view) with a type that knows only which of its lengths are 1: see
    :func:`_lasagne_typed`."""

    __props__ = ()
    view_map = {0: [0]}

    def make_node(self, *inputs: Any) -> Apply:
        (x,) = inputs
        shape = tuple(1 if n == 1 else None for n in x.type.shape)
        return Apply(self, [x], [x.type.clone(shape=shape)()])

    def perform(self, node: Any, inputs: Any, output_storage: Any) -> None:
        output_storage[0][0] = inputs[0]

    def infer_shape(self, *args: Any) -> Any:
        """PyTensor before 3.3 passes ``(fgraph, node, input_shapes)``, 3.3 ``(node, input_shapes)``."""
        return [args[-1][0]]

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> Any:
        return [inputs[0].type.filter_variable(cotangents[0], allow_convert=True)]


@node_rewriter([LasagneTypedOp])
def _remove_lasagne_typed(fgraph: Any, node: Any) -> Any:
    """The compiled graph reads ``x`` itself, with its static shape."""
    return [node.inputs[0]]


register_canonicalize(_remove_lasagne_typed)
register_specialize(_remove_lasagne_typed)
register_perform(LasagneTypedOp)
register_jax(LasagneTypedOp, lambda op, **kwargs: lambda x: x)


def _lasagne_typed(expression: Any) -> Any:
    """``expression`` with the type a Lasagne expression has: it knows which lengths are 1 (the
    broadcastable pattern of Theano's types) and no other length.

    :func:`get_output` returns the layers' outputs so: as with Lasagne, a value of another shape
    can stand for one (``out.eval({out: value})``, ``givens``), whatever the parameters' static
    shapes say.  The graph below keeps them, and a rewrite (canonicalize, specialize) removes this
    view before compilation, so that compiled functions (the JAX backend's in particular) see the
    static shapes.  A non-tensor, or a tensor whose type has no other static length, is returned
    as it is."""
    from pytensor.tensor.variable import TensorVariable

    if not isinstance(expression, TensorVariable):
        return expression
    if all(n is None or n == 1 for n in expression.type.shape):
        return expression
    return LasagneTypedOp()(expression)


def _given(known: dict[Any, Any], input_layer: Any, layer: Any, how: str) -> Any:
    """What ``layer`` reads from ``input_layer``: its output, or for a layer made from a shape
    (``input_layer`` None) what was given under the key None."""
    if input_layer in known:
        return known[input_layer]
    raise ValueError(f"{layer!r} was made from a shape, not a layer: give its input through {how} (the key None "
                     "stands for every such input)")


def _accepted_kwargs(layers: Sequence[Any]) -> set[str]:
    """The keyword arguments that ``get_output_for`` of some layer of ``layers`` takes: those of its
    signature with a default and those it lists in ``get_output_kwargs``, and ``deterministic``."""
    from synk_lasagne.utils import inspect_kwargs

    names = {"deterministic"}
    for lay in layers:
        try:
            names.update(inspect_kwargs(lay.get_output_for))
        except (TypeError, ValueError):  # a callable without a signature
            pass
        listed = getattr(lay, "get_output_kwargs", ())
        if isinstance(listed, (list, tuple, set)):
            names.update(listed)
    return names


def _warn_unused(kwargs: dict[str, Any], layers: Sequence[Any]) -> None:
    """Warn (Lasagne's UserWarning) about keyword arguments of get_output that no layer takes."""
    import difflib
    import warnings

    accepted = _accepted_kwargs(layers)
    unused = [name for name in kwargs if name not in accepted]
    if not unused:
        return
    lines = []
    for name in unused:
        close = difflib.get_close_matches(name, sorted(accepted), n=1)
        lines.append(f"{name} (perhaps you meant {close[0]})" if close else name)
    warnings.warn("get_output() was called with unused kwargs:\n\t" + "\n\t".join(lines), UserWarning,
                  stacklevel=3)


def _check_ndim(expression: Any, shape: tuple[int | None, ...]) -> None:
    """Raise ValueError where a tensor given for an InputLayer has another number of dimensions
    than the layer's shape.  (The lengths are not checked: as in Lasagne, the layer's shape is
    what the layers above assume, and a given expression is used as it is.)"""
    from pytensor.tensor.variable import TensorVariable

    if isinstance(expression, TensorVariable) and isinstance(shape, tuple) and expression.ndim != len(shape):
        raise ValueError(f"the input expression has {expression.ndim} dimensions; the InputLayer's shape {shape} "
                         f"has {len(shape)}")


def get_output_shape(layer_or_layers: Any, input_shapes: Any = None) -> Any:
    """The output shape of a layer, or a list of them (None for unknown lengths).

    Parameters
    ----------
    layer_or_layers : Layer or list of Layer
    input_shapes : tuple, or dict ``{InputLayer or Layer: tuple}``, optional
        Shapes to propagate instead of the layers' own: one shape for the only InputLayer, or a
        shape per layer (whose output shape it then is).

    Returns
    -------
    tuple, or list of tuples
    """
    layers, single = _as_list(layer_or_layers)
    if input_shapes is None or input_shapes == {}:
        shapes = [lay.output_shape for lay in layers]
        return shapes[0] if single else shapes
    treat_as_input = list(input_shapes) if isinstance(input_shapes, dict) else []
    all_layers = get_all_layers(layers, treat_as_input)
    known: dict[Any, Any] = {}
    if isinstance(input_shapes, dict):
        known.update(input_shapes)
    else:
        input_layers = [lay for lay in all_layers if isinstance(lay, InputLayer)]
        if len(input_layers) != 1:
            raise ValueError(f"get_output_shape got one input shape for {len(input_layers)} InputLayers: pass a "
                             "dict {input_layer: shape}")
        known[input_layers[0]] = input_shapes
    for lay in all_layers:
        if lay in known:
            continue
        if isinstance(lay, InputLayer):
            known[lay] = lay.shape
        elif isinstance(lay, MergeLayer):
            known[lay] = lay.get_output_shape_for([_given(known, i, lay, "input_shapes={layer: shape}")
                                                   for i in lay.input_layers])
        else:
            known[lay] = lay.get_output_shape_for(_given(known, lay.input_layer, lay, "input_shapes={layer: shape}"))
    shapes = [known[lay] for lay in layers]
    return shapes[0] if single else shapes


def get_all_params(layer: Any, unwrap_shared: bool = True, **tags: bool) -> list[Any]:
    """The parameters of every layer below ``layer`` (a list of layers too), each once, filtered by
    tags (``trainable=True``: what to train; ``regularizable=True``: what to penalise)."""
    seen: dict[Any, None] = {}
    for lay in get_all_layers(layer):
        for param in lay.get_params(unwrap_shared=unwrap_shared, **tags):
            seen.setdefault(param, None)
    return list(seen)


def count_params(layer: Any, **tags: bool) -> int:
    """The number of values of the parameters of :func:`get_all_params`."""
    return int(sum(np.prod(np.shape(p.get_value(borrow=True))) for p in get_all_params(layer, **tags)))


def get_all_param_values(layer: Any, **tags: bool) -> list[np.ndarray]:
    """The values (numpy arrays, copies) of the parameters of :func:`get_all_params`.

    In a forked Synkhronos program they are the master's (every rank holds the same parameters
    after each step of :func:`synk_lasagne.make_train_function`)."""
    return [np.array(p.get_value()) for p in get_all_params(layer, **tags)]


def set_all_param_values(layer: Any, values: Sequence[Any], **tags: bool) -> None:
    """Set the parameters of :func:`get_all_params` (same order) to ``values``.

    This sets this process's variables.  Before :func:`synkhronos.distribute` (or the first call
    of a function) that is what every rank receives; afterwards, give the values to every rank
    with ``synkhronos.broadcast(get_all_params(layer), values)``.

    Raises
    ------
    ValueError
        For a different number of values or a value of another shape.
    """
    params = get_all_params(layer, **tags)
    if len(params) != len(values):
        raise ValueError(f"the network has {len(params)} parameters (with tags {tags}), {len(values)} values were "
                         "given")
    for param, value in zip(params, values):
        shape = np.shape(param.get_value(borrow=True))
        if np.shape(value) != shape:
            raise ValueError(f"parameter {param.name!r} has shape {shape}, its value has shape {np.shape(value)}")
        param.set_value(np.asarray(value, dtype=param.type.dtype))
