"""Shared fixtures of the synk-shm tests.

The session fixture :func:`shm_left_clean` is the suite's proof that no segment outlives its run:
after the last test it asserts that ``/dev/shm`` holds nothing of this test run, then runs
:func:`synk_shm.sweep` and asserts that nothing of a dead run (of this user and pid namespace) is
left either.  It judges "dead" on its own, from ``/proc``, not through synk_shm's helpers.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

import synk_shm

# The helpers module (and the bodies of spawned children) import by name under any import mode;
# spawned children inherit sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shm_testutil import dead_run_entries, own_entries


@pytest.fixture(scope="session", autouse=True)
def shm_left_clean():
    """After the session: nothing of this run in /dev/shm, and sweep() leaves no dead run's.

    What this run already held when the first synk-shm test started is left out: when every
    package's tests run in one session, another package's session fixture (a process group set up
    by an earlier test directory) may legitimately outlive this fixture.  Run alone, that is nothing.
    """
    before = set(own_entries())
    yield
    gc.collect()  # Data that a failed test still referenced from a traceback
    leftovers = sorted(set(own_entries()) - before)
    assert not leftovers, f"the tests left shared-memory objects of their own run: {leftovers}"
    synk_shm.sweep()
    dead = dead_run_entries()
    assert not dead, f"sweep() left objects of dead runs in /dev/shm: {dead}"


@pytest.fixture(autouse=True)
def no_new_entries():
    """Per test: every segment the test created is gone when it ends (Data garbage-collected)."""
    before = set(own_entries())
    yield
    gc.collect()
    new = sorted(set(own_entries()) - before)
    assert not new, f"test left shared-memory objects behind: {new}"
