"""Synkhronos in CPU mode, side by side in one run (issue: call overhead and CPU speedup).

1. Overhead of a tiny synk call (a 4x2 input, n_parallel=2) over the plain PyTensor call of the
   same graph in the master.  Goal: <= 50 us median.
2. Speedup of a compute-bound function (mean(tanh(x @ W)) over 8192 x 1024 rows, W 1024 x 1024,
   float32) with n_parallel=2 on 2 cores against one process: one process with one BLAS thread,
   and one process with its default threads.  Goal: >= 1.7x.  Each configuration runs in its own
   interpreter so that its thread settings apply from the start.

    python benchmarks/bench_synk.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def overhead() -> dict[str, float]:
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    synk.fork(2, use_gpu=False)
    x = pt.matrix("x")
    f = synk.function([x], outputs=pt.sum(x))
    g = pytensor.function([x], pt.sum(x))
    a = np.ones((4, 2), dtype=x.dtype)
    xd = synk.data(a)
    for _ in range(300):
        f(xd)
        g(a)
    ours, plain = [], []
    for _ in range(15):  # blocks alternate, so drift hits both sides alike
        t0 = time.perf_counter()
        for _ in range(500):
            f(xd)
        ours.append((time.perf_counter() - t0) / 500)
        t0 = time.perf_counter()
        for _ in range(500):
            g(a)
        plain.append((time.perf_counter() - t0) / 500)
    synk.close()
    return {"synk_us": statistics.median(ours) * 1e6, "plain_us": statistics.median(plain) * 1e6}


def compute(mode: str) -> float:
    """Seconds per call of the compute-bound function in configuration ``mode``."""
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    rng = np.random.default_rng(0)
    x = pt.matrix("x", dtype="float32")
    w = pytensor.shared((rng.standard_normal((1024, 1024)) / 32).astype("float32"), name="w")
    y = pt.mean(pt.tanh(x @ w))
    xd = rng.standard_normal((8192, 1024)).astype("float32")
    if mode == "synk":
        import synkhronos as synk

        synk.fork(2, use_gpu=False)
        f = synk.function([x], outputs=y)
        arg = synk.data(xd)
        call = lambda: f(arg)  # noqa: E731
    else:
        g = pytensor.function([x], y)
        call = lambda: g(xd)  # noqa: E731
    for _ in range(3):
        call()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    if mode == "synk":
        synk.close()
    return statistics.median(times)


def run_config(mode: str, threads: str | None) -> float:
    env = dict(os.environ)
    for var in THREAD_VARS:
        env.pop(var, None)
        if threads is not None:
            env[var] = threads
    out = subprocess.run([sys.executable, __file__, "--compute", mode], env=env, check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--compute":
        print(compute(sys.argv[2]))
        return
    cores = len(os.sched_getaffinity(0))
    o = overhead()
    one_thread = run_config("plain", "1")
    default_threads = run_config("plain", None)
    ours = run_config("synk", "1")
    results = {"cores": cores, "overhead": o, "compute_s": {"1 process, 1 thread": one_thread,
                                                           "1 process, default threads": default_threads,
                                                           "synk n_parallel=2": ours}}
    print(f"\n## synkhronos, CPU mode ({cores} cores)\n")
    print("| what | synkhronos | reference | ratio / difference | goal |\n|---|---:|---:|---:|---|")
    print(f"| tiny call, n_parallel=2 (median) | {o['synk_us']:.1f} us | {o['plain_us']:.1f} us (plain PyTensor) | "
          f"+{o['synk_us'] - o['plain_us']:.1f} us | <= 50 us |")
    print(f"| compute-bound call vs 1 process, 1 thread | {ours * 1e3:.1f} ms | {one_thread * 1e3:.1f} ms | "
          f"{one_thread / ours:.2f}x | >= 1.7x |")
    print(f"| compute-bound call vs 1 process, default threads | {ours * 1e3:.1f} ms | "
          f"{default_threads * 1e3:.1f} ms | {default_threads / ours:.2f}x | |")
    print("\n" + json.dumps(results))


if __name__ == "__main__":
    main()
