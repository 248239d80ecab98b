"""synk_comm: processes in lock-step on one machine, and collectives between them.

The framework-agnostic core of Synkhronos (it knows nothing of PyTensor): use it alone to
all-reduce numpy arrays (CPU, through shared memory) or CUDA arrays (GPU, through NCCL) between
Python processes.

Groups
    :func:`spawn`     run ``fn(group, *args)`` in n ranks, return their results (SPMD)
    :func:`start`     start workers that serve commands from the master (master-driven)
    :func:`handler`   register a worker command handler
    :class:`Group`    rank, size, barrier, command, close, and the collectives below
    :mod:`synk_comm.net`  groups spanning hosts: one group per host, joined over pyzmq

Collectives (methods of :class:`Group`; numpy or CUDA arrays)
    broadcast, reduce, all_reduce, gather, all_gather, scatter, reduce_scatter,
    broadcast_object, gather_object; ops :class:`ReduceOp` (sum, prod, max, min, avg)

Errors
    :class:`WorkerError` (a worker raised: rank and traceback; the group stays usable),
    :class:`WorkerDiedError` (a worker process died: the group is closed),
    :class:`HostLostError` (a host of a group spanning hosts stopped answering: closed),
    :class:`GroupBrokenError` (use of a closed or broken group)

Example
-------
>>> import numpy as np, synk_comm
>>> def work(group):                                          # doctest: +SKIP
...     x = np.full(4, float(group.rank))
...     return group.all_reduce(x, "sum")
>>> synk_comm.spawn(work, 4)                                   # doctest: +SKIP
[array([6., 6., 6., 6.]), array([6., 6., 6., 6.]), array([6., 6., 6., 6.]), array([6., 6., 6., 6.])]
"""

from synk_comm.errors import GroupBrokenError, HostLostError, RemoteError, WorkerDiedError, WorkerError
from synk_comm.group import Group, current_group, handler, spawn, start
from synk_comm.ops import ReduceOp

__all__ = ["Group", "GroupBrokenError", "HostLostError", "ReduceOp", "RemoteError", "WorkerDiedError", "WorkerError",
           "current_group", "handler", "spawn", "start"]
__version__ = "0.1.0"
