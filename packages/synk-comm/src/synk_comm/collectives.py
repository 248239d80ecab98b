"""The collectives every backend provides, written out once.

=================  =====================================================================
broadcast          every rank ends with ``root``'s array
reduce             ``root`` ends with ``op`` over all ranks' arrays; the others get None
all_reduce         every rank ends with ``op`` over all ranks' arrays
gather             ``root`` gets the list of every rank's array (shapes may differ)
all_gather         every rank gets that list
scatter            rank ``r`` gets ``arrays[r]`` of ``root``'s list
reduce_scatter     rank ``r`` gets ``op`` over all ranks of chunk ``r`` of their arrays
                   (chunks: ``numpy.array_split`` along axis 0 into ``size`` parts)
=================  =====================================================================

``op`` is one of sum, prod, max, min, avg (:class:`~synk_comm.ops.ReduceOp`).  Every rank of the
group must make the same call in the same order (arguments other than the data may differ only
where stated); a mismatch of shapes or dtypes where they must agree raises ValueError in every rank.

:class:`Collectives` is the template; :class:`~synk_comm.shm_collectives.ShmCollectives` (numpy
arrays through shared memory) and :class:`~synk_comm.nccl.NcclCollectives` (CUDA arrays through
NCCL) fill it in.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from synk_comm.ops import ReduceOp

__all__ = ["Collectives"]

Array = Any
"""A numpy array (host backend) or a CUDA array (NCCL backend)."""


class Collectives(abc.ABC):
    """Template of a collective backend; ``rank`` and ``size`` say who we are."""

    rank: int
    size: int

    @abc.abstractmethod
    def broadcast(self, array: Array | None, *, root: int = 0) -> Array:
        """Every rank returns ``root``'s array.  Other ranks may pass None, or an array of the same
        shape and dtype that is overwritten in place (where the array type allows)."""

    @abc.abstractmethod
    def reduce(self, array: Array, op: ReduceOp | str = "sum", *, root: int = 0) -> Array | None:
        """``root`` returns ``op`` over every rank's array (same shape and dtype everywhere)."""

    @abc.abstractmethod
    def all_reduce(self, array: Array, op: ReduceOp | str = "sum", *, out: Array | None = None) -> Array:
        """Every rank returns ``op`` over every rank's array; ``out`` may be ``array`` (in place)."""

    @abc.abstractmethod
    def gather(self, array: Array, *, root: int = 0) -> list[Array] | None:
        """``root`` returns ``[array of rank 0, ..., array of rank size-1]``; shapes may differ."""

    @abc.abstractmethod
    def all_gather(self, array: Array) -> list[Array]:
        """Every rank returns the list of every rank's array; shapes may differ."""

    @abc.abstractmethod
    def scatter(self, arrays: Sequence[Array] | None, *, root: int = 0) -> Array:
        """Rank ``r`` returns ``arrays[r]`` (``root`` passes ``size`` arrays, the others None)."""

    @abc.abstractmethod
    def reduce_scatter(self, array: Array, op: ReduceOp | str = "sum") -> Array:
        """Rank ``r`` returns ``op`` over every rank's chunk ``r`` of ``array`` (split on axis 0)."""
