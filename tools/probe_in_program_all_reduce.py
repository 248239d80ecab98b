"""The in-program all-reduce alone (``synk_comm.xla_cpu``), at several rank counts, each rank
pinned to its share of the machine's cores as CPU mode pins them: microseconds a call and the
bandwidth it gives (a diagnosis of the MLP step's all-reduce, not a benchmark of record;
``bench_cpu_scaling.py --only mlp`` is that).

Each rank count runs in its own group of fresh processes (``synk_comm.spawn``); a rank pins itself
before JAX starts, then times ``--calls`` calls of a jitted program whose only work is the
all-reduce of ``--floats`` float32 values (default: the flat gradient of the benchmarks' MLP,
1024 -> 3x1024 -> 10, with its weight), after 5 calls of warm-up, and reports its median.  A
plain jitted copy of the same array is timed in the same processes for scale.

Usage: ``python tools/probe_in_program_all_reduce.py [--ranks 2,4,8,16] [--floats N] [--calls 30]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

MLP_FLOATS = 3 * 1024 * 1024 + 1024 * 10 + 3 * 1024 + 10 + 1
"""The benchmarks' MLP: its weights, biases and the rank's weight, as one flat gradient."""


def _timed(fn, x, calls: int) -> float:
    import jax

    for _ in range(5):
        jax.block_until_ready(fn(x))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rank_main(group, name: str, sets: list[list[int]], floats: int, calls: int) -> dict[str, float]:
    """One rank: pin, attach, time the all-reduce and the copy (us)."""
    from synk_comm import cores

    cores.pin_process(sets[group.rank])
    import jax
    import numpy as np

    from synk_comm import xla_cpu

    assert xla_cpu.available()
    segment = xla_cpu.Segment.attach(name, group.size)
    try:
        segment.set_weight(group.rank, 1.0)
        x = jax.device_put(np.full(floats, group.rank + 1.0, dtype=np.float32))
        reduce = jax.jit(lambda v: xla_cpu.all_reduce(v, "sum", segment, group.rank, group.size))
        out = np.asarray(reduce(x))
        assert out[0] == out[-1] == group.size * (group.size + 1) / 2, out[:3]
        group.barrier()
        all_reduce_s = _timed(reduce, x, calls)
        copy_s = _timed(jax.jit(lambda v: v * 1), x, calls)
        return {"all_reduce_us": all_reduce_s * 1e6, "copy_us": copy_s * 1e6}
    finally:
        segment.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4,8,16", help="comma-separated rank counts")
    parser.add_argument("--floats", type=int, default=MLP_FLOATS)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from machine import cpu_model

    import synk_comm
    from synk_comm import cores, xla_cpu

    machine_cores = cores.available()
    mb = args.floats * 4 / 1e6
    print(f"{cpu_model()}, {len(machine_cores)} cores; all-reduce of {args.floats} float32 ({mb:.1f} MB)")
    print("| ranks | cores a rank | all-reduce, us | its rate, GB/s of the array | a jitted copy, us |")
    print("|---:|---:|---:|---:|---:|")
    for n in [int(v) for v in args.ranks.split(",")]:
        if n > len(machine_cores):
            continue
        sets = cores.split(machine_cores, n)
        segment = xla_cpu.Segment.create(n)
        try:
            results = synk_comm.spawn(rank_main, n, args=(segment.name, sets, args.floats, args.calls))
        finally:
            segment.close()
        slowest = max(r["all_reduce_us"] for r in results)
        copy = statistics.median(r["copy_us"] for r in results)
        print(f"| {n} | {len(sets[0])} | {slowest:.0f} | {mb * 1e-3 / (slowest * 1e-6):.1f} | {copy:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
