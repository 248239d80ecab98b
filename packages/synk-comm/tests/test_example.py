"""The example of the repository that uses synk_comm alone runs to the end."""

from __future__ import annotations

import os

import pytest
from comm_testutil import ROOT, run_python


@pytest.mark.timeout(120)
def test_allreduce_numpy_example():
    script = os.path.join(ROOT, "examples", "allreduce_numpy.py")
    proc = run_python([script], timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all 4 ranks agree with numpy" in proc.stdout
