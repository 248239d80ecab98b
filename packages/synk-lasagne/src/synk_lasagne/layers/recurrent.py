"""Recurrent layers: a loop over the second axis (time) of a ``(batch, time, features...)`` input.

==============================  ===================================================================
:class:`CustomRecurrentLayer`   ``h_t = f(input_to_hidden(x_t) + hidden_to_hidden(h_{t-1}))`` for any
                                two feed-forward networks (dense, convolutional, deeper)
:class:`RecurrentLayer`         the same with two dense layers (a vanilla RNN)
:class:`LSTMLayer`              long short-term memory, with optional peepholes
:class:`GRULayer`               gated recurrent unit
:class:`Gate`                   the parameters and nonlinearity of one LSTM or GRU gate
==============================  ===================================================================

Every layer takes Lasagne's options: ``mask_input`` (a ``(batch, time)`` layer: where the mask is
0 the state is carried over unchanged), ``hid_init`` (and the LSTM's ``cell_init``) as a value, an
initialiser, a layer (one state per example) or, as in Lasagne 0.1, an expression of shape
``(batch, units)``; ``learn_init`` (train the initial state), ``backwards`` (run from the last step
to the first; the output keeps the input's order), ``gradient_steps`` (truncated backpropagation
through time), ``grad_clipping`` (clip the gradient flowing into the state),
``unroll_scan`` (a Python loop in the graph instead of ``pytensor.scan``: needs a known sequence
length), ``precompute_input`` (apply the input-to-hidden map to all steps at once, outside the
loop) and ``only_return_final`` (the last state only: ``(batch, units)``).

Example
-------
>>> from synk_lasagne import layers
>>> net = layers.InputLayer((None, 20, 8))
>>> net = layers.LSTMLayer(net, 16, only_return_final=True)
>>> net.output_shape
(None, 16)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from synk_lasagne import nonlinearities
from synk_lasagne.init import Constant, Normal, Uniform
from synk_lasagne.layers.base import Layer, MergeLayer
from synk_lasagne.layers.dense import DenseLayer
from synk_lasagne.layers.helper import _accepted_kwargs, _get_output, get_all_layers, get_all_params
from synk_lasagne.layers.input import InputLayer

__all__ = ["CustomRecurrentLayer", "GRULayer", "Gate", "LSTMLayer", "RecurrentLayer"]

_ZEROS = Constant(0.0)
_UNIFORM = Uniform()
_NORMAL = Normal(0.1)


def _is_expression(spec: Any) -> bool:
    """An expression that is not a shared variable (Lasagne 0.1's initial state per example)."""
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.basic import Variable

    return isinstance(spec, Variable) and not isinstance(spec, SharedVariable)


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Two shapes agree (None matches any length)."""
    return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))


class _Recurrent(MergeLayer):
    """What every recurrent layer shares: the inputs (sequence, mask, initial states as layers),
    the initial states as parameters, the loop, and the output's layout."""

    def __init__(self, incoming: Any, mask_input: Any, initial: dict[str, Any], backwards: bool,
                 learn_init: bool, gradient_steps: int, grad_clipping: float, unroll_scan: bool,
                 precompute_input: bool, only_return_final: bool, **kwargs: Any) -> None:
        incomings = [incoming]
        self.mask_incoming_index = -1
        if mask_input is not None:
            incomings.append(mask_input)
            self.mask_incoming_index = len(incomings) - 1
        self._state_index: dict[str, int] = {}
        for state, spec in initial.items():
            if isinstance(spec, Layer):
                incomings.append(spec)
                self._state_index[state] = len(incomings) - 1
        super().__init__(incomings, **kwargs)
        for state in initial:
            setattr(self, f"{state}_incoming_index", self._state_index.get(state, -1))
        self.backwards = bool(backwards)
        self.learn_init = bool(learn_init)
        self.gradient_steps = int(gradient_steps)
        self.grad_clipping = grad_clipping
        self.unroll_scan = bool(unroll_scan)
        self.precompute_input = bool(precompute_input)
        self.only_return_final = bool(only_return_final)
        if self.unroll_scan and self.gradient_steps != -1:
            raise ValueError(f"gradient_steps={gradient_steps} truncates pytensor.scan's gradient; an unrolled loop "
                             "(unroll_scan=True) has none: use gradient_steps=-1 or unroll_scan=False")
        if self.unroll_scan and self.input_shapes[0][1] is None:
            raise ValueError(f"unroll_scan=True needs the sequence length (axis 1 of the input shape "
                             f"{self.input_shapes[0]}); give it to the InputLayer or use unroll_scan=False")
        if len(self.input_shapes[0]) < 3:
            raise ValueError(f"a recurrent layer's input is (batch, time, features...); got shape "
                             f"{self.input_shapes[0]}")

    def _initial_state(self, state: str, spec: Any, shape: tuple[Any, ...]) -> None:
        """``self.<state>``: a layer (given at call time), an expression (Lasagne 0.1: ``(batch,
        units)``, used as is) or a parameter of shape ``(1, *shape)``."""
        if isinstance(spec, Layer):
            setattr(self, state, spec)
        elif _is_expression(spec):
            if spec.ndim != 1 + len(shape):
                raise ValueError(f"{state} as an expression is one state per example, {1 + len(shape)} dimensions "
                                 f"(batch, {', '.join(map(str, shape))}); got {spec.ndim}")
            setattr(self, state, spec)
        else:
            setattr(self, state, self.add_param(spec, (1, *shape), name=state, trainable=self.learn_init,
                                                regularizable=False))

    def _initial_value(self, state: str, inputs: Sequence[Any], num_batch: Any) -> Any:
        import pytensor.tensor as pt

        if state in self._state_index:
            return inputs[self._state_index[state]]
        value = getattr(self, state)
        if _is_expression(value):
            return value
        return pt.repeat(value, num_batch, axis=0)

    def _clip(self, expression: Any) -> Any:
        from pytensor.gradient import grad_clip

        if not self.grad_clipping:
            return expression
        return grad_clip(expression, -self.grad_clipping, self.grad_clipping)

    def _loop(self, step: Callable[..., list[Any]], sequence: Any, mask: Any, initial: list[Any],
              non_sequences: list[Any]) -> list[Any]:
        """Run ``step(x_t, *states, *non_sequences) -> states`` over the first axis of ``sequence``
        (and ``mask``, already time-major and broadcastable); the states of every step, in the
        order the steps ran."""
        import pytensor
        import pytensor.tensor as pt

        from synk_lasagne.utils import unroll_scan

        def masked(*args: Any) -> list[Any]:
            if mask is None:
                x_t, rest = args[0], args[1:]
            else:
                x_t, m_t, rest = args[0], args[1], args[2:]
            previous = rest[:len(initial)]
            new = step(x_t, *previous, *rest[len(initial):])
            if mask is not None:
                new = [pt.switch(pt.shape_padright(m_t, n.ndim - m_t.ndim), n, p) for n, p in zip(new, previous)]
            return [pt.cast(n, p.dtype) for n, p in zip(new, previous)]

        sequences = [sequence] if mask is None else [sequence, mask]
        if self.unroll_scan:
            return list(unroll_scan(masked, sequences, initial, non_sequences, n_steps=self.input_shapes[0][1],
                                    go_backwards=self.backwards))
        outputs = pytensor.scan(masked, sequences=sequences, outputs_info=initial, non_sequences=non_sequences,
                                go_backwards=self.backwards, truncate_gradient=self.gradient_steps, strict=False,
                                return_list=True, return_updates=False)
        return list(outputs)

    def _layout(self, states: Any) -> Any:
        """The loop's ``(time, batch, ...)`` states as the layer's output: batch first, the input's
        time order, or the last step only."""
        if self.only_return_final:
            return states[-1]
        states = states.dimshuffle(1, 0, *range(2, states.ndim))
        return states[:, ::-1] if self.backwards else states

    def _mask(self, inputs: Sequence[Any]) -> Any:
        """The mask, time-major ``(time, batch)``, or None."""
        if self.mask_incoming_index < 0:
            return None
        return inputs[self.mask_incoming_index].dimshuffle(1, 0)

    def _output_shape(self, input_shape: Sequence[Any], state_shape: Sequence[Any]) -> tuple[Any, ...]:
        if self.only_return_final:
            return (input_shape[0], *state_shape)
        return (input_shape[0], input_shape[1], *state_shape)


def _single_input(network: Layer, what: str) -> InputLayer:
    inputs = [lay for lay in get_all_layers(network) if isinstance(lay, InputLayer)]
    if len(inputs) != 1:
        raise ValueError(f"the {what} network must read exactly one InputLayer; it has {len(inputs)}")
    return inputs[0]


class CustomRecurrentLayer(_Recurrent):
    """``h_t = nonlinearity(input_to_hidden(x_t) + hidden_to_hidden(h_{t-1}))`` for two networks.

    Parameters
    ----------
    incoming : Layer or tuple
        ``(batch, time, *features)``.
    input_to_hidden : Layer
        A network from one InputLayer of shape ``(batch, *features)`` (``batch * time`` rows with
        ``precompute_input``) to ``(batch, *units)``.
    hidden_to_hidden : Layer
        A network from one InputLayer of shape ``(batch, *units)`` to the same shape.
    nonlinearity : callable or None
        Default rectify; None: identity.
    hid_init : initialiser, array, Layer or expression
        The initial state (default zeros).
    backwards, learn_init, gradient_steps, grad_clipping, unroll_scan, precompute_input, mask_input, only_return_final
        See the module's description.

    Raises
    ------
    ValueError
        For networks with several InputLayers or shapes that do not chain.
    """

    def __init__(self, incoming: Any, input_to_hidden: Layer, hidden_to_hidden: Layer,
                 nonlinearity: Any = nonlinearities.rectify, hid_init: Any = _ZEROS, backwards: bool = False,
                 learn_init: bool = False, gradient_steps: int = -1, grad_clipping: float = 0,
                 unroll_scan: bool = False, precompute_input: bool = True, mask_input: Any = None,
                 only_return_final: bool = False, **kwargs: Any) -> None:
        super().__init__(incoming, mask_input, {"hid_init": hid_init}, backwards, learn_init, gradient_steps,
                         grad_clipping, unroll_scan, precompute_input, only_return_final, **kwargs)
        self.input_to_hidden = input_to_hidden
        self.hidden_to_hidden = hidden_to_hidden
        self.nonlinearity = nonlinearities.identity if nonlinearity is None else nonlinearity
        in_layer = _single_input(input_to_hidden, "input_to_hidden")
        hid_layer = _single_input(hidden_to_hidden, "hidden_to_hidden")
        batch, steps = self.input_shapes[0][:2]
        rows = in_layer.shape[0]
        if precompute_input:
            expected = None if batch is None or steps is None else batch * steps
            if rows is not None and expected is not None and rows != expected:
                raise ValueError(f"with precompute_input=True, input_to_hidden reads batch * time = {expected} rows at "
                                 f"once; its InputLayer has {rows} (use None)")
        elif rows is not None and batch is not None and rows != batch:
            raise ValueError(f"with precompute_input=False, input_to_hidden reads one step of {batch} rows; its "
                             f"InputLayer has {rows} (use None)")
        in_out = tuple(input_to_hidden.output_shape)
        hid_out = tuple(hidden_to_hidden.output_shape)
        if not _same(in_out[1:], hid_out[1:]):
            raise ValueError(f"input_to_hidden's output shape {in_out} and hidden_to_hidden's {hid_out} differ after "
                             "the first axis: both are the state")
        if not _same(tuple(hid_layer.shape)[1:], hid_out[1:]):
            raise ValueError(f"hidden_to_hidden maps shape {hid_layer.shape} to {hid_out}: the state needs the same "
                             "shape in and out (after the first axis)")
        self._initial_state("hid_init", hid_init, hid_out[1:])
        # get_output's keyword arguments reach the two networks
        self.get_output_kwargs = sorted(_accepted_kwargs(get_all_layers([input_to_hidden, hidden_to_hidden])))

    def get_params(self, unwrap_shared: bool = True, **tags: bool) -> list[Any]:
        """This layer's own (the initial state) and those of its two networks."""
        params = super().get_params(unwrap_shared=unwrap_shared, **tags)
        params += get_all_params(self.input_to_hidden, **tags)
        params += get_all_params(self.hidden_to_hidden, **tags)
        return params

    def get_output_shape_for(self, input_shapes: Any) -> tuple[Any, ...]:
        return self._output_shape(input_shapes[0], tuple(self.hidden_to_hidden.output_shape)[1:])

    def get_output_for(self, inputs: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        import pytensor.tensor as pt

        sequence = inputs[0]
        num_batch, seq_len = sequence.shape[0], sequence.shape[1]
        sequence = sequence.dimshuffle(1, 0, *range(2, sequence.ndim))
        if self.precompute_input:
            flat = pt.reshape(sequence, (-1, *[sequence.shape[i] for i in range(2, sequence.ndim)]),
                              ndim=sequence.ndim - 1)
            mapped = _get_output(self.input_to_hidden, flat, False, **kwargs)
            sequence = pt.reshape(mapped, (seq_len, num_batch, *[mapped.shape[i] for i in range(1, mapped.ndim)]),
                                  ndim=mapped.ndim + 1)

        def step(x_t: Any, hid_previous: Any) -> list[Any]:
            hid_pre = _get_output(self.hidden_to_hidden, hid_previous, False, **kwargs)
            x_t = x_t if self.precompute_input else _get_output(self.input_to_hidden, x_t, False, **kwargs)
            hid_pre = hid_pre + x_t
            return [self.nonlinearity(self._clip(hid_pre))]

        hid_init = self._initial_value("hid_init", inputs, num_batch)
        (states,) = self._loop(step, sequence, self._mask(inputs), [hid_init], [])
        return self._layout(states)


class RecurrentLayer(CustomRecurrentLayer):
    """A vanilla RNN: ``h_t = nonlinearity(x_t W_in_to_hid + b + h_{t-1} W_hid_to_hid)``.

    A :class:`CustomRecurrentLayer` of two dense layers, named ``<name>.input_to_hidden`` (``W``,
    ``b``) and ``<name>.hidden_to_hidden`` (``W``); ``W_in_to_hid``, ``W_hid_to_hid`` and ``b``
    are their parameters.  The features (axes 2 and on) are flattened.

    Parameters
    ----------
    incoming : Layer or tuple
    num_units : int
    W_in_to_hid, W_hid_to_hid : initialiser, array or shared variable
        Default :class:`~synk_lasagne.init.Uniform`.
    b : initialiser, array, shared variable or None
        Default zeros.
    nonlinearity, hid_init, backwards, learn_init, gradient_steps, grad_clipping, unroll_scan
        As for :class:`CustomRecurrentLayer`.
    precompute_input, mask_input, only_return_final
        As for :class:`CustomRecurrentLayer`.
    """

    def __init__(self, incoming: Any, num_units: int, W_in_to_hid: Any = _UNIFORM, W_hid_to_hid: Any = _UNIFORM,
                 b: Any = _ZEROS, nonlinearity: Any = nonlinearities.rectify, hid_init: Any = _ZEROS,
                 backwards: bool = False, learn_init: bool = False, gradient_steps: int = -1,
                 grad_clipping: float = 0, unroll_scan: bool = False, precompute_input: bool = True,
                 mask_input: Any = None, only_return_final: bool = False, **kwargs: Any) -> None:
        input_shape = incoming if isinstance(incoming, tuple) else incoming.output_shape
        prefix = f"{kwargs['name']}." if kwargs.get("name") else ""
        in_to_hid = DenseLayer(InputLayer((None, *input_shape[2:])), num_units, W=W_in_to_hid, b=b,
                               nonlinearity=None, name=f"{prefix}input_to_hidden")
        hid_to_hid = DenseLayer(InputLayer((None, num_units)), num_units, W=W_hid_to_hid, b=None,
                                nonlinearity=None, name=f"{prefix}hidden_to_hidden")
        self.W_in_to_hid = in_to_hid.W
        self.W_hid_to_hid = hid_to_hid.W
        self.b = in_to_hid.b
        super().__init__(incoming, in_to_hid, hid_to_hid, nonlinearity=nonlinearity, hid_init=hid_init,
                         backwards=backwards, learn_init=learn_init, gradient_steps=gradient_steps,
                         grad_clipping=grad_clipping, unroll_scan=unroll_scan, precompute_input=precompute_input,
                         mask_input=mask_input, only_return_final=only_return_final, **kwargs)


class Gate:
    """One gate of an LSTM or GRU: ``nonlinearity(x_t W_in + h_{t-1} W_hid [+ c_{t-1} * W_cell] + b)``.

    Parameters
    ----------
    W_in, W_hid : initialiser, array or shared variable
        Default ``Normal(0.1)``.
    W_cell : initialiser, array, shared variable or None
        The LSTM's peephole weights (a vector); None: no peephole.  GRUs ignore it.
    b : initialiser, array or shared variable
        Default zeros.
    nonlinearity : callable or None
        Default sigmoid; None: identity.
    """

    def __init__(self, W_in: Any = _NORMAL, W_hid: Any = _NORMAL, W_cell: Any = _NORMAL,
                 b: Any = _ZEROS, nonlinearity: Any = nonlinearities.sigmoid) -> None:
        self.W_in = W_in
        self.W_hid = W_hid
        if W_cell is not None:
            self.W_cell = W_cell
        self.b = b
        self.nonlinearity = nonlinearities.identity if nonlinearity is None else nonlinearity


_GATE = Gate()
_GATE_NO_CELL = Gate(W_cell=None)
_TANH_GATE = Gate(W_cell=None, nonlinearity=nonlinearities.tanh)


class _Gated(_Recurrent):
    """LSTM and GRU: gates of dense weights on the flattened input, stacked into one product."""

    gates: tuple[str, ...] = ()

    def _add_gates(self, gates: Sequence[Gate], num_units: int) -> None:
        self.num_units = int(num_units)
        shape = self.input_shapes[0]
        if any(s is None for s in shape[2:]):
            raise ValueError(f"{type(self).__name__} needs the lengths of the input's feature axes (shape {shape})")
        num_inputs = int(np.prod(shape[2:]))
        for name, gate in zip(self.gates, gates):
            setattr(self, f"W_in_to_{name}", self.add_param(gate.W_in, (num_inputs, self.num_units),
                                                            name=f"W_in_to_{name}"))
            setattr(self, f"W_hid_to_{name}", self.add_param(gate.W_hid, (self.num_units, self.num_units),
                                                             name=f"W_hid_to_{name}"))
            setattr(self, f"b_{name}", self.add_param(gate.b, (self.num_units,), name=f"b_{name}",
                                                      regularizable=False))
            setattr(self, f"nonlinearity_{name}", gate.nonlinearity)

    def _stacked(self, kind: str) -> Any:
        import pytensor.tensor as pt

        return pt.concatenate([getattr(self, f"{kind}{name}") for name in self.gates], axis=-1)

    def _gate(self, stacked: Any, n: int) -> Any:
        return stacked[:, n * self.num_units:(n + 1) * self.num_units]

    def get_output_shape_for(self, input_shapes: Any) -> tuple[Any, ...]:
        return self._output_shape(input_shapes[0], (self.num_units,))

    def _inputs(self, inputs: Sequence[Any]) -> tuple[Any, Any, Any, Any, Any]:
        """Time-major flattened input, its projection if precomputed, the stacked weights."""
        import pytensor.tensor as pt

        sequence = inputs[0]
        num_batch = sequence.shape[0]
        if sequence.ndim > 3:
            sequence = pt.flatten(sequence, 3)
        sequence = sequence.dimshuffle(1, 0, 2)
        W_in, W_hid, b = self._stacked("W_in_to_"), self._stacked("W_hid_to_"), self._stacked("b_")
        if self.precompute_input:
            sequence = pt.dot(sequence, W_in) + b
        return sequence, num_batch, W_in, W_hid, b

    def _project(self, x_t: Any, W_in: Any, b: Any) -> Any:
        import pytensor.tensor as pt

        return x_t if self.precompute_input else pt.dot(x_t, W_in) + b


class LSTMLayer(_Gated):
    """Long short-term memory (Graves 2013), with peepholes by default.

    ``i, f, o = sigmoid(x W_in + h W_hid + c * W_cell + b)`` (each gate's own weights and
    nonlinearity), ``c_t = f * c_{t-1} + i * tanh(x W_in_c + h W_hid_c + b_c)``,
    ``h_t = o * nonlinearity(c_t)``; the output gate's peephole reads ``c_t``.  Parameters
    ``W_in_to_<gate>``, ``W_hid_to_<gate>``, ``b_<gate>`` for the gates ``ingate``, ``forgetgate``,
    ``cell``, ``outgate``; ``W_cell_to_<gate>`` for the peepholes; ``cell_init``, ``hid_init``.

    Parameters
    ----------
    incoming : Layer or tuple
    num_units : int
    ingate, forgetgate, cell, outgate : Gate
        The cell's gate defaults to ``Gate(W_cell=None, nonlinearity=tanh)``.
    nonlinearity : callable or None
        Applied to the cell before the output gate (default tanh).
    cell_init, hid_init : initialiser, array, Layer or expression
    peepholes : bool
    backwards, learn_init, gradient_steps, grad_clipping, unroll_scan, precompute_input, mask_input, only_return_final
        See the module's description.
    """

    gates = ("ingate", "forgetgate", "cell", "outgate")
    W_cell_to_ingate: Any
    W_cell_to_forgetgate: Any
    W_cell_to_outgate: Any
    nonlinearity_ingate: Callable[[Any], Any]
    nonlinearity_forgetgate: Callable[[Any], Any]
    nonlinearity_cell: Callable[[Any], Any]
    nonlinearity_outgate: Callable[[Any], Any]

    def __init__(self, incoming: Any, num_units: int, ingate: Gate = _GATE, forgetgate: Gate = _GATE,
                 cell: Gate = _TANH_GATE, outgate: Gate = _GATE,
                 nonlinearity: Any = nonlinearities.tanh, cell_init: Any = _ZEROS,
                 hid_init: Any = _ZEROS, backwards: bool = False, learn_init: bool = False,
                 peepholes: bool = True, gradient_steps: int = -1, grad_clipping: float = 0,
                 unroll_scan: bool = False, precompute_input: bool = True, mask_input: Any = None,
                 only_return_final: bool = False, **kwargs: Any) -> None:
        super().__init__(incoming, mask_input, {"hid_init": hid_init, "cell_init": cell_init}, backwards,
                         learn_init, gradient_steps, grad_clipping, unroll_scan, precompute_input,
                         only_return_final, **kwargs)
        self.nonlinearity = nonlinearities.identity if nonlinearity is None else nonlinearity
        self.peepholes = bool(peepholes)
        self._add_gates([ingate, forgetgate, cell, outgate], num_units)
        if self.peepholes:
            for name, gate in (("ingate", ingate), ("forgetgate", forgetgate), ("outgate", outgate)):
                setattr(self, f"W_cell_to_{name}", self.add_param(gate.W_cell, (self.num_units,),
                                                                  name=f"W_cell_to_{name}"))
        self._initial_state("cell_init", cell_init, (self.num_units,))
        self._initial_state("hid_init", hid_init, (self.num_units,))

    def get_output_for(self, inputs: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        import pytensor.tensor as pt

        sequence, num_batch, W_in, W_hid, b = self._inputs(inputs)

        def step(x_t: Any, cell_previous: Any, hid_previous: Any) -> list[Any]:
            gates = self._clip(self._project(x_t, W_in, b) + pt.dot(hid_previous, W_hid))
            ingate, forgetgate, cell_input, outgate = (self._gate(gates, n) for n in range(4))
            if self.peepholes:
                ingate = ingate + cell_previous * self.W_cell_to_ingate
                forgetgate = forgetgate + cell_previous * self.W_cell_to_forgetgate
            ingate = self.nonlinearity_ingate(ingate)
            forgetgate = self.nonlinearity_forgetgate(forgetgate)
            cell = forgetgate * cell_previous + ingate * self.nonlinearity_cell(cell_input)
            if self.peepholes:
                outgate = outgate + cell * self.W_cell_to_outgate
            hid = self.nonlinearity_outgate(outgate) * self.nonlinearity(cell)
            return [cell, hid]

        initial = [self._initial_value("cell_init", inputs, num_batch), self._initial_value("hid_init", inputs,
                                                                                              num_batch)]
        _, hids = self._loop(step, sequence, self._mask(inputs), initial, [])
        return self._layout(hids)


class GRULayer(_Gated):
    """Gated recurrent unit (Cho et al. 2014).

    ``r, u = sigmoid(x W_in + h_{t-1} W_hid + b)``, ``c = tanh(x W_in_c + b_c + r * (h_{t-1}
    W_hid_c))``, ``h_t = (1 - u) * h_{t-1} + u * c``.  Parameters ``W_in_to_<gate>``,
    ``W_hid_to_<gate>``, ``b_<gate>`` for ``resetgate``, ``updategate``, ``hidden_update``;
    ``hid_init``.

    Parameters
    ----------
    incoming : Layer or tuple
    num_units : int
    resetgate, updategate, hidden_update : Gate
        ``hidden_update`` defaults to ``Gate(W_cell=None, nonlinearity=tanh)``.
    hid_init : initialiser, array, Layer or expression
    backwards, learn_init, gradient_steps, grad_clipping, unroll_scan, precompute_input, mask_input, only_return_final
        See the module's description.
    """

    gates = ("resetgate", "updategate", "hidden_update")
    nonlinearity_resetgate: Callable[[Any], Any]
    nonlinearity_updategate: Callable[[Any], Any]
    nonlinearity_hidden_update: Callable[[Any], Any]

    def __init__(self, incoming: Any, num_units: int, resetgate: Gate = _GATE_NO_CELL,
                 updategate: Gate = _GATE_NO_CELL, hidden_update: Gate = _TANH_GATE,
                 hid_init: Any = _ZEROS, backwards: bool = False, learn_init: bool = False,
                 gradient_steps: int = -1, grad_clipping: float = 0, unroll_scan: bool = False,
                 precompute_input: bool = True, mask_input: Any = None, only_return_final: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(incoming, mask_input, {"hid_init": hid_init}, backwards, learn_init, gradient_steps,
                         grad_clipping, unroll_scan, precompute_input, only_return_final, **kwargs)
        self._add_gates([resetgate, updategate, hidden_update], num_units)
        self._initial_state("hid_init", hid_init, (self.num_units,))

    def get_output_for(self, inputs: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        import pytensor.tensor as pt

        sequence, num_batch, W_in, W_hid, b = self._inputs(inputs)

        def step(x_t: Any, hid_previous: Any) -> list[Any]:
            from_input = self._clip(self._project(x_t, W_in, b))
            from_hidden = self._clip(pt.dot(hid_previous, W_hid))
            resetgate = self.nonlinearity_resetgate(self._gate(from_input, 0) + self._gate(from_hidden, 0))
            updategate = self.nonlinearity_updategate(self._gate(from_input, 1) + self._gate(from_hidden, 1))
            update = self._gate(from_input, 2) + resetgate * self._gate(from_hidden, 2)
            update = self.nonlinearity_hidden_update(self._clip(update))
            return [(1 - updategate) * hid_previous + updategate * update]

        (hids,) = self._loop(step, sequence, self._mask(inputs), [self._initial_value("hid_init", inputs, num_batch)],
                             [])
        return self._layout(hids)
