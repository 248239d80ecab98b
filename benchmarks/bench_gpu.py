"""GPU benchmarks on 2+ GPUs, each comparison side by side in one run (``gpu/run_device.sh``).

1. all_reduce of a 256 MB float32 shared variable (``synk.all_reduce``) against raw nccl4py
   all-reduces of 256 MB JAX buffers, in a group of the same size started in the same run.
2. Data-parallel training step of the DDP anchor MLP (1024 -> 4 x 4096 tanh -> 10, softmax
   cross-entropy, SGD, global batch 8192, float32; XLA's default matmul precision, i.e. TF32 on
   Hopper) on 1 GPU and on every GPU, beside PyTorch DDP (TF32) on the same shapes: step time and
   scaling.  Synkhronos: data scattered once into GPU memory (sliceable shareds, ``batch_s``),
   gradients written into ONE flat shared vector, all-reduced (avg), then the SGD step.
3. Tiny-call overhead: a synk function on a 4x2 input against the plain PyTensor JAX function.
4. Throughput against batch size, 1 and n GPUs, ours and DDP's (PNG, when matplotlib exists).

Prints markdown tables and writes ``$OUT/bench_gpu.json`` (and the PNG).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import numpy as np

OUT = os.environ.get("OUT", "/tmp")
USE_GPU = os.environ.get("SYNK_BENCH_CPU") != "1"  # SYNK_BENCH_CPU=1: a dry run of the code on CPU workers
D, H, L, C = 1024, 4096, 4, 10


def gpu_count() -> int:
    return len(os.listdir("/proc/driver/nvidia/gpus"))


# --- 1. all_reduce ------------------------------------------------------------------------------

def synk_all_reduce(n: int, nbytes: int, iters: int = 20) -> float:
    import pytensor

    import synkhronos as synk

    synk.fork(n, use_gpu=USE_GPU)
    s = pytensor.shared(np.ones(nbytes // 4, dtype="float32"), name="big")
    synk.function([], outputs=s[0])()
    for _ in range(3):
        synk.all_reduce(s, op="sum")
    t0 = time.perf_counter()
    for _ in range(iters):
        synk.all_reduce(s, op="sum")
    seconds = (time.perf_counter() - t0) / iters  # each call returns after its stream synchronised
    if os.environ.get("SYNK_BENCH_PROFILE"):
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(iters):
                synk.all_reduce(s, op="sum")
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    synk.close()
    return seconds


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
        comm.allreduce(ca, cb, nc.SUM, stream=stream)
    stream.sync()
    group.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        comm.allreduce(ca, cb, nc.SUM, stream=stream)
    stream.sync()
    return (time.perf_counter() - t0) / iters


# --- 2. training step ------------------------------------------------------------------------

def synk_train_step(n: int, batch: int, steps: int = 30) -> float:
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    synk.fork(n, use_gpu=USE_GPU)
    rng = np.random.default_rng(0)
    dims = [D] + [H] * L + [C]
    ws = [pytensor.shared((rng.standard_normal((a, b)) / np.sqrt(a)).astype("float32"), name=f"w{i}")
          for i, (a, b) in enumerate(itertools.pairwise(dims))]
    bs = [pytensor.shared(np.zeros(b, dtype="float32"), name=f"b{i}") for i, b in enumerate(dims[1:])]
    params = ws + bs
    per_rank = batch // n
    xs = pytensor.shared(np.zeros((0, D), dtype="float32"), name="xs")
    ys = pytensor.shared(np.zeros(0, dtype="int32"), name="ys")
    h = xs
    for i, (w, b) in enumerate(zip(ws, bs)):
        h = h @ w + b
        if i < len(ws) - 1:
            h = pt.tanh(h)
    logp = pt.special.log_softmax(h, axis=1)
    loss = -pt.mean(logp[pt.arange(ys.shape[0]), ys])
    grads = pytensor.grad(loss, params)
    sizes = [int(np.prod(p.get_value().shape)) for p in params]
    flat = pytensor.shared(np.zeros(sum(sizes), dtype="float32"), name="flat_grad")
    f_grad = synk.function([], outputs=loss, updates=[(flat, pt.concatenate([g.flatten() for g in grads]))],
                           sliceable_shareds=[xs, ys])
    offsets = np.cumsum([0, *sizes])
    f_step = synk.function([], updates=[(p, p - 1e-3 * flat[a:b].reshape(p.shape))
                                        for p, a, b in zip(params, offsets[:-1], offsets[1:])])
    xd = synk.data(rng.standard_normal((batch, D)).astype("float32"))
    yd = synk.data(rng.integers(0, C, batch).astype("int32"))
    synk.scatter([xs, ys], [xd, yd])

    def step() -> None:
        f_grad(batch_s=slice(0, per_rank))
        if n > 1:
            synk.all_reduce(flat, op="avg")
        f_step()

    for _ in range(5):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    synk.get_value(0, ws[0])  # the last step has finished in the master
    seconds = (time.perf_counter() - t0) / steps
    synk.close()
    return seconds


def ddp_worker(rank: int, n: int, batch: int, path: str, q) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    torch.backends.cuda.matmul.allow_tf32 = True
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
    x = torch.randn(batch // n, D, device="cuda")
    y = torch.randint(0, C, (batch // n,), device="cuda")
    lossf = nn.CrossEntropyLoss()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = lossf(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(30):
        step().item()  # like ours: the loss comes back to the host every step
    torch.cuda.synchronize()
    if n > 1:
        dist.destroy_process_group()
    q.put((rank, (time.perf_counter() - t0) / 30))


def ddp_step(n: int, batch: int) -> float:
    import multiprocessing as mp

    from synkhronos.gpu import visible_devices

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = f"/tmp/ddp_{os.getpid()}_{n}_{batch}"
    procs = [ctx.Process(target=ddp_worker, args=(r, n, batch, path, q)) for r in range(n)]
    pinned = os.environ.get("CUDA_VISIBLE_DEVICES")  # synk.fork pinned this process to its GPU
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_devices())
    try:
        for p in procs:
            p.start()
    finally:
        if pinned is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = pinned
    times = [q.get(timeout=120)[1] for _ in procs]
    for p in procs:
        p.join()
    return max(times)


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
    nbytes = 256 << 20
    ours = synk_all_reduce(n, nbytes)
    raw = synk_comm.spawn(raw_nccl, n, args=(nbytes,), devices=list(range(n)))
    raw_s = max(raw)
    busbw = lambda s: 2 * (n - 1) / n * nbytes / s / 1e9  # noqa: E731
    results["all_reduce_256MB"] = {"synk_ms": ours * 1e3, "raw_nccl4py_ms": raw_s * 1e3,
                                   "synk_busbw": busbw(ours), "raw_busbw": busbw(raw_s)}
    print("\n## all_reduce of a 256 MB float32 shared variable\n")
    print("| | time (ms) | bus bandwidth (GB/s) |\n|---|---:|---:|")
    print(f"| synk.all_reduce | {ours * 1e3:.3f} | {busbw(ours):.1f} |")
    print(f"| raw nccl4py | {raw_s * 1e3:.3f} | {busbw(raw_s):.1f} |")
    print(f"| ratio | | {busbw(ours) / busbw(raw_s):.1%} |", flush=True)

    overhead, plain = call_overhead(n)
    results["tiny_call_us"] = {"synk": overhead * 1e6, "plain_jax": plain * 1e6}
    print(f"\n## tiny call\n\nsynk {overhead * 1e6:.1f} us, plain PyTensor JAX {plain * 1e6:.1f} us, "
          f"overhead {(overhead - plain) * 1e6:.1f} us", flush=True)

    batches = [int(b) for b in os.environ.get("SYNK_BENCH_BATCHES", "2048,8192,16384").split(",")]
    table = {}
    for batch in batches:
        row = {}
        for k in sorted({1, n}):
            row[f"synk_{k}"] = synk_train_step(k, batch)
            row[f"ddp_{k}"] = ddp_step(k, batch)
        table[batch] = row
        print(f"batch {batch}: " + ", ".join(f"{key} {v * 1e3:.2f} ms" for key, v in row.items()), flush=True)
    results["train_step_s"] = table
    print(f"\n## training step (MLP {D}->{L}x{H}->{C}, float32, TF32 matmuls on both sides)\n")
    print(f"| global batch | ours 1 GPU | ours {n} GPUs | ours scaling | DDP 1 GPU | DDP {n} GPUs | DDP scaling |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch, row in table.items():
        print(f"| {batch} | {row['synk_1'] * 1e3:.2f} ms | {row[f'synk_{n}'] * 1e3:.2f} ms | "
              f"{row['synk_1'] / row[f'synk_{n}']:.2f}x | {row['ddp_1'] * 1e3:.2f} ms | "
              f"{row[f'ddp_{n}'] * 1e3:.2f} ms | {row['ddp_1'] / row[f'ddp_{n}']:.2f}x |")
    with open(os.path.join(OUT, "bench_gpu.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for key, style in [("synk_1", "o-"), (f"synk_{n}", "o-"), ("ddp_1", "s--"), (f"ddp_{n}", "s--")]:
            ax.plot(batches, [b / table[b][key] for b in batches], style, label=key.replace("_", ", ") + " GPU(s)")
        ax.set_xlabel("global batch")
        ax.set_ylabel("samples / s")
        ax.set_xscale("log", base=2)
        ax.set_title("MLP training throughput, 2x H200")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(OUT, "gpu_throughput.png"), dpi=120)
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
