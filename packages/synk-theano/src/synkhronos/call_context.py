"""The call whose share this process is computing: what the in-graph collectives need to know.

The call path (:func:`synkhronos.calls.execute`, in the master and in every worker) enters
:func:`running` around a rank's compute of a function whose graph holds collectives of
:mod:`synkhronos.ops`; those ops ask :func:`active` for the group to combine with, this rank's
weight (its rows in the call, as the output reduction counts them) and the weights' total.
Outside a call (a plain ``pytensor.function``, :meth:`~synkhronos.function.Function.as_theano`)
there is none, and the ops are the identity.

A plain module variable, not a :mod:`contextvars` variable: under ``mode="JAX"`` the ops reach
the group from XLA's host-callback thread, which must see the call that the main thread entered.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from synk_comm import Group

__all__ = ["CallContext", "active", "running"]


class CallContext:
    """One rank's view of the call in progress.

    Attributes
    ----------
    group : synk_comm.Group
        The ranks of the call (all of the run's ranks).
    weight : float
        This rank's weight: its rows in the call (scattered input rows, or sliceable rows after
        ``batch_s``; 1 when nothing is split), the weight the output reduction ``avg`` uses.
    failure : Exception or None
        What a collective raised in this rank (a peer's failure, mismatched shapes): the call path
        raises it as it is, where a backend (JAX's host callbacks) would have wrapped it.
    """

    def __init__(self, group: Group, weight: float) -> None:
        self.group = group
        self.weight = float(weight)
        self.failure: Exception | None = None
        self._total: float | None = None

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def has_rows(self) -> bool:
        """Whether this rank has rows in the call (a rank without rows contributes identities)."""
        return self.weight > 0

    def total_weight(self) -> float:
        """``sum_r w_r`` over the ranks: one small all-reduce, the first time a call needs it.

        Every rank runs the same graph, so every rank asks at the same collective."""
        if self._total is None:
            self._total = float(self.group.all_reduce(np.array([self.weight]), "sum")[0])
        return self._total

    def share(self) -> float:
        """``w_r / sum_r w_r``: this rank's share of the call's rows (0 when no rank has rows)."""
        total = self.total_weight()
        return self.weight / total if total else 0.0


_active: CallContext | None = None


def active() -> CallContext | None:
    """The call this process is computing its share of, or None."""
    return _active


@contextmanager
def running(group: Group, weight: float) -> Iterator[CallContext]:
    """Mark this process as computing its share (of weight ``weight``) of a call in ``group``."""
    global _active
    previous, _active = _active, CallContext(group, weight)
    try:
        yield _active
    finally:
        _active = previous
