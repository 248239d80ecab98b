"""Entry point of a worker process: ``python -m synk_comm.worker`` (started by :func:`synk_comm.start`).

The environment says who the worker is (``SYNK_GROUP_PREFIX``, ``SYNK_RANK``, ``SYNK_SIZE``,
``SYNK_MASTER_RANK``, ``SYNK_MASTER_PID``); the master's mailbox holds the rest of the set-up
(modules to import, the handler table, the master's ``sys.path``).  The worker then serves
commands until told to exit.  It ignores SIGINT (Ctrl-C in a terminal reaches the whole process
group: the master alone decides what an interrupt means) and exits by itself, cleaning up the
run's shared memory, when the master dies.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import signal
import sys
import threading
import time
from typing import Any

from synk_comm import cores as cores_mod
from synk_comm import group as group_module
from synk_comm.lockstep import ERROR, MAILBOX


def _watch_master(master_pid: int, prefix: str) -> None:
    """Daemon thread: leave (and clean up) as soon as the master is gone, even mid-computation."""
    while True:
        time.sleep(0.2)
        if os.getppid() != master_pid:
            group_module._master_gone(prefix)


def _import_main(path: str) -> None:
    """Make the master's ``__main__`` importable as ``multiprocessing`` does (``__mp_main__``)."""
    spec = importlib.util.spec_from_file_location("__mp_main__", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["__mp_main__"] = module
    spec.loader.exec_module(module)
    sys.modules["__main__"] = module


def _missing_handler(name: str) -> Any:
    def fail(_group: Any, _payload: Any) -> None:
        raise RuntimeError(f"command {name!r} has no handler in the workers: define it in a module "
                           "that the workers import (synk_comm.start(imports=[...]))")

    return fail


def main() -> None:
    cores_mod.pin_from_env()  # first: the threads started from here on inherit the cores
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    env = os.environ
    prefix = env["SYNK_GROUP_PREFIX"]
    rank, size = int(env["SYNK_RANK"]), int(env["SYNK_SIZE"])
    master_rank, master_pid = int(env["SYNK_MASTER_RANK"]), int(env["SYNK_MASTER_PID"])
    if os.getppid() != master_pid:
        return
    threading.Thread(target=_watch_master, args=(master_pid, prefix), daemon=True,
                     name="synk-watch-master").start()
    group = group_module.Group(prefix=prefix, rank=rank, size=size, master_rank=master_rank,
                               scratch_size=int(env["SYNK_SCRATCH_SIZE"]),
                               device=env.get("CUDA_VISIBLE_DEVICES"), create=False)
    group_module._current = group
    row = group.control.rows[rank]
    row["pid"] = os.getpid()
    try:
        config = pickle.loads(group.buffers.read_bytes(master_rank, MAILBOX))
        for path in reversed(config["sys_path"]):
            if path not in sys.path:
                sys.path.insert(0, path)
        if config["main_path"]:
            _import_main(config["main_path"])
        for module in config["imports"]:
            importlib.import_module(module)
        names = config["handlers"]
        for name in names:
            group_module.HANDLERS.setdefault(name, _missing_handler(name))
        group._command_names = names
    except BaseException as exc:
        group._report(exc)
        row["status"] = ERROR
        group.sems.done.release()
        time.sleep(0.5)  # let the master read the report before it sees the exit
        sys.exit(1)
    group.sems.done.release()
    try:
        group._serve()
    finally:
        group.close()


if __name__ == "__main__":
    main()
