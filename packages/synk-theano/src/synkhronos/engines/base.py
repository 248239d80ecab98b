"""The engine interface: what the public API asks of the machinery that runs the ranks.

Each method runs in the master, after the public API has checked every argument and, for a call,
written its plan into the group's scratch slots (:mod:`synkhronos.calls`): an engine does not
validate user input.  The order of operations is the caller's: :mod:`synkhronos.inflight` orders
asynchronous calls before anything that reads or writes what they touch.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from synkhronos.calls import CallPlan
    from synkhronos.chain import Chain
    from synkhronos.replica import Replica
    from synkhronos.runtime import Runtime

__all__ = ["Engine"]


class Engine(abc.ABC):
    """One way of running a Synkhronos group (``Runtime.driver`` in the master).

    ``master_computes``: whether the master is a compute rank (group rank ``r`` is compute rank
    ``r``) or only orchestrates (compute rank ``r`` is group rank ``r + 1``).
    """

    name: str = ""
    master_computes: bool = True

    def known_reason(self, rep: Replica, plan: CallPlan) -> tuple[str | None] | None:
        """What the engine keeps with a plan that a later call may reuse (None: nothing)."""
        return None

    @abc.abstractmethod
    def call(self, rt: Runtime, rep: Replica, plan: CallPlan, known: tuple[str | None] | None,
             defer: bool = False) -> Any:
        """Run the planned call of ``rep`` on every rank; returns its combined outputs in the
        plan's order (``plan.subset`` or every output).  ``known``: :meth:`known_reason` of an
        earlier call with this plan.  ``defer`` (a submitted call, in the window's dispatch
        thread): the engine may return a :class:`~synkhronos.inflight.Deferred` of the outputs
        instead, and resolve it later, in that thread (the JAX engine pipelines its calls; the
        per-rank engine returns the outputs)."""

    @abc.abstractmethod
    def chain(self, rt: Runtime, chain: Chain, sids: Sequence[int], args: Sequence[Any], kwargs: dict[str, Any],
              output_subset: Any, batch: Any, batch_s: Any, num_slices: Any) -> Any:
        """Run a :class:`~synkhronos.chain.Chain` (its ``first`` call, the all-reduce of the shared
        ids ``sids``, its ``then`` call); returns what ``first`` returns."""

    @abc.abstractmethod
    def collective(self, rt: Runtime, name: str, payload: dict[str, Any], defer: bool = False) -> Any:
        """A collective on shared variables (``name`` as in :mod:`synkhronos.collectives`,
        ``payload["sids"]`` the variables' ids); returns what the master's side returns.
        ``defer`` (a submitted collective, in the window's dispatch thread): the engine may return a
        :class:`~synkhronos.inflight.Deferred` of that instead, as :meth:`call` may."""

    def close(self, rt: Runtime) -> None:  # noqa: B027 - optional: most engines have nothing to do
        """Before the workers stop (the group is still up; errors are logged, not raised)."""
