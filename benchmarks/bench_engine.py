"""One GPU: the JAX engine with one rank against plain PyTensor JAX and the per-rank engine.

Each variant runs in a fresh interpreter (its own GPU memory peak), all in one run, ``REPS`` times
(best of them reported):

``plain``       PyTensor JAX, ``pytensor.function(..., mode="JAX")`` with the parameters on the
                GPU, the batch given as numpy (host -> GPU every step, as a Synkhronos call does)
``plain_dev``   the same with the batch already on the GPU (no host transfer: the floor)
``engine``      ``synk.fork(1, engine="jax")``: the step as one program in the one worker, the
                batch from a ``synk.data`` (``batch=``)
``engine_dev``  the same with the data set on the GPU in sliceable shared variables, the batch a
                ``batch_s`` window read inside the program (compare with ``plain_dev``)
``ranks``       ``synk.fork(1, use_gpu=True, engine="ranks")``: the per-rank engine (the master computes)
``tiny``        the tiny call alone, plain and engine side by side in one process (the master runs
                plain's function on the GPU between the engine's calls): blocks of calls alternate,
                so drift on a shared machine hits both sides alike; the medians of the blocks and of
                the paired differences (the figure of record for the tiny-call goal)

Measured: the benchmark MLP 1024 -> 4 x 4096 (tanh) -> 10, softmax cross-entropy, SGD, float32
(XLA's default precision: TF32 matmuls on Hopper), ms per step at batch 256 / 8192 / 16384 with
the loss read on the host every step; the peak GPU memory of the process that computes; a tiny
call (the sum of an 8-float vector from a ``synk.data``; plain: from numpy) in microseconds.

Goals (issue 17): engine within 3% of plain per step, peak <= 1.05x plain, tiny call <= plain + 100 us.

    python benchmarks/bench_engine.py              # one GPU: the table (about 2 minutes on one H100)
    python benchmarks/bench_engine.py --dry-run    # no GPU needed: small shapes on JAX's CPU device
    python benchmarks/bench_engine.py --reps 1 --variants plain,engine   # a quicker look

Without a GPU and without ``--dry-run`` it says so and exits 0 (``nox -s bench`` on a CPU machine).
Run from the repository root with the packages on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

VARIANTS = ("plain", "plain_dev", "engine", "engine_dev", "ranks", "tiny")
FULL = {"dims": [1024, 4096, 4096, 4096, 4096, 10], "batches": [256, 8192, 16384], "steps": 30, "tiny": 2000}
DRY = {"dims": [64, 128, 128, 10], "batches": [32, 64], "steps": 5, "tiny": 200}


# --- the model -------------------------------------------------------------------------------------

def init_params(dims: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    params = []
    for a, b in itertools.pairwise(dims):
        params += [(rng.standard_normal((a, b)) / np.sqrt(a)).astype("float32"), np.zeros(b, "float32")]
    return params


def loss_of(x: Any, y: Any, params: list[Any]) -> Any:
    import pytensor.tensor as pt

    h = x
    n_layers = len(params) // 2
    for i in range(n_layers):
        h = h.dot(params[2 * i]) + params[2 * i + 1]
        if i < n_layers - 1:
            h = pt.tanh(h)
    logp = pt.special.log_softmax(h, axis=1)
    return -pt.mean(logp[pt.arange(y.shape[0]), y])


def sgd(loss: Any, params: list[Any]) -> list[tuple[Any, Any]]:
    import pytensor

    return [(p, p - np.float32(1e-3) * g) for p, g in zip(params, pytensor.grad(loss, params))]


def batch_data(cfg: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    n = max(cfg["batches"])
    return (rng.standard_normal((n, cfg["dims"][0])).astype("float32"),
            rng.integers(0, cfg["dims"][-1], n).astype("int32"))


def timed(step: Any, steps: int) -> float:
    """Milliseconds per call of ``step`` (5 calls to warm up)."""
    for _ in range(5):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps * 1e3


def tiny_us(call: Any, n: int) -> float:
    for _ in range(n // 10):
        call()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n * 1e6


def local_peak() -> int:
    import jax

    return int((jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0))


# --- the variants (each in its own interpreter) --------------------------------------------------------

def run_plain(cfg: dict[str, Any], on_device: bool) -> dict[str, float]:
    import jax
    import pytensor
    import pytensor.tensor as pt

    shared = [pytensor.shared(p) for p in init_params(cfg["dims"])]
    dev = jax.devices()[0]
    for s in shared:
        s.container.storage[0] = jax.device_put(s.get_value(), dev)
    x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
    loss = loss_of(x, y, shared)
    f = pytensor.function([x, y], loss, updates=sgd(loss, shared), mode="JAX")
    f.trust_input = True
    xs, ys = batch_data(cfg)
    out: dict[str, float] = {}
    for b in cfg["batches"]:
        xb, yb = (jax.device_put(xs[:b], dev), jax.device_put(ys[:b], dev)) if on_device else (xs[:b], ys[:b])
        out[str(b)] = timed(lambda xb=xb, yb=yb: np.asarray(f(xb, yb)), cfg["steps"])
    out["peak_GiB"] = local_peak() / 2**30
    v = pt.vector("v", dtype="float32")
    g = pytensor.function([v], pt.sum(v), mode="JAX")
    a = np.ones(8, "float32")
    out["tiny_us"] = tiny_us(lambda: np.asarray(g(a)), cfg["tiny"])
    return out


def run_synk(cfg: dict[str, Any], engine: str, use_gpu: bool, on_device: bool = False) -> dict[str, float]:
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    synk.fork(1, use_gpu=use_gpu, engine=engine)
    shared = [pytensor.shared(p) for p in init_params(cfg["dims"])]
    xs, ys = batch_data(cfg)
    out: dict[str, float] = {}
    if on_device:  # the data set in GPU memory, each batch a window of it
        xv, yv = pytensor.shared(xs, name="X"), pytensor.shared(ys, name="Y")
        loss = loss_of(xv, yv, shared)
        f = synk.function([], outputs=loss, updates=sgd(loss, shared), sliceable_shareds=[xv, yv])
        for b in cfg["batches"]:
            out[str(b)] = timed(lambda b=b: f(batch_s=slice(0, b)), cfg["steps"])
    else:
        x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
        loss = loss_of(x, y, shared)
        f = synk.function([x, y], outputs=loss, updates=sgd(loss, shared))
        xd, yd = synk.data(xs), synk.data(ys)
        for b in cfg["batches"]:
            out[str(b)] = timed(lambda b=b: f(xd, yd, batch=b), cfg["steps"])
    if engine == "jax":
        from synkhronos.engine.master import device_memory

        out["peak_GiB"] = device_memory()[0]["peak_bytes_in_use"] / 2**30
    else:
        out["peak_GiB"] = local_peak() / 2**30
    v = pt.vector("v", dtype="float32")
    g = synk.function([v], outputs=pt.sum(v))
    a = synk.data(np.ones(8, "float32"))
    out["tiny_us"] = tiny_us(lambda: g(a), cfg["tiny"])
    synk.close()
    return out


def run_tiny(cfg: dict[str, Any]) -> dict[str, Any]:
    """The tiny call of plain PyTensor JAX and of the engine, in blocks that alternate in one process."""
    import jax
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    synk.fork(1, engine="jax")
    v = pt.vector("v", dtype="float32")
    g = synk.function([v], outputs=pt.sum(v))
    data = synk.data(np.ones(8, "float32"))
    plain = pytensor.function([v], pt.sum(v), mode="JAX")
    a = np.ones(8, "float32")
    sides = {"plain": lambda: np.asarray(plain(a)), "engine": lambda: g(data)}
    block = max(cfg["tiny"] // 10, 10)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for rep in range(16):  # the first round warms up
        for name, call in sides.items():
            t0 = time.perf_counter()
            for _ in range(block):
                call()
            if rep:
                times[name].append((time.perf_counter() - t0) / block * 1e6)
    synk.close()
    diffs = [e - p for e, p in zip(times["engine"], times["plain"])]
    return {"plain_us": float(np.median(times["plain"])), "engine_us": float(np.median(times["engine"])),
            "diff_us": float(np.median(diffs)), "plain_device": jax.devices()[0].platform}


def run_variant(name: str, cfg: dict[str, Any], dry: bool) -> dict[str, Any]:
    if name == "tiny":
        return run_tiny(cfg)
    if name in ("plain", "plain_dev"):
        return run_plain(cfg, on_device=name == "plain_dev")
    return run_synk(cfg, "ranks" if name == "ranks" else "jax", use_gpu=True, on_device=name == "engine_dev")


# --- the driver ------------------------------------------------------------------------------------

def has_gpu() -> bool:
    return os.path.isdir("/proc/driver/nvidia/gpus") and bool(os.listdir("/proc/driver/nvidia/gpus"))


def child_env(dry: bool) -> dict[str, str]:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    if dry:  # GPU mode's code on JAX's CPU device (synkhronos.emulation)
        env.update(SYNK_EMULATE_GPUS="1", JAX_PLATFORMS="cpu")
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="small shapes on JAX's CPU device (no GPU needed)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=int(os.environ.get("REPS", 2)))
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated variants to run (default: all)")
    args = parser.parse_args()
    cfg = DRY if args.dry_run else FULL
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args.variant, cfg, args.dry_run)), flush=True)
        return
    if not args.dry_run and not has_gpu():
        print("bench_engine: no GPU on this machine; skipped (--dry-run runs small shapes on the CPU)")
        return
    results: dict[str, list[dict[str, float]]] = {}
    t0 = time.perf_counter()
    for rep in range(args.reps):
        for name in args.variants.split(","):
            cmd = [sys.executable, __file__, "--variant", name] + (["--dry-run"] if args.dry_run else [])
            proc = subprocess.run(cmd, env=child_env(args.dry_run), capture_output=True, text=True, timeout=400)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if not line:
                print(f"{name}: FAILED\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", flush=True)
                continue
            results.setdefault(name, []).append(json.loads(line[0][7:]))
            print(f"rep {rep} {name}: {results[name][-1]}", flush=True)
    report(results, cfg, time.perf_counter() - t0)


def report(results: dict[str, list[dict[str, Any]]], cfg: dict[str, Any], seconds: float) -> None:
    keys = [str(b) for b in cfg["batches"]] + ["peak_GiB", "tiny_us"]
    tiny = results.pop("tiny", [])
    best = {name: {k: min(r[k] for r in rs) for k in keys} for name, rs in results.items()}
    if best:
        _report_steps(best, keys, results, cfg, seconds)
    for r in tiny:
        print(f"\ntiny call side by side in one process (plain on {r['plain_device']}): plain {r['plain_us']:.1f} us, "
              f"engine {r['engine_us']:.1f} us, median paired difference +{r['diff_us']:.1f} us (goal <= +100)")


def _report_steps(best: dict[str, dict[str, float]], keys: list[str], results: dict[str, list[dict[str, Any]]],
                  cfg: dict[str, Any], seconds: float) -> None:
    print(f"\nbest of {max(len(r) for r in results.values())} (ms per step at batch "
          f"{' / '.join(map(str, cfg['batches']))}; peak GiB; tiny call us), {seconds:.0f} s in all")
    print("| variant | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, row in best.items():
        print(f"| {name} | " + " | ".join(f"{row[k]:.3f}" for k in keys) + " |")
    for ours, theirs in (("engine", "plain"), ("engine_dev", "plain_dev")):
        if ours in best and theirs in best:
            p, e = best[theirs], best[ours]
            steps = " / ".join(f"{e[str(b)] / p[str(b)]:.3f}" for b in cfg["batches"])
            peak = e["peak_GiB"] / p["peak_GiB"] if p["peak_GiB"] else float("nan")
            print(f"\n{ours} / {theirs}: step {steps} (goal <= 1.03); peak {peak:.2f}x (goal <= 1.05); "
                  f"tiny call +{e['tiny_us'] - p['tiny_us']:.0f} us (goal <= +100)")


if __name__ == "__main__":
    main()
