"""GPU benchmarks on 2+ GPUs, each comparison side by side in one run (``gpu/run_device.sh``).

1. all_reduce of a 256 MB float32 shared variable (``synk.all_reduce``) against raw nccl4py
   all-reduces of 256 MB JAX buffers, in a group of the same size started in the same run.
2. Data-parallel training step of the DDP anchor MLP (1024 -> 4 x 4096 tanh -> 10, softmax
   cross-entropy, SGD, float32; XLA's default matmul precision, i.e. TF32 on Hopper, then again
   with strict float32 matmuls, the DESIGN anchor's two rows; with ``bf16`` in ``SYNK_BENCH_PARTS``,
   a third table in mixed precision: ours ``precision="bf16"``, DDP under ``torch.autocast``
   bfloat16, plain PyTensor JAX in ``precision.jax_mode("JAX", "bf16")``) for several global batches on 1
   GPU and on every GPU, beside PyTorch DDP (TF32) on the same shapes and the
   plain PyTensor JAX step on one GPU: step time, scaling, peak GPU memory.  Synkhronos:
   ``synk_lasagne.make_train_function`` with data scattered once into GPU memory (sliceable
   shareds, ``batch_s``): one program per step on the JAX engine (gradient, XLA's all-reduce,
   SGD update).
3. Tiny-call overhead: a synk function on a 4x2 input against the plain PyTensor JAX function.
4. Throughput against batch size, 1 and n GPUs, ours and DDP's (PNG, when matplotlib exists).

Prints markdown tables and writes ``$OUT/bench_gpu.json`` (and the PNG).  ``SYNK_BENCH_PARTS``
(comma-separated, default ``allreduce,tiny,tf32,fp32``) chooses the parts: ``allreduce`` (1),
``tiny`` (3), ``tf32``/``fp32``/``bf16`` the training tables (2; the plot follows ``tf32``), e.g.
``SYNK_BENCH_PARTS=bf16,tf32``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
from models import mlp  # the benchmarks' MLP builder (this folder)

OUT = os.environ.get("OUT", "/tmp")
PRECISION_ENV = "JAX_DEFAULT_MATMUL_PRECISION"
"""Set to "highest" (strict float32 matmuls: JAX reads it at import; the DDP rows follow it) for
the strict float32 table; unset, matmuls run in TF32 on Hopper (JAX's and our DDP rows' default)."""
POLICY_ENV = "SYNK_BENCH_POLICY"
"""The precision policy of the training rows (:mod:`synkhronos.precision`; set by :func:`main` for the
bf16 table, read by the rows' processes): ``bf16`` also puts DDP's forward pass under autocast."""
IN_FLIGHT = int(os.environ.get("SYNK_BENCH_IN_FLIGHT", "0"))
"""> 0: beside the synchronous synk step, a column of the same step submitted (``Function.submit``,
pipelined on the JAX engine) with this many calls in flight (``fork(max_in_flight=...)``), every
step's loss read through its future as it completes, up to this many steps late; 0 (default): the
synchronous step alone."""
USE_GPU = os.environ.get("SYNK_BENCH_CPU") != "1"  # SYNK_BENCH_CPU=1: a dry run of the code on CPU workers
D, H, L, C = 1024, 4096, 4, 10
WIDTHS = [D] + [H] * L + [C]
"""The DDP anchor's MLP (:func:`models.mlp`)."""


def policy() -> str:
    """This process's precision policy (:data:`POLICY_ENV`)."""
    return os.environ.get(POLICY_ENV, "default")


def gpu_count() -> int:
    return len(os.listdir("/proc/driver/nvidia/gpus"))


# --- 1. all_reduce ------------------------------------------------------------------------------

def synk_all_reduce(n: int, nbytes: int, iters: int = 50) -> tuple[float, float]:
    """Seconds per ``synk.all_reduce`` of ``nbytes``: called (each waits for itself) and submitted
    (``synk.all_reduce.submit``: pipelined, the loop waits for the last); the median of 3 blocks."""
    import pytensor

    import synkhronos as synk

    synk.fork(n, use_gpu=USE_GPU)
    s = pytensor.shared(np.ones(nbytes // 4, dtype="float32"), name="big")
    first = synk.function([], outputs=(s[0], "max"))
    first()
    for _ in range(10):  # warm-up (the first call compiles the all-reduce program)
        synk.all_reduce(s, op="max")
    first()

    def block(submit: bool) -> float:
        t0 = time.perf_counter()
        if submit:
            futures = [synk.all_reduce.submit(s, op="max") for _ in range(iters)]
            futures[-1].result()
        else:
            for _ in range(iters):
                synk.all_reduce(s, op="max")
        first()  # every rank reads s (nothing left queued)
        return (time.perf_counter() - t0) / iters

    seconds = statistics.median([block(False) for _ in range(3)])
    submitted = statistics.median([block(True) for _ in range(3)])
    if os.environ.get("SYNK_BENCH_PROFILE"):
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(iters):
                synk.all_reduce(s, op="max")
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    synk.close()
    return seconds, submitted


def raw_nccl(group, nbytes: int, iters: int = 20) -> float:
    import jax
    import jax.numpy as jnp
    import nccl.core as nc

    from synk_comm.nccl import CudaBuffer

    comm = group.nccl.comm
    stream = group.nccl._stream
    a = jax.device_put(np.ones(nbytes // 4, dtype="float32"), jax.devices()[0])
    b = jnp.empty_like(a)
    b.block_until_ready()
    ca, cb = CudaBuffer(a), CudaBuffer(b)
    for _ in range(3):
        comm.allreduce(ca, cb, nc.MAX, stream=stream)
    stream.sync()
    group.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        comm.allreduce(ca, cb, nc.MAX, stream=stream)
    stream.sync()
    return (time.perf_counter() - t0) / iters


# --- 2. training step ------------------------------------------------------------------------

def peak_gpu_bytes() -> int:
    import jax

    return int(jax.devices()[0].memory_stats().get("peak_bytes_in_use", 0))


def synk_training(n: int, scattered: int) -> tuple[Any, list[Any]]:
    """Fork ``n`` ranks and build ``synk_lasagne``'s training function of the MLP (one program per
    step on the JAX engine: gradient, XLA's all-reduce, SGD update) over
    ``scattered`` random rows scattered into the ranks' memory; returns (train, params)."""
    import pytensor

    import synkhronos as synk
    from synk_lasagne import make_train_function, updates

    synk.fork(n, use_gpu=USE_GPU, **({"max_in_flight": IN_FLIGHT} if IN_FLIGHT > 0 else {}))
    rng = np.random.default_rng(0)
    xs = pytensor.shared(np.zeros((0, D), dtype="float32"), name="xs")
    ys = pytensor.shared(np.zeros(0, dtype="int32"), name="ys")
    loss, params = mlp(xs, ys, rng, WIDTHS)
    train = make_train_function(loss, params, [], updates.sgd, sliceable_shareds=[xs, ys], learning_rate=1e-3,
                                precision=policy())
    synk.scatter([xs, ys], [synk.data(rng.standard_normal((scattered, D)).astype("float32")),
                            synk.data(rng.integers(0, C, scattered).astype("int32"))])
    return train, params


def synk_train_steps(n: int, batches: list[int], steps: int = 20) -> dict[int, float]:
    """Seconds per step of ``synk_lasagne``'s training function (:func:`synk_training`), data
    resident on the GPUs: key ``batch`` synchronous (the loss read every step), key ``-batch``
    submitted (with :data:`IN_FLIGHT`; the loss of every step read through its future)."""
    import synkhronos as synk
    from synkhronos.engine.master import device_memory

    train, params = synk_training(n, max(batches))
    times = {}
    for batch in batches:
        rows = slice(0, batch // n)
        for _ in range(5):
            train(batch_s=rows)
        t0 = time.perf_counter()
        for _ in range(steps):
            train(batch_s=rows)  # returns the loss: every step ends with the host holding it
        synk.get_value(0, params[-1])  # the last update has finished (a 10-value bias: a cheap wait)
        times[batch] = (time.perf_counter() - t0) / steps
        if IN_FLIGHT > 0:  # every step's loss read when it completes, up to IN_FLIGHT steps late
            losses = []
            t0 = time.perf_counter()
            pending: collections.deque[Any] = collections.deque()
            for _ in range(steps):
                pending.append(train.submit(batch_s=rows))
                if len(pending) >= IN_FLIGHT:
                    losses.append(float(pending.popleft().result()))
            while pending:
                losses.append(float(pending.popleft().result()))
            synk.get_value(0, params[-1])
            times[-batch] = (time.perf_counter() - t0) / steps
            assert len(losses) == steps and all(np.isfinite(losses))
    # the GPU 0 worker's peak (the JAX engine's master holds no GPU: its own statistics read 0)
    times[-1] = device_memory()[0]["peak_bytes_in_use"] if USE_GPU else 0
    synk.close()
    return times


def _child(target, args, q) -> None:
    try:
        q.put((True, target(*args)))
    except BaseException as exc:  # the parent re-raises it instead of waiting for a result that never comes
        import traceback

        q.put((False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


@contextlib.contextmanager
def gpus_visible(devices: list[str]):
    """Processes started in the body see ``devices`` (``synk.fork`` pinned this one to its GPU)."""
    saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_PREALLOCATE")}
    os.environ.update(CUDA_VISIBLE_DEVICES=",".join(devices), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def in_child(target, args: tuple, devices: list[str]) -> Any:
    """``target(*args)`` in a fresh interpreter that sees ``devices``: its own GPU memory peak."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with gpus_visible(devices):
        p = ctx.Process(target=_child, args=(target, args, q))
        p.start()
    import queue

    deadline = time.monotonic() + 400
    while True:
        try:
            ok, result = q.get(timeout=1.0)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"{getattr(target, '__name__', target)} died (exit code {p.exitcode}) "
                                   "before returning a result") from None
            if time.monotonic() > deadline:
                p.kill()
                raise TimeoutError(f"{getattr(target, '__name__', target)} returned nothing in 400 s") from None
    p.join()
    if not ok:
        raise RuntimeError(f"{getattr(target, '__name__', target)} failed in its child process:\n{result}")
    return result


def plain_worker(batches: list[int], steps: int = 20) -> dict[int, float]:
    """PyTensor JAX on one GPU, no Synkhronos: the fused step (gradient and SGD update in one
    function) of the whole batch, its loss read every step."""
    import jax
    import pytensor
    import pytensor.tensor as pt

    rng = np.random.default_rng(0)
    x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
    loss, params = mlp(x, y, rng, WIDTHS)
    grads = pytensor.grad(loss, params)
    from synkhronos import precision

    f = pytensor.function([x, y], loss, updates=[(p, p - np.float32(1e-3) * g) for p, g in zip(params, grads)],
                          mode=precision.jax_mode("JAX", policy()))
    f.trust_input = True
    dev = jax.devices()[0]
    for p in params:
        p.container.storage[0] = jax.device_put(p.get_value(), dev)
    times = {}
    for batch in batches:
        xd = jax.device_put(rng.standard_normal((batch, D)).astype("float32"), dev)
        yd = jax.device_put(rng.integers(0, C, batch).astype("int32"), dev)
        for _ in range(5):
            np.asarray(f(xd, yd))
        t0 = time.perf_counter()
        for _ in range(steps):
            np.asarray(f(xd, yd))
        times[batch] = (time.perf_counter() - t0) / steps
    times[-1] = peak_gpu_bytes()
    return times


def ddp_worker(rank: int, n: int, batches: list[int], path: str, q, steps: int = 20) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    torch.backends.cuda.matmul.allow_tf32 = os.environ.get(PRECISION_ENV) != "highest"
    torch.cuda.set_device(rank)
    if n > 1:
        dist.init_process_group("nccl", init_method="file://" + path, rank=rank, world_size=n)
    layers: list = [nn.Linear(D, H), nn.Tanh()]
    for _ in range(L - 1):
        layers += [nn.Linear(H, H), nn.Tanh()]
    layers.append(nn.Linear(H, C))
    torch.manual_seed(0)
    model = nn.Sequential(*layers).cuda()
    if n > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    lossf = nn.CrossEntropyLoss()
    times = {}
    for batch in batches:
        x = torch.randn(batch // n, D, device="cuda")
        y = torch.randint(0, C, (batch // n,), device="cuda")

        def step(x: Any = x, y: Any = y) -> Any:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=policy() == "bf16"):
                loss = lossf(model(x), y)
            loss.backward()
            opt.step()
            return loss

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step().item()  # like ours: the loss comes back to the host every step
        times[batch] = (time.perf_counter() - t0) / steps
        t0 = time.perf_counter()
        for _ in range(steps):
            step()  # the DDP anchor's loop: the host runs ahead, one synchronisation at the end
        torch.cuda.synchronize()
        times[-batch] = (time.perf_counter() - t0) / steps
    if n > 1:
        dist.destroy_process_group()
    q.put((rank, times))


def ddp_steps(n: int, batches: list[int]) -> dict[int, float]:
    """Seconds per step of PyTorch DDP (key ``batch``: loss read every step; key ``-batch``: the
    anchor's loop without it), the slowest rank's."""
    import multiprocessing as mp

    from synkhronos.gpu import visible_devices

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = f"/tmp/ddp_{os.getpid()}_{n}"
    procs = [ctx.Process(target=ddp_worker, args=(r, n, batches, path, q)) for r in range(n)]
    with gpus_visible(visible_devices()):
        for p in procs:
            p.start()
    per_rank = [q.get(timeout=300)[1] for _ in procs]
    for p in procs:
        p.join()
    return {k: max(t[k] for t in per_rank) for k in per_rank[0]}


def gpu_counts(n: int) -> list[int]:
    """The GPU counts of the scaling table: 1, the powers of two below ``n``, and ``n``."""
    return sorted({1, n, *(2**i for i in range(1, n.bit_length()) if 2**i < n)})


def gpu_name() -> str:
    """The first GPU's model name, as the driver reports it."""
    root = "/proc/driver/nvidia/gpus"
    try:
        with open(os.path.join(root, sorted(os.listdir(root))[0], "information")) as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("Model"))
    except (OSError, IndexError, StopIteration):
        return "GPU"


@contextlib.contextmanager
def matmul_precision(precision: str | None, name: str = PRECISION_ENV):
    """Processes started in the body run matmuls at ``precision`` ("highest": strict float32), or with
    ``name=POLICY_ENV`` under that precision policy."""
    saved = os.environ.get(name)
    if precision is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = precision
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def training_runs(batches: list[int], counts: list[int], devices: list[str]) -> dict[str, dict[int, float]]:
    """Every training configuration, each in a fresh process (its own GPU memory peak)."""
    runs = {"plain_1": in_child(plain_worker, (batches,), devices[:1]) if USE_GPU else {}}
    for k in counts:
        runs[f"synk_{k}"] = in_child(synk_train_steps, (k, batches), devices) if USE_GPU else \
            synk_train_steps(k, batches)
        runs[f"ddp_{k}"] = ddp_steps(k, batches) if USE_GPU else {}
        print(f"{k} GPU(s): " + ", ".join(f"{key} {v}" for key, v in runs.items()), flush=True)
    return runs


def print_training_table(runs: dict[str, dict[int, float]], batches: list[int], counts: list[int],
                         precision: str) -> None:
    """Markdown: ms per step and scaling over 1 GPU, ours and DDP's, for every batch and GPU count."""
    print(f"\n## training step (MLP {D}->{L}x{H}->{C}, float32 parameters, {precision} matmuls on both sides; "
          "ms per step)\n")
    head = ["global batch", "PyTensor JAX 1 GPU"]
    for k in counts:
        head += [f"ours {k}", *([f"ours {k} submitted ({IN_FLIGHT} in flight)"] if IN_FLIGHT > 0 else []),
                 f"DDP {k}", f"DDP {k} no per-step sync"]
        if k > 1:
            head += [f"ours scaling {k}", f"DDP scaling {k}"]
    print("| " + " | ".join(head) + " |\n|" + "---:|" * len(head))
    for b in batches:
        cells = [str(b), f"{runs['plain_1'][b] * 1e3:.2f}"]
        for k in counts:
            ours, ddp = runs[f"synk_{k}"][b], runs[f"ddp_{k}"][b]
            submitted = [f"{runs[f'synk_{k}'][-b] * 1e3:.2f}"] if IN_FLIGHT > 0 else []
            cells += [f"{ours * 1e3:.2f}", *submitted, f"{ddp * 1e3:.2f}", f"{runs[f'ddp_{k}'][-b] * 1e3:.2f}"]
            if k > 1:
                cells += [f"{runs['synk_1'][b] / ours:.2f}x", f"{runs['ddp_1'][b] / ddp:.2f}x"]
        print("| " + " | ".join(cells) + " |")
    mib = 1 << 20
    peaks = ", ".join(f"ours {k} GPU(s) {runs[f'synk_{k}'][-1] / mib:.0f} MiB" for k in counts)
    print(f"\nPeak GPU memory of GPU 0 over the batches (the largest): PyTensor JAX 1 GPU "
          f"{runs['plain_1'][-1] / mib:.0f} MiB, {peaks}")


# --- 3. call overhead ----------------------------------------------------------------------------

def call_overhead(n: int, iters: int = 2000) -> tuple[float, float]:
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    synk.fork(n, use_gpu=USE_GPU)
    x = pt.matrix("x")
    f = synk.function([x], outputs=x.sum())
    g = pytensor.function([x], x.sum(), mode="JAX")
    a = np.ones((4, 2), dtype="float32")
    xd = synk.data(a)
    for _ in range(100):
        f(xd)
        np.asarray(g(a))
    t0 = time.perf_counter()
    for _ in range(iters):
        f(xd)
    ours = (time.perf_counter() - t0) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        np.asarray(g(a))
    plain = (time.perf_counter() - t0) / iters
    if os.environ.get("SYNK_BENCH_PROFILE"):
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(200):
                f(xd)
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    synk.close()
    return ours, plain


def main() -> None:
    import synk_comm

    n = gpu_count()
    results: dict = {"gpus": n}
    parts = os.environ.get("SYNK_BENCH_PARTS", "allreduce,tiny,tf32,fp32").split(",")
    nbytes = 256 << 20
    if "allreduce" in parts:
        ours, submitted = synk_all_reduce(n, nbytes)
        raw = synk_comm.spawn(raw_nccl, n, args=(nbytes,), devices=list(range(n)))
        raw_s = max(raw)
        busbw = lambda s: 2 * (n - 1) / n * nbytes / s / 1e9  # noqa: E731
        results["all_reduce_256MB"] = {"synk_ms": ours * 1e3, "synk_submitted_ms": submitted * 1e3,
                                       "raw_nccl4py_ms": raw_s * 1e3, "synk_busbw": busbw(ours),
                                       "synk_submitted_busbw": busbw(submitted), "raw_busbw": busbw(raw_s)}
        print(f"\n## all_reduce of a 256 MB float32 shared variable, {n} GPUs (loops of 50; raw: on one stream)\n")
        print("| | time (ms) | bus bandwidth (GB/s) | of raw NCCL |\n|---|---:|---:|---:|")
        for label, t in (("synk.all_reduce", ours), ("synk.all_reduce.submit", submitted), ("raw nccl4py", raw_s)):
            print(f"| {label} | {t * 1e3:.3f} | {busbw(t):.1f} | {busbw(t) / busbw(raw_s):.1%} |")
        print(flush=True)

    if "tiny" in parts:
        overhead, plain = call_overhead(n)
        results["tiny_call_us"] = {"synk": overhead * 1e6, "plain_jax": plain * 1e6}
        print(f"\n## tiny call\n\nsynk {overhead * 1e6:.1f} us, plain PyTensor JAX {plain * 1e6:.1f} us, "
              f"overhead {(overhead - plain) * 1e6:.1f} us", flush=True)

    batches = [int(b) for b in os.environ.get("SYNK_BENCH_BATCHES", "2048,8192,16384").split(",")]
    from synkhronos.gpu import visible_devices

    devices = visible_devices()
    counts = gpu_counts(n)
    runs: dict[str, dict[int, float]] = {}
    if "tf32" in parts:
        with matmul_precision(None):
            runs = training_runs(batches, counts, devices)
        if not USE_GPU:
            print(runs)
            return
        results["train_step_s"] = runs
        print_training_table(runs, batches, counts, "TF32")
    if "bf16" in parts:
        with matmul_precision(None), matmul_precision("bf16", POLICY_ENV):
            mixed = training_runs(batches, counts, devices)
        results["train_step_s_bf16"] = mixed
        if USE_GPU:
            print_training_table(mixed, batches, counts, "bf16 (ours precision='bf16', DDP autocast bf16)")
    strict_batches = [b for b in batches if b >= 8192]
    if "fp32" in parts and USE_GPU:
        with matmul_precision("highest"):
            strict = training_runs(strict_batches, counts, devices)
        results["train_step_s_strict_fp32"] = strict
        print_training_table(strict, strict_batches, counts, "strict float32")
    with open(os.path.join(OUT, "bench_gpu.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    if not runs:
        return
    try:
        title = f"MLP training throughput, {n}x {gpu_name()}"
        plot(runs, batches, counts, title, os.path.join(OUT, "gpu_throughput.png"))
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)


def plot(runs: dict[str, dict[int, float]], batches: list[int], counts: list[int], title: str, path: str) -> None:
    """Samples per second over the global batch: every configuration of ``runs`` (seconds per step by
    batch; a negative batch is the same batch submitted, for synk, or without the per-step sync, for
    DDP), the submitted synk steps where measured.  Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in [*(f"synk_{k}" for k in counts), *(f"ddp_{k}" for k in counts), "plain_1"]:
        kind, k = key.split("_")
        label = {"synk": "Synkhronos", "ddp": "PyTorch DDP", "plain": "PyTensor JAX alone"}[kind]
        style = {"synk": "o-", "ddp": "s--", "plain": "x:"}[kind]
        ax.plot(batches, [b / runs[key][b] for b in batches], style, label=f"{label}, {k} GPU")
        if kind == "synk" and all(-b in runs[key] for b in batches):
            ax.plot(batches, [b / runs[key][-b] for b in batches], "^-", label=f"Synkhronos submitted, {k} GPU")
    ax.set_xlabel("global batch")
    ax.set_ylabel("samples / s")
    ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
