"""Helpers of the reliability suite (processes, /dev/shm, subprocess masters) and the synk_comm
command handlers of its plain process groups.

A module of its own, not ``conftest`` (every test directory of the monorepo runs in one pytest
session, where that name is not unique).  Workers import it by name: the suite's conftest puts this
directory on ``sys.path`` and workers inherit the master's.  It never imports PyTensor (see
:mod:`reliability_ops` for the Ops and the fault injection of synkhronos workers).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

import synk_comm
import synk_shm

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
SHM_DIR = "/dev/shm"
COMM_TESTS = os.path.join(ROOT, "packages", "synk-comm", "tests")
if COMM_TESTS not in sys.path:  # the process and /dev/shm helpers (comm_testutil)
    sys.path.append(COMM_TESTS)

from comm_testutil import ON_ENGINE, USE_GPU, alive, own_entries, wait_gone, worker_pids  # noqa: E402, F401

FAULT_ENV = "SYNK_REL_FAULT_FILE"
PROMISE_S = 2.0
"""Seconds within which DESIGN.md promises a fault to surface (and a dead master's workers to go)."""

# --- leaks and commands --------------------------------------------------------------------------

LEAKS: list[tuple[str, object]] = []
"""Every leak a test found: (what, the leftover pids or /dev/shm entries).  The summary counts them."""


def check_no_leak(what: str, left: object) -> None:
    """Record and fail if ``left`` (leftover pids or /dev/shm entries) is not empty."""
    if left:
        LEAKS.append((what, left))
    assert not left, f"leak: {what}: {left}"


def run_prefix() -> str:
    return synk_shm.run_prefix()


class CommandSpy:
    """Counts the commands a master's group starts (each starts by releasing every worker's ``go``
    semaphore): zero means no worker was told to act.  Use as a context manager."""

    class _Counting:
        def __init__(self, sem: Any, spy: CommandSpy) -> None:
            self._sem, self._spy = sem, spy

        def release(self) -> None:
            self._spy.releases += 1
            self._sem.release()

        def __getattr__(self, name: str) -> Any:
            return getattr(self._sem, name)

    def __init__(self, group: Any) -> None:
        self.group = group
        self.releases = 0
        self._saved: list[Any] = []

    def __enter__(self) -> CommandSpy:
        self._saved = list(self.group.sems.go)
        self.group.sems.go = [self._Counting(s, self) for s in self._saved]
        return self

    def __exit__(self, *exc: object) -> None:
        self.group.sems.go = self._saved


# --- processes and /dev/shm ------------------------------------------------------------------------

def wait_no_entries(prefix: str, timeout: float) -> list[str]:
    """Wait up to ``timeout`` seconds for /dev/shm to hold nothing under ``prefix``; returns what is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = own_entries(prefix)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def group_worker_pids(group: Any) -> list[int]:
    """The worker pids of a master's :class:`synk_comm.Group`, from its control rows (each worker
    writes its pid there at start-up) checked against the processes the master started."""
    started = sorted(p.pid for p in group._procs.values())
    rows = sorted(int(group.control.rows[r]["pid"]) for r in group.workers)
    assert rows == started, f"control rows say {rows}, the master started {started}"
    return started


def child_env(**extra: str) -> dict[str, str]:
    """Environment of a subprocess master: a run of its own (no inherited run prefix), this
    directory importable."""
    env = dict(os.environ)
    env.pop("SYNK_RUN_PREFIX", None)
    env.pop(FAULT_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join([HERE, *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class Script:
    """A subprocess master (``python path *args``, a run of its own) whose stdout lines are read by
    a thread, each with the monotonic time it arrived."""

    def __init__(self, path: str, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, path, *args], env=child_env(), cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[tuple[str | None, float]] = queue.Queue()
        self.seen: list[str] = []
        self.worker_pids: list[int] = []
        self.prefix = "/synk-unknown-"  # the run prefix, once the script has printed it
        self._err: list[str] = []
        self._readers = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]  # a full pipe would block it
        for t in self._readers:
            t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((line.rstrip("\n"), time.monotonic()))
        self.lines.put((None, time.monotonic()))  # the end of the output

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._err.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expect(self, startswith: str, timeout: float) -> tuple[str, float]:
        """The next stdout line that starts with ``startswith`` and the time it arrived;
        AssertionError (with the child's output) if none comes within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line, at = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:  # the end of the output: nothing more will come
                self.lines.put((None, at))  # for the next expect
                break
            self.seen.append(line)
            if line.startswith(startswith):
                return line, at
        raise AssertionError(f"no line starting with {startswith!r} within {timeout} s; stdout so far: "
                             f"{self.seen!r}; stderr: {self.stderr()[-3000:]}")

    def stderr(self) -> str:
        """What the script wrote to stderr so far (all of it once it has ended)."""
        if self.proc.poll() is not None:
            self._readers[1].join(5)
        return "".join(self._err)

    def close(self) -> None:
        """Leave nothing running: kill the script and any of its workers still alive."""
        for pid in self.worker_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for t in self._readers:
            t.join(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


# --- synk_comm handlers (groups started with imports=["reliability_lib"]) -------------------------

class InjectedFault(RuntimeError):
    """What an injected fault raises in a worker."""


_STATE: dict[str, np.ndarray] = {}
"""Per-rank data of a synk_comm group (set by ``rel.set_state``): what a bad call must not lose."""


@synk_comm.handler("rel.set_state")
def _set_state(group: synk_comm.Group, payload: Any) -> None:
    _STATE["v"] = np.arange(4.0) + 10.0 * group.rank


@synk_comm.handler("rel.get_state")
def _get_state(group: synk_comm.Group, payload: Any) -> Any:
    return group.gather_object(None if "v" not in _STATE else _STATE["v"].copy())


@synk_comm.handler("rel.sum_ranks")
def _sum_ranks(group: synk_comm.Group, payload: Any) -> Any:
    """All-reduce of ``[rank] * payload``: ``n (n - 1) / 2`` everywhere."""
    return group.all_reduce(np.full(int(payload), float(group.rank)), "sum")


@synk_comm.handler("rel.pids")
def _pids(group: synk_comm.Group, payload: Any) -> Any:
    return group.gather_object(os.getpid())


@synk_comm.handler("rel.raise_in_collective")
def _raise_in_collective(group: synk_comm.Group, payload: Any) -> Any:
    """Every rank all-reduces twice; rank ``payload`` raises between the two."""
    out = group.all_reduce(np.ones(8), "sum")
    if group.rank == payload:
        raise InjectedFault(f"injected fault in rank {group.rank} between two all_reduces")
    return group.all_reduce(out, "sum")


@synk_comm.handler("rel.all_reduce_loop")
def _all_reduce_loop(group: synk_comm.Group, payload: Any) -> None:
    x = np.ones(16)
    for _ in range(int(payload)):
        group.all_reduce(x, "sum")


@synk_comm.handler("rel.command_from_worker")
def _command_from_worker(group: synk_comm.Group, payload: Any) -> None:
    if not group.is_master:
        group.run("rel.sum_ranks", 2)


@synk_comm.handler("rel.start_in_worker")
def _start_in_worker(group: synk_comm.Group, payload: Any) -> None:
    if not group.is_master:
        synk_comm.start(2, imports=["reliability_lib"])


@synk_comm.handler("rel.fork_in_worker")
def _fork_in_worker(group: synk_comm.Group, payload: Any) -> None:
    if not group.is_master:
        import synkhronos

        synkhronos.fork(2, use_gpu=USE_GPU)
