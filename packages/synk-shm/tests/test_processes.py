"""Real separate processes: a spawned child reads and writes a Data in place and follows the
creator's reallocation; children that exit, are terminated or are SIGKILLed leave nothing in
/dev/shm once :func:`synk_shm.sweep` has run; a forked child never unlinks its parent's segments.

Children are fresh interpreters (the ``spawn`` start method) except in the fork test.  Their bodies
live in :mod:`shm_testutil`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import shm_testutil
from shm_testutil import own_entries

import synk_shm
from synk_shm import Data, naming

pytestmark = pytest.mark.timeout(60)
SPAWN = mp.get_context("spawn")


class Child:
    """A spawned child serving :func:`shm_testutil.child_attach_and_follow`."""

    def __init__(self, handle):
        self.commands, self.replies = SPAWN.Queue(), SPAWN.Queue()
        self.process = SPAWN.Process(target=shm_testutil.child_attach_and_follow,
                                     args=(handle, self.commands, self.replies), daemon=True)
        self.process.start()

    def ask(self, *cmd):
        self.commands.put(cmd)
        status, result = self.replies.get(timeout=30)
        if status != "ok":
            raise AssertionError(f"child failed on {cmd[0]!r}: {result}")
        return result

    def ask_error(self, *cmd) -> str:
        self.commands.put(cmd)
        status, result = self.replies.get(timeout=30)
        assert status == "error", f"child did not fail on {cmd!r}"
        return result

    def stop(self):
        try:
            if self.process.is_alive():
                self.ask("stop")
        finally:
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
            for q in (self.commands, self.replies):  # no feeder thread outlives the test
                q.close()
                q.join_thread()


def segment_exists(segment: str | None) -> bool:
    return segment is not None and os.path.exists("/dev/shm/" + segment.lstrip("/"))


def test_child_reads_writes_in_place_and_follows_reallocation():
    d = Data(np.arange(12, dtype="float32").reshape(4, 3), name="x", oversize=1.5)
    child = Child(d.handle())
    try:
        np.testing.assert_array_equal(child.ask("read"), d.data)
        assert child.ask("info") == ((4, 3), d.tag, 2, d.handle().segment)

        d[1] = 100  # the parent writes: the child reads it in place, with no message
        np.testing.assert_array_equal(child.ask("check", 1), [100, 100, 100])
        child.ask("write", (slice(None), 2), np.array([-1, -2, -3, -4], dtype="float32"))
        np.testing.assert_array_equal(d[:, 2], [-1, -2, -3, -4])  # and the other way round

        assert "RuntimeError: Data 'x' is attached from another process" in child.ask_error("resize", 9)

        # a new shape within the allocation: same segment, the child follows through update()
        segment, tag = d.handle().segment, d.tag
        d.set_length(6)
        assert (d.handle().segment, d.tag) == (segment, tag)
        child.ask("update", d.handle())
        assert child.ask("info") == ((6, 3), tag, 2, segment)
        np.testing.assert_array_equal(child.ask("read"), d.data)

        # beyond the allocation: a new segment; the old name is gone but the child still maps it
        expected = d.data.copy()
        d.set_length(1000)
        assert d.tag == tag + 1 and d.handle().segment != segment
        assert not segment_exists(segment)
        np.testing.assert_array_equal(child.ask("read"), expected)  # the old, still mapped
        child.ask("update", d.handle())
        assert child.ask("info") == ((1000, 3), tag + 1, 2, d.handle().segment)
        got = child.ask("read")
        np.testing.assert_array_equal(got[:6], expected)
        assert not got[6:].any()
        child.ask("write", 999, np.array([7, 8, 9], dtype="float32"))
        np.testing.assert_array_equal(d[999], [7, 8, 9])

        # free: the child drops its mapping and errs clearly on indexing
        d.free_memory()
        child.ask("update", d.handle())
        assert child.ask("info") == (None, tag + 2, 2, None)
        assert "ValueError: Data 'x' holds no memory" in child.ask_error("check", 0)
        d.set_value(np.ones((2, 3), "float32"))
        child.ask("update", d.handle())
        np.testing.assert_array_equal(child.ask("read"), np.ones((2, 3)))
    finally:
        child.stop()
        d.free_memory()
    assert child.process.exitcode == 0


def _start_creator(how: str, n_segments: int = 3):
    replies = SPAWN.Queue()
    env_prefix = os.environ.pop(naming.RUN_PREFIX_ENV, None)  # the child is a run of its own
    try:
        process = SPAWN.Process(target=shm_testutil.child_create_and_wait,
                                args=(n_segments, replies, how), daemon=True)
        process.start()
    finally:
        if env_prefix is not None:
            os.environ[naming.RUN_PREFIX_ENV] = env_prefix
    prefix, entries = replies.get(timeout=30)
    assert prefix != synk_shm.run_prefix()
    assert prefix.startswith(f"/synk{os.stat('/proc/self/ns/pid').st_ino:x}-{process.pid}-")
    assert len(entries) == n_segments + 1  # the Data and one semaphore
    assert any(e.startswith("sem.") for e in entries)
    return process, prefix, entries


def test_sigkilled_child_leaves_segments_that_sweep_removes():
    process, prefix, entries = _start_creator("wait")
    try:
        assert synk_shm.sweep() >= 0
        assert own_entries(prefix) == entries  # a live run is never swept
        process.kill()
        process.join(10)
        assert process.exitcode == -signal.SIGKILL
        assert own_entries(prefix) == entries  # SIGKILL runs no clean-up: the sweep must
        assert synk_shm.sweep() >= len(entries)
        assert own_entries(prefix) == []
    finally:
        if process.is_alive():
            process.kill()
            process.join()
        naming.unlink_prefix(prefix)


@pytest.mark.parametrize(("how", "exitcode"), [("exit", 0), ("sigterm", -signal.SIGTERM),
                                               ("terminate", -signal.SIGTERM)])
def test_child_ending_normally_or_by_sigterm_leaves_nothing(how, exitcode):
    process, prefix, entries = _start_creator("wait" if how == "terminate" else how)
    try:
        if how == "terminate":
            assert own_entries(prefix) == entries
            process.terminate()  # SIGTERM from outside, while the child sleeps
        process.join(20)
        assert process.exitcode == exitcode
        assert own_entries(prefix) == []  # without any sweep
    finally:
        if process.is_alive():
            process.kill()
            process.join()
        naming.unlink_prefix(prefix)


@pytest.mark.parametrize("how", ["close", "cleanup", "terminate"])
def test_forked_child_never_unlinks_the_parents_segments(how):
    d = Data(np.arange(3.0))
    other = Data.attach(d.handle())
    process = mp.get_context("fork").Process(target=shm_testutil.child_forked,
                                             args=(d, "wait" if how == "terminate" else how))
    process.start()
    try:
        if how == "terminate":
            # wait until the child runs (its SIGTERM handler is inherited from this process)
            process.join(0.5)
            process.terminate()
        process.join(20)
        assert process.exitcode == (-signal.SIGTERM if how == "terminate" else 0)
        assert segment_exists(d.handle().segment)
        Data.attach(d.handle()).close()
    finally:
        if process.is_alive():
            process.kill()
            process.join()
        other.close()
        d.free_memory()


_THREAD_FIRST = """
import os, signal, threading, time
import numpy as np, synk_shm
held = []
t = threading.Thread(target=lambda: held.append(synk_shm.Data(np.zeros(3))))  # first segment
t.start(); t.join()
held.append(synk_shm.Data(np.zeros(3)))
print(synk_shm.run_prefix(), flush=True)
if {sigterm}:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
"""


@pytest.mark.parametrize("sigterm", [False, True])
def test_plain_interpreter_cleans_up_even_when_a_thread_made_the_first_segment(sigterm):
    env = {k: v for k, v in os.environ.items() if k != naming.RUN_PREFIX_ENV}
    proc = subprocess.run([sys.executable, "-c", _THREAD_FIRST.format(sigterm=sigterm)], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == (-signal.SIGTERM if sigterm else 0), proc.stderr
    prefix = proc.stdout.split()[0]
    try:
        assert own_entries(prefix) == []
    finally:
        naming.unlink_prefix(prefix)
