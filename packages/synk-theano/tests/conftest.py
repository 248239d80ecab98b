"""Fixtures of the synkhronos tests, in CPU mode or, with ``SYNK_TEST_GPU=1``, in GPU mode.

Helpers live in :mod:`synk_testutil` (every package's tests run in one pytest session, where the
name ``conftest`` is not unique); this directory goes on ``sys.path`` so that it imports by name.

``ranks`` forks a group of 2, then of 3, ranks once per test module (``synk.fork(n,
use_gpu=False)``) and closes it after the module's last test, checking that no worker process
and no shared-memory object of the group outlives :func:`synkhronos.close`.

GPU mode (``SYNK_TEST_GPU=1``, run with ``PYTENSOR_FLAGS=floatX=float64``: the tests compare float64
data with numpy) forks ``synk.fork(n, use_gpu=True)`` for the sizes the visible GPUs allow (2 on 2
GPUs) and skips the tests marked ``cpu_only(reason)``, whose scenario exists in CPU mode only.
Without GPUs, ``SYNK_EMULATE_GPUS=2`` runs GPU mode on JAX's CPU backend (see :mod:`synkhronos.gpu`).
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from synk_testutil import USE_GPU, assert_no_workers_left, max_ranks, own_entries, rank_counts  # noqa: E402

import synkhronos as synk  # noqa: E402
from synkhronos.runtime import current  # noqa: E402

ONE_GPU_MODULES = ("test_synk_engine.py", "test_synk_engine_gpu.py", "test_synk_gpu.py", "test_synk_layout.py")
"""Modules that need no GPU mode fork of 2 ranks (or skip by themselves)."""


def pytest_collection_modifyitems(config, items):
    """In GPU mode, tests marked ``cpu_only(reason)`` skip with their reason; with fewer than 2
    GPUs the suite's GPU-mode tests skip (they fork 2 and 3 ranks, one GPU each): one GPU runs
    the engine's own tests (``test_synk_engine_gpu.py``)."""
    if not USE_GPU:
        return
    gpus = max_ranks()
    for item in items:
        if gpus < 2 and os.path.basename(str(item.fspath)) not in ONE_GPU_MODULES:
            item.add_marker(pytest.mark.skip(reason=f"GPU mode's suite forks 2 and 3 ranks: needs 2 GPUs ({gpus} "
                                                    "visible)"))
            continue
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            reason = marker.args[0] if marker.args else marker.kwargs.get("reason", "")
            item.add_marker(pytest.mark.skip(reason=f"CPU mode only: {reason}"))


@pytest.fixture(scope="module", params=rank_counts(), ids=[f"{n}ranks" for n in rank_counts()])
def ranks(request):
    """A forked group of ``request.param`` ranks (GPU mode under ``SYNK_TEST_GPU=1``) for the whole
    module; yields its size."""
    n = synk.fork(request.param, use_gpu=USE_GPU)
    assert n == request.param and current().device.use_gpu == USE_GPU
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
