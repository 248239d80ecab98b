"""synk-comm on GPUs: all_reduce bus bandwidth against raw nccl4py and torch.distributed NCCL, one run.

On a machine with n >= 2 GPUs, for float32 sums of 8 B, 1 MiB, 16 MiB, 256 MiB and 1 GiB:

* synk_comm: ``Group.all_reduce`` on JAX arrays through its NCCL backend (``synk_comm.spawn`` with
  one GPU per rank), out of place (a new result buffer per call) and in place (``out=x``);
* synk_comm ``Group.all_reduce(t, out=t)`` on torch CUDA tensors (NCCL on torch's current stream,
  no synchronisation per call, as torch.distributed does; max of ones, so the result stays checkable);
* raw nccl4py on the same communicator, stream and kind of buffers:
  ``comm.allreduce(CudaBuffer(a), CudaBuffer(b), SUM, stream=...)``, calls queued back to back;
* torch.distributed with the NCCL backend on torch CUDA tensors (in place, as torch does), in
  processes of its own (``multiprocessing`` spawn context, ``init_method="file://..."``), run
  first so that they find every GPU free.

Each row times ``REPS`` blocks of calls (the block size depends on the message size), each block
started after a barrier and ended by a stream synchronisation; a rank's time is the median of
its blocks, and the row's time is the slowest rank's.  Bus bandwidth = 2 (n - 1) / n * bytes /
time (nccl-tests' convention).  Prints a markdown table and writes ``$OUT/bench_comm_gpu.json``.

Run: ``python benchmarks/bench_comm_gpu.py`` (about a minute on 2x H200).  ``SYNK_BENCH_CPU=1``
is a dry run of the control flow on CPU ranks (numpy arrays through shared memory; the nccl4py and
torch columns say skipped).  ``SYNK_BENCH_SIZES=8,1048576`` overrides the sizes (bytes).
"""

from __future__ import annotations

import faulthandler
import json
import os
import platform
import queue
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

for _key, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                     "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}.items():
    os.environ.setdefault(_key, _value)  # before anything starts a child or a CUDA context

import synk_comm  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
USE_GPU = os.environ.get("SYNK_BENCH_CPU") != "1"
MiB = 2**20
SIZES = [8, MiB, 16 * MiB, 256 * MiB, 1024 * MiB]
CPU_SIZES = [8, MiB, 16 * MiB]
REPS = 3
WALL_S = 170.0
"""The whole run is stopped (with every thread's traceback) after this many seconds."""
TORCH_TIMEOUT_S = 120.0
"""Seconds the parent waits for each torch rank's result."""


def sizes_to_run() -> list[int]:
    """The message sizes in bytes: ``SYNK_BENCH_SIZES`` or the defaults of this mode."""
    env = os.environ.get("SYNK_BENCH_SIZES")
    if env:
        return [int(s) for s in env.split(",")]
    return SIZES if USE_GPU else CPU_SIZES


def iters_for(nbytes: int) -> int:
    """Calls per timed block: about 4 GiB moved per block, between 10 and 200 calls."""
    return min(200, max(10, (4 << 30) // max(nbytes, 1)))


def busbw(nbytes: int, seconds: float | None, n: int) -> float | None:
    """Bus bandwidth in GB/s of an all-reduce of ``nbytes`` in ``n`` ranks taking ``seconds``."""
    if not seconds:
        return None
    return 2 * (n - 1) / n * nbytes / seconds / 1e9


def time_blocks(fn: Callable[[], object], sync: Callable[[], object], barrier: Callable[[], object],
                iters: int) -> float:
    """Median seconds per call of ``fn`` over ``REPS`` blocks of ``iters`` calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(REPS):
        barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


# --- synk_comm and raw nccl4py, in the ranks of one synk_comm group -------------------------------

def synk_rank(group: synk_comm.Group, sizes: list[int], use_gpu: bool) -> dict[int, dict[str, float | None]]:
    """Runs in every rank: ``{nbytes: {"synk": s, "synk_inplace": s, "raw": s or None}}``."""
    return {nbytes: (_gpu_row(group, nbytes) if use_gpu else _cpu_row(group, nbytes)) for nbytes in sizes}


def _gpu_row(group: synk_comm.Group, nbytes: int) -> dict[str, float | None]:
    import jax.numpy as jnp
    import nccl.core as nc

    from synk_comm.nccl import CudaBuffer

    count = max(1, nbytes // 4)
    iters = iters_for(nbytes)
    x = jnp.ones(count, jnp.float32)
    y = jnp.zeros(count, jnp.float32)  # reduced in place: zeros stay zeros, call after call
    x.block_until_ready()
    y.block_until_ready()
    row: dict[str, float | None] = {}
    done = group.nccl.synchronize  # nothing is left queued after a JAX call; kept for symmetry with torch
    row["synk"] = time_blocks(lambda: group.all_reduce(x, "sum"), done, group.barrier, iters)
    row["synk_inplace"] = time_blocks(lambda: group.all_reduce(y, "sum", out=y), done, group.barrier, iters)
    comm, stream = group.nccl.comm, group.nccl._stream
    out = jnp.empty_like(x)
    out.block_until_ready()
    ca, cb = CudaBuffer(x), CudaBuffer(out)
    row["raw"] = time_blocks(lambda: comm.allreduce(ca, cb, nc.SUM, stream=stream), stream.sync, group.barrier,
                             iters)
    check = np.asarray(out[:2])
    if not np.all(check == group.size):
        raise AssertionError(f"raw nccl4py all-reduce gave {check}, expected {group.size}")
    row["synk_torch_inplace"] = _torch_inplace(group, count, iters)
    return row


def _torch_inplace(group: synk_comm.Group, count: int, iters: int) -> float | None:
    """``Group.all_reduce(t, out=t)`` on a torch CUDA tensor: NCCL on torch's current stream, no
    synchronisation per call (as torch.distributed); one ``torch.cuda.synchronize`` per block."""
    try:
        import torch
    except ImportError:
        return None
    t = torch.ones(count, dtype=torch.float32, device="cuda")
    group.all_reduce(t, "max", out=t)  # ones stay ones under max: the result is checkable after any count
    seconds = time_blocks(lambda: group.all_reduce(t, "max", out=t), torch.cuda.synchronize, group.barrier, iters)
    if not bool((t[:2] == 1).all()):
        raise AssertionError(f"synk_comm all-reduce of a torch tensor gave {t[:2].tolist()}, expected ones")
    return seconds


def _cpu_row(group: synk_comm.Group, nbytes: int) -> dict[str, float | None]:
    count = max(1, nbytes // 4)
    iters = min(iters_for(nbytes), 20)
    x = np.ones(count, np.float32)
    y = np.zeros(count, np.float32)
    row: dict[str, float | None] = {
        "synk": time_blocks(lambda: group.all_reduce(x, "sum"), lambda: None, group.barrier, iters),
        "synk_inplace": time_blocks(lambda: group.all_reduce(y, "sum", out=y), lambda: None, group.barrier, iters),
        "raw": None,
        "synk_torch_inplace": None,
    }
    return row


# --- torch.distributed NCCL, in processes of its own -----------------------------------------------

def torch_rank(rank: int, n: int, sizes: list[int], path: str, results: Any) -> None:
    """A torch rank (spawned): puts ``(rank, "ok", {nbytes: seconds})`` or ``(rank, "error", text)``."""
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method="file://" + path, rank=rank, world_size=n,
                                device_id=torch.device("cuda", rank))
        row = {}
        for nbytes in sizes:
            t = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device="cuda")
            row[nbytes] = time_blocks(lambda t=t: dist.all_reduce(t), torch.cuda.synchronize, dist.barrier,
                                      iters_for(nbytes))
        dist.destroy_process_group()
        results.put((rank, "ok", row))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def torch_nccl(n: int, sizes: list[int], visible: str | None) -> tuple[dict[int, float], str]:
    """Seconds per all-reduce of torch NCCL by size (the slowest rank's), and a status line."""
    import multiprocessing as mp

    try:
        import torch
    except ImportError:
        return {}, "skipped (torch not installed)"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    path = os.path.join(tempfile.mkdtemp(prefix="synk_bench_"), "init")
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        procs = [ctx.Process(target=torch_rank, args=(r, n, sizes, path, results), daemon=True) for r in range(n)]
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    rows: dict[int, dict[int, float]] = {}
    errors = []
    try:
        for _ in range(n):
            rank, status, value = results.get(timeout=TORCH_TIMEOUT_S)
            if status == "ok":
                rows[rank] = value
            else:
                errors.append(f"rank {rank}: {value}")
    except queue.Empty:
        errors.append(f"no result within {TORCH_TIMEOUT_S:.0f} s")
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    if errors:
        print("torch NCCL failed:\n" + "\n".join(errors), file=sys.stderr, flush=True)
        return {}, "failed (see stderr)"
    return {nbytes: max(rows[r][nbytes] for r in rows) for nbytes in sizes}, f"torch {torch.__version__}, NCCL"


# --- report ---------------------------------------------------------------------------------------

def fmt_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def fmt(seconds: float | None, nbytes: int, n: int) -> str:
    """``ms | GB/s`` cells of a time, or two skipped cells."""
    bw = busbw(nbytes, seconds, n)
    if seconds is None or bw is None:
        return "skipped | skipped"
    return f"{seconds * 1e3:.3f} | {bw:.1f}"


def pct(ours: float | None, ref: float | None) -> str:
    """Our bus bandwidth as a percentage of the reference's (= the reference's time over ours)."""
    if not ours or not ref:
        return "—"
    return f"{ref / ours:.0%}"


def gpu_count() -> int:
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except FileNotFoundError:
        return 0


def main() -> None:
    faulthandler.dump_traceback_later(WALL_S, exit=True)  # never hang: the workers follow the master out
    t_start = time.perf_counter()
    sizes = sizes_to_run()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    n = (len(visible.split(",")) if visible else gpu_count()) if USE_GPU else 2
    if n < 2:
        raise SystemExit(f"bench_comm_gpu: needs 2 or more GPUs, found {n} (SYNK_BENCH_CPU=1 for a CPU dry run)")
    torch_s, torch_status = torch_nccl(n, sizes, visible) if USE_GPU else ({}, "skipped (CPU dry run)")
    devices = list(range(n)) if USE_GPU else None
    per_rank = synk_comm.spawn(synk_rank, n, args=(sizes, USE_GPU), devices=devices)
    rows: dict[int, dict[str, float | None]] = {}
    for nbytes in sizes:
        cells = [r[nbytes] for r in per_rank]
        rows[nbytes] = {k: (None if any(c[k] is None for c in cells) else max(c[k] for c in cells))
                        for k in ("synk", "synk_inplace", "raw", "synk_torch_inplace")}
        rows[nbytes]["torch"] = torch_s.get(nbytes)
    elapsed = time.perf_counter() - t_start

    mode = f"{n} GPUs" if USE_GPU else f"CPU dry run, {n} ranks"
    print(f"synk-comm {synk_comm.__version__}, Python {platform.python_version()}, {torch_status}; {mode}; "
          f"float32 sum; slowest rank's median of {REPS} blocks; bus bandwidth 2(n-1)/n*bytes/time; "
          f"{elapsed:.1f} s\n")
    print("| size | synk_comm ms | GB/s | synk_comm out=x ms | GB/s | synk_comm torch out=x ms | GB/s "
          "| raw nccl4py ms | GB/s | torch NCCL ms | GB/s | synk / raw | synk out=x / raw | synk out=x / torch "
          "| synk torch out=x / torch |")
    print("|---:|" + "---:|" * 14)
    for nbytes, row in rows.items():
        print(f"| {fmt_size(nbytes)} | {fmt(row['synk'], nbytes, n)} | {fmt(row['synk_inplace'], nbytes, n)} | "
              f"{fmt(row['synk_torch_inplace'], nbytes, n)} | {fmt(row['raw'], nbytes, n)} | "
              f"{fmt(row['torch'], nbytes, n)} | {pct(row['synk'], row['raw'])} | "
              f"{pct(row['synk_inplace'], row['raw'])} | {pct(row['synk_inplace'], row['torch'])} | "
              f"{pct(row['synk_torch_inplace'], row['torch'])} |")
    report = {"n": n, "use_gpu": USE_GPU, "torch": torch_status, "elapsed_s": elapsed, "rows": {
        str(nbytes): {**{f"{k}_s": v for k, v in row.items()},
                      **{f"{k}_busbw_GBps": busbw(nbytes, v, n) for k, v in row.items()}}
        for nbytes, row in rows.items()}}
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "bench_comm_gpu.json"), "w") as f:
        json.dump(report, f, indent=1)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
