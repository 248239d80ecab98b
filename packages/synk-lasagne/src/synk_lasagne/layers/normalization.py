"""Normalization: :class:`BatchNormLayer`, :func:`batch_norm` and the running averages;
:class:`StandardizationLayer`, :func:`instance_norm`, :func:`layer_norm`;
:class:`LocalResponseNormalization2DLayer`.

``out = (input - mean) * inv_std * gamma + beta`` per channel, with ``mean`` and ``inv_std =
1 / sqrt(var + epsilon)`` of the batch in training and their running averages in evaluation
(``deterministic=True``).

Running averages are updates
----------------------------
In training (``deterministic=False``) the running averages ``mean`` and ``inv_std`` advance at
every call: ``running := (1 - alpha) * running + alpha * batch_value``.  As in Lasagne, the
training graph holds an alias of each (a shared variable on the same storage) whose
``default_update`` is that update, so ``pytensor.function`` applies it with no updates given (and
an evaluation function, whose graph reads ``mean`` itself, applies none).  The same updates are
also explicit: :func:`get_state_updates` collects them from any expression built on the output,
an update rule given the loss holds them, and :func:`synk_lasagne.make_train_function` applies
them; either way each call advances the averages once.  In a :func:`synkhronos.function` the alias
is the variable itself (one value per rank) and its default update applies where no update of the
variable is given.

Data-parallel training
----------------------
In a step of :func:`synk_lasagne.make_train_function` each rank normalizes with the statistics
of ITS OWN share of the batch and updates its own running averages from them, as Synkhronos 1.0
did (the gradient is all-reduced; the statistics are not).  The ranks' running averages then
drift apart a little; :func:`average_running_statistics` makes them equal (their average over
the ranks, one all-reduce) -- call it before evaluating or saving, or every few steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from synk_lasagne import nonlinearities
from synk_lasagne.init import ONES, ZEROS
from synk_lasagne.layers.base import Layer, add_state_updates, state_alias

__all__ = ["BatchNormLayer", "LocalResponseNormalization2DLayer", "StandardizationLayer",
           "average_running_statistics", "batch_norm", "get_running_statistics", "instance_norm", "layer_norm"]


class BatchNormLayer(Layer):
    """Batch normalization (Ioffe and Szegedy, 2015) over ``axes``.

    Parameters
    ----------
    incoming : Layer or tuple
    axes : "auto" or int or tuple of int
        The axes to average over; "auto": every axis but the second (per channel / feature).
    epsilon : float
        Added to the variance.
    alpha : float
        The weight of each new batch in the running averages.
    beta, gamma : initialiser, array, shared variable or None
        Shift and scale (trainable; ``gamma`` regularizable, ``beta`` not, as in Lasagne); None: none.
    mean, inv_std : initialiser, array or shared variable
        The running averages (not trainable).
    """

    def __init__(self, incoming: Any, axes: Any = "auto", epsilon: float = 1e-4, alpha: float = 0.1,
                 beta: Any = ZEROS, gamma: Any = ONES, mean: Any = ZEROS,
                 inv_std: Any = ONES, **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        if axes == "auto":
            axes = (0, *range(2, len(self.input_shape)))
        elif isinstance(axes, int):
            axes = (axes,)
        self.axes = tuple(axes)
        self.epsilon = epsilon
        self.alpha = alpha
        shape = [n for axis, n in enumerate(self.input_shape) if axis not in self.axes]
        if any(n is None for n in shape):
            raise ValueError(f"BatchNormLayer needs specified input sizes for all axes not normalized over (the "
                             f"axes it does not average over): input shape {self.input_shape}, axes {self.axes}")
        self.beta = None if beta is None else self.add_param(beta, shape, "beta", trainable=True,
                                                             regularizable=False)
        self.gamma = None if gamma is None else self.add_param(gamma, shape, "gamma", trainable=True,
                                                               regularizable=True)  # as Lasagne's
        self.mean = self.add_param(mean, shape, "mean", trainable=False, regularizable=False, batch_norm_stat=True)
        self.inv_std = self.add_param(inv_std, shape, "inv_std", trainable=False, regularizable=False,
                                      batch_norm_stat=True)

    def get_output_for(self, input: Any, deterministic: bool = False,
                       batch_norm_use_averages: bool | None = None, batch_norm_update_averages: bool | None = None,
                       **kwargs: Any) -> Any:
        """Normalized ``input``.

        Parameters
        ----------
        deterministic : bool
            Evaluation: the running averages, no update.
        batch_norm_use_averages : bool, optional
            Normalize with the running averages (default: ``deterministic``).
        batch_norm_update_averages : bool, optional
            Attach the running averages' updates to the output (default: ``not deterministic``;
            see :func:`get_state_updates`).
        """
        import pytensor.tensor as pt
        from pytensor.compile.sharedvalue import SharedVariable

        use_averages = deterministic if batch_norm_use_averages is None else batch_norm_use_averages
        update_averages = (not deterministic) if batch_norm_update_averages is None else batch_norm_update_averages
        batch_mean = input.mean(self.axes)
        batch_inv_std = 1 / pt.sqrt(input.var(self.axes) + self.epsilon)
        mean, inv_std = (self.mean, self.inv_std) if use_averages else (batch_mean, batch_inv_std)
        state: list[tuple[Any, Any]] = []
        aliases = []
        if update_averages:
            for stat, batch in ((self.mean, batch_mean), (self.inv_std, batch_inv_std)):
                if isinstance(stat, SharedVariable):  # (an expression given for it has no state to update)
                    aliases.append(state_alias(stat))
                    state.append((stat, (1 - self.alpha) * aliases[-1] + self.alpha * batch))
            # the aliases in the graph, computing nothing: a plain function collects their updates
            mean = mean + sum(0 * alias for alias in aliases)
        pattern = _broadcast_pattern(input.ndim, self.axes)
        gamma = 1 if self.gamma is None else self.gamma.dimshuffle(pattern)
        beta = 0 if self.beta is None else self.beta.dimshuffle(pattern)
        output = (input - mean.dimshuffle(pattern)) * (gamma * inv_std.dimshuffle(pattern)) + beta
        if state:
            add_state_updates(output, state, aliases)
        return output


def _broadcast_pattern(ndim: int, axes: Sequence[int]) -> list[Any]:
    """The dimshuffle pattern that puts a per-channel vector back among ``ndim`` axes."""
    pattern: list[Any] = []
    kept = 0
    for axis in range(ndim):
        if axis in axes:
            pattern.append("x")
        else:
            pattern.append(kept)
            kept += 1
    return pattern


def _take_over(layer: Any) -> tuple[Any, str | None]:
    """Set ``layer``'s nonlinearity to the identity and remove its bias ``b`` (a normalization
    after it makes both redundant); its former nonlinearity and its name."""
    nonlinearity = getattr(layer, "nonlinearity", None)
    if nonlinearity is not None:
        layer.nonlinearity = nonlinearities.identity
    if getattr(layer, "b", None) is not None:
        del layer.params[layer.b]
        layer.b = None
    return nonlinearity, getattr(layer, "name", None)


def _finish(normalized: Layer, nonlinearity: Any, name: str | None) -> Layer:
    from synk_lasagne.layers.special import NonlinearityLayer

    if nonlinearity is None or nonlinearity is nonlinearities.identity:
        return normalized
    return NonlinearityLayer(normalized, nonlinearity, name=f"{name}_nonlin" if name else None)


def batch_norm(layer: Layer, **kwargs: Any) -> Layer:
    """Put a :class:`BatchNormLayer` after ``layer`` (Lasagne's ``batch_norm``).

    The layer's nonlinearity moves after the normalization (a :class:`NonlinearityLayer`) and
    its bias ``b`` is removed (the normalization's ``beta`` takes its place).  The new layers are
    named ``name`` (default: the layer's name + ``"_bn"``) and ``name + "_nonlin"``.

    Returns
    -------
    Layer
        The NonlinearityLayer (or the BatchNormLayer for a linear layer).
    """
    nonlinearity, layer_name = _take_over(layer)
    name = kwargs.pop("name", None) or (f"{layer_name}_bn" if layer_name else None)
    return _finish(BatchNormLayer(layer, name=name, **kwargs), nonlinearity, name)


def _standardize_stack(layer: Any, axes: str, suffix: str, learn_scale: bool, learn_bias: bool,
                       **kwargs: Any) -> Layer:
    from synk_lasagne.layers.special import BiasLayer, ScaleLayer

    nonlinearity, layer_name = _take_over(layer)
    name = kwargs.pop("name", None) or (f"{layer_name}_{suffix}" if layer_name else None)
    out: Layer = StandardizationLayer(layer, axes=axes, name=name, **kwargs)
    if learn_scale:
        out = ScaleLayer(out, shared_axes="auto", name=f"{name}_scale" if name else None)
    if learn_bias:
        out = BiasLayer(out, shared_axes="auto", name=f"{name}_bias" if name else None)
    return _finish(out, nonlinearity, name)


def instance_norm(layer: Layer, learn_scale: bool = True, learn_bias: bool = True, **kwargs: Any) -> Layer:
    """Instance normalization (Ulyanov et al. 2016) after ``layer``: each example's channels
    standardized over their spatial axes (:class:`StandardizationLayer`, ``axes="spatial"``), then
    a per-channel :class:`ScaleLayer` and :class:`BiasLayer` (each optional), then ``layer``'s
    nonlinearity (its bias removed).  Names: ``name`` (default the layer's + ``"_in"``) and
    ``name + "_scale"``, ``"_bias"``, ``"_nonlin"``; ``kwargs`` go to the StandardizationLayer.

    Returns
    -------
    Layer
        The top of the stack.
    """
    return _standardize_stack(layer, "spatial", "in", learn_scale, learn_bias, **kwargs)


def layer_norm(layer: Layer, **kwargs: Any) -> Layer:
    """Layer normalization (Ba et al. 2016) after ``layer``: each example standardized over all
    its features (``axes="features"``), then a per-channel scale and bias and ``layer``'s
    nonlinearity.  Names as :func:`instance_norm` with ``"_ln"``.

    Returns
    -------
    Layer
    """
    return _standardize_stack(layer, "features", "ln", True, True, **kwargs)


class LocalResponseNormalization2DLayer(Layer):
    """Local response normalization across channels (Krizhevsky et al. 2012):
    ``out[b, c] = x[b, c] / (k + alpha * sum_{|c' - c| <= n // 2} x[b, c'] ** 2) ** beta``.

    Parameters
    ----------
    incoming : Layer or tuple
        ``(batch, channels, rows, columns)``.
    alpha, k, beta : float
    n : int
        The (odd) number of channels in each window.

    Raises
    ------
    NotImplementedError
        For an even ``n``.
    """

    def __init__(self, incoming: Any, alpha: float = 1e-4, k: float = 2, beta: float = 0.75, n: int = 5,
                 **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        if n % 2 == 0:
            raise NotImplementedError(f"LocalResponseNormalization2DLayer needs an odd window n, got n={n}")
        self.alpha, self.k, self.beta, self.n = alpha, k, beta, int(n)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        half = self.n // 2
        squares = pt.sqr(input)
        channels = input.shape[1]
        padded = pt.zeros((input.shape[0], channels + 2 * half, *[input.shape[i] for i in range(2, input.ndim)]),
                          dtype=input.dtype)
        padded = pt.set_subtensor(padded[:, half:half + channels], squares)
        window_sums = sum(padded[:, i:i + channels] for i in range(self.n))
        return input / (self.k + self.alpha * window_sums) ** self.beta


def get_running_statistics(layer_or_layers: Any) -> list[Any]:
    """The running-average variables (``mean``, ``inv_std``) of every BatchNormLayer below."""
    from synk_lasagne.layers.helper import get_all_layers

    return [var for lay in get_all_layers(layer_or_layers) if isinstance(lay, BatchNormLayer)
            for var in (lay.mean, lay.inv_std)]


def average_running_statistics(layer_or_layers: Any) -> None:
    """Make every rank's batch-norm running averages their average over the ranks (one
    ``synkhronos.all_reduce(..., op="avg")``).  Without a forked group: nothing to do."""
    import synkhronos as synk
    from synkhronos.runtime import current

    statistics = get_running_statistics(layer_or_layers)
    rt = current()
    if statistics and rt is not None and not rt.group.closed:
        synk.all_reduce(statistics, op="avg")


class StandardizationLayer(Layer):
    """Each sample standardized over ``axes``: ``(x - mean) / sqrt(var + epsilon)`` (no state).

    Parameters
    ----------
    incoming : Layer or tuple
    axes : "auto", "spatial", "features", int or tuple of int
        ``"auto"``: axis 1 for 2-d input, the spatial axes (2 and after) otherwise (instance
        normalization); ``"features"``: every axis after 0 (layer normalization).
    epsilon : float
        Added to the variance (default 1e-4).
    """

    def __init__(self, incoming: Any, axes: Any = "auto", epsilon: float = 1e-4, **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        ndim = len(self.input_shape)
        if axes == "auto":
            axes = (1,) if ndim == 2 else tuple(range(2, ndim))
        elif axes == "spatial":
            axes = tuple(range(2, ndim))
        elif axes == "features":
            axes = tuple(range(1, ndim))
        elif isinstance(axes, int):
            axes = (axes,)
        self.axes = tuple(axes)
        self.epsilon = epsilon

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        mean = input.mean(self.axes, keepdims=True)
        return (input - mean) / pt.sqrt(input.var(self.axes, keepdims=True) + self.epsilon)
