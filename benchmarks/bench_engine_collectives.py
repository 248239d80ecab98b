"""The JAX engine's collectives on shared variables: programs of the ranks' runtime, against the
master-in-numpy path they replaced (side by side, one run).

``program``: ``synk.all_reduce(s, "sum")`` and ``synk.broadcast(s)`` as they are now
(:mod:`synkhronos.engine.collectives`: one ``psum`` program over the workers' mesh).
``master``: what the engine did before: the master reads every worker's value (pickled through
the control plane), reduces in numpy, and sets every worker's value (``VALUE`` read / assign).

Usage: ``python benchmarks/bench_engine_collectives.py [--workers 2] [--sizes-mib 1,16,64]``; JAX's
CPU devices (gloo) unless ``--gpu``.  Prints a markdown table (ms per call, median of 5).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def master_all_reduce(rt, sid: int) -> None:
    """The replaced path: every value to the master, numpy's sum, the result to every worker."""
    from synkhronos.engine import VALUE

    with rt.group.command(VALUE, ("read", [sid], None)):
        pass
    replies = rt.group.replies()
    total = np.sum([replies[r + 1][0] for r in range(rt.size)], axis=0)
    with rt.group.command(VALUE, ("assign", [sid], (None, [total]))):
        pass


def median_ms(fn, repeats: int = 5) -> float:
    fn()  # warm-up (compiles the program)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sizes-mib", default="1,16,64")
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args()

    import pytensor

    import synkhronos as synk
    from synkhronos.runtime import current

    synk.fork(args.workers, use_gpu=args.gpu, engine="jax")
    rt = current()
    print("| MiB | all_reduce program | all_reduce via master | broadcast program |\n|---:|---:|---:|---:|")
    for mib in (int(m) for m in args.sizes_mib.split(",")):
        s = pytensor.shared(np.ones((mib << 20) // 8), name=f"s{mib}")
        synk.function([], outputs=s.sum())
        synk.broadcast(s)  # distributes it
        sid = rt.shared_ids[s]
        program = median_ms(lambda s=s: synk.all_reduce(s, op="sum"))
        master = median_ms(lambda sid=sid: master_all_reduce(rt, sid))
        bcast = median_ms(lambda s=s: synk.broadcast(s))
        print(f"| {mib} | {program:.2f} | {master:.2f} | {bcast:.2f} |", flush=True)
    synk.close()


if __name__ == "__main__":
    main()
