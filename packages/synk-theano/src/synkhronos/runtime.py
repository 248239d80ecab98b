"""The state of a Synkhronos run in one process: its group, and the functions, shared variables
and Data that every rank knows by the same small integer ids.

The master holds a :class:`Runtime` from :func:`synkhronos.fork` to :func:`synkhronos.close`;
each worker builds its own at start-up (:mod:`synkhronos.worker`).  Both sides run the same code
on it for every call and collective, so that a rank's work is written once.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, cast

from synk_comm import Group
from synk_comm.cores import env_cores
from synk_shm import Data
from synkhronos.device import Device
from synkhronos.inflight import Window

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

    from synkhronos.engines.base import Engine
    from synkhronos.replica import Replica

__all__ = ["Runtime", "get_runtime", "current", "rank_runtime", "settled", "submit"]

log = logging.getLogger("synkhronos")


class Runtime:
    """Ids and objects of a run, in one rank.

    ``engine``: None for the per-rank engine, where every group rank computes (``rank`` and
    ``size`` are the group's); else the engine's state (:mod:`synkhronos.engine`), where group
    rank 0 is the master, which computes nothing, and compute rank ``r`` is group rank ``r + 1``
    (``size`` counts the compute ranks; the master's ``rank`` is -1).
    """

    def __init__(self, group: Group, device: Device, engine: Any = None, driver: Engine | None = None) -> None:
        self.group = group
        self.device = device
        self.engine = engine
        self.driver: Engine = cast("Engine", driver)
        self.window = Window()
        """The master's calls in flight (:mod:`synkhronos.inflight`)."""
        """The master's :class:`~synkhronos.engines.base.Engine` (None in a worker)."""
        offset = 0 if engine is None else 1
        # A group that spans hosts (synk_comm.net): this host's group ranks are the span's from span_offset.
        self.rank = group.rank + getattr(group, "span_offset", 0) - offset
        self.size = getattr(group, "span_size", group.size) - offset
        self.is_master = group.is_master
        self.replicas: dict[int, Replica] = {}
        self.shared: dict[int, SharedVariable] = {}
        self.shared_ids: dict[SharedVariable, int] = {}
        # The master holds its Data weakly, so that a Data the user drops is freed (and the workers told,
        # see data_registry._forget); a worker holds its attached copies until the master drops them.
        self.data: dict[int, Data] = weakref.WeakValueDictionary() if self.is_master else {}  # type: ignore[assignment]
        self.data_ids: dict[int, int] = {}  # id(Data) -> data id (master)
        self.index_data: Data | None = None  # batch / batch_s indices written by the master
        self.dropped: list[int] = []  # data ids the master no longer holds (sent with the next update)
        self.counter = 0  # ids of functions and Data (master)
        self.max_dim = 16  # fork(max_dim=...): the most dimensions of a function's variables
        self.precision = "default"  # fork(precision=...): the policy of functions that give none (master)
        self.thread_limits: Any = None  # CPU mode: the master's BLAS limit (threadpoolctl), undone by close
        self.cores: tuple[int, ...] = ()  # CPU mode, ranks pinned: every core of the group (master)
        self.distributed: set[int] = set()  # function ids the workers have (master)

    def add_shared(self, sid: int, var: SharedVariable) -> None:
        self.shared[sid] = var
        self.shared_ids[var] = sid

    def shared_var(self, sid: int) -> SharedVariable:
        return self.shared[sid]


_runtime: Runtime | None = None


def current() -> Runtime | None:
    """This process's runtime, or None before fork / after close."""
    return _runtime


def settled() -> Runtime | None:
    """This process's runtime once no submitted call is pending (:meth:`Window.drain`), or None."""
    rt = _runtime
    if rt is not None:
        rt.window.drain()
    return rt


def set_current(rt: Runtime | None) -> None:
    global _runtime
    _runtime = rt


def get_runtime() -> Runtime:
    """This process's runtime; RuntimeError that says what to do if there is none."""
    if _runtime is None:
        raise RuntimeError("Synkhronos is not forked: call synk.fork() first (or again, after synk.close())")
    if _runtime.window._pending:  # every operation comes after the calls submitted before it
        _runtime.window.drain()
    if _runtime.group.closed:
        raise RuntimeError("the Synkhronos group is closed (a worker died, or close() was called): "
                           "call synk.close() and synk.fork() again")
    return _runtime


def submit(what: str, fn: Callable[[], Any]) -> Future[Any]:
    """Queue ``fn`` (an operation of the group; ``what`` names it in errors) on this process's window
    of submitted calls (:mod:`synkhronos.inflight`); RuntimeError that says what to do if there is no
    open group now, or if the group it was submitted to is closed when its turn comes."""
    rt = _runtime
    if rt is None or rt.group.closed:
        get_runtime()  # raises the RuntimeError that says what to do
    assert rt is not None

    def run() -> Any:
        if _runtime is not rt:
            get_runtime()
            raise RuntimeError(f"{what} was submitted to a group that is closed")
        if rt.group.closed:
            get_runtime()  # the RuntimeError that says the group is closed
        return fn()

    return rt.window.submit(run)


def describe(obj: Any) -> str:
    """A short name for messages: a variable's name, or its repr."""
    name = getattr(obj, "name", None)
    return repr(name) if name else repr(obj)


def rank_runtime(group: Group) -> Runtime:
    """This rank's runtime: the master's is made by fork, a worker's here on its first command
    (its device from the mode the master launched it in, ``SYNK_USE_GPU``)."""
    rt = current()
    if rt is None or rt.group is not group:
        rt = Runtime(group, _make_device(os.environ.get("SYNK_USE_GPU") == "1", group.size))
        set_current(rt)
    return rt


def _make_device(use_gpu: bool, size: int) -> Device:
    if use_gpu:
        from synkhronos.gpu import GpuDevice

        return GpuDevice()
    from synkhronos import cpu
    from synkhronos.device import CpuDevice

    cores = env_cores()  # set where the worker is pinned: its cores
    device = CpuDevice(os.environ.get(cpu.BACKEND_ENV, "pytensor"), one_core=cores is not None and len(cores) == 1)
    device.all_reduce_segment = cpu.attach_all_reduce_segment(size)
    return device
