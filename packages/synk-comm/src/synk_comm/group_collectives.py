"""The collectives of a :class:`~synk_comm.group.Group` (:class:`GroupCollectives`): numpy arrays through
shared memory (:mod:`synk_comm.shm_collectives`), CUDA arrays through NCCL (:mod:`synk_comm.nccl`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from synk_comm.group_base import GroupBase
from synk_comm.ops import ReduceOp

if TYPE_CHECKING:
    from synk_comm.group import Group

__all__ = ["GroupCollectives"]


def _is_cuda_array(obj: Any) -> bool:
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    devices = getattr(obj, "devices", None)  # jax.Array
    if callable(devices):
        try:
            return any(d.platform == "gpu" for d in devices())
        except Exception:
            return False
    return bool(getattr(obj, "is_cuda", False))  # torch.Tensor


class GroupCollectives(GroupBase):
    """A group's collectives (see :mod:`synk_comm.collectives`)."""

    # -- collectives (numpy arrays through shared memory; CUDA arrays through NCCL) -------------
    def _backend(self, array: Any) -> Any:
        self._require_usable()  # a closed group's buffers and semaphores are gone
        if array is not None and not isinstance(array, np.ndarray) and _is_cuda_array(array):
            self._one_host_only("a collective on CUDA arrays (NCCL)")
            if self._nccl is None:
                from synk_comm.nccl import NcclCollectives

                self._nccl = NcclCollectives(cast("Group", self))
            return self._nccl
        return self.host

    def _one_host_only(self, name: str) -> None:
        if self.spans_hosts:
            raise NotImplementedError(f"{name} is not carried across hosts in a group spanning hosts (synk_comm.net): "
                                      "all_reduce, all_gather, gather_object and barrier are")

    def broadcast(self, array: Any, *, root: int | None = None) -> Any:
        """Every rank returns ``root``'s array (see :mod:`synk_comm.collectives`)."""
        self._one_host_only("broadcast")
        root = self.master_rank if root is None else root
        return self._backend(array).broadcast(array, root=root)

    def reduce(self, array: Any, op: ReduceOp | str = "sum", *, root: int | None = None) -> Any:
        """``root`` (default: the master) returns ``op`` over every rank's array; others None."""
        self._one_host_only("reduce")
        root = self.master_rank if root is None else root
        return self._backend(array).reduce(array, op, root=root)

    def all_reduce(self, array: Any, op: ReduceOp | str = "sum", *, out: Any = None) -> Any:
        """Every rank returns ``op`` over every rank's array."""
        return self._backend(array).all_reduce(array, op, out=out)

    def gather(self, array: Any, *, root: int | None = None) -> list[Any] | None:
        """``root`` returns every rank's array in rank order (shapes may differ); others None."""
        self._one_host_only("gather")
        root = self.master_rank if root is None else root
        return self._backend(array).gather(array, root=root)

    def all_gather(self, array: Any) -> list[Any]:
        """Every rank returns every rank's array in rank order (shapes may differ)."""
        return self._backend(array).all_gather(array)

    def scatter(self, arrays: Sequence[Any] | None, *, root: int | None = None) -> Any:
        """Rank ``r`` returns ``arrays[r]`` of ``root``'s list."""
        self._one_host_only("scatter")
        root = self.master_rank if root is None else root
        probe = arrays[0] if arrays else None
        return self._backend(probe).scatter(arrays, root=root)

    def reduce_scatter(self, array: Any, op: ReduceOp | str = "sum") -> Any:
        """Rank ``r`` returns ``op`` over every rank's chunk ``r`` (``array_split`` on axis 0)."""
        self._one_host_only("reduce_scatter")
        return self._backend(array).reduce_scatter(array, op)

    def broadcast_object(self, obj: object = None, *, root: int | None = None) -> object:
        """Every rank returns ``root``'s picklable object."""
        self._one_host_only("broadcast_object")
        self._require_usable()
        return self.host.broadcast_object(obj, root=self.master_rank if root is None else root)

    def gather_object(self, obj: object, *, root: int | None = None) -> list[object] | None:
        """``root`` returns every rank's picklable object in rank order; others None."""
        self._require_usable()
        return self.host.gather_object(obj, root=self.master_rank if root is None else root)

    @property
    def nccl(self) -> Any:
        """The NCCL backend (made on first use; needs ``synk-comm[nccl]`` and a GPU per rank)."""
        if self._nccl is None:
            from synk_comm.nccl import NcclCollectives

            self._nccl = NcclCollectives(cast("Group", self))
        return self._nccl

