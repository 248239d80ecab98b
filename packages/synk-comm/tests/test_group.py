"""The process group: spawn, commands, worker errors, dead workers, a dead master, interrupts, close.

Every test that can hang if the group misbehaves carries a pytest-timeout; timings that the
design promises (a dead worker is reported within about a second) are asserted with slack.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from comm_handlers import all_reduce_ranks, raise_on_rank, rank_plus
from comm_testutil import alive, entries_with, python_env, run_entries, run_python, wait_gone

import synk_comm
from synk_comm import GroupBrokenError, WorkerDiedError, WorkerError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def group():
    """One group of 3 for the tests that leave it usable."""
    g = synk_comm.start(3, imports=["comm_handlers"])
    yield g
    g.close()


def fresh(size: int = 3) -> synk_comm.Group:
    """A group of its own, for a test that breaks it."""
    return synk_comm.start(size, imports=["comm_handlers"])


def assert_usable(group: synk_comm.Group) -> None:
    n = group.size
    np.testing.assert_array_equal(group.run("sum_ranks", 7), np.full(7, n * (n - 1) / 2))
    assert group.run("echo", "again") == [(r, "again") for r in range(n)]


def group_entries(group: synk_comm.Group) -> list[str]:
    prefix = group.prefix.lstrip("/")
    return entries_with(lambda e: e.startswith((prefix, "sem." + prefix)))


# --- spawn ----------------------------------------------------------------------------------------


def test_spawn_returns_results_in_rank_order():
    results = synk_comm.spawn(rank_plus, 4, args=(10,))
    assert [r[:2] for r in results] == [(10, 4), (11, 4), (12, 4), (13, 4)]
    pids = [r[2] for r in results]
    assert pids[0] == os.getpid()
    assert len(set(pids)) == 4
    assert wait_gone(pids[1:], 5.0) == []


def test_spawn_all_reduce():
    for res in synk_comm.spawn(all_reduce_ranks, 3):
        np.testing.assert_array_equal(res, np.full(3, 3.0))


def test_spawn_error_in_a_rank_is_worker_error():
    with pytest.raises(WorkerError) as info:
        synk_comm.spawn(raise_on_rank, 3, args=(2,))
    assert info.value.ranks == [2]
    assert "boom from rank 2" in str(info.value) and "raise_on_rank" in info.value.errors[0].traceback


def test_size_one_group_has_no_workers():
    g = synk_comm.start(1, imports=["comm_handlers"])
    try:
        np.testing.assert_array_equal(g.run("sum_ranks", 2), np.zeros(2))
        assert g.run("echo", 5) == [(0, 5)]
    finally:
        g.close()


def test_master_rank_other_than_zero():
    g = synk_comm.start(3, imports=["comm_handlers"], master_rank=1)
    try:
        assert g.rank == 1 and g.workers == [0, 2]
        assert g.run("echo", "x") == [(0, "x"), (1, "x"), (2, "x")]
        np.testing.assert_array_equal(g.run("sum_ranks", 3), np.full(3, 3.0))
    finally:
        g.close()
    assert group_entries(g) == []


# --- commands -------------------------------------------------------------------------------------


def test_command_runs_in_every_rank(group):
    assert group.run("echo", {"a": [1, 2]}) == [(r, {"a": [1, 2]}) for r in range(3)]
    with group.command("sum_ranks", 4):
        res = group.all_reduce(np.full(4, float(group.rank)), "sum")
    np.testing.assert_array_equal(res, np.full(4, 3.0))


def test_replies_follow_every_change_of_layout_and_buffer(group):
    """The master keeps its views of the workers' replies while no layout changes
    (``Buffers.read_each``): same layouts, then new shapes in one rank, then back, then a reply
    larger than the mailbox (a new segment), then an error message in the mailbox in between, then
    two layouts taking turns (a train step's reply and an evaluation's: each keeps its views)."""
    plans = [{1: [1], 2: [1]}, {1: [1], 2: [1]}, {1: [1], 2: [3, 2]}, {1: [1], 2: [1]}, {1: [100_000], 2: [1]},
             {1: [2], 2: [2]}, {1: None, 2: [2]}, {1: [2], 2: [2]}, {1: [5], 2: [2]},
             *[{1: [3, 1], 2: [1]}, {1: [1], 2: [2, 3]}] * 3]
    for i, plan in enumerate(plans):
        plan["base"] = 10 * i  # every reply's values differ from the last one of its layout
        if plan[1] is None:
            with pytest.raises(WorkerError, match="no reply from rank 1"), group.command("reply_shapes", plan):
                pass
            continue
        with group.command("reply_shapes", plan):
            pass
        for copy in (False, True):
            replies = group.replies(copy=copy)
            assert sorted(replies) == [1, 2]
            for rank, arrays in replies.items():
                assert len(arrays) == len(plan[rank]), (plan, rank)
                for a, n in zip(arrays, plan[rank]):
                    np.testing.assert_array_equal(a, 10 * i + rank + np.arange(n), err_msg=f"{plan}, rank {rank}")


def test_numbers_replied_by_every_rank_land_in_one_table(group):
    """``reply_values``: each rank's numbers (the master's own too) in its row of the table that
    the master reads after the command, float64; a rank that replies fewer numbers leaves the
    rest of its row as it was; more than REPLY_VALUES is a ValueError in that rank, after which
    the group goes on."""
    from synk_comm.lockstep import REPLY_VALUES

    full = {r: [10.0 * r + i + 0.5 for i in range(REPLY_VALUES)] for r in range(3)}
    group.run("reply_values", full)
    table = group.replied_values()
    assert table.shape == (3, REPLY_VALUES) and table.dtype == np.float64
    np.testing.assert_array_equal(table, [full[r] for r in range(3)])
    group.run("reply_values", {0: [np.float32(0.1)], 1: [-1.0, 2**60], 2: []})
    table = group.replied_values()
    np.testing.assert_array_equal(table[0], [float(np.float32(0.1)), *full[0][1:]])
    np.testing.assert_array_equal(table[1], [-1.0, 2.0**60, *full[1][2:]])
    np.testing.assert_array_equal(table[2], full[2])
    with pytest.raises(WorkerError, match="at most"):
        group.run("reply_values", {0: [1.0], 1: [1.0] * (REPLY_VALUES + 1), 2: [2.0]})
    with pytest.raises(ValueError, match="at most"):
        group.reply_values([0.0] * (REPLY_VALUES + 1))
    group.run("reply_values", {0: [7.0], 1: [8.0], 2: [9.0]})
    np.testing.assert_array_equal(group.replied_values()[:, 0], [7.0, 8.0, 9.0])


def test_unknown_handler_is_value_error(group):
    with pytest.raises(ValueError, match="no handler named 'no_such_handler'"):
        group.run("no_such_handler")
    with pytest.raises(ValueError, match="no handler named"), group.command("no_such_handler"):
        pass
    assert_usable(group)


@pytest.mark.parametrize("bad_rank", [1, 2])
@pytest.mark.parametrize("others_wait", [False, True], ids=["alone", "others_at_barrier"])
def test_worker_error_names_rank_with_traceback(group, bad_rank, others_wait):
    """A handler raising in one worker: WorkerError with that rank and its traceback; group usable."""
    with pytest.raises(WorkerError) as info:
        group.run("fail_on_rank", {"rank": bad_rank, "barrier": others_wait})
    err = info.value
    assert err.ranks == [bad_rank]
    remote = err.errors[0]
    assert remote.rank == bad_rank and remote.type_name == "RuntimeError"
    assert remote.message == f"boom from rank {bad_rank}"
    assert "Traceback (most recent call last)" in remote.traceback
    assert "fail_on_rank" in remote.traceback and "comm_handlers.py" in remote.traceback
    text = str(err)
    assert f"rank {bad_rank} raised RuntimeError: boom from rank {bad_rank}" in text
    assert f"traceback in rank {bad_rank}" in text
    assert_usable(group)


def test_master_error_inside_command_is_its_own(group):
    """The master's body raises while the workers wait at a barrier: the master's exception comes
    out (not a WorkerError), and the group is usable."""
    with pytest.raises(ZeroDivisionError), group.command("barrier", 3):
        1 / 0  # noqa: B018
    assert_usable(group)
    with pytest.raises(LookupError, match="master's own"), group.command("noop"):
        raise LookupError("the master's own")
    assert_usable(group)


@pytest.mark.parametrize("handler", ["sleep", "sleep_barrier"])
def test_keyboard_interrupt_mid_command(group, handler):
    """Ctrl-C in the master while a worker is busy: it propagates at once; the next command
    collects the interrupted one's completions first and gives correct results."""
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt), group.command(handler, 1.0):
        raise KeyboardInterrupt
    assert time.monotonic() - t0 < 0.9, "the interrupt must not wait for the workers"
    assert_usable(group)
    assert time.monotonic() - t0 >= 1.0, "the next command waited for the interrupted one"
    assert_usable(group)


# --- dead workers ---------------------------------------------------------------------------------


@pytest.mark.timeout(20)
@pytest.mark.parametrize("next_command", ["noop", "sum_ranks"])
def test_worker_killed_while_idle(next_command):
    g = fresh(3)
    try:
        pids = g.run("pids")
        os.kill(pids[1], signal.SIGKILL)
        assert wait_gone([pids[1]], 5.0) == []
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            g.run(next_command, 4)
        assert time.monotonic() - t0 < 2.0
        assert info.value.rank == 1 and info.value.pid == pids[1]
        assert info.value.returncode == -signal.SIGKILL
        assert "rank 1" in str(info.value) and "SIGKILL" in str(info.value)
        assert g.closed
        with pytest.raises(GroupBrokenError):
            g.run("noop")
        with pytest.raises(GroupBrokenError):
            g.run("sum_ranks")
        assert wait_gone(pids[2:], 5.0) == []
        assert group_entries(g) == []
    finally:
        g.close()


@pytest.mark.timeout(20)
def test_worker_killed_during_collective():
    """A worker dies while every rank is inside back-to-back all_reduces."""
    g = fresh(3)
    try:
        pids = g.run("pids")
        x = np.ones(16)
        killed_at = None
        with pytest.raises(WorkerDiedError) as info, g.command("all_reduce_loop", 10**9):
            for i in range(10**9):
                g.all_reduce(x, "sum")
                if i == 200:
                    os.kill(pids[2], signal.SIGKILL)
                    killed_at = time.monotonic()
        assert killed_at is not None
        assert time.monotonic() - killed_at < 2.0
        assert info.value.rank == 2
        assert g.closed
        with pytest.raises(GroupBrokenError):
            g.run("noop")
        assert wait_gone(pids[1:], 5.0) == []
        assert group_entries(g) == []
    finally:
        g.close()


@pytest.mark.timeout(20)
def test_worker_killed_during_pipelined_all_reduce():
    """A worker dies while the master waits inside a pipelined all-reduce for its progress."""
    g = fresh(2)
    try:
        pids = g.run("pids")
        g.host.pipeline = True
        n = 4 << 20
        x, out = np.ones(n, np.float32), np.empty(n, np.float32)
        killed_at = None
        with pytest.raises(WorkerDiedError) as info, g.command("big_all_reduce_loop", {"n": n, "calls": 10**9}):
            for i in range(10**9):
                g.all_reduce(x, "sum", out=out)
                if i == 5:
                    os.kill(pids[1], signal.SIGKILL)
                    killed_at = time.monotonic()
        assert killed_at is not None
        assert time.monotonic() - killed_at < 2.0
        assert info.value.rank == 1
        assert g.closed
        assert group_entries(g) == []
    finally:
        g.close()


KILL_AFTER_S = 0.3


class Doomed:
    """A fresh group of 2 (``group``, its ``pids``) whose rank 1 a timer SIGKILLs
    :data:`KILL_AFTER_S` after :meth:`start`."""

    def __init__(self, group: synk_comm.Group) -> None:
        self.group = group
        self.pids = group.run("pids")
        self.killer = threading.Timer(KILL_AFTER_S, os.kill, (self.pids[1], signal.SIGKILL))

    def start(self) -> float:
        """Start the timer; return when (``time.monotonic()``)."""
        t0 = time.monotonic()
        self.killer.start()
        return t0


@pytest.fixture
def doomed():
    """A :class:`Doomed` group, closed (and its timer joined) after the test."""
    g = fresh(2)
    try:
        d = Doomed(g)
        yield d
        if d.killer.ident is not None:
            d.killer.join()
    finally:
        g.close()


@pytest.mark.timeout(20)
def test_worker_killed_while_master_waits_at_barrier(doomed):
    g = doomed.group
    with pytest.raises(WorkerDiedError) as info, g.command("sleep", 30.0):
        t0 = doomed.start()
        g.barrier()  # rank 1 sleeps in its handler, then dies: it never arrives
    assert time.monotonic() - t0 < KILL_AFTER_S + 2.0
    assert info.value.rank == 1
    assert g.closed


@pytest.mark.timeout(20)
def test_worker_killed_while_master_computes_its_own_part(doomed):
    """The master's own part runs Python for 10 s (no wait on the group): its watchdog ends it
    with WorkerDiedError within about a second of the worker's death."""
    g = doomed.group
    with pytest.raises(WorkerDiedError) as info, g.command("sleep", 30.0):
        t0 = doomed.start()
        while time.monotonic() - t0 < 10.0:  # the master's share: Python code, no group call
            sum(range(1000))
    assert time.monotonic() - t0 < KILL_AFTER_S + 1.5
    assert info.value.rank == 1
    assert g.closed
    assert wait_gone(doomed.pids[1:], 5.0) == []
    doomed.killer.join()
    g2 = fresh(2)  # the next group is not interrupted by the last one's watchdog
    try:
        t1 = time.monotonic()
        with g2.command("sleep", 0.0):
            while time.monotonic() - t1 < 0.5:
                sum(range(1000))
        assert_usable(g2)
    finally:
        g2.close()


# --- a dead master --------------------------------------------------------------------------------

MASTER_SCRIPT = textwrap.dedent("""\
    import os, signal, sys
    import numpy as np
    import synk_comm

    group = synk_comm.start(3, imports=["comm_handlers"])
    group.run("sum_ranks", 100_000)          # buffers of every rank exist in /dev/shm
    pids = group.run("pids")
    print(" ".join(map(str, pids)), flush=True)
    if sys.argv[1] == "busy":
        with group.command("all_reduce_loop", 10**9):
            for _ in range(100):
                group.all_reduce(np.ones(16))
            os.kill(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("state", ["idle", "busy"])
def test_master_sigkilled_workers_exit_and_clean_up(tmp_path, state):
    script = tmp_path / "master.py"
    script.write_text(MASTER_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), state], env=python_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        line = proc.stdout.readline()
        assert proc.wait(10) == -signal.SIGKILL, proc.stderr.read()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 3 and pids[0] == proc.pid
        t0 = time.monotonic()
        left = wait_gone(pids[1:], 5.0)
        assert left == [], f"workers {left} outlived their master"
        assert time.monotonic() - t0 < 5.0
        deadline = time.monotonic() + 2.0
        while run_entries(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run_entries(proc.pid) == []
    finally:
        for pid in pids[1:]:
            if alive(pid):  # a worker that failed the test: do not leave it running
                os.kill(pid, signal.SIGKILL)
        proc.stdout.close()
        proc.stderr.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- close ----------------------------------------------------------------------------------------


def test_close_is_idempotent():
    g = fresh(3)
    pids = g.run("pids")
    assert group_entries(g) != []
    g.close()
    assert g.closed
    g.close()
    g.close(timeout=0.1)
    assert wait_gone(pids[1:], 5.0) == []
    assert group_entries(g) == []
    with pytest.raises(GroupBrokenError, match="closed"):
        g.run("noop")
    with pytest.raises(GroupBrokenError):
        g.command("noop").__enter__()
    assert "closed" in repr(g)


def test_collectives_after_close_raise_group_broken():
    """A collective on a closed group: GroupBrokenError, and no new segment in /dev/shm."""
    g = fresh(2)
    g.close()
    x = np.ones(3)
    calls = [lambda: g.all_reduce(x), lambda: g.reduce(x), lambda: g.broadcast(x), lambda: g.gather(x),
             lambda: g.all_gather(x), lambda: g.scatter([x, x]), lambda: g.reduce_scatter(x),
             lambda: g.broadcast_object(1), lambda: g.gather_object(1), g.barrier]
    for call in calls:
        with pytest.raises(GroupBrokenError, match="closed"):
            call()
    assert group_entries(g) == []


# --- scripts and imports --------------------------------------------------------------------------

UNGUARDED_SCRIPT = textwrap.dedent("""\
    # no `if __name__ == "__main__":` guard: the workers must never run this file
    import os
    import sys
    import numpy as np
    import synk_comm
    import comm_handlers

    with open(sys.argv[1], "a") as f:
        f.write("ran\\n")
    group = synk_comm.start(3, imports=["comm_handlers"])
    result = group.run("sum_ranks", 4)
    assert (result == 3.0).all(), result
    assert group.run("echo", "hi") == [(0, "hi"), (1, "hi"), (2, "hi")]
    group.close()
    spawned = synk_comm.spawn(comm_handlers.all_reduce_ranks, 2)
    assert all((r == 1.0).all() for r in spawned), spawned
    print("result", result.tolist())
    print("pid", os.getpid())
""")


def test_script_without_main_guard(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    marker = tmp_path / "runs.txt"
    proc = run_python([str(script), str(marker)], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result [3.0, 3.0, 3.0, 3.0]" in proc.stdout
    assert marker.read_text() == "ran\n", "a worker re-ran the script's top level"
    pid = int(proc.stdout.split("pid", 1)[1])
    assert run_entries(pid) == []


NO_PYTENSOR_SCRIPT = textwrap.dedent("""\
    import sys
    import synk_comm
    import synk_comm.buffers, synk_comm.collectives, synk_comm.errors, synk_comm.group  # noqa
    import synk_comm.lockstep, synk_comm.ops, synk_comm.shm_collectives, synk_comm.worker  # noqa
    import comm_handlers

    assert "pytensor" not in sys.modules, "synk_comm imported pytensor"
    try:
        import pytensor  # noqa
    except ImportError:
        pass
    else:
        raise AssertionError("the pytensor blocker did not work")
    results = synk_comm.spawn(comm_handlers.modules_loaded, 2, args=(["pytensor", "theano", "jax"],))
    assert results == [[False, False, False]] * 2, results
    print("ok")
""")


def test_import_without_pytensor(tmp_path):
    """synk_comm never imports PyTensor: with an unimportable ``pytensor`` first on the path (as if
    it were not installed), import and a spawn work in master and workers alike."""
    blocker = tmp_path / "blocked" / "pytensor"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('pytensor is not installed (test blocker)')\n")
    script = tmp_path / "no_pytensor.py"
    script.write_text("if __name__ == '__main__':\n" + textwrap.indent(NO_PYTENSOR_SCRIPT, "    "))
    proc = run_python([str(script)], extra_path=[str(tmp_path / "blocked")])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "ok"


def test_worker_errors_survive_pickling() -> None:
    import pickle

    from synk_comm.errors import RemoteError

    err = synk_comm.WorkerError([RemoteError(1, "KeyError", "'k'", "Traceback ...")])
    back = pickle.loads(pickle.dumps(err))
    assert back.ranks == [1] and str(back) == str(err)
    died = synk_comm.WorkerDiedError(2, 1234, -9, " It said hello.")
    back_died = pickle.loads(pickle.dumps(died))
    assert (back_died.rank, back_died.pid, back_died.returncode) == (2, 1234, -9) and str(back_died) == str(died)
