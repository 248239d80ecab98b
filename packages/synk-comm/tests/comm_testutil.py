"""Helpers of the synk-comm tests that are not fixtures: /dev/shm entries, processes, scripts.

The process and /dev/shm helpers here serve the other suites too (synkhronos, synk-lasagne, the
reliability and multi-host tests import them from this module, which needs no PyTensor): their test
helpers put this directory on ``sys.path``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence

USE_GPU = os.environ.get("SYNK_TEST_GPU", "").strip() not in ("", "0")
"""``SYNK_TEST_GPU=1``: the synkhronos and reliability suites fork in GPU mode (``use_gpu=True``);
without GPUs, run them with ``SYNK_EMULATE_GPUS=2 PYTENSOR_FLAGS=floatX=float64`` (GPU mode's code
on JAX's CPU backend).  Read here, where no PyTensor is imported, for every suite alike."""
ON_ENGINE = (os.environ.get("SYNK_ENGINE", "").strip() or ("jax" if USE_GPU else "ranks")) == "jax"
"""Whether forks run on the JAX engine (GPU mode's default; ``SYNK_ENGINE`` chooses): the master
computes nothing and holds no value of its own, every rank is a worker process (group rank ``r + 1``
computes rank ``r``'s share)."""
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
SHM_DIR = "/dev/shm"


def entries_with(keep: Callable[[str], bool]) -> list[str]:
    """The entries of /dev/shm for which ``keep(name)`` is true."""
    try:
        return sorted(e for e in os.listdir(SHM_DIR) if keep(e))
    except OSError:
        return []


def own_entries(prefix: str | None = None) -> list[str]:
    """Entries of /dev/shm (segments and ``sem.`` semaphores) under ``prefix`` (default: this run's)."""
    import synk_shm

    bare = (prefix or synk_shm.run_prefix()).lstrip("/")
    return entries_with(lambda e: e.startswith((bare, "sem." + bare)))


def run_entries(pid: int) -> list[str]:
    """Entries of /dev/shm that belong to the run whose root process is ``pid``."""
    return entries_with(lambda e: f"-{pid}-" in e)


def alive(pid: int) -> bool:
    """True if ``pid`` is a running process (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :].split()[0] not in (b"Z", b"X")


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for every pid to be gone; returns those still alive."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def worker_pids(parent: int | None = None) -> list[int]:
    """Live children of ``parent`` (default: this process) that run ``synk_comm.worker``."""
    parent = os.getpid() if parent is None else parent
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        state, ppid = fields[0], int(fields[1])
        if ppid == parent and state not in (b"Z", b"X") and b"synk_comm.worker" in cmdline:
            found.append(int(entry))
    return sorted(found)


def assert_no_workers_left(timeout: float = 10.0) -> None:
    """Every worker child of this process is gone within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while worker_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = worker_pids()
    assert not left, f"worker processes still running: {left}"


def python_env(extra_path: Sequence[str] = ()) -> dict[str, str]:
    """The environment for a child interpreter: this test directory (and ``extra_path``) first on
    ``PYTHONPATH``, and no inherited run prefix (the child is a run of its own)."""
    env = dict(os.environ)
    env.pop("SYNK_RUN_PREFIX", None)
    path = [*extra_path, HERE, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def run_python(args: Sequence[str], timeout: float = 60.0, extra_path: Sequence[str] = (),
               cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python *args`` to completion with :func:`python_env`; capture its output."""
    return subprocess.run([sys.executable, *args], env=python_env(extra_path), cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=timeout)
