"""The worker side's entry: ``synk_comm`` starts each worker as a fresh interpreter and imports
this module, which registers every handler of :mod:`synkhronos` (calls, chains, distribution, Data
updates, collectives; the engine's in :mod:`synkhronos.engine.worker`) and owns the per-rank call
(``CALL``).  The handlers' modules import nothing from here: each finds this rank's
:class:`~synkhronos.runtime.Runtime` through :func:`synkhronos.runtime.rank_runtime` (made on the
first command), so the import graph has no cycle.
"""

from __future__ import annotations

import atexit
import cProfile
import os

from synk_comm import Group, handler
from synkhronos import calls, chain, collectives, data_registry, distribution  # noqa: F401 - register handlers
from synkhronos.engine import collectives as _engine_collectives  # noqa: F401 - register the engine's handlers
from synkhronos.engine import worker as _engine_worker  # noqa: F401
from synkhronos.protocol import CALL
from synkhronos.runtime import rank_runtime

__all__: list[str] = []

PROFILE_ENV = "SYNK_PROFILE_DIR"


@handler(CALL)
def _call(group: Group, _payload: None) -> None:
    rt = rank_runtime(group)
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
