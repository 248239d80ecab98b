"""The worker side: the runtime a worker builds for itself, and its command handlers.

``synk_comm`` starts each worker as a fresh interpreter and imports this module, which
registers the handlers of :mod:`synkhronos` (calls, distribution, Data updates, collectives).
The worker's :class:`~synkhronos.runtime.Runtime` is made on the first command.
"""

from __future__ import annotations

import atexit
import cProfile
import os

from synk_comm import Group, handler
from synkhronos import calls, chain, collectives, data_registry, distribution  # noqa: F401 - register handlers
from synkhronos.device import CpuDevice, Device
from synkhronos.engine import worker as _engine_worker  # noqa: F401 - register the engine's handlers
from synkhronos.function import CALL
from synkhronos.runtime import Runtime, current, set_current

__all__ = ["runtime"]

PROFILE_ENV = "SYNK_PROFILE_DIR"


def make_device(use_gpu: bool) -> Device:
    if use_gpu:
        from synkhronos.gpu import GpuDevice

        return GpuDevice()
    from synkhronos.cpu import BACKEND_ENV

    return CpuDevice(os.environ.get(BACKEND_ENV, "pytensor"))


def runtime(group: Group) -> Runtime:
    """This rank's runtime (the master's is made by fork; a worker's on its first command)."""
    rt = current()
    if rt is None or rt.group is not group:
        rt = Runtime(group, make_device(os.environ.get("SYNK_USE_GPU") == "1"))
        set_current(rt)
    return rt


@handler(CALL)
def _call(group: Group, _payload: None) -> None:
    rt = runtime(group)
    calls.share(rt, calls.decode(group.scratch, rt.size))


def _start_profile() -> None:
    directory = os.environ.get(PROFILE_ENV)
    if not directory or os.environ.get("SYNK_RANK") is None:
        return
    profile = cProfile.Profile()
    profile.enable()
    path = os.path.join(directory, f"synkhronos_worker_rank{os.environ['SYNK_RANK']}.prof")

    def dump() -> None:
        profile.disable()
        profile.dump_stats(path)

    atexit.register(dump)


_start_profile()
