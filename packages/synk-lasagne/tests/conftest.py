"""Fixtures of the synk-lasagne tests (CPU mode, real worker processes).

Helpers live in :mod:`lasagne_testutil` (every package's tests run in one pytest session, where
the name ``conftest`` is not unique); this directory goes on ``sys.path`` so that it imports by
name.  ``ranks`` forks a group of 2, then of 3, ranks (:data:`RANKS`) once per test module and closes it after
the module's last test, checking that no worker process and no shared memory outlives it.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from lasagne_testutil import forked_group  # noqa: E402

RANKS = [int(n) for n in os.environ.get("SYNK_TEST_RANKS", "2,3").split(",")]
"""The group sizes ``ranks`` forks: 2 and 3, or those of ``SYNK_TEST_RANKS`` (e.g. ``2``)."""


@pytest.fixture(scope="module", params=RANKS, ids=[f"{n}ranks" for n in RANKS])
def ranks(request):
    """A forked CPU-mode group of ``request.param`` ranks for the whole module; yields its size."""
    with forked_group(request.param) as n:
        yield n
