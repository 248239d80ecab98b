"""Mixed precision: accuracy and memory of ResNet-50 under ``precision="bf16"``, and the gradient
all-reduce in bfloat16, each comparison side by side in one run (``gpu/run_device.sh precision2``).

``--part resnet`` (one GPU): synk_lasagne's training step of ResNet-50 (:func:`bench_resnet.network`:
batch norm with batch statistics, softmax cross-entropy, SGD with momentum 0.9) on 1 rank, ``--steps``
steps (default 200) at batch ``--batch`` (default 128), the same initial parameters and data under each
policy: ``"highest"`` (strict float32, row ``fp32``), ``"default"`` (TF32 on Hopper, ``tf32``) and
``"bf16"``; and ``fp32ulp``: strict float32 again, each initial parameter moved by one float32 ulp (the
protocol's floor: how far two runs drift apart that differ by the smallest change float32 can make,
nothing a precision policy decides).  The data are synthetic and learnable (:func:`teacher_batch`): a
new batch every step (scattered into the GPU), normal noise at a quarter of the resolution, upsampled,
each image labelled by a fixed random linear function of it (``--teacher-classes`` classes of the
network's 1000): the loss falls (the network first learns which classes occur, then the function)
without the network memorising a few batches, whose curve would depend on chance more than on the
precision.  Each row runs in a fresh process (its own GPU memory statistics), all at once.
Prints

* the loss curves side by side (every 10th step) and the relative difference of each curve to the
  strict float32 one: ``sum|l - l_fp32| / sum|l_fp32|`` over the steps (the goal: <= 2% for bf16;
  PASS/FAIL), with the largest per-step difference, the largest of 10-step means and that of the last
  20 steps' means (``fp32ulp``'s and TF32's differences, of runs that differ from strict float32 by a
  rounding of the start or of the products only, show how far two trajectories drift apart by chance);
* the GPU memory of each step: the worker's ``peak_bytes_in_use`` and ``bytes_in_use`` after the
  steps (:func:`synkhronos.engine.master.device_memory`; the goal: bf16's peak no more than
  float32's and TF32's; PASS/FAIL), and the seconds per step (the loss read every step).

``--part allreduce`` (every GPU, 2 or more): the benchmark MLP's step (:mod:`bench_gpu`'s DDP
anchor MLP, SGD) with the gradient all-reduced in float32 and in bfloat16
(``make_train_function(all_reduce_dtype="bfloat16")``), under ``precision="default"`` and
``"bf16"``, from the same parameters on the same data: seconds per step at each global batch, the
losses' largest relative difference over the steps and the parameters' relative difference at the
end (the accuracy effect); then PyTorch DDP with and without ``bf16_compress_hook`` (autocast
under bf16) on the same shapes.

Prints markdown tables and writes ``$OUT/bench_precision_<part>.json``.  ``--dry-run``: the same
code on CPU ranks (a ResNet-10 of width 8 on 32x32 images, 6 steps; the MLP 64 wide), no figures.

    python benchmarks/bench_precision.py --part resnet
    python benchmarks/bench_precision.py --part allreduce
    python benchmarks/bench_precision.py --part resnet --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from typing import Any

import numpy as np
from bench_gpu import _child, gpu_name, gpus_visible

OUT = os.environ.get("OUT", "/tmp")
POLICIES = {"fp32": "highest", "fp32ulp": "highest", "tf32": "default", "bf16": "bf16"}
"""The rows of the ResNet part: our names -> the precision policy (:mod:`synkhronos.precision`)."""
ULP_ROWS = ("fp32ulp",)
"""Rows whose initial parameters are each moved by one float32 ulp, up or down at random (seed 0): the
strict float32 run again from a start that differs by the smallest float32 change (the protocol's
floor: how far two trajectories that differ by nothing a precision decides drift apart)."""
LOSS_GOAL = 0.02
"""bf16's loss curve within 2% of strict float32's (relative L1 difference over the steps)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--part", choices=["resnet", "allreduce"], required=True)
    parser.add_argument("--steps", type=int, default=200, help="resnet: training steps per policy")
    parser.add_argument("--batch", type=int, default=128, help="resnet: images per step")
    parser.add_argument("--teacher-classes", type=int, default=10, help="resnet: classes the data's labels take")
    parser.add_argument("--lr", type=float, default=0.01, help="resnet: SGD learning rate (momentum 0.9)")
    parser.add_argument("--precisions", default="fp32,fp32ulp,tf32,bf16", help="resnet: rows, comma-separated")
    parser.add_argument("--gpu", default="0", help="resnet: the GPU (a CUDA_VISIBLE_DEVICES entry) of its rows")
    parser.add_argument("--batches", default="2048,16384", help="allreduce: global batches, comma-separated")
    parser.add_argument("--timed", type=int, default=20, help="allreduce: timed steps per batch (after 5)")
    parser.add_argument("--timeout", type=float, default=420, help="seconds a row's process may take")
    parser.add_argument("--dry-run", action="store_true", help="tiny models on CPU ranks: checks the code")
    args = parser.parse_args(argv)
    args.depth, args.width, args.image_size, args.classes = 50, 64, 224, 1000
    args.widths = [1024, 4096, 4096, 4096, 4096, 10]
    if args.dry_run:
        args.steps, args.batch, args.timed = 6, 4, 2
        args.depth, args.width, args.image_size, args.classes = 10, 8, 32, 10
        args.widths = [32, 64, 64, 10]
        args.batches = "16,32"
    args.precision_list = [p for p in args.precisions.split(",") if p]
    if set(args.precision_list) - set(POLICIES) or "fp32" not in args.precision_list:
        parser.error(f"--precisions: some of {sorted(POLICIES)}, fp32 among them (the reference)")
    args.batch_list = [int(b) for b in args.batches.split(",")]
    return args


def in_children(jobs: dict[str, tuple[Any, tuple]], devices: list[str], timeout: float) -> dict[str, Any]:
    """Every ``target(*args)`` of ``jobs`` in a fresh interpreter of its own that sees ``devices``,
    all at once (each its own GPU memory statistics; no preallocation, so they share the GPU)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    running = {}
    with gpus_visible(devices):
        for name, (target, args) in jobs.items():
            q = ctx.Queue()
            p = ctx.Process(target=_child, args=(target, args, q))
            p.start()
            running[name] = (p, q)
    results, deadline = {}, time.monotonic() + timeout
    for name, (p, q) in running.items():
        while True:
            try:
                ok, result = q.get(timeout=1.0)
                break
            except queue.Empty:
                if not p.is_alive():
                    ok, result = False, f"died (exit code {p.exitcode}) before returning a result"
                    break
                if time.monotonic() > deadline:
                    p.kill()
                    ok, result = False, f"returned nothing in {timeout:.0f} s"
                    break
        p.join(timeout=30)
        if ok:
            results[name] = result
        else:
            print(f"{name}: FAILED\n{result}", flush=True)
    return results


def use_gpu(args: argparse.Namespace) -> bool:
    return not args.dry_run


# --- ResNet-50: loss curves and memory ------------------------------------------------------------

def teacher_batch(args: argparse.Namespace, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s batch: normal noise at a quarter of the image size, upsampled 4x (nearest), each
    image's label the argmax of a fixed random linear map of the noise to ``--teacher-classes``
    classes (the same map, seed 0, at every step and in every process; the noise seeded by the step)."""
    small = max(1, args.image_size // 4)
    teacher = np.random.default_rng(0).standard_normal((3 * small * small, args.teacher_classes)).astype(np.float32)
    noise = np.random.default_rng(1000 + step).standard_normal((args.batch, 3, small, small), dtype=np.float32)
    labels = np.argmax(noise.reshape(args.batch, -1) @ teacher, axis=1).astype(np.int32)
    images = np.repeat(np.repeat(noise, 4, axis=2), 4, axis=3)[:, :, :args.image_size, :args.image_size]
    return np.ascontiguousarray(images), labels


def perturbed_by_one_ulp(params: list[Any]) -> None:
    """Each value of each parameter moved to its float32 neighbour above or below (at random, seed 0)."""
    rng = np.random.default_rng(0)
    for p in params:
        value = np.asarray(p.get_value(), np.float32)
        toward = np.where(rng.random(value.shape) < 0.5, -np.inf, np.inf).astype(np.float32)
        p.set_value(np.nextafter(value, toward).astype(np.float32))


def resnet_run(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """The ResNet step on 1 rank as row ``name`` (its policy, ``ULP_ROWS``: from perturbed initial
    parameters): its losses, seconds per step and device memory."""
    import pytensor
    from bench_resnet import network, quiet

    import synkhronos as synk
    from synk_lasagne import make_train_function, updates
    from synkhronos.engine.master import device_memory

    quiet()
    pytensor.config.floatX = "float32"
    synk.fork(1, use_gpu=use_gpu(args))
    try:
        size = args.image_size
        xs = pytensor.shared(np.zeros((0, 3, size, size), "float32"), name="xs", shape=(None, 3, size, size))
        ys = pytensor.shared(np.zeros(0, "int32"), name="ys")
        loss, params, _ = network(args, xs, ys)  # the same initial parameters under every policy (seed 0)
        policy = POLICIES[name]
        if name in ULP_ROWS:
            perturbed_by_one_ulp(params)
        train = make_train_function(loss, params, [], updates.momentum, sliceable_shareds=[xs, ys],
                                    learning_rate=np.float32(args.lr), momentum=np.float32(0.9), precision=policy)
        losses, times = [], []
        for i in range(args.steps):
            synk.scatter([xs, ys], list(teacher_batch(args, i)))
            t0 = time.perf_counter()
            out = train()
            losses.append(float(np.asarray(out).ravel()[0]))  # the loss read every step
            times.append(time.perf_counter() - t0)
            if i == 0:
                print(f"{name} ({policy}): first step (compilation) {times[0]:.1f} s", flush=True)
        memory = device_memory()[0] if use_gpu(args) else {"peak_bytes_in_use": 0, "bytes_in_use": 0}
        return {"losses": losses, "seconds_per_step": float(np.median(times[5:] or times)), **memory}
    finally:
        synk.close()


def curve_difference(losses: list[float], reference: list[float]) -> dict[str, float]:
    """Relative differences of a loss curve to ``reference``: over the whole curve (L1), the largest
    per step, and of the last 20 steps' means."""
    a, b = np.asarray(losses, np.float64), np.asarray(reference, np.float64)
    tail, window = min(20, len(a)), min(10, len(a))
    cut = len(a) // window * window
    means_a, means_b = a[:cut].reshape(-1, window).mean(axis=1), b[:cut].reshape(-1, window).mean(axis=1)
    return {"l1": float(np.abs(a - b).sum() / np.abs(b).sum()),
            "max_step": float(np.max(np.abs(a - b) / np.abs(b))),
            "max_window10": float(np.max(np.abs(means_a - means_b) / np.abs(means_b))),
            "last20": float(abs(a[-tail:].mean() - b[-tail:].mean()) / abs(b[-tail:].mean()))}


def resnet_part(args: argparse.Namespace) -> dict[str, Any]:
    devices = [] if args.dry_run else [args.gpu]
    jobs = {name: (resnet_run, (args, name)) for name in args.precision_list}
    t0 = time.perf_counter()
    runs = in_children(jobs, devices, args.timeout)
    print(f"\nall policies in {time.perf_counter() - t0:.0f} s (run at once, one process each)\n", flush=True)
    names = [n for n in args.precision_list if n in runs]
    result: dict[str, Any] = {"runs": runs, "differences": {}, "pass": {}}
    if "fp32" not in runs:
        print("no strict float32 run: nothing to compare")
        return result
    ref = runs["fp32"]["losses"]
    print(f"## ResNet-{args.depth} loss, batch {args.batch}, a new synthetic batch every step ({args.teacher_classes} "
          f"classes, labels a fixed linear function of the images), SGD lr {args.lr} momentum 0.9, same initial "
          "parameters and data\n")
    print("| step | " + " | ".join(names) + " | " + " | ".join(f"{n} vs fp32" for n in names if n != "fp32") + " |")
    print("|" + "---:|" * (1 + 2 * len(names) - 1))
    for i in sorted({*range(0, args.steps, 10 if args.steps >= 20 else 1), args.steps - 1}):
        cells = [f"{runs[n]['losses'][i]:.4f}" for n in names]
        diffs = [f"{(runs[n]['losses'][i] - ref[i]) / abs(ref[i]):+.2%}" for n in names if n != "fp32"]
        print(f"| {i} | " + " | ".join(cells + diffs) + " |")
    print()
    for n in names:
        if n == "fp32":
            continue
        d = result["differences"][n] = curve_difference(runs[n]["losses"], ref)
        ok = d["l1"] <= LOSS_GOAL
        if n == "bf16":
            result["pass"][f"loss {n}"] = ok
        print(f"{n} vs fp32 over {args.steps} steps: relative difference of the curves {d['l1']:.2%} (largest "
              f"step {d['max_step']:.2%}, largest of 10-step means {d['max_window10']:.2%}, last 20 steps' means "
              f"{d['last20']:.2%}): "
              + (f"{'PASS' if ok else 'FAIL'} (goal <= {LOSS_GOAL:.0%})" if n == "bf16" else
                 f"a reference (the goal of {LOSS_GOAL:.0%} is bf16's)"))
    print(f"\n## GPU memory of the step (worker's device, after {args.steps} steps), batch {args.batch}\n")
    print("| policy | peak GiB | in use GiB | peak vs fp32 | s/step (loss read every step, data scattered before) |")
    print("|---|---:|---:|---:|---:|")
    gib = 2.0 ** 30
    for n in names:
        r = runs[n]
        ratio = r["peak_bytes_in_use"] / runs["fp32"]["peak_bytes_in_use"] if runs["fp32"]["peak_bytes_in_use"] else 0
        print(f"| {n} ({POLICIES[n]}) | {r['peak_bytes_in_use'] / gib:.2f} | {r['bytes_in_use'] / gib:.2f} | "
              f"{ratio:.2f} | {r['seconds_per_step']:.4f} |")
    if "bf16" in runs:
        peak = runs["bf16"]["peak_bytes_in_use"]
        others = {n: runs[n]["peak_bytes_in_use"] for n in names if n != "bf16"}
        ok = all(peak <= v for v in others.values())
        result["pass"]["memory bf16"] = ok
        note = " (dry run: CPU devices keep no statistics)" if args.dry_run else ""
        print(f"\nbf16 peak {peak / gib:.2f} GiB <= " + ", ".join(f"{n} {v / gib:.2f} GiB" for n, v in others.items())
              + f": {'PASS' if ok else 'FAIL'}{note}")
    return result


# --- the gradient all-reduce in bfloat16 -----------------------------------------------------------

def allreduce_run(args: argparse.Namespace, n: int, policy: str) -> dict[str, Any]:
    """The MLP step on ``n`` ranks under ``policy``, its gradient all-reduced in float32 and in
    bfloat16 (two networks from the same initial parameters, on the same scattered data)."""
    import pytensor
    from bench_resnet import quiet
    from models import mlp

    import synkhronos as synk
    from synk_lasagne import make_train_function, updates

    quiet()
    pytensor.config.floatX = "float32"
    synk.fork(n, use_gpu=use_gpu(args))
    try:
        width, classes, most = args.widths[0], args.widths[-1], max(args.batch_list)
        xs = pytensor.shared(np.zeros((0, width), "float32"), name="xs")
        ys = pytensor.shared(np.zeros(0, "int32"), name="ys")
        trains, params = {}, {}
        for wire in ("float32", "bfloat16"):
            loss, params[wire] = mlp(xs, ys, np.random.default_rng(0), args.widths)
            trains[wire] = make_train_function(loss, params[wire], [], updates.sgd, sliceable_shareds=[xs, ys],
                                               learning_rate=np.float32(1e-2), precision=policy,
                                               all_reduce_dtype=None if wire == "float32" else wire)
        rng = np.random.default_rng(1)
        synk.scatter([xs, ys], [synk.data(rng.standard_normal((most, width)).astype("float32")),
                                synk.data(rng.integers(0, classes, most).astype("int32"))])
        seconds: dict[str, dict[int, float]] = {w: {} for w in trains}
        losses: dict[str, list[float]] = {w: [] for w in trains}
        for batch in args.batch_list:
            rows = slice(0, batch // n)
            for wire, train in trains.items():
                for _ in range(5):
                    losses[wire].append(float(np.asarray(train(batch_s=rows)).ravel()[0]))
                t0 = time.perf_counter()
                for _ in range(args.timed):
                    losses[wire].append(float(np.asarray(train(batch_s=rows)).ravel()[0]))
                seconds[wire][batch] = (time.perf_counter() - t0) / args.timed
        a = [synk.get_value(0, p) for p in params["bfloat16"]]
        b = [synk.get_value(0, p) for p in params["float32"]]
        diff = float(np.sqrt(sum(np.sum((x - y) ** 2) for x, y in zip(a, b)) / sum(np.sum(y ** 2) for y in b)))
        la, lb = np.asarray(losses["bfloat16"]), np.asarray(losses["float32"])
        return {"seconds": seconds, "losses": losses, "param_rel_diff": diff,
                "loss_max_rel_diff": float(np.max(np.abs(la - lb) / np.abs(lb))),
                "dtypes": sorted({str(x.dtype) for x in a})}
    finally:
        synk.close()


def ddp_worker(rank: int, n: int, args: argparse.Namespace, amp: bool, hook: bool, path: str, q: Any) -> None:
    """PyTorch DDP's step of the same MLP (``hook``: ``bf16_compress_hook``), seconds per step."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="file://" + path, rank=rank, world_size=n)
    layers: list[Any] = []
    for i, (a, b) in enumerate(zip(args.widths[:-1], args.widths[1:])):
        layers += [nn.Linear(a, b), *([nn.Tanh()] if i < len(args.widths) - 2 else [])]
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers).cuda(), device_ids=[rank])
    if hook:
        model.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    lossf = nn.CrossEntropyLoss()
    times = {}
    for batch in args.batch_list:
        x = torch.randn(batch // n, args.widths[0], device="cuda")
        y = torch.randint(0, args.widths[-1], (batch // n,), device="cuda")

        def step(x: Any = x, y: Any = y) -> Any:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = lossf(model(x), y)
            loss.backward()
            opt.step()
            return loss

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.timed):
            step().item()  # as ours: the loss read every step
        times[batch] = (time.perf_counter() - t0) / args.timed
    dist.destroy_process_group()
    q.put(times)


def ddp_seconds(args: argparse.Namespace, n: int, amp: bool, hook: bool) -> dict[int, float]:
    import multiprocessing as mp

    from synkhronos.gpu import visible_devices

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = f"/tmp/ddp_precision_{os.getpid()}_{amp}_{hook}"
    with gpus_visible(visible_devices()[:n]):
        procs = [ctx.Process(target=ddp_worker, args=(r, n, args, amp, hook, path, q)) for r in range(n)]
        for p in procs:
            p.start()
    per_rank = [q.get(timeout=args.timeout) for _ in procs]
    for p in procs:
        p.join()
    return {b: max(t[b] for t in per_rank) for b in per_rank[0]}


def allreduce_part(args: argparse.Namespace) -> dict[str, Any]:
    from synkhronos.gpu import visible_devices

    devices = visible_devices()
    n = 2 if args.dry_run else len(devices)
    if n < 2:
        print("the all-reduce part needs 2 or more GPUs: skipped")
        return {}
    result: dict[str, Any] = {"gpus": n}
    for policy in ("default", "bf16"):
        run = allreduce_run(args, n, policy) if args.dry_run else \
            in_children({policy: (allreduce_run, (args, n, policy))}, devices, args.timeout).get(policy)
        if run is None:
            continue
        result[policy] = run
        if not args.dry_run:
            import torch  # noqa: F401  (DDP's rows need it; a missing torch fails here, after ours)

            run["ddp"] = {str(hook): ddp_seconds(args, n, policy == "bf16", hook) for hook in (False, True)}
    print(f"\n## MLP {'-'.join(map(str, args.widths))} step on {n} ranks, gradient all-reduced in float32 and "
          f"bfloat16 (ms per step, loss read every step)\n")
    print("| precision | global batch | synk f32 all-reduce | synk bf16 all-reduce | speedup | DDP | "
          "DDP bf16_compress_hook | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for policy in ("default", "bf16"):
        run = result.get(policy)
        if not run:
            continue
        for b in args.batch_list:
            f32, bf = run["seconds"]["float32"][b], run["seconds"]["bfloat16"][b]
            ddp = run.get("ddp", {})
            d0, d1 = ddp.get("False", {}).get(b), ddp.get("True", {}).get(b)
            dd = f"{d0 * 1e3:.2f} | {d1 * 1e3:.2f} | {d0 / d1:.2f}" if d0 and d1 else "- | - | -"
            print(f"| {policy} | {b} | {f32 * 1e3:.2f} | {bf * 1e3:.2f} | {f32 / bf:.2f} | {dd} |")
    for policy in ("default", "bf16"):
        run = result.get(policy)
        if run:
            steps = len(run["losses"]["float32"])
            print(f"\n{policy}: after {steps} steps from the same parameters, bf16 all-reduce against float32: "
                  f"parameters' relative difference {run['param_rel_diff']:.2e}, losses' largest relative "
                  f"difference {run['loss_max_rel_diff']:.2e}; parameters {', '.join(run['dtypes'])}")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run:
        from synkhronos.gpu import visible_devices

        if not visible_devices():
            print("no GPU visible: run with --dry-run to check the code on CPU")
            return 1
    machine = gpu_name() if not args.dry_run else "CPU (dry run: tiny models, the figures mean nothing)"
    print(f"bench_precision --part {args.part} on {machine}", flush=True)
    result = resnet_part(args) if args.part == "resnet" else allreduce_part(args)
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, f"bench_precision_{args.part}.json")
    with open(path, "w") as f:
        json.dump({"machine": machine, "args": {k: v for k, v in vars(args).items()}, **result}, f, indent=1,
                  default=str)
    print(f"\nfigures: {path}")
    return 0 if all(result.get("pass", {}).values()) or args.dry_run else 2


if __name__ == "__main__":
    sys.exit(main())
