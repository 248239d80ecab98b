"""Fixtures of the synkhronos (CPU mode) tests.

Helpers live in :mod:`synk_testutil` (every package's tests run in one pytest session, where the
name ``conftest`` is not unique); this directory goes on ``sys.path`` so that it imports by name.

``ranks`` forks a group of 2, then of 3, ranks once per test module (``synk.fork(n,
use_gpu=False)``) and closes it after the module's last test, checking that no worker process
and no shared-memory object of the group outlives :func:`synkhronos.close`.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from synk_testutil import assert_no_workers_left, own_entries  # noqa: E402

import synkhronos as synk  # noqa: E402
from synkhronos.runtime import current  # noqa: E402


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request):
    """A forked CPU-mode group of ``request.param`` ranks for the whole module; yields its size."""
    n = synk.fork(request.param, use_gpu=False)
    assert n == request.param
    prefix = current().group.prefix
    yield n
    synk.close()
    gc.collect()
    assert_no_workers_left()
    left = own_entries(prefix)
    assert not left, f"synk.close() left shared-memory objects of its group: {left}"


@pytest.fixture(scope="session", autouse=True)
def synk_nothing_left(request):
    """After the session: no synkhronos group open, no worker process, nothing of ours in /dev/shm
    that the synkhronos tests created (checked when every test passed: a failed test's traceback
    may still hold its Data)."""
    before = set(own_entries())
    yield
    synk.close()
    gc.collect()
    assert_no_workers_left()
    if request.session.testsfailed:
        return
    left = sorted(set(own_entries()) - before)
    assert not left, f"the synkhronos tests left shared-memory objects of their run: {left}"
