"""Shared fixtures of the synk-comm tests.

Workers receive the master's ``sys.path``, so putting this directory on it makes the handler
module :mod:`comm_handlers` (and the SPMD functions in it) importable by name in every rank.

The session fixture :func:`no_shm_left` is the suite's check that no segment or semaphore of this
test run outlives it: after the last test, ``/dev/shm`` must hold no entry of our run prefix.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

from synk_shm import naming

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from comm_testutil import entries_with  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def no_shm_left():
    """After the session: /dev/shm holds nothing of this run (segments, nor ``sem.`` semaphores)."""
    yield
    gc.collect()
    prefix = naming.run_prefix().lstrip("/")
    left = entries_with(lambda e: e.startswith((prefix, "sem." + prefix)))
    assert not left, f"the synk-comm tests left shared-memory objects of their run in /dev/shm: {left}"
