"""CPU mode against what a CPU user would run instead, over rank counts, side by side in one run.

Three tables (markdown), each configuration in a fresh interpreter (its own thread settings):

1. The tiny call: a Synkhronos function with one scalar out (``sum`` of a 4n x 2 input), median
   microseconds per call at 2/4/8/16 ranks (capped at the cores available unless
   ``--tiny-ranks`` says otherwise), and the plain PyTensor call of the same graph.
   Goal: 16 ranks within 2x of 2 ranks.
2. One SGD step of an MLP 1024 -> 3x1024 (tanh) -> 10, softmax cross-entropy, global batch 4096,
   float32, in ms: Synkhronos CPU mode (its default backend, ranks pinned: the defaults of
   :func:`synkhronos.fork`) at 1/2/4/8/16 ranks (capped at the cores), one plain PyTensor
   process in JAX mode and in PyTensor's default mode (default threads, every core), and, when
   torch is importable, torch DDP (gloo, one thread pool of cores/n threads per process) at the
   same counts and one torch process.  Goal: Synkhronos at its best count beats DDP at its best.
3. A compute-bound call, ``mean(tanh(x @ W))`` over 8192 x 1024 float32 rows with a 1024 x 1024
   ``W``, in ms: Synkhronos CPU mode at 2 ranks against one plain PyTensor process of the same
   backend (JAX mode when JAX is installed, else the default mode) with one thread and with its
   default threads.  Goal: 2 ranks on 2 cores at least 1.7x one process of one thread.

Usage (repository root, the packages importable)::

    python benchmarks/bench_cpu_scaling.py                 # every table
    python benchmarks/bench_cpu_scaling.py --only tiny     # the tiny-call table alone
    python benchmarks/bench_cpu_scaling.py --tiny-ranks 2,4,8,16 --only tiny   # oversubscribed too
    taskset -c 0,1 python benchmarks/bench_cpu_scaling.py --only mlp --rounds 5   # 2 cores, 5 turns
    taskset -c 0,1 python benchmarks/bench_cpu_scaling.py --only compute           # the 2-core target

With ``--rounds R`` every MLP configuration runs R times, the configurations taking turns (round
1 of each, then round 2 of each, ...), so that a machine's drift hits them alike; a cell is the
median of its R figures, and every figure is printed under the table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
from models import mlp  # the benchmarks' MLP builder (this folder)

D, H, L, C = 1024, 1024, 3, 10
WIDTHS = [D] + [H] * L + [C]
BATCH = 4096
STEPS = 10
WARMUP = 3
RANKS = (1, 2, 4, 8, 16)
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


# -- the configurations (each runs in its own interpreter) -----------------------------------------
def _timed(step: Any) -> float:
    for _ in range(WARMUP):
        step()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - t0) / STEPS


def plain_step(mode: str) -> float:
    """One process, plain PyTensor in ``mode``, PyTensor's and the backend's default threads."""
    import pytensor
    import pytensor.tensor as pt

    if mode == "JAX":  # PyTensor < 3.3: its JAX arange fails on this graph without the fix CPU mode uses
        from synkhronos.cpu import backport_jax_arange

        backport_jax_arange()
    rng = np.random.default_rng(0)
    x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
    loss, params = mlp(x, y, rng, WIDTHS)
    grads = pytensor.grad(loss, params)
    f = pytensor.function([x, y], loss, updates=[(p, p - np.float32(1e-3) * g) for p, g in zip(params, grads)],
                          mode=mode)
    xd = rng.standard_normal((BATCH, D)).astype("float32")
    yd = rng.integers(0, C, BATCH).astype("int32")
    return _timed(lambda: float(f(xd, yd)))


def synk_step(n: int) -> float:
    """Synkhronos CPU mode with ``n`` ranks, its defaults (backend, pinning, threads)."""
    import pytensor

    import synkhronos as synk
    from synk_lasagne import make_train_function, updates

    synk.fork(n, use_gpu=False)
    rng = np.random.default_rng(0)
    xs = pytensor.shared(np.zeros((0, D), dtype="float32"), name="xs")
    ys = pytensor.shared(np.zeros(0, dtype="int32"), name="ys")
    loss, params = mlp(xs, ys, rng, WIDTHS)
    train = make_train_function(loss, params, [], updates.sgd, sliceable_shareds=[xs, ys], learning_rate=1e-3)
    synk.scatter([xs, ys], [synk.data(rng.standard_normal((BATCH, D)).astype("float32")),
                            synk.data(rng.integers(0, C, BATCH).astype("int32"))])
    rows = slice(0, BATCH // n)
    dt = _timed(lambda: train(batch_s=rows))
    synk.close()
    return dt


def tiny_call(n: int) -> dict[str, float]:
    """Median us per call of a one-scalar-out function with ``n`` ranks (and of the plain call)."""
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    synk.fork(n, use_gpu=False)
    x = pt.matrix("x")
    f = synk.function([x], outputs=pt.sum(x))
    plain_fns = {"plain_us": pytensor.function([x], pt.sum(x))}
    try:
        plain_fns["plain_jax_us"] = pytensor.function([x], pt.sum(x), mode="JAX")
    except Exception:  # no JAX: that column stays empty
        pass
    a = np.ones((4 * n, 2), dtype=x.dtype)
    xd = synk.data(a)
    for _ in range(300):
        f(xd)
        for g in plain_fns.values():
            g(a)
    times: dict[str, list[float]] = {"synk_us": [], **{k: [] for k in plain_fns}}
    for _ in range(9):  # blocks alternate, so drift hits every side alike
        t0 = time.perf_counter()
        for _ in range(300):
            f(xd)
        times["synk_us"].append((time.perf_counter() - t0) / 300)
        for key, g in plain_fns.items():
            t0 = time.perf_counter()
            for _ in range(300):
                g(a)
            times[key].append((time.perf_counter() - t0) / 300)
    synk.close()
    return {key: statistics.median(values) * 1e6 for key, values in times.items()}


def compute_call(kind: str, one_core: bool = False) -> float:
    """Seconds per call (median of 10) of the compute-bound function: ``kind`` ``synk`` (2 ranks) or
    ``plain`` (one process; ``one_core``: pinned to one core, so that XLA's thread pool, sized by the
    affinity mask when JAX starts, has one thread)."""
    if one_core:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import pytensor
    import pytensor.tensor as pt

    rng = np.random.default_rng(0)
    x = pt.matrix("x", dtype="float32")
    w = pytensor.shared((rng.standard_normal((1024, 1024)) / 32).astype("float32"), name="w")
    y = pt.mean(pt.tanh(x @ w))
    xd = rng.standard_normal((8192, 1024)).astype("float32")
    if kind == "synk":
        import synkhronos as synk

        synk.fork(2, use_gpu=False)
        f = synk.function([x], outputs=y)
        arg = synk.data(xd)
        call: Any = lambda: f(arg)  # noqa: E731
    else:
        from synkhronos.cpu import choose_backend

        g = pytensor.function([x], y, mode="JAX" if choose_backend() == "jax" else None)
        call = lambda: g(xd)  # noqa: E731
    for _ in range(3):
        call()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    if kind == "synk":
        synk.close()
    return statistics.median(times)


def _ddp_worker(rank: int, n: int, port: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // n))
    torch.manual_seed(0)
    if n > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    dims = WIDTHS
    layers: list[Any] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        layers.append(nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(nn.Tanh())
    model: Any = nn.Sequential(*layers)
    if n > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(BATCH // n, D), torch.randint(0, C, (BATCH // n,))
    loss_fn = nn.CrossEntropyLoss()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.item())

    dt = _timed(step)
    if rank == 0:
        queue.put(dt)
    if n > 1:
        dist.destroy_process_group()


def ddp_step(n: int) -> float:
    """torch: one process (n=1, all cores) or DDP over ``n`` processes (gloo)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ddp_worker, args=(r, n, port, queue)) for r in range(n)]
    for p in procs:
        p.start()
    import queue as queue_module

    while True:  # a process that died would leave the result missing forever
        try:
            dt = float(queue.get(timeout=1.0))
            break
        except queue_module.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a DDP process failed (exit codes {failed}): see its traceback above") from None
    for p in procs:
        p.join()
    return dt


# -- the driver --------------------------------------------------------------------------------------
def run_one(kind: str, n: int, timeout: float = 300.0) -> dict[str, Any]:
    """Run one configuration in a fresh interpreter; its result, or its error."""
    env = dict(os.environ)
    env.setdefault("PYTENSOR_FLAGS", "floatX=float32")  # float32 throughout (see docs/guides/cpu.rst)
    if "floatX" not in env["PYTENSOR_FLAGS"]:
        env["PYTENSOR_FLAGS"] += ",floatX=float32"
    if kind == "ddp" and n > 1:  # torch reads these at import: each process a thread pool of cores/n
        for var in THREAD_VARS:
            env[var] = str(max(1, len(os.sched_getaffinity(0)) // n))
    if kind == "compute_plain" and n == 1:  # one thread: the BLAS and OpenMP pools (XLA's: compute_call)
        env.update({var: "1" for var in THREAD_VARS})
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, __file__, "--one", kind, str(n)], env=env, capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"kind": kind, "n": n, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"kind": kind, "n": n, "error": (out.stderr or out.stdout).strip()[-400:]}
    return {"kind": kind, "n": n, "result": json.loads(lines[-1][7:]), "wall_s": time.perf_counter() - t0}


def _one(kind: str, n: int) -> Any:
    if kind == "tiny":
        return tiny_call(n)
    if kind == "synk":
        return synk_step(n)
    if kind == "ddp":
        return ddp_step(n)
    if kind in ("JAX", "default"):
        return plain_step("JAX" if kind == "JAX" else "FAST_RUN")
    if kind == "compute_synk":
        return compute_call("synk")
    if kind == "compute_plain":
        return compute_call("plain", one_core=n == 1)
    raise ValueError(f"unknown configuration {kind!r}")


def _torch_importable() -> bool:
    return subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0


def _cell(r: dict[str, Any], key: str) -> str:
    return "error" if "error" in r else f"{r['result'][key]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["tiny", "mlp", "compute"], default=None)
    parser.add_argument("--tiny-ranks", default=None, help="comma-separated rank counts of the tiny-call table")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the MLP configurations this many times, taking turns; cells are medians")
    parser.add_argument("--one", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(_one(args.one[0], int(args.one[1]))), flush=True)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from machine import cpu_model

    cores = len(os.sched_getaffinity(0))
    counts = [n for n in RANKS if n <= cores]
    t_start = time.perf_counter()
    print(f"{cpu_model()}, {cores} cores; Python {sys.version.split()[0]}; "
          f"MLP {D} -> {L}x{H} -> {C}, batch {BATCH}, float32, {STEPS} steps after {WARMUP}", flush=True)
    if args.only in (None, "tiny"):
        tiny_counts = ([int(v) for v in args.tiny_ranks.split(",")] if args.tiny_ranks
                       else [n for n in (2, 4, 8, 16) if n <= cores])
        tiny = {n: run_one("tiny", n) for n in tiny_counts}
        for r in tiny.values():
            print(json.dumps(r), file=sys.stderr, flush=True)
        print("\n| tiny call (one scalar out), us | " + " | ".join(f"{n} ranks" for n in tiny_counts) + " |")
        print("|---|" + "---:|" * len(tiny_counts))
        print("| synkhronos CPU mode | " + " | ".join(_cell(tiny[n], "synk_us") for n in tiny_counts) + " |")
        print("| plain PyTensor call, default mode | " + " | ".join(_cell(tiny[n], "plain_us") for n in tiny_counts)
              + " |")
        print("| plain PyTensor call, JAX mode | " + " | ".join(
            _cell(tiny[n], "plain_jax_us") if "plain_jax_us" in tiny[n].get("result", {}) else ""
            for n in tiny_counts) + " |")
        first, last = tiny[tiny_counts[0]], tiny[tiny_counts[-1]]
        if "result" in first and "result" in last and len(tiny_counts) > 1:
            ratio = last["result"]["synk_us"] / first["result"]["synk_us"]
            print(f"\n{tiny_counts[-1]} ranks / {tiny_counts[0]} ranks: {ratio:.2f}x (goal <= 2x)")
    if args.only in (None, "mlp"):
        configs = [("synkhronos CPU mode", "synk", n) for n in counts]
        configs += [("plain PyTensor, JAX mode, 1 process", "JAX", 1),
                    ("plain PyTensor, default mode, 1 process", "default", 1)]
        if _torch_importable():
            configs += [("torch DDP (gloo); n=1: one torch process", "ddp", n) for n in counts]
        runs: dict[str, dict[int, list[float]]] = {}
        for _ in range(args.rounds):  # the configurations take turns, round after round
            for name, kind, n in configs:
                r = run_one(kind, n)
                print(json.dumps(r), file=sys.stderr, flush=True)
                if "result" in r:
                    runs.setdefault(name, {}).setdefault(n, []).append(r["result"] * 1e3)
        names = list(dict.fromkeys(name for name, _, _ in configs))
        median = {name: {n: statistics.median(ms) for n, ms in runs.get(name, {}).items()} for name in names}
        title = "MLP SGD step, ms" + (f" (median of {args.rounds} rounds)" if args.rounds > 1 else "")
        print(f"\n| {title} | " + " | ".join(str(n) for n in counts) + " |")
        print("|---|" + "---:|" * len(counts))
        for name in names:
            tried = {n for c_name, _, n in configs if c_name == name}
            print(f"| {name} | " + " | ".join(f"{median[name][n]:.1f}" if n in median[name]
                                              else "error" if n in tried else "" for n in counts) + " |")
        print()
        for name in names:
            if median[name]:
                ms, n = min((v, n) for n, v in median[name].items())
                print(f"best of {name}: {ms:.1f} ms ({n} process{'es' if n > 1 else ''})")
        if args.rounds > 1:
            print("\nevery round, ms:")
            for name in names:
                for n, ms_list in runs.get(name, {}).items():
                    print(f"  {name}, {n}: " + ", ".join(f"{v:.1f}" for v in ms_list))
    if args.only in (None, "compute") and cores >= 2:
        # n is 1 for one thread, 0 for the default threads (run_one's switch), 2 for the ranks
        rows = [("synkhronos CPU mode, 2 ranks", "compute_synk", 2),
                ("plain PyTensor, 1 process, 1 thread", "compute_plain", 1),
                ("plain PyTensor, 1 process, default threads", "compute_plain", 0)]
        got = {name: run_one(kind, n) for name, kind, n in rows}
        for r in got.values():
            print(json.dumps(r), file=sys.stderr, flush=True)
        print("\n| compute-bound call, mean(tanh(x @ W)) over 8192 x 1024, ms | ms | 2 ranks faster by |")
        print("|---|---:|---:|")
        ours = got[rows[0][0]]
        for name, _, _ in rows:
            r = got[name]
            ratio = ("" if "result" not in r or "result" not in ours or r is ours
                     else f"{r['result'] / ours['result']:.2f}x")
            cell = "error" if "error" in r else f"{r['result'] * 1e3:.1f}"
            print(f"| {name} | {cell} | {ratio} |")
        print("\n(goal: 2 ranks on 2 cores at least 1.7x one process of one thread)")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
