"""The path between hosts against the shared-memory path, on this machine (issue 20).

Two runs of 2 ranks each on the JAX engine in CPU mode, one after the other in this process:

``one host``   ``synk.fork(2, use_gpu=False, engine="jax")``: both workers read the Data in place,
               values travel through shared memory.
``two hosts``  :class:`synkhronos.launch.LocalNodes`: one worker here, one on a simulated host (a
               launcher of its own, with its own shared memory): everything for the other host's rank goes
               through pyzmq over TCP on localhost (the master's hub, its agent) before its shared memory.
               Each "host" on its own half of the cores (``split_cores``); on one host, each of the
               2 workers has 1 XLA thread per core of its share too (the engine's default).

Measured per size (float64, MiB of the whole value), median of ``REPS`` repetitions, MB/s = bytes of
the value / seconds (1 MB = 1e6 bytes):

``call rows``   ``f(x)`` of ``sum(x)`` over a Data of that size: the rows of the other host's rank
                travel once per call (half the value); on one host nothing moves.
``scatter``     ``synk.scatter(v, value)``: each rank gets its half (engine: through the master).
``all_reduce``  ``synk.all_reduce(v)`` of a shared variable of that size per rank (engine: the master
                reads every rank's value and sets the sum).
``in-graph``    a function whose update is ``synk.ops.all_reduce(v)``: JAX's all-reduce inside the
                program (gloo over TCP on both runs: the same path).

And the tiny call (the sum of 8 floats from a ``synk.data``, one program), median of 300, in us.

``--hierarchical``: an all-reduce over 2 hosts of 2 ranks, three ways (a second table): synk_comm's
shared-memory all-reduce on one host (5 ranks, the master included), ``synk_comm.net``'s all-reduce
over 2 simulated hosts (within each host through shared memory, then one array per host through the
master over pyzmq; 5 ranks: the master, 2 workers here, 2 under a bare agent), and JAX's gloo
all-reduce inside one program over the same 2 + 2 engine workers (``synk.ops.all_reduce``).  Each
includes its command's overhead.

    python benchmarks/bench_multinode.py                 # 1, 16, 64 MiB (about a minute on 2 cores)
    python benchmarks/bench_multinode.py --sizes 1 4     # other sizes (MiB)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import synk_comm

REPS = 5
ALL_REDUCE = "bench_multinode.all_reduce"
KINDS = ("call rows", "scatter", "all_reduce", "in-graph")


def timed(fn: Callable[[], Any], reps: int) -> float:
    fn()  # compile, allocate
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def nbytes_of(mib: float, cols: int = 1024) -> tuple[int, int]:
    """(rows, bytes) of a float64 value of about ``mib`` MiB with ``cols`` columns (rows even)."""
    rows = max(2, int(mib * 2**20 / 8 / cols) // 2 * 2)
    return rows, rows * cols * 8


def measure_size(mib: float, reps: int) -> dict[str, float]:
    """Seconds per operation on a value of ``mib`` MiB, in the run that is forked now."""
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    n_rows, _ = nbytes_of(mib)
    value = np.random.default_rng(0).normal(size=(n_rows, 1024))
    x = pt.matrix("x")
    f = synk.function([x], outputs=(pt.sum(x), "sum"))
    data = synk.data(value)
    v = pytensor.shared(np.zeros((n_rows // 2, 1024)), name="v")
    synk.function([x], outputs=pt.sum(v) + pt.sum(x))  # v reaches the workers
    w = pytensor.shared(np.ones((n_rows, 1024)), name="w")
    h = synk.function([], updates=[(w, synk.ops.all_reduce(w, "avg"))])
    synk.distribute()
    return {"call rows": timed(lambda: f(data), reps),
            "scatter": timed(lambda: synk.scatter(v, value), reps),
            "all_reduce": timed(lambda: synk.all_reduce(w, op="avg"), reps),
            "in-graph": timed(h, reps)}


def measure(sizes_mib: list[float], reps: int) -> dict[tuple[str, float], float]:
    """Seconds per operation, by (kind, MiB), and the tiny call's as ("tiny", 0)."""
    import pytensor.tensor as pt

    import synkhronos as synk

    seconds: dict[tuple[str, float], float] = {}
    measure_size(0.25, 2)  # warm-up (the run's first calls are slower), not reported
    for mib in sizes_mib:
        seconds.update({(kind, mib): t for kind, t in measure_size(mib, reps).items()})
    x = pt.matrix("x")
    tiny = synk.data(np.ones((2, 4)))
    f = synk.function([x], outputs=(pt.sum(x), "sum"))
    seconds[("tiny", 0)] = timed(lambda: f(tiny), 300)
    return seconds


@synk_comm.handler(ALL_REDUCE)
def _all_reduce(group: synk_comm.Group, n: int) -> None:
    """Every rank (master included) all-reduces ``n`` float64 values."""
    group.all_reduce(np.ones(n), "sum")


def hierarchical(sizes_mib: list[float], reps: int) -> dict[tuple[str, float], float]:
    """Seconds per all-reduce, by (way, MiB): see the module docstring."""
    import subprocess

    import pytensor

    import synkhronos as synk
    from synk_comm import net
    from synkhronos.launch import LocalNodes, free_port_pair

    here = os.path.dirname(os.path.abspath(__file__))
    sizes = {mib: int(mib * 2**20 / 8) for mib in sizes_mib}
    seconds: dict[tuple[str, float], float] = {}
    group = synk_comm.start(5, imports=["bench_multinode"])
    try:
        for mib, n in sizes.items():
            seconds[("shm, one host", mib)] = timed(lambda n=n: group.run(ALL_REDUCE, n), reps)
    finally:
        group.close()
    ports = free_port_pair()
    port = ports.port
    secret = net.new_secret()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, *sys.path[1:]]), **{net.SECRET_ENV: secret})
    env.pop("SYNK_RUN_PREFIX", None)
    agent = subprocess.Popen([sys.executable, "-m", "synk_comm.net", f"tcp://127.0.0.1:{port}", "1", "2"], env=env)
    ports.close()
    hub = net.Hub(f"tcp://127.0.0.1:{port}", secret=secret)
    try:
        span = net.SpanGroup.start(hub, nnodes=2, nproc=2, imports=["bench_multinode"], timeout=60)
        for mib, n in sizes.items():
            seconds[("synk_comm.net", mib)] = timed(lambda n=n: span.run(ALL_REDUCE, n), reps)
        span.close()
    finally:
        hub.shutdown()
        agent.wait(15)
    with LocalNodes(nnodes=2, nproc_per_node=2, here=2):
        synk.fork(use_gpu=False)
        for mib, n in sizes.items():
            w = pytensor.shared(np.ones(n), name="w")
            h = synk.function([], updates=[(w, synk.ops.all_reduce(w, "sum"))])
            seconds[("gloo in-graph", mib)] = timed(h, reps)
    return seconds


@contextlib.contextmanager
def one_host() -> Iterator[None]:
    import synkhronos as synk

    synk.fork(2, use_gpu=False, engine="jax")
    try:
        yield
    finally:
        synk.close()


@contextlib.contextmanager
def two_hosts() -> Iterator[None]:
    import synkhronos as synk
    from synkhronos.launch import LocalNodes

    with LocalNodes(nnodes=2, nproc_per_node=1, here=1, split_cores=True):
        synk.fork(use_gpu=False)
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 16, 64], help="MiB per value")
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--hierarchical", action="store_true", help="the all-reduce of 2 hosts x 2 ranks, 3 ways")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from machine import cpu_model

    if args.hierarchical:
        found = hierarchical(args.sizes, args.reps)
        ways = ("shm, one host", "synk_comm.net", "gloo in-graph")
        print(f"# {cpu_model()}, {len(os.sched_getaffinity(0))} cores; all-reduce (sum) of float64; median of "
              f"{args.reps}; MB/s of the value (ms)")
        print("| MiB | shm, one host (5 ranks) | synk_comm.net, 2 hosts (1 + 2 + 2) "
              "| gloo in one program, 2 hosts (2 + 2) |")
        print("|---:|---:|---:|---:|")
        for mib in args.sizes:
            cells = [f"{mib * 2**20 / found[(w, mib)] / 1e6:,.0f} ({found[(w, mib)] * 1e3:.2f})" for w in ways]
            print(f"| {mib:g} | " + " | ".join(cells) + " |")
        return

    results = {}
    for name, run in (("one host", one_host), ("two hosts", two_hosts)):
        with run():
            results[name] = measure(args.sizes, args.reps)
    print(f"# {cpu_model()}, {len(os.sched_getaffinity(0))} cores; 2 ranks, JAX engine, CPU mode; "
          f"median of {args.reps}; MB/s (ms)")
    print("| operation | MiB | one host (shared memory) | two hosts (pyzmq, localhost) | ratio |")
    print("|---|---:|---:|---:|---:|")
    a, b = results["one host"][("tiny", 0)], results["two hosts"][("tiny", 0)]
    print(f"| tiny call (us) | - | {a * 1e6:.0f} | {b * 1e6:.0f} | {b / a:.2f}x |")
    for kind in KINDS:
        for mib in args.sizes:
            nbytes = nbytes_of(mib)[1]
            a, b = results["one host"][(kind, mib)], results["two hosts"][(kind, mib)]
            print(f"| {kind} | {mib:g} | {nbytes / a / 1e6:,.0f} ({a * 1e3:.2f}) | {nbytes / b / 1e6:,.0f} "
                  f"({b * 1e3:.2f}) | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
