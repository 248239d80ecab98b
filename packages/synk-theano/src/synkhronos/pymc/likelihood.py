"""The graph node of a split likelihood (:class:`SplitLikelihood`), and the model's ``logp`` inside a
``data_parallel`` block (:class:`_Hook`), which puts that node in every graph PyMC builds."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

from synkhronos.errors import SplitError
from synkhronos.pymc import chains
from synkhronos.pymc.graph import _leading
from synkhronos.pymc.split import _IDS, _SPLITS, _Split


class SplitLikelihood(Op):
    """The graph node of a split likelihood.  Outputs: the summed log-likelihood of a
    :class:`_Split`, then (``with_grad``) its gradient by each float parameter.  Inputs: the
    parameters.  A class of the module (not of a function) so that a step method holding it
    pickles by reference: the chains' copies of ``pm.sample``'s step method share the split."""

    __props__ = ("split_id", "with_grad")

    def __init__(self, split_id: int, with_grad: bool = True) -> None:
        self.split_id = split_id
        self.with_grad = with_grad

    def make_node(self, *params: Any) -> Apply:
        import pytensor.tensor as pt

        split = _SPLITS[self.split_id]
        inputs = [pt.as_tensor_variable(p) for p in params]
        outputs = [pt.scalar(dtype=split.dtype)]
        if self.with_grad:
            outputs += [inputs[i].type() for i in split.float_params]
        return Apply(self, inputs, outputs)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for a chain process (``pm.sample``'s spawn or forkserver): with the address of the
        master's chain server where one runs."""
        state = dict(self.__dict__)
        address = chains.channel()
        if address is not None:
            state["_chain_server"] = address
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        address = state.pop("_chain_server", None)
        self.__dict__.update(state)
        _op_class()
        if address is not None:
            chains.adopt_channel(address)

    def perform(self, node: Any, inputs: Any, output_storage: Any) -> None:
        split = _SPLITS.get(self.split_id)
        if split is not None and os.getpid() == split.pid:
            res = split(inputs, self.with_grad)
        else:  # a chain process of pm.sample: evaluated by the master with the other chains' points
            chain = chains.client()
            if chain is None and split is None:
                raise RuntimeError(f"likelihood split {self.split_id} is gone: its data_parallel block has ended "
                                   "(a function compiled inside the block runs only inside it)")
            if chain is None:
                raise RuntimeError("a function compiled inside synkhronos.pymc.data_parallel ran in another "
                                   "process: it runs in the process that forked the ranks, or in the chain "
                                   "processes of a pm.sample inside the block")
            res = chain.evaluate(self.split_id, inputs, self.with_grad)
        for storage, value, var in zip(output_storage, res, node.outputs):
            storage[0] = np.asarray(value, dtype=var.type.dtype).reshape(var.type.shape if all(
                s is not None for s in var.type.shape) else np.shape(value))

    def pullback(self, inputs: Any, outputs: Any, output_grads: Any) -> list[Any]:
        from pytensor.gradient import DisconnectedType

        if any(not isinstance(g.type, DisconnectedType) for g in output_grads[1:]):
            raise SplitError("second derivatives of a likelihood split by data_parallel are not supported "
                             "(compile_d2logp, Hessians): compile them outside the block")
        split = _SPLITS[self.split_id]
        grads_of = outputs if self.with_grad else SplitLikelihood(self.split_id, True).make_node(*inputs).outputs
        g = output_grads[0]
        result: list[Any] = []
        j = 1
        for i, inp in enumerate(inputs):
            if i in split.float_params:
                result.append(g * grads_of[j])
                j += 1
            else:
                result.append(inp.zeros_like(dtype=g.dtype))
        return result

    def connection_pattern(self, node: Any) -> list[list[bool]]:
        return [[True] * len(node.outputs) for _ in node.inputs]


_REGISTERED: list[bool] = []


def _op_class() -> type[SplitLikelihood]:
    """:class:`SplitLikelihood`, its rewrite and its Numba fallback registered on first use."""
    if not _REGISTERED:
        _register_rewrite(SplitLikelihood)
        _register_numba(SplitLikelihood)
        _REGISTERED.append(True)
    return SplitLikelihood


def _register_numba(op_class: type) -> None:
    """PyTensor's Numba backend (PyMC's default) runs the node's ``perform`` in object mode, as it
    does for any Op without a Numba implementation, here without its warning: the node's work is
    a call into the ranks."""
    import warnings

    try:
        from pytensor.link.numba.dispatch.basic import generate_fallback_impl, numba_funcify
    except ImportError:  # pragma: no cover - PyTensor without its Numba backend
        return

    @numba_funcify.register(op_class)
    def _funcify(op: Any, node: Any = None, storage_map: Any = None, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Numba will use object mode", category=UserWarning)
            return generate_fallback_impl(op, node, storage_map, **kwargs)


def _register_rewrite(op_class: type) -> None:
    """A rewrite that computes no gradient where the compiled function reads only the value
    (``compile_logp``): one call per evaluation either way."""
    from pytensor.graph.rewriting.basic import node_rewriter
    from pytensor.tensor.rewriting.basic import register_specialize

    @node_rewriter([op_class])
    def synk_likelihood_value_only(fgraph: Any, node: Any) -> Any:
        op = node.op
        if not op.with_grad or any(fgraph.clients.get(o) for o in node.outputs[1:]):
            return None
        return {node.outputs[0]: op_class(op.split_id, False).make_node(*node.inputs).outputs[0]}

    register_specialize(synk_likelihood_value_only)


class _Hook:
    """The model's ``logp`` inside a :func:`data_parallel` block (an attribute of the model
    object, removed at the block's end)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.original = model.logp
        self.splits: dict[tuple[int, ...], int] = {}

    def logp(self, vars: Any = None, jacobian: bool = True, sum: bool = True) -> Any:
        from pytensor.tensor import as_tensor
        from pytensor.tensor.math import variadic_add

        model = self.model
        if not sum:
            return self.original(vars=vars, jacobian=jacobian, sum=False)
        if vars is None:
            varlist = [*model.free_RVs, *model.observed_RVs, *model.potentials]
        elif not isinstance(vars, (list, tuple)):
            varlist = [vars]
        else:
            varlist = list(vars)
        observed = set(model.observed_RVs)
        obs = [v for v in varlist if v in observed]
        rest = [v for v in varlist if v not in observed]
        factors = [as_tensor(f, allow_xtensor_conversion=True).sum()
                   for f in (self.original(vars=rest, jacobian=jacobian, sum=False) if rest else [])]
        op = _op_class()
        for split_id, params in self._splits(obs):
            factors.append(op(split_id, True).make_node(*params).outputs[0])
        total = variadic_add(*factors)
        name = "__logp" if jacobian else "__logp_nojac"
        total.name = f"{name}_{model.name}" if model.name else name
        return total

    def _splits(self, obs: list[Any]) -> Iterator[tuple[int, list[Any]]]:
        """(split id, parameters) of each group of ``obs`` with the same number of rows."""
        groups: dict[int | None, list[Any]] = {}
        for rv in obs:
            groups.setdefault(_leading(self.model.rvs_to_values[rv]), []).append(rv)
        for rvs in groups.values():
            key = tuple(sorted(id(rv) for rv in rvs))
            split_id = self.splits.get(key)
            if split_id is None:
                terms = self.original(vars=rvs, jacobian=True, sum=False)
                split_id = next(_IDS)
                _SPLITS[split_id] = _Split(self.model, rvs, terms)
                self.splits[key] = split_id
            yield split_id, _SPLITS[split_id].params

    def close(self) -> None:
        for split_id in self.splits.values():
            split = _SPLITS.pop(split_id, None)
            if split is not None:
                split.free()
