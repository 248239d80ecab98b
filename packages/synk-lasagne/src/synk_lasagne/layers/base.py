"""The base classes of layers: :class:`Layer` (one input) and :class:`MergeLayer` (several).

A layer knows its input layer(s), its output shape (``None`` for unknown lengths, e.g. the
batch), and its parameters: shared variables with tags (``trainable``, ``regularizable``, and any
other), made by :meth:`Layer.add_param` from an initialiser, a numpy array or a shared variable.
:func:`synk_lasagne.layers.get_output` composes ``get_output_for`` along the network.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

__all__ = ["Layer", "MergeLayer", "add_state_updates", "create_param", "draw_generator", "get_state_updates",
           "state_alias"]

Shape = tuple[Any, ...]
"""A layer's shape: ints, and None for lengths not known before a call (the batch)."""


def create_param(spec: Any, shape: Sequence[int], name: str | None = None) -> Any:
    """A layer's parameter from ``spec``: :func:`synk_lasagne.utils.create_param`."""
    from synk_lasagne.utils import create_param as create

    return create(spec, shape, name)


STATE_UPDATES = "synk_lasagne_state_updates"
"""The tag of an expression that carries state updates (see :func:`add_state_updates`)."""


def state_alias(var: Any) -> Any:
    """An alias of the shared variable ``var`` -- another variable on its storage
    (``SharedVariable.clone()``) -- for one training graph to read, so that the graph's update of
    ``var`` can be the alias's ``default_update`` (see :func:`add_state_updates`) while a graph that
    reads ``var`` itself (evaluation) updates nothing."""
    return var.clone()


def draw_generator(seeds: Any, name: str) -> Any:
    """A new shared random generator (numpy's ``Generator``, the next seed of the
    ``numpy.random.SeedSequence`` ``seeds``) for the draws of one training graph: its own state,
    as each draw of Lasagne's random streams has."""
    import numpy as np
    import pytensor

    (seed,) = seeds.spawn(1)
    return pytensor.shared(np.random.default_rng(seed), name=name)


def add_state_updates(expression: Any, updates: Sequence[tuple[Any, Any]], default_updates: Sequence[Any] = ()) -> None:
    """Attach ``updates`` (``(shared variable, new value)`` pairs) to ``expression``: state that
    computing it advances (batch norm's running averages, a dropout layer's random generator).

    :func:`get_state_updates` finds them again from any expression built on ``expression``.
    ``default_updates``: for each update, the shared variable of the graph that gets ``new`` as its
    ``default_update`` (the variable, where only this graph reads it, or its
    :func:`state_alias`): a plain ``pytensor.function`` of any expression built on ``expression``
    then applies the update with no updates given, as Lasagne's graphs do.  (PyTensor 3
    deprecates setting ``default_update`` but applies it.)"""
    import warnings

    pairs = [(var, var.type.filter_variable(new, allow_convert=True)) for var, new in updates]
    for carrier, (_, new) in zip(default_updates, pairs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            carrier.default_update = new
    found = getattr(expression.tag, STATE_UPDATES, [])
    setattr(expression.tag, STATE_UPDATES, [*found, *pairs])


def get_state_updates(expression_or_expressions: Any) -> list[tuple[Any, Any]]:
    """The state updates of every layer output that ``expression_or_expressions`` is built on.

    Parameters
    ----------
    expression_or_expressions : expression or list of expressions
        E.g. the loss of a training-mode :func:`~synk_lasagne.layers.get_output`.

    Returns
    -------
    list of (shared variable, expression)
        For ``pytensor.function(..., updates=...)`` (:func:`synk_lasagne.make_train_function`
        adds them itself): the running averages of batch norm layers, the random generators of
        dropout layers.

    Raises
    ------
    ValueError
        If one variable would get two different updates (two training-mode outputs of the same
        layer in one function: build the graph once).
    """
    from pytensor.graph.basic import Variable

    try:
        from pytensor.graph.traversal import ancestors
    except ImportError:  # PyTensor before 3.3
        from pytensor.graph.basic import ancestors  # type: ignore[no-redef]
    roots = expression_or_expressions if isinstance(expression_or_expressions, (list, tuple)) \
        else [expression_or_expressions]
    updates: dict[Any, Any] = {}
    for var in ancestors([r for r in roots if isinstance(r, Variable)]):
        for shared, new in getattr(var.tag, STATE_UPDATES, []):
            if shared in updates and updates[shared] is not new:
                raise ValueError(f"{shared} has two different updates in this graph (two training-mode outputs of "
                                 "one layer): build each layer's output once")
            updates[shared] = new
    return list(updates.items())


def _checked(layer: Any, shape: Any) -> Any:
    """``shape``, or a ValueError if it is an expression or holds one (a shape must be numbers)."""
    from pytensor.graph.basic import Variable

    if isinstance(shape, Variable) or any(isinstance(n, Variable) for n in shape):
        raise ValueError(f"{type(layer).__name__} computed a symbolic output shape {shape}: get_output_shape_for "
                         "must return ints and None (None for lengths known only at run time)")
    return shape


class Layer:
    """A layer with one input: a layer, or a shape tuple for a layer without one.

    Parameters
    ----------
    incoming : Layer or tuple
        The input layer, or the input's shape.
    name : str, optional
        Prefixes the names of the layer's parameters (``"conv1.W"``).

    Attributes
    ----------
    input_layer : Layer or None
    input_shape : tuple
    params : OrderedDict
        ``shared variable -> set of tags``.
    """

    get_output_kwargs: list[str] = []
    """Keyword arguments that ``get_output_for`` takes through ``**kwargs`` (besides those of its
    signature): :func:`~synk_lasagne.layers.get_output` warns about any that no layer takes."""

    def __init__(self, incoming: Any, name: str | None = None) -> None:
        if isinstance(incoming, tuple):
            self.input_shape: Shape = incoming
            self.input_layer: Layer | None = None
        else:
            self.input_shape = incoming.output_shape
            self.input_layer = incoming
        self.name = name
        self.params: OrderedDict[Any, set[str]] = OrderedDict()
        if any(d is not None and d <= 0 for d in self.input_shape):
            raise ValueError(f"cannot create layer {name or type(self).__name__}: its input shape "
                             f"{self.input_shape} has a length <= 0")

    @property
    def output_shape(self) -> Shape:
        """The shape of the output (None for unknown lengths)."""
        return _checked(self, self.get_output_shape_for(self.input_shape))

    def get_params(self, unwrap_shared: bool = True, **tags: bool) -> list[Any]:
        """The parameters, filtered by tags: ``trainable=True`` keeps those tagged trainable,
        ``regularizable=False`` those not tagged regularizable.  A parameter given as an expression
        counts as the shared variables it is computed from (``unwrap_shared=False``: itself)."""
        from synk_lasagne.utils import collect_shared_vars

        wanted = [tag for tag, value in tags.items() if value]
        unwanted = [tag for tag, value in tags.items() if not value]
        result = [p for p in self.params if all(t in self.params[p] for t in wanted)
                  and not any(t in self.params[p] for t in unwanted)]
        return collect_shared_vars(result) if unwrap_shared else result

    def get_output_shape_for(self, input_shape: Any) -> Shape:
        """The output shape for an input of ``input_shape`` (default: the same)."""
        return input_shape

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        """The output expression for the input expression ``input``."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_output_for")

    def add_param(self, spec: Any, shape: Sequence[int], name: str | None = None, **tags: bool) -> Any:
        """Make (from an initialiser, an array or a shared variable), register and return a parameter.

        Tags default to ``trainable=True, regularizable=True``; pass ``False`` to drop one."""
        if name is not None and self.name is not None:
            name = f"{self.name}.{name}"
        param = create_param(spec, shape, name)
        tags.setdefault("trainable", True)
        tags.setdefault("regularizable", True)
        self.params[param] = {tag for tag, value in tags.items() if value}
        return param

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        try:
            shape = f" {self.output_shape}"
        except (AttributeError, NotImplementedError, TypeError, ValueError):
            shape = ""  # an abstract layer, or one whose shape cannot be computed
        return f"<{type(self).__name__}{label}{shape}>"


class MergeLayer(Layer):
    """A layer with several inputs (layers or shape tuples): ``get_output_for`` receives a list."""

    def __init__(self, incomings: Sequence[Any], name: str | None = None) -> None:
        self.input_shapes: list[Shape] = [i if isinstance(i, tuple) else i.output_shape for i in incomings]
        self.input_layers: list[Layer | None] = [None if isinstance(i, tuple) else i for i in incomings]
        self.name = name
        self.params = OrderedDict()

    @property
    def output_shape(self) -> Shape:
        """The shape of the output; an AttributeError for a class without ``get_output_shape_for``
        (so that ``hasattr`` and ``unittest.mock``'s specs see no attribute)."""
        try:
            shape = self.get_output_shape_for(self.input_shapes)
        except NotImplementedError as error:
            raise AttributeError(str(error)) from error
        return _checked(self, shape)

    def get_output_shape_for(self, input_shapes: Any) -> Shape:
        raise NotImplementedError(f"{type(self).__name__} must implement get_output_shape_for")

    def get_output_for(self, inputs: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise NotImplementedError(f"{type(self).__name__} must implement get_output_for")
