"""Lasagne's MNIST example (``examples/lasagne_mnist.py``: Lasagne's model, loss, updates and loop,
imports and data aside) trains to the same accuracy in one process (``theano.function``, i.e.
``pytensor.function``) and on 2 CPU ranks (``synk.function`` and ``synk.data``: the two lines)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from lasagne_testutil import run_script

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.job, pytest.mark.timeout(300)]


def accuracy(ranks: int) -> float:
    env = {**os.environ, "PYTENSOR_FLAGS": "mode=FAST_COMPILE"}
    result, _ = run_script([str(ROOT / "examples" / "lasagne_mnist.py"), "mlp", "2", "--batch-size", "100",
                            "--ranks", str(ranks)], timeout=240, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    found = re.findall(r"test accuracy:\s+([\d.]+) %", result.stdout)
    assert found, result.stdout[-2000:]
    return float(found[-1]) / 100


def test_lasagne_mnist_one_process_and_two_ranks_reach_the_same_accuracy():
    one, two = accuracy(0), accuracy(2)
    assert one > 0.8 and two > 0.8, (one, two)
    assert abs(one - two) < 0.05, (one, two)  # dropout draws differ between the runs; the maths does not
