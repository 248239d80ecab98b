"""synkhronos.quiet: gloo's connection lines dropped from a process's stdout (everything else kept,
partial lines too), the coordination client's blocks dropped from stderr once a worker leaves
JAX's runtime, to the process's end (its other lines kept, nothing filtered before), and float32
work in JAX mode without requests for 64-bit dtypes (the same values, no JAX warning)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

WRITER = r"""
import os, sys, time
from synkhronos.quiet import drop_gloo_connect_lines
print("before", flush=True)
drop_gloo_connect_lines()
os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n")
os.write(1, b"user line\n[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n")
os.write(1, b"[Gloo] Rank 0 is NOT connected to: [1]\n")
os.write(1, b"[Gloo] Rank 2 is conn")
os.write(1, b"ected to 1 peer ranks.\nprogress 50%")
time.sleep(0.2)
print(" [Gloo] Rank 3 is not at the start of its line", flush=True)
print("end without newline", end="")
"""


def test_gloo_lines_are_dropped_and_everything_else_kept():
    out = subprocess.run([sys.executable, "-c", WRITER], capture_output=True, timeout=60, check=True).stdout
    assert out == (b"before\nuser line\n[Gloo] Rank 0 is NOT connected to: [1]\n"
                   b"progress 50% [Gloo] Rank 3 is not at the start of its line\nend without newline")


BLOCK = (b"W1128 15:50:24.714234   46532 pjrt_client.cc:1605] WatchTasksAsync failed for task 0: CANCELLED: CANCELLED\n"
         b"Additional GRPC error information from remote target coordination_service while calling "
         b"/xla.coordination.CoordinationService/WatchTasks:\n"
         b":CANCELLED:CANCELLED [type.googleapis.com/tensorflow.DerivedStatus='']\n"
         b"=== Source Location Trace: ===\n"
         b"external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89\n"
         b"\n")

LEAVER = r"""
import atexit, os, sys
from synkhronos.quiet import shutdown_runtime_quietly
block = sys.stdin.buffer.read()
os.write(2, b"before\n" + block)  # not filtered yet
def shutdown():
    os.write(2, block[:40])  # a block written in pieces
    os.write(2, block[40:] + b"W1128 other.cc:1] a warning that stays\n" + block)
    os.write(2, b"Traceback (most recent call last):\n  the runtime's own error\n")
    os.write(2, b"partial")
    raise RuntimeError("the service is gone")
atexit.register(lambda: os.write(2, b" line\n" + block + b"last words\n"))  # runs after the one below
atexit.register(shutdown_runtime_quietly, shutdown)
"""


def test_the_runtime_shutdown_blocks_are_dropped_until_the_end_and_everything_else_kept():
    err = subprocess.run([sys.executable, "-c", LEAVER], input=BLOCK, capture_output=True, timeout=60,
                         check=True).stderr
    assert err == (b"before\n" + BLOCK + b"W1128 other.cc:1] a warning that stays\n"
                   b"Traceback (most recent call last):\n  the runtime's own error\npartial line\nlast words\n")


def test_float32_work_requests_no_float64_from_jax():
    jax = pytest.importorskip("jax")
    import pytensor
    import pytensor.tensor as pt

    from synkhronos.quiet import request_canonical_dtypes

    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        request_canonical_dtypes()
        with pytensor.config.change_flags(floatX="float32"):
            x = pt.matrix("x", dtype="float32")
            f = pytensor.function([x], [pt.sum(x), pt.mean(x, axis=0), pt.prod(x[0])], mode="JAX")
            value = np.arange(1, 13, dtype="float32").reshape(4, 3)
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="Explicitly requested dtype")
                total, mean, prod = f(value)
        np.testing.assert_allclose(total, value.sum())
        np.testing.assert_allclose(mean, value.mean(axis=0))
        np.testing.assert_allclose(prod, value[0].prod())
    finally:
        jax.config.update("jax_enable_x64", x64)


NOTES = r"""
import warnings
import jax.numpy as jnp
from synkhronos import cpu
def noted():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", append=True)  # every warning the process's own filters let through
        jnp.arange(3, dtype="int64"), jnp.ones(2).astype("float64")
    return sum("Explicitly requested dtype" in str(c.message) for c in caught)
print(noted())
cpu.enable_x64_if_float64()
print(noted())
"""


def test_float32_work_does_not_repeat_jaxs_32_bit_notes():
    """Under floatX=float32 a rank's JAX computes int64 indices and float64 casts in 32 bits (the
    documented behaviour): once CPU mode (or a GPU worker) set JAX up, its note about each is not
    shown; before, it is."""
    pytest.importorskip("jax")
    out = subprocess.run([sys.executable, "-c", NOTES], capture_output=True, timeout=120, check=True, text=True,
                         env={**os.environ, "PYTENSOR_FLAGS": "floatX=float32", "JAX_PLATFORMS": "cpu"}).stdout
    before, after = (int(n) for n in out.split())
    assert before >= 2 and after == 0, out
