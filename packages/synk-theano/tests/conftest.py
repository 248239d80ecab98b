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


_RUN_START_ENTRIES: list[set[str]] = []
"""Our /dev/shm entries when the first synkhronos test started (set by :func:`synk_nothing_left`)."""


@pytest.fixture(scope="session", autouse=True)
def synk_nothing_left():
    """Notes what of ours /dev/shm holds before the first synkhronos test; the check that the tests
    left nothing runs in :func:`pytest_sessionfinish`."""
    _RUN_START_ENTRIES.append(set(own_entries()))
    yield


def pytest_sessionfinish(session):
    """After the session: no synkhronos group open, no worker process, nothing of ours in /dev/shm
    that the synkhronos tests created (checked when every test passed: a failed test's traceback
    may still hold its Data).

    A hook, not the teardown of the session fixture: that teardown runs inside the last test's,
    while pytest still holds that test's arguments (a module fixture's Data among them), which
    pytest releases only after every fixture is torn down.  A failed check fails the run (exit
    status 1) with its message.
    """
    if not _RUN_START_ENTRIES:  # no synkhronos test ran
        return
    synk.close()
    gc.collect()
    problems = []
    try:
        assert_no_workers_left()
    except AssertionError as exc:
        problems.append(str(exc))
    left = sorted(set(own_entries()) - _RUN_START_ENTRIES[0])
    if left and not session.testsfailed:
        problems.append(f"the synkhronos tests left shared-memory objects of their run: {left}")
    if problems:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for problem in problems:
            if reporter is None:
                print(problem, file=sys.stderr)
            else:
                reporter.ensure_newline()
                reporter.write_line(f"FAILED after the session: {problem}", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
