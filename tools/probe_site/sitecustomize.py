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

if os.environ.get("SYNK_PROBE_PHASES_DIR"):
    # probe_chain_step.py: every process (master and workers) records when each phase of a
    # synk.chain step starts and ends, ``(tag + ">" or "<", time.perf_counter())``; perf_counter is
    # CLOCK_MONOTONIC, so the processes' stamps compare.  The modules are wrapped as they are
    # imported (an import hook), since this runs before any of them.
    import atexit
    import functools
    import importlib.abc
    import importlib.util
    import json
    import sys
    import time

    _events: list[tuple[str, float]] = []

    def _wrap(owner, name, tag):  # type: ignore[no-untyped-def]
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def stamped(*args, **kwargs):  # type: ignore[no-untyped-def]
            _events.append((tag + ">", time.perf_counter()))
            try:
                return fn(*args, **kwargs)
            finally:
                _events.append((tag + "<", time.perf_counter()))

        setattr(owner, name, stamped)

    _PHASES = {  # module -> [(attribute path, tag)]
        "synkhronos.chain": [("Chain.__call__", "step"), ("_all_reduce", "all_reduce")],
        "synkhronos.calls": [("execute", "share"), ("compute", "compute"), ("reply", "reply"),
                             ("decode", "decode")],
        "synkhronos.function": [("Function._prepare", "plan"), ("Function._gather", "combine")],
        "synkhronos.rank_functions": [("JaxOrDefault.__call__", "jax")],
        "synk_comm.group": [("Group.barrier", "barrier"), ("Group.start_command", "start"),
                            ("Group.finish_command", "finish")],
    }

    class _StampOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name not in _PHASES:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            load = spec.loader.exec_module

            def exec_module(module):  # type: ignore[no-untyped-def]
                load(module)
                for path, tag in _PHASES[name]:
                    *owners, attr = path.split(".")
                    owner = module
                    for o in owners:
                        owner = getattr(owner, o)
                    _wrap(owner, attr, tag)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _StampOnImport())

    @atexit.register
    def _dump_phases() -> None:
        if _events:
            with open(os.path.join(os.environ["SYNK_PROBE_PHASES_DIR"], f"{os.getpid()}.json"), "w") as f:
                json.dump(_events, f)
