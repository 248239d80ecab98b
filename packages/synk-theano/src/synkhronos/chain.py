"""``synkhronos.chain``: a call, an all-reduce and a second call, run as ONE command.

A data-parallel training step is three operations: every rank computes its gradient (a call of
one function), the ranks all-reduce it (a collective), every rank applies the same update (a
call of a second function, without inputs).  Issued one by one they cost three commands: three
round trips between the master and the workers and, on GPUs, a wait for each to finish.  A
:class:`Chain` runs the three in one command with exactly the same result as::

    out = first(*data, batch=..., batch_s=..., num_slices=...)
    synk.all_reduce(shared_vars, op)
    then()
    return out

How it travels: the first call's plan goes into the shared scratch slots as for any call
(:mod:`synkhronos.calls`), followed by the chain's tail ``[then's id, op, zeros_if_idle, n,
shared ids...]``;
no pickling.  Every rank runs its share of ``first`` (a worker replies its outputs right away),
then all ranks meet at a barrier (if any rank failed, every other rank stops there, so that none
waits forever inside the collective), all-reduce (nothing with one rank), and run ``then``.

Under the per-rank engine the all-reduce goes through host shared memory (in GPU mode too: the
device path through NCCL went with the per-rank GPU engine's default).  Under the JAX engine the
three run one by one, the all-reduce a program over the ranks
(:mod:`synkhronos.engine.collectives`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from synk_comm import Group, handler
from synk_comm.ops import as_op
from synkhronos import calls
from synkhronos.collectives import _all_reduce, _prepare
from synkhronos.function import Function
from synkhronos.protocol import CHAIN
from synkhronos.runtime import Runtime, describe, rank_runtime

__all__ = ["Chain", "chain"]


OPS = ("avg", "sum", "prod", "max", "min")


class Chain:
    """``first``, an all-reduce, ``then``: one command per call (made by :func:`chain`).

    Call it as ``first``; it returns what ``first`` returns.
    """

    def __init__(self, first: Function, shared_vars: list[Any], op: str, then: Function | None,
                 zeros_if_idle: bool = False) -> None:
        self.first = first
        self.shared_vars = shared_vars
        self.op = op
        self.then = then
        self.zeros_if_idle = zeros_if_idle

    def __repr__(self) -> str:
        names = ", ".join(describe(v) for v in self.shared_vars)
        return f"<synkhronos.Chain {self.first!r} -> all_reduce({names}, {self.op!r}) -> {self.then!r}>"

    def __call__(self, *args: Any, output_subset: Sequence[int] | None = None, batch: Any = None,
                 batch_s: Any = None, num_slices: int = 1, **kwargs: Any) -> Any:
        """Run the chain; arguments and result as for :meth:`Function.__call__
        <synkhronos.function.Function.__call__>` of ``first``."""
        self.first._subset(output_subset)  # checked before anything runs
        rt, _, sids, _ = _prepare(self.shared_vars)  # distributes new functions first
        return rt.driver.chain(rt, self, sids, args, kwargs, output_subset, batch, batch_s, num_slices)


def chain(first: Function, all_reduce: Any, op: str = "avg", then: Function | None = None,
          zeros_if_idle: bool = False) -> Chain:
    """One command that calls ``first``, all-reduces shared variables, then calls ``then``.

    Parameters
    ----------
    first : Function
        Called with the chain's arguments (Data, ``batch``, ``batch_s``, ``num_slices``...).
    all_reduce : shared variable or list of them
        All-reduced after ``first`` (typically the flat gradient that ``first`` updates).
    op : str, optional
        ``"avg"`` (default), ``"sum"``, ``"prod"``, ``"max"`` or ``"min"``.
    then : Function, optional
        Called after the all-reduce; it must take no inputs and return no outputs (typically
        the update rule's step).
    zeros_if_idle : bool, optional
        A rank that gets no rows in ``first`` computes nothing, so its variables keep their
        previous values.  With True such a rank contributes zeros to the all-reduce instead
        (its variables are set to zeros first): for gradients summed over the ranks, an idle rank
        then adds nothing, and nothing has to reset them after every step.

    Returns
    -------
    Chain
        Call it as ``first``: ``chain(...)(x_data, batch=rows)`` returns ``first``'s outputs.

    Raises
    ------
    TypeError
        If ``first`` or ``then`` is not a Synkhronos function, or a variable is not shared.
    ValueError
        For an unknown ``op``, an op the variables' dtype does not support, or a ``then``
        with inputs or outputs.

    Examples
    --------
    >>> step = synk.chain(grad_fn, all_reduce=flat_grad, op="avg", then=update_fn)  # doctest: +SKIP
    >>> loss = step(x_data, y_data, batch=rows)                                      # doctest: +SKIP
    """
    from pytensor.compile.sharedvalue import SharedVariable

    if not isinstance(first, Function):
        raise TypeError(f"first must be a synkhronos Function, got {first!r}")
    if then is not None:
        if not isinstance(then, Function):
            raise TypeError(f"then must be a synkhronos Function or None, got {then!r}")
        if then.inputs or then.bcast_inputs or then._spec.outputs:
            raise ValueError(f"then={then!r} must take no inputs and return no outputs: it runs after the "
                             "all-reduce with nothing to read but shared variables")
    variables = list(all_reduce) if isinstance(all_reduce, (list, tuple)) else [all_reduce]
    if not variables:
        raise ValueError("all_reduce needs at least one shared variable")
    for var in variables:
        if not isinstance(var, SharedVariable):
            raise TypeError(f"all_reduce takes PyTensor shared variables, got {var!r}")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    for var in variables:
        as_op(op, var.type.dtype)
    return Chain(first, variables, op, then, bool(zeros_if_idle))


def _run(rt: Runtime, plan: calls.CallPlan, offset: int) -> list[np.ndarray] | None:
    """This rank's part of a chain: its share of ``first``, the all-reduce, ``then``."""
    scratch = rt.group.scratch
    then_fid, op_code, zeros_if_idle, n = (int(v) for v in scratch[offset:offset + 4])
    variables = [rt.shared[int(sid)] for sid in scratch[offset + 4:offset + 4 + n]]
    weight, outputs = calls.execute(rt, plan)
    # ``first``'s outputs are final: a worker replies them now, in what would be its wait at the
    # barrier if it is the first there, so that the master does not wait for it after ``then``
    # (a failure later in the chain replaces the reply with the error)
    own = calls.reply(rt, plan, weight, outputs)
    if weight == 0 and zeros_if_idle:
        for var in variables:
            rt.device.set(var, np.zeros(rt.device.raw(var).shape, dtype=var.type.dtype))
    rt.group.barrier()  # every rank's share succeeded: none is left alone inside the all-reduce
    if rt.size > 1:
        _all_reduce(rt, variables, OPS[op_code], nccl=False)
    if then_fid >= 0:
        then = rt.replicas[then_fid]
        calls.compute(rt, then, 1.0, lambda: then.run([], [], None, None, 1, 1))
    return own


@handler(CHAIN)
def _chain(group: Group, _payload: None) -> None:
    rt = rank_runtime(group)
    _run(rt, calls.decode(group.scratch, rt.size), calls.CallPlan.length_of(group.scratch, rt.size))
