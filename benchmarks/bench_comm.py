"""synk-comm: barrier and all-reduce between 2 processes, against torch.distributed (gloo) and a copy.

One ``synk_comm.spawn`` of 2 ranks measures everything, side by side: each rank also joins a
gloo process group (when torch is installed), and every repetition times synk_comm, then gloo,
then a plain numpy copy, so that the ratios compare like with like on a machine whose speed moves
with its neighbours.

* barrier round trip: ``group.barrier()`` in a loop (gloo: ``dist.barrier()``);
* all_reduce latency: 8 bytes (2 float32), ``group.all_reduce(x, "sum", out=y)`` in a loop
  (gloo: ``dist.all_reduce(t)``, in place);
* all_reduce time of 64 MiB of float32 (16 Mi elements): one call per repetition, after a barrier,
  into a preallocated ``out`` (the goal's row); in place (``out=x``, as gloo reduces); and
  returning a new array;
* the floor: a plain numpy copy of 64 MiB (``np.copyto``) in rank 0, while rank 1 waits.

Times are rank 0's; the median of the repetitions, with the fastest in parentheses.  Everything
is warmed up first (our buffers alternate between two per rank: every size runs at least 4 times
before it is timed).

Run: ``python benchmarks/bench_comm.py`` (about 20 s; torch is optional: without it, the gloo
column says skipped).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from machine import cpu_model

import synk_comm

MiB = 2**20
GOAL_LATENCY_US = 50.0
GOAL_VS_GLOO = 3.0
GOAL_VS_COPY = 2.0


def per_call(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call of ``fn`` over ``iters`` calls in a row."""
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def once(sync: Callable[[], object], fn: Callable[[], object]) -> float:
    """Seconds of one call of ``fn``, started right after ``sync()`` (a barrier)."""
    sync()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(group: synk_comm.Group, port: int, reps: int, iters: int, mib: int) -> dict[str, Any]:
    """Runs in both ranks; returns ``{row: [seconds per repetition]}`` (rank 0's clock)."""
    n_big = mib * MiB // 4
    small, small_out = np.ones(2, np.float32), np.empty(2, np.float32)
    big = np.full(n_big, float(group.rank + 1), np.float32)
    big_out = np.empty_like(big)
    big_inplace = big.copy()  # doubles on every call: 2**(6 + reps) stays far from float32's range
    copy_src, copy_dst = np.ones(n_big, np.float32), np.empty(n_big, np.float32)

    ours: dict[str, Callable[[], object]] = {
        "barrier": group.barrier,
        "small": lambda: group.all_reduce(small, "sum", out=small_out),
        "big": lambda: group.all_reduce(big, "sum", out=big_out),
        "big_inplace": lambda: group.all_reduce(big_inplace, "sum", out=big_inplace),
        "big_new": lambda: group.all_reduce(big, "sum"),
    }
    gloo: dict[str, Callable[[], object]] | None = None
    gloo_status = ""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        gloo_status = "skipped (torch not installed)"
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=group.rank,
                                world_size=group.size)
        t_small, t_big = torch.ones(2), torch.full((n_big,), float(group.rank + 1))
        gloo = {"barrier": dist.barrier, "small": lambda: dist.all_reduce(t_small),
                "big": lambda: dist.all_reduce(t_big)}
        gloo_status = f"torch {torch.__version__}, gloo"

    def copy() -> None:
        if group.rank == 0:
            np.copyto(copy_dst, copy_src)

    # warm up: every operation, every size, at least 4 times (2 alternating buffers per rank)
    for _ in range(6):
        for fns in (ours, gloo or {}):
            for fn in fns.values():
                fn()
        copy()
        group.barrier()
    np.testing.assert_array_equal(big_out[:4], np.full(4, group.size * (group.size + 1) / 2, np.float32))
    np.testing.assert_array_equal(small_out, np.full(2, group.size, np.float32))

    times: dict[str, list[float]] = {}
    for _ in range(reps):
        for side, fns in (("ours", ours), ("gloo", gloo or {})):
            sync = group.barrier if side == "ours" else (gloo or {}).get("barrier", group.barrier)
            for key, fn in fns.items():
                latency = key in ("barrier", "small")
                t = per_call(fn, iters) if latency else once(sync, fn)
                times.setdefault(f"{side}.{key}", []).append(t)
        group.barrier()
        times.setdefault("copy", []).append(per_call(copy, 1))
        group.barrier()
    if gloo is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    return {"times": times, "gloo": gloo_status, "pid": os.getpid()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fmt_us(ts: list[float] | None) -> str:
    if not ts:
        return "skipped"
    return f"{statistics.median(ts) * 1e6:.1f} ({min(ts) * 1e6:.1f})"


def fmt_ms(ts: list[float] | None) -> str:
    if not ts:
        return "skipped"
    return f"{statistics.median(ts) * 1e3:.2f} ({min(ts) * 1e3:.2f})"


def ratio(num: list[float] | None, den: list[float] | None) -> str:
    if not num or not den:
        return "—"
    return f"{statistics.median(num) / statistics.median(den):.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9, help="repetitions (default 9)")
    parser.add_argument("--iters", type=int, default=1000, help="calls per latency repetition (default 1000)")
    parser.add_argument("--mib", type=int, default=64, help="size of the large all-reduce in MiB (default 64)")
    args = parser.parse_args()

    t0 = time.perf_counter()
    results = synk_comm.spawn(measure, 2, args=(free_port(), args.reps, args.iters, args.mib))
    elapsed = time.perf_counter() - t0
    t: dict[str, list[float]] = results[0]["times"]
    gloo_status = results[0]["gloo"]
    g = t.get

    lat = statistics.median(t["ours.small"]) * 1e6
    vs_gloo = statistics.median(t["gloo.big"]) / statistics.median(t["ours.big"]) if g("gloo.big") else None
    vs_copy = statistics.median(t["ours.big"]) / statistics.median(t["copy"])
    met = {True: "met", False: "**not met**"}

    print(f"synk-comm {synk_comm.__version__}, numpy {np.__version__}, Python {platform.python_version()}, "
          f"{gloo_status}; {cpu_model()}, {os.cpu_count()} CPUs; 2 processes; median (fastest) of "
          f"{args.reps} repetitions, latency rows averaged over {args.iters} calls; {elapsed:.1f} s")
    print()
    print("| what | synk_comm | gloo | copy | gloo / synk_comm | synk_comm / copy | goal |")
    print("|---|---:|---:|---:|---:|---:|---|")
    print(f"| barrier round trip, us | {fmt_us(g('ours.barrier'))} | {fmt_us(g('gloo.barrier'))} | | "
          f"{ratio(g('gloo.barrier'), g('ours.barrier'))} | | |")
    print(f"| all_reduce 8 B, us | {fmt_us(g('ours.small'))} | {fmt_us(g('gloo.small'))} | | "
          f"{ratio(g('gloo.small'), g('ours.small'))} | | < {GOAL_LATENCY_US:.0f} us: "
          f"{met[lat < GOAL_LATENCY_US]} |")
    goal_big = f">= {GOAL_VS_GLOO:.0f}x faster than gloo: " + (met[vs_gloo >= GOAL_VS_GLOO] if vs_gloo else "—")
    goal_big += f"; <= {GOAL_VS_COPY:.0f}x the copy: {met[vs_copy <= GOAL_VS_COPY]}"
    print(f"| all_reduce {args.mib} MiB float32 into `out`, ms | {fmt_ms(g('ours.big'))} | {fmt_ms(g('gloo.big'))} "
          f"| {fmt_ms(g('copy'))} | {ratio(g('gloo.big'), g('ours.big'))} | {ratio(g('ours.big'), g('copy'))} "
          f"| {goal_big} |")
    print(f"| all_reduce {args.mib} MiB float32 in place (`out=x`), ms | {fmt_ms(g('ours.big_inplace'))} | "
          f"{fmt_ms(g('gloo.big'))} | | {ratio(g('gloo.big'), g('ours.big_inplace'))} | "
          f"{ratio(g('ours.big_inplace'), g('copy'))} | |")
    print(f"| all_reduce {args.mib} MiB float32, new result array, ms | {fmt_ms(g('ours.big_new'))} | | | "
          f"{ratio(g('gloo.big'), g('ours.big_new'))} | {ratio(g('ours.big_new'), g('copy'))} | |")
    print(f"| numpy copy {args.mib} MiB (`np.copyto`), ms | | | {fmt_ms(g('copy'))} | | | the floor |")
    if not g("gloo.big"):
        print()
        print(f"gloo: {gloo_status}")


if __name__ == "__main__":
    main()
