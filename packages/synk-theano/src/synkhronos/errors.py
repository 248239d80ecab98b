"""Every exception of :mod:`synkhronos`, in one module.

Two kinds (as nccl4py separates ``NcclInvalid`` from runtime failures): errors found in the master
before any worker is told to act (``TypeError``/``ValueError``/``RuntimeError`` and the subclasses
below), and errors of the ranks, which reach the master as :class:`WorkerError` (the rank and its
traceback), :class:`WorkerDiedError` (a worker process ended) or :class:`GroupBrokenError`.

=================================  ================================================================
:class:`WorkerError`               a worker raised; names the rank, carries its traceback
:class:`WorkerDiedError`           a worker process died (SIGKILL, segfault, OOM): the group closes
:class:`GroupBrokenError`          the group cannot go on (after a death or a broken collective)
:class:`SelectionError`            ``batch_s`` rows that do not fit a rank's sliceable variables
:class:`NotOneProgramError`        a call with in-graph collectives the JAX engine cannot run as one
                                   program
:class:`DivergentGradientError`    a gradient through an in-graph collective that would leave the
                                   ranks with different values of a replicated variable
:class:`SplitError`                a PyMC model term that :func:`synkhronos.pymc.data_parallel`
                                   cannot split over the ranks exactly
:class:`ChainStopped`              a PyMC chain of a batched ``pm.sample`` stopped because another
                                   chain (or the group) failed; that failure is what the user sees
=================================  ================================================================
"""

from __future__ import annotations

from synk_comm import GroupBrokenError, WorkerDiedError, WorkerError  # noqa: F401 - the ranks' errors, here too

__all__ = ["ChainStopped", "DivergentGradientError", "NotOneProgramError", "SelectionError", "ShapesDiffer",
           "SplitError"]
"""This module's own exceptions (the ranks' errors, :mod:`synk_comm`'s, are imported here too)."""


class SelectionError(IndexError, ValueError):
    """A rank's rows of its sliceable shared variables do not fit the call (found by that rank,
    before any rank computes: the ranks pass a barrier between checking and computing)."""


class NotOneProgramError(ValueError):
    """A call of a function with in-graph collectives (:mod:`synkhronos.ops`) that cannot run as one
    program over the ranks (uneven shares with sliceable shared variables, a random generator,
    ``batch_s`` other than equal windows, ...; uneven shares alone run as one program): raised in
    the master before any worker acts, so a caller may run the step another way (as
    ``synk_lasagne``'s train function does, through its chain)."""


class DivergentGradientError(ValueError):
    """Raised by :func:`synkhronos.function` for a graph whose gradient goes through an in-graph
    collective in a form that is not exact over several ranks (see "Gradients" in
    :mod:`synkhronos.ops`): the ranks would hold different values of a replicated variable."""


class ShapesDiffer(ValueError):
    """Internal to the JAX engine: raised when tracing an uneven call's program, where an output
    (or updated value) has other shapes in the branches than its op can combine (a ``sum`` of rows
    that follow the row count, say).  Every rank finds it alike; the call then runs per rank, where
    the master's combine raises the user's ValueError (:func:`synkhronos.reduce_ops.common_shape`)."""


class SplitError(ValueError):
    """A PyMC model (or one of its likelihood terms) that :func:`synkhronos.pymc.data_parallel` cannot
    split over the ranks exactly; the message names the term.  Raised before anything runs."""


class ChainStopped(RuntimeError):
    """Raised in a chain's thread of a batched ``pm.sample`` (:mod:`synkhronos.pymc`) at its next
    evaluation once another chain, or the group, failed; ``pm.sample`` then raises that failure."""
