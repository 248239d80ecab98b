"""NCCL collectives on CuPy, PyTorch and JAX arrays, two or more GPUs (``gpu`` marker).

Run on a machine with 2+ GPUs and ``synk-comm[nccl]``: ``pytest -m gpu packages/synk-comm/tests``
(the device script ``gpu/run_device.sh`` does).  Each rank checks its results against numpy.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import comm_gpu
import pytest

import synk_comm


def _gpu_count() -> int:
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpu_count() < 2 or importlib.util.find_spec("nccl") is None,
                       reason="needs 2 GPUs and nccl4py"),
    pytest.mark.timeout(300),
]


@pytest.mark.parametrize("kind", ["jax", "cupy", "torch"])
def test_nccl_collectives_match_numpy(kind: str) -> None:
    if importlib.util.find_spec(kind) is None:
        pytest.skip(f"{kind} not installed")
    n = min(_gpu_count(), 8)
    results = synk_comm.spawn(comm_gpu.nccl_collectives, n, args=(kind,), devices=list(range(n)))
    wrong = [w for rank_wrong in results for w in rank_wrong]
    assert not wrong, "\n".join(wrong)


def test_group_methods_dispatch_device_arrays_to_nccl() -> None:
    n = min(_gpu_count(), 8)
    results = synk_comm.spawn(comm_gpu.group_dispatch, n, devices=list(range(n)))
    assert not [w for rank_wrong in results for w in rank_wrong]


def _run_jax_scenario(scenario: Callable[[Any], list[str]]) -> None:
    """Run ``scenario`` in a rank per GPU; it returns what it found wrong."""
    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax not installed")
    n = min(_gpu_count(), 8)
    results = synk_comm.spawn(scenario, n, devices=list(range(n)))
    wrong = [w for rank_wrong in results for w in rank_wrong]
    assert not wrong, "\n".join(wrong)


def test_jax_all_reduces_equal_numpy() -> None:
    _run_jax_scenario(comm_gpu.jax_all_reduce)
