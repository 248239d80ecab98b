"""A synkhronos master run as a subprocess by the fault tests: ``python rel_master.py MODE SECONDS``.

It forks 2 ranks (GPU mode under ``SYNK_TEST_GPU=1``: :data:`reliability_lib.USE_GPU`; the
workers are then both ranks), checks a quick call, prints ``pids <master> <workers...>`` and
``prefix <run prefix>``, then:

* ``idle``: prints ``ready`` and sleeps (the test signals it);
* ``busy``: prints ``calling`` and calls a function that computes for SECONDS in every rank;
* ``sigint-catch``: as ``busy`` inside ``try/except KeyboardInterrupt``; prints ``interrupted``,
  then ``result <value>`` of the next call (which must be right), then ``done``;
* ``sigint-waiting`` (CPU mode only): the master (rank 1) has no rows, so it waits for the worker (rank 0)
  computing for SECONDS; on KeyboardInterrupt prints ``interrupted``, ``result``, ``done``.

No main guard on purpose: synkhronos must never re-run this file in a worker.
"""

import os
import signal
import sys
import time

import numpy as np
import pytensor.tensor as pt
import reliability_ops as ro
from reliability_lib import USE_GPU

import synk_shm
import synkhronos as synk
from synkhronos.runtime import current

# The tests signal this master with SIGINT: Python's KeyboardInterrupt, whatever the test run
# inherited (a job that a non-interactive shell started in the background ignores SIGINT, and then
# so does Python).
signal.signal(signal.SIGINT, signal.default_int_handler)
mode, seconds = sys.argv[1], float(sys.argv[2])
synk.fork(2, use_gpu=USE_GPU, master_rank=1 if mode == "sigint-waiting" else 0)
MODE = "JAX" if USE_GPU else "FAST_COMPILE"
x = pt.matrix("x", dtype="float64")
slow = synk.function([x], (ro.SlowSum(seconds)(x), "sum"), mode=MODE)
quick = synk.function([x], (ro.SlowSum(0.0)(x), "sum"), mode=MODE)
rows = 1 if mode == "sigint-waiting" else 4  # one row: rank 0 (the worker) gets it
X = synk.data(np.arange(2.0 * rows).reshape(rows, 2))
want = float(X.data.sum())
assert quick(X) == want
synk.distribute()
print("pids", os.getpid(), *[p.pid for p in current().group._procs.values()], flush=True)
print("prefix", synk_shm.run_prefix(), flush=True)
if mode == "idle":
    print("ready", flush=True)
    time.sleep(60)
    sys.exit(1)
print("calling", flush=True)
if mode == "busy":
    slow(X)
    sys.exit(1)  # the test kills this process before
try:
    slow(X)
    print("finished", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
t0 = time.monotonic()
result = quick(X)
print("result", result, want, f"{time.monotonic() - t0:.2f}", flush=True)
synk.close()
print("done", flush=True)
