"""Soak: 100,000 calls of a small synkhronos function, a collective every 100 calls, nothing grows.

2 ranks, in CPU mode, or in GPU mode (the JAX engine) under ``SYNK_TEST_GPU=1``, the reliability
suite's switch (:data:`reliability_lib.USE_GPU`; without GPUs add ``SYNK_EMULATE_GPUS=2
PYTENSOR_FLAGS=floatX=float64``: GPU mode's code on JAX's CPU backend). The function (``sum(x)``
with ``s := s + sum(x, axis=0)`` in each rank) runs on an 8x4 float64 Data; every 100th step is a
collective instead, in turn ``all_reduce(s, "avg")``, ``broadcast(s)``, ``gather(s)`` and an
index-``batch`` call; once every 1,000 steps the call takes a brand-new Data (registered with the
workers, dropped after), and once every 1,000 a Data that was just freed and filled again (a new
segment, which the workers follow). Every call's result is checked against numpy, and at every
sample every rank's ``s`` too.

Sampled after a warm-up of 2,000 calls ("start"), every 10,000 calls and at the end, from /proc and
/dev/shm:

* resident memory (``VmRSS``) of the master and of each worker;
* open file descriptors (``/proc/<pid>/fd``) of each;
* the /dev/shm entries (segments and semaphores) of this run, and their bytes.

Flat means: RSS of master + workers grows by less than 5% from start to end, and the fds and the
/dev/shm entries at the end equal those at the start.  The script prints a table, then the verdict;
it exits with status 1 if anything grew.

    python tests/reliability/soak.py                # 100,000 calls (about a minute on 2 cores)
    python tests/reliability/soak.py --calls 20000  # a shorter run
    SYNK_TEST_GPU=1 python tests/reliability/soak.py --calls 20000  # GPU mode
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
from reliability_lib import USE_GPU  # the reliability suite's switch of GPU mode (this folder)

import synk_shm
import synkhronos as synk
from synkhronos.runtime import current

SHM_DIR = "/dev/shm"
RSS_GROWTH_LIMIT = 0.05


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def shm_usage(prefix: str) -> tuple[int, int]:
    """(entries, bytes) of this run in /dev/shm."""
    bare = prefix.lstrip("/")
    entries = [e for e in os.listdir(SHM_DIR) if e.startswith((bare, "sem." + bare))]
    size = 0
    for e in entries:
        try:
            size += os.stat(os.path.join(SHM_DIR, e)).st_size
        except FileNotFoundError:
            pass
    return len(entries), size


def sample(calls: int, t0: float, pids: list[int]) -> dict[str, object]:
    entries, nbytes = shm_usage(synk_shm.run_prefix())
    return {"calls": calls, "seconds": time.perf_counter() - t0, "rss": [rss_kib(p) for p in pids],
            "fds": [fd_count(p) for p in pids], "shm_entries": entries, "shm_bytes": nbytes}


def row(s: dict[str, object]) -> str:
    rss, fds = s["rss"], s["fds"]
    assert isinstance(rss, list) and isinstance(fds, list)
    return (f"{s['calls']:>8}  {s['seconds']:>8.1f}  {rss[0] / 1024:>9.1f}  "
            f"{' '.join(f'{r / 1024:.1f}' for r in rss[1:]):>11}  {sum(rss) / 1024:>9.1f}  "
            f"{' '.join(map(str, fds)):>9}  {s['shm_entries']:>11}  {s['shm_bytes'] / 1024:>10.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--every", type=int, default=100, help="a collective every this many calls")
    parser.add_argument("--sample", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=2_000)
    args = parser.parse_args()

    n = synk.fork(2, use_gpu=USE_GPU)
    pids = [os.getpid(), *(p.pid for p in current().group._procs.values())]
    x = pt.matrix("x", dtype="float64")
    s = pytensor.shared(np.zeros(4), name="s")
    f = synk.function([x], (pt.sum(x), "sum"), updates=[(s, s + pt.sum(x, axis=0))])
    xd = np.arange(32.0).reshape(8, 4) / 64  # multiples of 1/64: every sum below is exact
    flipped = xd[::-1].copy()
    X = synk.data(xd)
    Y = synk.data(xd)
    batch = np.array([7, 0, 3, 4])
    expected = np.zeros((n, 4))  # every rank's s, in numpy

    def call(data: synk.Data, values: np.ndarray, rows: np.ndarray | None = None) -> None:
        r = f(data) if rows is None else f(data, batch=rows)
        used = values if rows is None else values[rows]
        if r != used.sum():
            raise AssertionError(f"a call gave {r}, numpy {used.sum()}")
        for rank, part in enumerate(np.array_split(used, n)):
            expected[rank] += part.sum(0)

    def step(i: int) -> None:
        if i % args.every == 0:
            kind = (i // args.every) % 4
            if kind == 0:
                synk.all_reduce(s, op="avg")
                expected[:] = expected.mean(0)
            elif kind == 1:
                synk.broadcast(s)
                expected[:] = expected[0]
            elif kind == 2:
                got = synk.gather(s)
                if not np.allclose(got, expected, rtol=1e-12, atol=0):
                    raise AssertionError(f"step {i}: gather gave {got}, numpy {expected}")
            else:
                call(X, xd, batch)  # an index batch: the indices go through the shared index buffer
        elif i % 1000 == 500:
            call(synk.data(xd), xd)  # a new Data, registered with the workers, dropped after the call
        elif i % 1000 == 250:
            values = flipped if (i // 1000) % 2 else xd
            Y.free_memory()  # the workers unmap it...
            Y.set_value(values)  # ...and map the new segment
            call(Y, values)
        else:
            call(X, xd)

    for i in range(1, args.warmup + 1):
        step(i)
    print(f"soak: {args.calls} calls of a small synkhronos function, a collective every {args.every} calls, "
          f"{'GPU' if USE_GPU else 'CPU'} mode, {n} ranks (pids {pids}: the master, then the workers), after a "
          f"warm-up of {args.warmup} calls")
    print(f"{'calls':>8}  {'seconds':>8}  {'master MiB':>9}  {'worker MiB':>11}  {'total MiB':>9}  "
          f"{'fds':>9}  {'shm entries':>11}  {'shm KiB':>10}")
    t0 = time.perf_counter()
    samples = [sample(0, t0, pids)]
    print(row(samples[-1]), flush=True)
    for i in range(1, args.calls + 1):
        step(args.warmup + i)
        if i % args.sample == 0 or i == args.calls:
            np.testing.assert_allclose(synk.gather(s), expected, rtol=1e-12, atol=0)
            samples.append(sample(i, t0, pids))
            print(row(samples[-1]), flush=True)
    elapsed = time.perf_counter() - t0
    start, end = samples[0], samples[-1]
    rss0, rss1 = sum(start["rss"]), sum(end["rss"])  # type: ignore[arg-type]
    growth = (rss1 - rss0) / rss0
    synk.close()
    X.free_memory()
    Y.free_memory()
    problems = []
    if growth >= RSS_GROWTH_LIMIT:
        problems.append(f"resident memory grew by {100 * growth:.1f}% (limit {100 * RSS_GROWTH_LIMIT:.0f}%)")
    if end["fds"] != start["fds"]:
        problems.append(f"open file descriptors went from {start['fds']} to {end['fds']}")
    if (end["shm_entries"], end["shm_bytes"]) != (start["shm_entries"], start["shm_bytes"]):
        problems.append(f"/dev/shm went from {start['shm_entries']} entries ({start['shm_bytes']} B) to "
                        f"{end['shm_entries']} ({end['shm_bytes']} B)")
    left = shm_usage(synk_shm.run_prefix())[0]
    if left:
        problems.append(f"{left} /dev/shm entries of the run outlived close()")
    print(f"{args.calls} calls in {elapsed:.1f} s ({1e6 * elapsed / args.calls:.0f} us per step, collectives "
          f"included); RSS (master + workers) {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB ({100 * growth:+.2f}%); "
          f"fds {start['fds']} -> {end['fds']}; /dev/shm entries {start['shm_entries']} -> {end['shm_entries']}, "
          f"{start['shm_bytes']} -> {end['shm_bytes']} B; after close: {left} entries")
    if problems:
        print("soak: NOT FLAT: " + "; ".join(problems))
        return 1
    print("soak: flat")
    return 0


if __name__ == "__main__":
    sys.exit(main())
