"""ResNet-50 training throughput (images/s), side by side in one run, strict float32, TF32 and bf16.

Every row trains the same network on the same shapes: ResNet-50 of
:func:`synk_lasagne.models.build_resnet` (bottleneck blocks, batch norm with batch statistics,
224x224x3, 1000 classes), softmax cross-entropy, SGD with momentum 0.9, float32 data resident on
the GPU, ``--steps`` timed steps after ``--warmup``:

``plain PyTensor JAX``      the same PyTensor graph as one ``pytensor.function(mode="JAX")`` in one
                            process (gradient, momentum and batch-norm updates fused): what
                            PyTensor's JAX translation gives, without Synkhronos.  The loss is
                            read every step (as ours); ``(async)``: read once at the end.
``plain JAX NHWC``          the same network written by hand in JAX (:mod:`jax_resnet`): images NHWC,
                            one jitted step donating parameters, momenta and statistics; under
                            bf16 the policy by hand.  The row a JAX user who writes for speed gets.
``synk N rank(s)``          :func:`synk_lasagne.make_train_function` on N GPUs (one chained
                            command per step: gradient into one flat vector, NCCL all-reduce,
                            update), images scattered into the GPUs (``batch_s``), ``--batches``
                            images PER GPU (weak scaling, as the Synkhronos paper).
``torchvision NCHW`` / ``channels_last``
                            ``torchvision.models.resnet50``, cuDNN benchmark mode, loss ``.item()``
                            every step; ``(async)`` the anchor's loop (one synchronisation at the end).
``DDP N GPUs``              the same with DistributedDataParallel (channels_last), per-GPU batch.

Precisions: ``fp32`` strict float32 (``jax_default_matmul_precision=highest``;
``torch.backends.cudnn.allow_tf32 = False`` and ``torch.backends.cuda.matmul.allow_tf32 =
False``), ``tf32`` each framework's defaults (XLA: TF32 convolutions and matmuls on Hopper;
torch: TF32 cuDNN convolutions, float32 matmuls), ``bf16`` mixed precision: ours the policy
``precision="bf16"`` (:mod:`synkhronos.precision`: bfloat16 activations, products accumulating
in float32, reductions, parameters and optimizer state float32; plain PyTensor JAX compiled in
``precision.jax_mode("JAX", "bf16")``), torch ``torch.autocast("cuda", torch.bfloat16)`` (AMP),
and in bf16 one more torch row: ``channels_last compile``, AMP + channels_last + ``torch.compile``.

Anchors measured on one H100 (``shared/reference/resnet_anchor.py``, batch 64 / 128, defaults):
torchvision NCHW 1713 / 1802, channels_last 2204 / 2398, a plain-JAX ResNet-50 2399 / 2632.

Every configuration runs in a fresh process (its own GPU memory and JAX configuration).  Prints
markdown tables and writes ``$OUT/bench_resnet.json``.  ``--dry-run``: the same code on CPU
(a ResNet-10 of width 8 on 32x32 images, 2 steps, synk in CPU mode with 1 and 2 ranks) in a minute.

    python benchmarks/bench_resnet.py                         # every visible GPU: 1, 2, 4, 8
    python benchmarks/bench_resnet.py --gpus 1 --batches 64,128
    python benchmarks/bench_resnet.py --dry-run
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import warnings
from typing import Any

import numpy as np
from bench_gpu import gpu_counts, gpu_name, gpus_visible, in_child

OUT = os.environ.get("OUT", "/tmp")
PRECISIONS = {"fp32": "highest", "tf32": None, "bf16": None}
"""Our precision names -> ``jax_default_matmul_precision`` (None: XLA's default)."""
POLICIES = {"fp32": "default", "tf32": "default", "bf16": "bf16"}
"""Our precision names -> the Synkhronos precision policy (:mod:`synkhronos.precision`)."""
ANCHORS = {"torchvision NCHW": (1713, 1802), "torchvision channels_last": (2204, 2398),
           "plain JAX ResNet-50 (anchor)": (2399, 2632)}
"""images/s on one H100 at batch 64 / 128, each framework's default precision."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batches", default="64,128", help="images per GPU per step, comma-separated")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the clock starts")
    parser.add_argument("--depth", type=int, default=50)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--precisions", default="fp32,tf32", help="comma-separated: fp32 (strict), tf32, bf16")
    parser.add_argument("--gpus", type=int, default=None, help="largest GPU count of the scaling rows (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated rows to skip: plain, jax, synk, torch, ddp")
    parser.add_argument("--in-flight", type=int, default=0,
                        help="synk rows: beside the synchronous step, the step submitted (TrainFunction.submit, "
                             "pipelined on the JAX engine) with this many calls in flight, every step's loss read "
                             "through its future as it completes (0: the synchronous rows alone)")
    parser.add_argument("--dry-run", action="store_true", help="tiny network on CPU: checks the code, no figures")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.batches, args.steps, args.warmup = "4", 2, 1
        args.depth, args.width, args.image_size, args.classes = 10, 8, 32, 10
    args.batch_list = [int(b) for b in args.batches.split(",")]
    args.precision_list = [p for p in args.precisions.split(",") if p]
    unknown = set(args.precision_list) - set(PRECISIONS)
    if unknown:
        parser.error(f"unknown precisions {sorted(unknown)}: use fp32, tf32 and/or bf16")
    args.skip_set = {s for s in args.skip.split(",") if s}
    return args


def network(args: argparse.Namespace, x: Any, y: Any) -> tuple[Any, list[Any], list[tuple[Any, Any]]]:
    """(loss, trainable parameters, batch-norm state updates) of the ResNet on ``x``, ``y``."""
    import pytensor.tensor as pt

    from synk_lasagne import layers, objectives
    from synk_lasagne.models import build_resnet
    from synk_lasagne.random import set_rng

    set_rng(np.random.RandomState(0))
    net = build_resnet(args.depth, args.image_size, args.classes, args.width)
    probabilities = pt.special.softmax(layers.get_output(net, x), axis=-1)
    loss = objectives.aggregate(objectives.categorical_crossentropy(probabilities, y))
    return loss, layers.get_all_params(net, trainable=True), layers.get_state_updates(loss)


def random_batch(args: argparse.Namespace, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    size = args.image_size
    return (rng.standard_normal((n, 3, size, size), dtype=np.float32),
            rng.integers(0, args.classes, n).astype("int32"))


def timed(step: Any, warmup: int, steps: int, finish: Any = None) -> float:
    """Seconds per call of ``step`` after ``warmup`` calls (``finish()`` once before the clock
    stops, to wait for queued work)."""
    for _ in range(warmup):
        step()
    if finish is not None:
        finish()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if finish is not None:
        finish()
    return (time.perf_counter() - t0) / steps


def quiet() -> None:
    """JAX's notes about float64 constants truncated to float32 (x64 off), PyTensor's about
    asserts JAX cannot trace: expected here, not worth a line per compilation."""
    warnings.filterwarnings("ignore", message="Explicitly requested dtype")
    warnings.filterwarnings("ignore", message="Skipping Assert")


# --- plain PyTensor JAX, one process ----------------------------------------------------------------

def jax_available() -> bool:
    try:
        import jax  # noqa: F401
    except ImportError:
        return False
    return True


def momentum_step(args: argparse.Namespace) -> tuple[Any, Any, Any, list[Any], list[Any], list[Any], list[Any]]:
    """The plain step's graph in float32: ``(x, y, loss, params, velocities, updates, state)``, the
    updates SGD with momentum 0.9 and learning rate 0.01, ``state`` batch norm's updates."""
    import pytensor
    import pytensor.tensor as pt

    quiet()
    pytensor.config.floatX = "float32"
    x = pt.tensor4("x", shape=(None, 3, args.image_size, args.image_size))
    y = pt.ivector("y")
    loss, params, state = network(args, x, y)
    grads = pytensor.grad(loss, params)
    velocities = [pytensor.shared(np.zeros_like(p.get_value()), shape=p.type.shape) for p in params]
    updates = []
    for p, g, v in zip(params, grads, velocities):
        new_v = np.float32(0.9) * v - np.float32(0.01) * g
        updates += [(v, new_v), (p, p + new_v)]
    return x, y, loss, params, velocities, updates, state


def plain_worker(args: argparse.Namespace) -> dict[str, float]:
    """``{f"{precision} {batch}" and f"{precision} {batch} async": seconds per step}``: the fused
    PyTensor JAX step, each precision set at run time (jit retraces under a new precision).
    Without JAX (a dry run only): PyTensor's FAST_COMPILE mode, the same code otherwise."""
    import pytensor

    x, y, loss, params, velocities, updates, state = momentum_step(args)
    use_jax = jax_available()
    compiled: dict[str, Any] = {}

    def step_function(precision: str) -> Any:
        """The step compiled under ``precision``'s policy (one function per policy)."""
        policy = POLICIES[precision] if use_jax else "default"
        if policy not in compiled:
            from synkhronos import precision as precisions

            t0 = time.perf_counter()
            mode = precisions.jax_mode("JAX", policy) if use_jax else "FAST_COMPILE"
            fn = compiled[policy] = pytensor.function([x, y], loss, updates=updates + state, mode=mode)
            fn.trust_input = True
            print(f"plain PyTensor: compiled the graph ({policy}) in {time.perf_counter() - t0:.1f} s", flush=True)
        return compiled[policy]

    put: Any = np.asarray
    if use_jax:
        import jax

        device = jax.devices()[0]
        put = lambda a: jax.device_put(a, device)  # noqa: E731
        for var in [*params, *velocities, *(s for s, _ in state)]:
            var.container.storage[0] = put(var.get_value())
    times = {}
    for precision in args.precision_list:
        if use_jax:
            jax.config.update("jax_default_matmul_precision", PRECISIONS[precision])
        f = step_function(precision)
        for batch in args.batch_list:
            xb, yb = (put(a) for a in random_batch(args, batch))
            t0 = time.perf_counter()
            np.asarray(f(xb, yb))
            print(f"plain PyTensor {precision} batch {batch}: first call (compilation) "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            times[f"{precision} {batch}"], times[f"{precision} {batch} async"] = plain_times(f, xb, yb, args, use_jax)
    return times


def plain_times(f: Any, xb: Any, yb: Any, args: argparse.Namespace, use_jax: bool) -> tuple[float, float]:
    """Seconds per step of ``f(xb, yb)``: the loss read every step, then read once at the end."""
    synchronous = timed(lambda: np.asarray(f(xb, yb)), args.warmup, args.steps)
    out: list[Any] = []
    wait = (lambda: out and out[-1].block_until_ready()) if use_jax else None
    return synchronous, timed(lambda: out.append(f(xb, yb)), args.warmup, args.steps, finish=wait)


# --- plain JAX, written by hand ------------------------------------------------------------------

def jax_worker(args: argparse.Namespace) -> dict[str, float]:
    """``{f"{precision} {batch}" and f"{precision} {batch} async": seconds per step}`` of the
    hand-written JAX ResNet (:mod:`jax_resnet`), the images NHWC on the device."""
    import jax
    import jax_resnet

    times = {}
    for precision in args.precision_list:
        jax.config.update("jax_default_matmul_precision", PRECISIONS[precision])
        step, carry = jax_resnet.make_training(args.depth, args.width, args.classes, args.image_size,
                                               bf16=precision == "bf16")
        for batch in args.batch_list:
            x, y = random_batch(args, batch)
            xb, yb = jax.device_put(np.ascontiguousarray(x.transpose(0, 2, 3, 1))), jax.device_put(y)
            t0 = time.perf_counter()
            carry, loss = step(carry, xb, yb)
            float(loss)
            print(f"plain JAX {precision} batch {batch}: first call (compilation) {time.perf_counter() - t0:.1f} s",
                  flush=True)
            times[f"{precision} {batch}"], times[f"{precision} {batch} async"], carry = \
                jax_times(step, carry, xb, yb, args)
    return times


def jax_times(step: Any, carry: Any, xb: Any, yb: Any, args: argparse.Namespace) -> tuple[float, float, Any]:
    """Seconds per step of the hand-written ``step`` on ``(xb, yb)``: the loss read every step, then
    read once at the end; and the carry the last step returned (the others' are donated)."""
    box, losses = [carry], []

    def run() -> Any:
        box[0], loss = step(box[0], xb, yb)
        losses.append(loss)
        return loss

    synchronous = timed(lambda: float(run()), args.warmup, args.steps)
    losses.clear()
    return synchronous, timed(run, args.warmup, args.steps, finish=lambda: losses[-1].block_until_ready()), box[0]


# --- Synkhronos ---------------------------------------------------------------------------------

def synk_worker(args: argparse.Namespace, n: int, use_gpu: bool, policy: str = "default") -> dict[str, float]:
    """``{str(batch): seconds per step}`` of synk_lasagne's training function on ``n`` ranks under the
    precision ``policy`` (and ``JAX_DEFAULT_MATMUL_PRECISION`` in the environment of the workers), the
    loss read every step; with ``--in-flight``, also ``{f"{batch} submitted": ...}``, the steps
    submitted and every loss read through its future, up to ``in_flight`` steps late."""
    import pytensor

    import synkhronos as synk
    from synk_lasagne import make_train_function, updates

    quiet()
    pytensor.config.floatX = "float32"
    synk.fork(n, use_gpu=use_gpu, **({"max_in_flight": args.in_flight} if args.in_flight > 0 else {}))
    try:
        size = args.image_size
        xs = pytensor.shared(np.zeros((0, 3, size, size), "float32"), name="xs", shape=(None, 3, size, size))
        ys = pytensor.shared(np.zeros(0, "int32"), name="ys")
        loss, params, _ = network(args, xs, ys)  # make_train_function applies the state updates itself
        fkw = {} if use_gpu or policy != "default" else {"mode": "FAST_COMPILE"}  # a policy needs JAX
        train = make_train_function(loss, params, [], updates.momentum, sliceable_shareds=[xs, ys],
                                    learning_rate=np.float32(0.01), momentum=np.float32(0.9), function_kwargs=fkw,
                                    precision=policy)
        synk.scatter([xs, ys], list(random_batch(args, max(args.batch_list) * n)))
        times = {}
        for batch in args.batch_list:
            rows = slice(0, batch)
            t0 = time.perf_counter()
            train(batch_s=rows)
            print(f"synk {n} rank(s) batch {batch}: first step (compilation) {time.perf_counter() - t0:.1f} s",
                  flush=True)
            times[str(batch)] = timed(lambda rows=rows: float(train(batch_s=rows)), args.warmup, args.steps,
                                      finish=lambda: synk.get_value(0, params[-1]))
            if args.in_flight > 0:  # the loss of every step read when it completes, up to in_flight steps late
                pending: collections.deque[Any] = collections.deque()

                def step(rows: slice = rows, pending: collections.deque[Any] = pending) -> None:
                    pending.append(train.submit(batch_s=rows))
                    if len(pending) >= args.in_flight:
                        float(pending.popleft().result())

                def finish(pending: collections.deque[Any] = pending) -> None:
                    while pending:
                        float(pending.popleft().result())
                    synk.get_value(0, params[-1])

                times[f"{batch} submitted"] = timed(step, args.warmup, args.steps, finish=finish)
        return times
    finally:
        synk.close()


# --- torch ----------------------------------------------------------------------------------------

def torch_model(precision: str, channels_last: bool, device: str) -> tuple[Any, Any]:
    import torch
    import torchvision

    strict = precision == "fp32"
    torch.backends.cudnn.allow_tf32 = not strict
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=1000).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return torch, model


def torch_step(torch: Any, model: Any, batch: int, channels_last: bool, device: str, args: argparse.Namespace,
               amp: bool = False, compiled: Any = None) -> Any:
    """A closure of one SGD-momentum step of ``model`` on a random resident batch (``amp``: the forward
    pass and loss under ``torch.autocast`` bfloat16; ``compiled``: ``torch.compile(model)`` runs it)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, args.image_size, args.image_size, device=device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)
    lossf = torch.nn.CrossEntropyLoss()

    run = model if compiled is None else compiled

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            loss = lossf(run(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def torch_worker(args: argparse.Namespace, precision: str, device: str) -> dict[str, float]:
    """``{f"{layout} {batch}" and ... " async": seconds per step}`` of torchvision's resnet50."""
    times = {}
    amp = precision == "bf16"
    for layout in torch_layouts(precision, device):
        torch, model = torch_model(precision, layout != "NCHW", device)
        compiled = torch.compile(model) if layout.endswith("compile") else None
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for batch in args.batch_list:
            step = torch_step(torch, model, batch, layout != "NCHW", device, args, amp, compiled)
            times[f"{layout} {batch}"] = timed(lambda step=step: step().item(), args.warmup, args.steps)
            times[f"{layout} {batch} async"] = timed(step, args.warmup, args.steps, finish=sync)
    return times


def torch_layouts(precision: str, device: str) -> list[str]:
    """The torch rows of ``precision``: NCHW and channels_last; in bf16 on GPUs also channels_last with
    ``torch.compile`` (the fastest PyTorch recipe: AMP + channels_last + compile)."""
    compile_row = precision == "bf16" and device == "cuda"
    return ["NCHW", "channels_last", *(["channels_last compile"] if compile_row else [])]


def ddp_worker(rank: int, n: int, args: argparse.Namespace, precision: str, path: str, q: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="file://" + path, rank=rank, world_size=n)
    _, model = torch_model(precision, True, "cuda")
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    times = {}
    for batch in args.batch_list:
        step = torch_step(torch, model, batch, True, "cuda", args, precision == "bf16")
        times[str(batch)] = timed(lambda step=step: step().item(), args.warmup, args.steps)
    dist.destroy_process_group()
    q.put(times)


def ddp_steps(args: argparse.Namespace, n: int, precision: str, devices: list[str]) -> dict[str, float]:
    """Seconds per step of DDP on ``n`` GPUs (the slowest rank's)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = f"/tmp/ddp_resnet_{os.getpid()}_{n}_{precision}"
    with gpus_visible(devices[:n]), precision_env(precision):
        procs = [ctx.Process(target=ddp_worker, args=(r, n, args, precision, path, q)) for r in range(n)]
        for p in procs:
            p.start()
    per_rank = [q.get(timeout=400) for _ in procs]
    for p in procs:
        p.join()
    return {k: max(t[k] for t in per_rank) for k in per_rank[0]}


# --- the run --------------------------------------------------------------------------------------

class precision_env:
    """Processes started in the body run at ``precision`` (``JAX_DEFAULT_MATMUL_PRECISION``)."""

    def __init__(self, precision: str) -> None:
        self.value = PRECISIONS[precision]

    def __enter__(self) -> None:
        self.saved = os.environ.get("JAX_DEFAULT_MATMUL_PRECISION")
        if self.value is None:
            os.environ.pop("JAX_DEFAULT_MATMUL_PRECISION", None)
        else:
            os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = self.value

    def __exit__(self, *exc: Any) -> None:
        if self.saved is None:
            os.environ.pop("JAX_DEFAULT_MATMUL_PRECISION", None)
        else:
            os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = self.saved


def torch_available() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


def collect(args: argparse.Namespace, devices: list[str], use_gpu: bool) -> list[dict[str, Any]]:
    """Every configuration, each in a fresh process; one row per (configuration, batch)."""
    rows: list[dict[str, Any]] = []

    def add(name: str, precision: str, gpus: int, seconds: dict[str, float], key: str) -> None:
        for batch in args.batch_list:
            value = seconds.get(key.format(batch=batch))
            if value:
                rows.append({"name": f"{name} {precision}", "config": name, "precision": precision, "gpus": gpus,
                             "batch_per_gpu": batch, "images_per_s": batch * gpus / value})

    one = devices[:1]
    if "plain" not in args.skip_set:
        plain = in_child(plain_worker, (args,), one) if use_gpu else plain_worker(args)
        name = "plain PyTensor JAX" if use_gpu or jax_available() else "plain PyTensor FAST_COMPILE"
        for precision in args.precision_list:
            add(name, precision, 1, plain, precision + " {batch}")
            add(f"{name} (async)", precision, 1, plain, precision + " {batch} async")
    if "jax" not in args.skip_set and (use_gpu or jax_available()):
        seconds = in_child(jax_worker, (args,), one) if use_gpu else jax_worker(args)
        for precision in args.precision_list:
            add("plain JAX NHWC", precision, 1, seconds, precision + " {batch}")
            add("plain JAX NHWC (async)", precision, 1, seconds, precision + " {batch} async")
    counts = gpu_counts(len(devices)) if use_gpu else [2]  # a dry run: the 2-rank row checks the same code as 1
    for precision in args.precision_list:
        if "synk" not in args.skip_set:
            for n in counts:
                with precision_env(precision):
                    work = (args, n, use_gpu, POLICIES[precision])
                    seconds = in_child(synk_worker, work, devices) if use_gpu else synk_worker(*work)
                add(f"synk {n} rank{'s' if n > 1 else ''}", precision, n, seconds, "{batch}")
                if args.in_flight > 0:
                    add(f"synk {n} rank{'s' if n > 1 else ''} (submitted, {args.in_flight} in flight)", precision, n,
                        seconds, "{batch} submitted")
        if "torch" not in args.skip_set and torch_available():
            device = "cuda" if use_gpu else "cpu"
            seconds = in_child(torch_worker, (args, precision, device), one) if use_gpu else \
                torch_worker(args, precision, device)
            for layout in torch_layouts(precision, device):
                add(f"torchvision {layout}", precision, 1, seconds, layout + " {batch}")
                add(f"torchvision {layout} (async)", precision, 1, seconds, layout + " {batch} async")
        if "ddp" not in args.skip_set and use_gpu and torch_available():
            for n in counts[1:]:
                add(f"DDP {n} GPUs", precision, n, ddp_steps(args, n, precision, devices), "{batch}")
        print(f"{precision}: {len(rows)} rows so far", flush=True)
    return rows


def table(rows: list[dict[str, Any]], precision: str, batches: list[int]) -> str:
    """A markdown table of one precision: images/s per batch, and the ratios the goals name."""
    mine = [r for r in rows if r["precision"] == precision]
    by = {(r["config"], r["batch_per_gpu"]): r["images_per_s"] for r in mine}
    configs = list(dict.fromkeys(r["config"] for r in mine))
    head = ("| configuration | " + " | ".join(f"batch {b} img/s" for b in batches)
            + " | vs plain JAX | vs best torch | scaling |")
    lines = [head, "|" + "---|" * (len(batches) + 4)]
    for config in configs:
        cells, plain, torch_best, scaling = [], [], [], []
        for b in batches:
            value = by.get((config, b))
            cells.append(f"{value:.0f}" if value else "-")
            base = by.get(("plain PyTensor JAX", b))
            best = max((by.get((c, b)) or 0 for c in ("torchvision NCHW", "torchvision channels_last",
                                                        "torchvision channels_last compile")), default=0)
            gpus = next((r["gpus"] for r in mine if r["config"] == config), 1)
            one = by.get(("synk 1 rank", b)) if config.startswith("synk") else \
                by.get(("torchvision channels_last", b)) if config.startswith("DDP") else None
            if value and base:
                plain.append(f"{value / gpus / base:.3f}")
            if value and best:
                torch_best.append(f"{value / gpus / best:.2f}")
            if value and one and gpus > 1:
                scaling.append(f"{value / (gpus * one):.3f}")
        lines.append(f"| {config} {precision} | " + " | ".join(cells) + f" | {' / '.join(plain) or '-'} | "
                     f"{' / '.join(torch_best) or '-'} | {' / '.join(scaling) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_gpu = not args.dry_run
    if use_gpu:
        from synkhronos.gpu import visible_devices

        devices = visible_devices()
        if not devices:
            print("no GPU visible: run with --dry-run to check the code on CPU")
            return 1
        devices = devices[:args.gpus] if args.gpus else devices
        machine = f"{len(devices)}x {gpu_name()}"
    else:
        devices, machine = [], "CPU (dry run: tiny network, the figures mean nothing)"
    print(f"ResNet-{args.depth} (width {args.width}) {args.image_size}x{args.image_size}, batches per GPU "
          f"{args.batch_list}, {args.steps} timed steps after {args.warmup}, on {machine}", flush=True)
    t0 = time.perf_counter()
    rows = collect(args, devices, use_gpu)
    print(f"\nall runs in {time.perf_counter() - t0:.0f} s; images/s (ratios per GPU, batch by batch)\n")
    for precision in args.precision_list:
        print(table(rows, precision, args.batch_list) + "\n")
    print("anchors (one H100, default precisions, batch 64 / 128): " +
          ", ".join(f"{k} {a} / {b}" for k, (a, b) in ANCHORS.items()))
    path = os.path.join(OUT, "bench_resnet.json")
    with open(path, "w") as f:
        json.dump({"machine": machine, "args": {k: v for k, v in vars(args).items() if k != "skip_set"},
                   "rows": rows}, f, indent=1)
    print(f"figures: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
