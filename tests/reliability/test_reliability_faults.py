"""Faults with real processes, each held to DESIGN.md's promises:

* a worker that raises (in a function, a collective, a distribution) reaches the master as a
  ``WorkerError`` that names the rank and carries the worker's traceback; the group stays usable
  and the next call gives the right result;
* a worker that dies (SIGKILL while idle, during a call, a collective, a distribution or a
  compilation) makes the operation fail with ``WorkerDiedError`` within 2 s; the group is closed, a new one works;
* a master that dies (SIGKILL, SIGTERM) takes its workers with it within 2 s;
* Ctrl-C (SIGINT) in the master during a long call raises KeyboardInterrupt within 2 s; caught,
  the next call of the same script is right; uncaught, the script exits within 2 s;
* always: no hang (pytest-timeout), no worker process left, no /dev/shm entry of the group (or of
  the subprocess master's run) left.

Each test records its measured seconds (user property ``seconds``) for the summary table.
Faults inside workers are injected through :mod:`reliability_ops` (a fault file that the workers
read); deaths from outside are plain ``os.kill``.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError
from dataclasses import dataclass

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import reliability_lib as rl
import reliability_ops as ro
from pytensor.raise_op import Assert

import synk_comm
import synkhronos as synk
from synkhronos.runtime import current

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:Numba will use object mode")]
PROMISE_S = rl.PROMISE_S
ENGINE = rl.ON_ENGINE
"""GPU mode's engine: every rank is a worker, a call is one JAX program (the Ops of
:mod:`reliability_ops` run as host callbacks in it), a collective is one program too."""
REDUCE_AT = "reduce" if ENGINE else "all_reduce"
"""The fault point of an all_reduce (see :mod:`reliability_ops`)."""
RAISED = r"(?s)rank 1 raised .*InjectedFault" if ENGINE else "rank 1 raised InjectedFault"
"""A fault raised in a call: on the engine JAX wraps the callback's exception (its message and
traceback follow), in CPU mode the worker raises it as it is."""
MASTER = os.path.join(rl.HERE, "rel_master.py")
SY, CM = "synkhronos", "synk_comm"
MODE = "JAX" if rl.USE_GPU else "FAST_COMPILE"
"""PyTensor mode of the functions here: what is tested is processes, not code generation, and
PyTensor's default (Numba) compiles these Python Ops for seconds in every new process.  GPU mode
compiles with JAX only."""


@dataclass
class Run:
    """A 2-rank synkhronos group with per-rank shared values and functions that carry the Ops of
    :mod:`reliability_ops` (so that the workers import it, and its fault injection)."""

    fault_file: str
    group: synk_comm.Group
    pids: list[int]
    prefix: str
    a: pytensor.compile.SharedVariable
    b: pytensor.compile.SharedVariable
    f: synk.Function
    xd: np.ndarray
    X: synk.Data

    def arm(self, where: str, action: str, rank: int = 1) -> None:
        ro.set_fault(self.fault_file, where, rank, action)

    def values(self) -> tuple[np.ndarray, np.ndarray]:
        return synk.gather([self.a, self.b])

    def expected(self, a: np.ndarray, b: np.ndarray) -> float:
        """f sums x (every row once) and a and b of every rank."""
        return float(self.xd.sum() + a.sum() + b.sum())

    def assert_usable(self) -> None:
        a, b = self.values()
        assert self.f(self.X) == pytest.approx(self.expected(a, b), rel=1e-12)


def build_run(fault_file: str) -> Run:
    synk.fork(2, use_gpu=rl.USE_GPU)
    group = current().group
    x = pt.matrix("x", dtype="float64")
    a = pytensor.shared(np.zeros(3), name="a")
    b = pytensor.shared(np.zeros((2, 2)), name="b")
    f = synk.function([x], (pt.sum(ro.Probe()(x)) + pt.sum(a) + pt.sum(b), "sum"), mode=MODE)
    for r in range(2):
        synk.set_value(r, [a, b], [np.arange(3.0) + r, np.full((2, 2), 10.0 * (r + 1))])
    xd = np.arange(12.0).reshape(6, 2)
    run = Run(fault_file, group, rl.group_worker_pids(group), group.prefix, a, b, f, xd, synk.data(xd))
    run.assert_usable()
    return run


_spare: list[Run] = []
"""The group that a test built to show that ``fork()`` works again after its fault, kept open: the
next test's group (a fresh group either way; one fork fewer per fault)."""


def _drop_spare() -> None:
    """Close the kept group, if any; nothing of it may be left."""
    if _spare:
        r = _spare.pop()
        synk.close()
        r.X.free_memory()
        rl.check_no_leak("worker processes of the kept group", rl.wait_gone(r.pids, 5.0))
        rl.check_no_leak("/dev/shm entries of the kept group", rl.wait_no_entries(r.prefix, 2.0))


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The fault file of every group of the module (a group may serve the test after the one that
    built it); the kept group goes at the module's end."""
    yield str(tmp_path_factory.mktemp("faults") / "fault.json")
    _drop_spare()


@pytest.fixture
def run(fault_file, monkeypatch) -> Iterator[Run]:
    """A fresh group whose workers read the fault file (nothing armed); afterwards nothing of it is
    left."""
    monkeypatch.setenv(rl.FAULT_ENV, fault_file)
    if os.path.exists(fault_file):
        os.unlink(fault_file)
    r = _spare.pop() if _spare else None
    if r is None or r.group.closed:
        synk.close()
        r = build_run(fault_file)
    pids, prefix, X = r.pids, r.prefix, r.X
    yield r
    if not _spare:  # the test kept no new group (which is now the current one)
        synk.close()
    X.free_memory()
    del r, X
    gc.collect()
    rl.check_no_leak("worker processes of the group", rl.wait_gone(pids, 5.0))
    rl.check_no_leak("/dev/shm entries of the group", rl.wait_no_entries(prefix, 2.0))


def record(request: pytest.FixtureRequest, seconds: float) -> None:
    request.node.user_properties.append(("seconds", round(seconds, 3)))
    assert seconds < PROMISE_S, f"took {seconds:.2f} s; DESIGN.md promises about a second (< {PROMISE_S} s)"


def assert_dead_group(run: Run, info: pytest.ExceptionInfo[synk.WorkerDiedError], rank: int = 1) -> None:
    """The group is closed, its workers and /dev/shm entries are gone, and a new group works."""
    assert info.value.rank == rank and info.value.returncode == -signal.SIGKILL
    assert "SIGKILL" in str(info.value) and "fork() again" in str(info.value)
    assert_closed_then_fork_works(run, "a worker death")


def assert_closed_then_fork_works(run: Run, after: str) -> None:
    """The group is closed and refuses calls, its workers and /dev/shm entries are gone, and a new
    group works (and computes the right result)."""
    assert run.group.closed
    with pytest.raises(RuntimeError, match="closed"):
        run.f(run.X)
    rl.check_no_leak(f"workers after {after}", rl.wait_gone(run.pids, PROMISE_S))
    rl.check_no_leak(f"/dev/shm entries after {after}", rl.wait_no_entries(run.prefix, PROMISE_S))
    synk.close()
    _spare.append(build_run(run.fault_file))  # a new group works; the next test's group


def assert_stopped_group(run: Run, info: pytest.ExceptionInfo[synk.WorkerError], seconds: float,
                         request: pytest.FixtureRequest) -> None:
    """The engine's promise for a worker that raises alone inside a program (the GPU guide): the
    others wait in its collectives, so after ``ABORT_GRACE_S`` the master stops the group and
    raises the worker's error, saying so; nothing is left and a new group works."""
    from synkhronos.engine.launch import ABORT_GRACE_S

    request.node.user_properties.append(("seconds", round(seconds, 3)))
    limit = ABORT_GRACE_S + PROMISE_S
    assert seconds < limit, f"took {seconds:.2f} s; the engine promises {ABORT_GRACE_S:g} s of grace (< {limit:g} s)"
    assert info.value.ranks == [1]
    assert "the group is closed; start a new one" in "\n".join(getattr(info.value, "__notes__", []))
    assert_closed_then_fork_works(run, "a stopped group")


# --- a worker raises --------------------------------------------------------------------------------

@pytest.mark.reliability("fault", SY)
@pytest.mark.skipif(ENGINE, reason="GPU mode compiles with JAX, whose form of PyTensor's Assert checks nothing "
                                   "(a compiled program cannot raise on data); a raise inside a call is "
                                   "test_worker_raises_inside_a_chain")
def test_worker_raises_inside_a_function(run, request):
    """A data-dependent assertion fails in rank 1 only (its rows hold a negative number)."""
    x = pt.matrix("x", dtype="float64")
    g = synk.function([x], (pt.sum(Assert("rows must be positive")(x, pt.all(x > 0))), "sum"), mode=MODE)
    bad = np.ones((6, 2))
    bad[4, 0] = -1.0  # rows 3..5 are rank 1's
    B = synk.data(bad)
    synk.distribute()
    before = run.values()
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerError, match="rank 1 raised AssertionError: rows must be positive") as info:
        g(B)
    record(request, time.monotonic() - t0)
    assert info.value.ranks == [1] and "Traceback" in info.value.errors[0].traceback
    for v, w in zip(run.values(), before):
        np.testing.assert_array_equal(v, w)
    B.set_value(np.ones((6, 2)))
    assert g(B) == 12.0  # the group survives: the next call is right
    run.assert_usable()
    B.free_memory()


@pytest.mark.reliability("fault", SY)
@pytest.mark.parametrize("after", ["program", "per-rank"], ids=["after a call", "after a per-rank call"])
def test_worker_raises_inside_a_collective(run, request, after):
    """Rank 1 raises as the all_reduce starts: in CPU mode before it reduced (no rank changed
    anything, the group survives); on the engine rank 0 waits inside the program, so the group
    stops after the grace (:func:`assert_stopped_group`), whatever kind of call came before (a
    call that ran per rank too: the grace belongs to the collective, not to the last call)."""
    if after == "per-rank":
        a, b = run.values()  # each slice sums a and b once more
        assert run.f(run.X, num_slices=2) == pytest.approx(run.xd.sum() + 2 * (a.sum() + b.sum()), rel=1e-12)
    before = run.values()
    run.arm(REDUCE_AT, "raise")
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerError, match="rank 1 raised InjectedFault") as info:
        synk.all_reduce([run.a, run.b], op="sum")
    if ENGINE:
        assert_stopped_group(run, info, time.monotonic() - t0, request)
        return
    record(request, time.monotonic() - t0)
    assert info.value.ranks == [1] and "reliability_ops.py" in info.value.errors[0].traceback
    for v, w in zip(run.values(), before):  # rank 1 raised before it reduced: no rank changed anything
        np.testing.assert_array_equal(v, w)
    synk.all_reduce([run.a, run.b], op="sum")  # the group survives: the next collective is right
    for v, w in zip(run.values(), before):
        np.testing.assert_array_equal(v, np.stack([w.sum(0)] * 2))
    run.assert_usable()


def _chain(run: Run) -> tuple[synk.Chain, pytensor.compile.SharedVariable]:
    """first: ``acc := column sums of x`` (with the Probe, the injection point); all_reduce acc;
    then: ``a := a + sum(acc)``."""
    x = pt.matrix("x", dtype="float64")
    acc = pytensor.shared(np.zeros(2), name="acc")
    first = synk.function([x], (pt.sum(ro.Probe()(x)), "sum"), updates=[(acc, x.sum(axis=0))], mode=MODE)
    then = synk.function([], updates=[(run.a, run.a + acc.sum())], mode=MODE)
    return synk.chain(first, all_reduce=acc, op="sum", then=then), acc


@pytest.mark.reliability("fault", SY)
def test_worker_raises_inside_a_chain(run, request):
    """Rank 1 raises in the chain's first call: the master stops at the barrier before the
    all-reduce (no rank is left inside it), ``then`` runs nowhere, and the group goes on.  On the
    engine the first call is one program in which rank 0 waits for rank 1: the group stops after
    the grace (:func:`assert_stopped_group`)."""
    step, _ = _chain(run)
    synk.distribute()
    a_before, _ = run.values()
    run.arm("call", "raise")
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerError, match=RAISED) as info:
        step(run.X)
    if ENGINE:  # rank 0 waits inside the program for rank 1
        assert_stopped_group(run, info, time.monotonic() - t0, request)
        return
    record(request, time.monotonic() - t0)
    assert info.value.ranks == [1]
    np.testing.assert_array_equal(run.values()[0], a_before)  # then ran in no rank
    run.arm("nowhere", "raise")
    assert step(run.X) == pytest.approx(run.xd.sum(), rel=1e-12)
    np.testing.assert_allclose(run.values()[0], a_before + run.xd.sum())
    run.assert_usable()


@pytest.mark.reliability("fault", SY)
def test_worker_killed_inside_a_chain(run, request):
    step, _ = _chain(run)
    synk.distribute()
    run.arm("call", "kill")
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError) as info:
        step(run.X)
    record(request, time.monotonic() - t0)
    assert_dead_group(run, info)


@pytest.mark.reliability("fault", SY)
def test_worker_raises_inside_distribute(run, request):
    """The distribution of a new function (with a new shared variable) fails in rank 1; the next
    call distributes it again and computes the right result."""
    x = pt.matrix("x", dtype="float64")
    s = pytensor.shared(np.full(2, 5.0), name="s_new")
    g = synk.function([x], (pt.sum(ro.Probe("other")(x)) + pt.sum(s), "sum"), mode=MODE)
    run.arm("distribute", "raise")
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerError, match="rank 1 raised InjectedFault: injected fault at 'distribute'"):
        g(run.X)
    record(request, time.monotonic() - t0)
    assert g(run.X) == run.xd.sum() + 2 * 10.0
    np.testing.assert_array_equal(synk.gather(s), np.full((2, 2), 5.0))
    run.assert_usable()


# --- a worker dies ----------------------------------------------------------------------------------

@pytest.mark.reliability("fault", SY)
def test_worker_killed_while_idle(run, request):
    os.kill(run.pids[0], signal.SIGKILL)
    assert rl.wait_gone(run.pids[:1], 5.0) == []  # dead (a zombie until the master reaps it)
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError) as info:
        run.f(run.X)
    record(request, time.monotonic() - t0)
    assert_dead_group(run, info)


def _call_killing_rank_1(run: Run, seconds: float, after: float = 0.3
                         ) -> tuple[pytest.ExceptionInfo[synk.WorkerDiedError], float]:
    """Call a function whose every rank computes for ``seconds``; SIGKILL rank 1 ``after`` seconds in.

    Returns the WorkerDiedError raised and the time of the kill."""
    x = pt.matrix("x", dtype="float64")
    slow = synk.function([x], (ro.SlowSum(seconds)(x), "sum"), mode=MODE)
    synk.distribute()
    killed: list[float] = []

    def kill() -> None:
        os.kill(run.pids[0], signal.SIGKILL)
        killed.append(time.monotonic())

    timer = threading.Timer(after, kill)
    timer.start()
    try:
        with pytest.raises(synk.WorkerDiedError) as info:
            slow(run.X)
    finally:
        timer.join()
    return info, killed[0]


@pytest.mark.reliability("fault", SY)
def test_worker_killed_during_a_call(run, request):
    """Every rank computes for 1.5 s; rank 1 is killed 0.3 s in: the call fails within 2 s of the
    kill (the master's watchdog interrupts its own share)."""
    info, killed_at = _call_killing_rank_1(run, seconds=1.5)
    record(request, time.monotonic() - killed_at)
    assert_dead_group(run, info)


@pytest.mark.reliability("fault", SY)
def test_worker_killed_early_in_a_long_call(run, request):
    """Every rank computes for 3 s; rank 1 is killed 0.3 s in: the master's watchdog interrupts
    the master's own share (Python code between two numpy steps), and the call fails within about
    a second of the death, not when the share ends."""
    info, killed_at = _call_killing_rank_1(run, seconds=3.0)
    record(request, time.monotonic() - killed_at)
    assert_dead_group(run, info)


@pytest.mark.reliability("fault", SY)
def test_worker_killed_during_a_collective(run, request):
    """Rank 1 dies inside all_reduce([a, b]), after a and before b, while the master waits at b's
    barrier; on the engine (one program reduces both), as the program starts, while rank 0 waits
    inside it."""
    run.arm("reduce" if ENGINE else "all_reduce/1", "kill")
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError) as info:
        synk.all_reduce([run.a, run.b], op="sum")
    record(request, time.monotonic() - t0)
    assert_dead_group(run, info)


@pytest.mark.reliability("fault", SY)
def test_worker_killed_during_a_submitted_collective(run, request):
    """Rank 1 dies inside a submitted all_reduce (``synk.all_reduce.submit``) with another submitted
    behind it: the first's future raises WorkerDiedError, the second's that or CancelledError."""
    run.arm("reduce" if ENGINE else "all_reduce/1", "kill")
    t0 = time.monotonic()
    first = synk.all_reduce.submit([run.a, run.b], op="sum")
    behind = synk.all_reduce.submit(run.a, op="sum")
    with pytest.raises(synk.WorkerDiedError) as info:
        first.result(timeout=PROMISE_S)
    with pytest.raises((synk.WorkerDiedError, CancelledError)):
        behind.result(timeout=PROMISE_S)
    record(request, time.monotonic() - t0)
    assert_dead_group(run, info)


@pytest.mark.reliability("fault", SY)
def test_worker_killed_during_distribute(run, request):
    x = pt.matrix("x", dtype="float64")
    g = synk.function([x], (pt.sum(ro.Probe("other")(x)), "sum"), mode=MODE)
    run.arm("distribute", "kill")
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError) as info:
        g(run.X)
    record(request, time.monotonic() - t0)
    assert_dead_group(run, info)


@pytest.mark.reliability("fault", SY)
def test_worker_killed_while_compiling(run, request):
    """Rank 1 dies while it compiles a new function (its first call): the call fails within 2 s;
    the group is closed and a new one works."""
    x = pt.matrix("x", dtype="float64")
    g = synk.function([x], (pt.sum(ro.Probe("compiled")(x)) * 2.0, "sum"), mode=MODE)
    run.arm("compile", "kill")
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError) as info:
        g(run.X)
    record(request, time.monotonic() - t0)
    assert not os.path.exists(run.fault_file), "the fault did not fire: rank 1 compiled no Probe"
    assert_dead_group(run, info)


# --- synk_comm alone -------------------------------------------------------------------------------

@pytest.fixture
def comm() -> Iterator[synk_comm.Group]:
    _drop_spare()
    group = synk_comm.start(3, imports=["reliability_lib"])
    pids = rl.group_worker_pids(group)
    yield group
    group.close()
    rl.check_no_leak("workers of the synk_comm group", rl.wait_gone(pids, 5.0))
    rl.check_no_leak("/dev/shm entries of the synk_comm group", rl.wait_no_entries(group.prefix, 2.0))


@pytest.mark.reliability("fault", CM)
def test_comm_worker_raises_between_collectives(comm, request):
    t0 = time.monotonic()
    with pytest.raises(synk_comm.WorkerError, match="rank 2 raised InjectedFault") as info:
        comm.run("rel.raise_in_collective", 2)
    record(request, time.monotonic() - t0)
    assert info.value.ranks == [2]
    np.testing.assert_array_equal(comm.run("rel.sum_ranks", 4), np.full(4, 3.0))
    np.testing.assert_array_equal(comm.run("rel.raise_in_collective", -1), np.full(8, 9.0))


@pytest.mark.reliability("fault", CM)
def test_comm_worker_killed_in_a_loop_of_all_reduces(comm, request):
    pids = rl.group_worker_pids(comm)
    x = np.ones(16)
    killed = None
    with pytest.raises(synk_comm.WorkerDiedError) as info, comm.command("rel.all_reduce_loop", 10**9):
        for i in range(10**9):
            comm.all_reduce(x, "sum")
            if i == 100:
                os.kill(pids[1], signal.SIGKILL)
                killed = time.monotonic()
    assert killed is not None
    record(request, time.monotonic() - killed)
    assert info.value.rank == 2 and comm.closed
    rl.check_no_leak("workers after a worker death", rl.wait_gone(pids, PROMISE_S))
    rl.check_no_leak("/dev/shm entries after a worker death", rl.wait_no_entries(comm.prefix, PROMISE_S))


# --- the master dies, or is interrupted (a subprocess master) ---------------------------------------

@pytest.fixture
def master(request) -> Iterator[rl.Script]:
    """``rel_master.py`` started in the mode the test names; afterwards nothing of its run is left."""
    _drop_spare()
    mode, seconds = request.param
    script = rl.Script(MASTER, mode, str(seconds))
    try:
        line, _ = script.expect("pids", 120)
        pids = [int(p) for p in line.split()[1:]]
        assert pids[0] == script.pid and len(pids) == (3 if ENGINE else 2)  # the engine's master is no rank
        script.worker_pids = pids[1:]
        script.prefix = script.expect("prefix", 10)[0].split()[1]
        yield script
    finally:
        gone = rl.wait_gone(script.worker_pids, 5.0)
        script.close()
    rl.check_no_leak("workers of the subprocess master", gone)
    rl.check_no_leak("/dev/shm entries of the subprocess master's run", rl.wait_no_entries(script.prefix, 2.0))


def assert_master_gone(script: rl.Script, died_at: float, request: pytest.FixtureRequest) -> None:
    """Every worker exits, and the run's /dev/shm entries go, within 2 s of the master's death."""
    left = rl.wait_gone(script.worker_pids, 5.0)
    rl.check_no_leak("workers of a dead master", left)
    entries = rl.wait_no_entries(script.prefix, 5.0)
    record(request, time.monotonic() - died_at)
    rl.check_no_leak("/dev/shm entries of a dead master's run", entries)


@pytest.mark.reliability("fault", SY)
@pytest.mark.parametrize("master", [("idle", 0)], indirect=True, ids=["idle"])
def test_master_sigkilled_while_idle(master, request):
    master.expect("ready", 30)
    os.kill(master.pid, signal.SIGKILL)
    assert master.proc.wait(5) == -signal.SIGKILL
    assert_master_gone(master, time.monotonic(), request)


@pytest.mark.reliability("fault", SY)
@pytest.mark.parametrize("master", [("busy", 30.0)], indirect=True, ids=["busy"])
def test_master_sigkilled_during_a_call(master, request):
    master.expect("calling", 30)
    time.sleep(0.5)  # the workers are computing
    os.kill(master.pid, signal.SIGKILL)
    assert master.proc.wait(5) == -signal.SIGKILL
    assert_master_gone(master, time.monotonic(), request)


@pytest.mark.reliability("fault", SY)
@pytest.mark.parametrize("master", [("idle", 0)], indirect=True, ids=["idle"])
def test_master_sigterm_while_idle(master, request):
    """SIGTERM: the master closes its group on the way out (synk_shm's handler), then dies of it."""
    master.expect("ready", 30)
    os.kill(master.pid, signal.SIGTERM)
    t0 = time.monotonic()
    assert master.proc.wait(5) == -signal.SIGTERM
    assert_master_gone(master, t0, request)


@pytest.mark.reliability("fault", SY)
@pytest.mark.parametrize("master", [
    ("sigint-catch", 3.0),
    pytest.param(("sigint-waiting", 3.0), marks=pytest.mark.skipif(
        ENGINE, reason="GPU mode's master computes no share and is no rank (master_rank has no meaning): "
                       "it always waits for the workers, as 'master computing' tests there")),
], indirect=True, ids=["master computing", "master waiting for a worker"])
def test_sigint_during_a_long_call_caught_then_next_call(master, request):
    """Ctrl-C 0.5 s into a 3 s call: KeyboardInterrupt within 2 s; the script catches it, and its
    next call (which first waits for the workers to finish the interrupted one) is right."""
    master.expect("calling", 30)
    time.sleep(0.5)
    os.kill(master.pid, signal.SIGINT)
    t0 = time.monotonic()
    _, at = master.expect("interrupted", 10)
    record(request, at - t0)
    line, _ = master.expect("result", 15)
    _, got, want, _seconds = line.split()
    assert float(got) == float(want)
    master.expect("done", 10)
    assert master.proc.wait(10) == 0


@pytest.mark.reliability("fault", SY)
@pytest.mark.parametrize("master", [("busy", 10.0)], indirect=True, ids=["uncaught"])
def test_sigint_during_a_long_call_uncaught(master, request):
    """Ctrl-C in a script that does not catch it: a KeyboardInterrupt traceback and the end of the
    process (its workers with it) within 2 s, though the workers were 9 s away from done."""
    master.expect("calling", 30)
    time.sleep(0.5)
    os.kill(master.pid, signal.SIGINT)
    t0 = time.monotonic()
    rc = master.proc.wait(10)
    exited = time.monotonic() - t0
    assert exited < PROMISE_S, f"the script took {exited:.2f} s to exit after Ctrl-C"
    assert rc in (-signal.SIGINT, 1, 130), rc
    assert "KeyboardInterrupt" in master.stderr()
    assert_master_gone(master, t0, request)
