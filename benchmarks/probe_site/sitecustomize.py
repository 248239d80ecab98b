"""Imported at start-up by every interpreter that has this folder on PYTHONPATH (only
``probe_tiny_call.py`` puts it there): in a Synkhronos worker, record when each command starts
and ends (CLOCK_MONOTONIC, comparable across processes), and apply the probe's switches."""

import os

if os.environ.get("SYNK_PROBE_DIR"):
    import atexit
    import time

    import numpy as np

    from synk_comm import group as _group
    from synk_comm import lockstep as _lockstep

    if os.environ.get("SYNK_PROBE_ASYNC") == "0":
        import jax

        jax.config.update("jax_cpu_enable_async_dispatch", False)
    if os.environ.get("SYNK_PROBE_TIGHT_US"):
        _lockstep.TIGHT_S = float(os.environ["SYNK_PROBE_TIGHT_US"]) * 1e-6
    if os.environ.get("SYNK_PROBE_YIELD") == "0":
        _lockstep.sched_yield = lambda: None  # type: ignore[assignment]
    _stamps: list[int] = []
    _wait = _group.wait

    def _timed_wait(sem, check, *args, **kwargs):  # type: ignore[no-untyped-def]
        _stamps.append(time.monotonic_ns())  # a worker: entering a wait ends its last command
        _wait(sem, check, *args, **kwargs)
        _stamps.append(time.monotonic_ns())  # ... and leaving it starts the next

    if os.environ.get("SYNK_RANK") is not None:
        _group.wait = _timed_wait

        def _dump() -> None:
            np.save(os.path.join(os.environ["SYNK_PROBE_DIR"], f"rank{os.environ['SYNK_RANK']}.npy"),
                    np.array(_stamps, dtype=np.int64))

        atexit.register(_dump)
