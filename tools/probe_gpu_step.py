"""The data-parallel training step on every GPU against JAX's own floor, under XLA flag variants.

``bench_gpu.py``'s MLP step (1024 -> 4 x 4096 -> 10, SGD, loss read every step) three ways, side
by side in one run:

``raw``   hand-written JAX, no PyTensor and no Synkhronos: one process per GPU joined by
          ``jax.distributed``, ``shard_map`` over the ranks, ``psum`` of each gradient, the
          parameters donated -- the floor of the engine's design;
``synk``  ``synk_lasagne.make_train_function`` on the JAX engine (``bench_gpu.synk_train_steps``);
``ddp``   PyTorch DDP (``bench_gpu.ddp_steps``), when torch is installed.

Each runs on one GPU and on two, the two-GPU rows once per XLA flag variant (:data:`VARIANTS`:
the engine's flags are ``ours``; ``SYNK_XLA_FLAGS`` carries a variant to the engine's workers).
``--phases`` then profiles the engine's step per rank (``SYNK_PROFILE_CALL``: where a step's host
time goes, medians in us).  Run on 2 GPUs (``gpu/run_device.sh``'s environment)::

    python tools/probe_gpu_step.py [--batches 8192,16384] [--variants ours,none] [--only raw,synk,ddp]
    python tools/probe_gpu_step.py --phases
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_gpu import WIDTHS, C, D, L, ddp_steps, in_child, synk_train_steps, synk_training

LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"
VARIANTS = {
    "none": "",
    "lhs": LHS,
    "ours": LHS + " --xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "lhs_c8m": LHS + " --xla_gpu_all_reduce_combine_threshold_bytes=8388608",
    "lhs_c32m_prio": LHS + " --xla_gpu_all_reduce_combine_threshold_bytes=33554432"
                           " --xla_gpu_enable_highest_priority_async_stream=true",
}


def raw_rank(pid: int, port: int, n: int, flags: str, batches: list[int]) -> dict[str, float]:
    """One process of the raw JAX step: ms per step for each global batch, and its dispatch (us)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(pid)
    os.environ["XLA_FLAGS"] = flags
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if n > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid, local_device_ids=[0])
    mesh = Mesh(np.array(jax.devices()), ("r",))
    dev = jax.local_devices()[0]
    rng = np.random.default_rng(0)
    pairs = list(itertools.pairwise(WIDTHS))
    host = [(rng.standard_normal(s) / np.sqrt(s[0])).astype("float32") for s in pairs]
    host += [np.zeros(b, "float32") for _, b in pairs]
    rep = NamedSharding(mesh, P())
    params = [jax.make_array_from_single_device_arrays(p.shape, rep, [jax.device_put(p, dev)]) for p in host]

    def loss_fn(ps: list, x: object, y: object) -> object:
        h = x
        for i, (w, b) in enumerate(zip(ps[:L + 1], ps[L + 1:])):
            h = h @ w + b
            h = jnp.tanh(h) if i < L else h
        return -jnp.mean(jax.nn.log_softmax(h, axis=1)[jnp.arange(y.shape[0]), y])

    def body(ps: list, x: object, y: object) -> tuple:
        loss, gs = jax.value_and_grad(loss_fn)(ps, x, y)
        gs = [jax.lax.psum(g, "r") / n for g in gs]
        return [p - 1e-3 * g for p, g in zip(ps, gs)], jax.lax.psum(loss, "r") / n

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("r"), P("r")), out_specs=(P(), P()),
                                 check_vma=False), donate_argnums=(0,))
    out: dict[str, float] = {}
    rows = NamedSharding(mesh, P("r"))
    for batch in batches:
        xs = jax.device_put(rng.standard_normal((batch // n, D)).astype("float32"), dev)
        ys = jax.device_put(rng.integers(0, C, batch // n).astype("int32"), dev)
        xg = jax.make_array_from_single_device_arrays((batch, D), rows, [xs])
        yg = jax.make_array_from_single_device_arrays((batch,), rows, [ys])
        for _ in range(5):
            params, loss = step(params, xg, yg)
            np.asarray(loss.addressable_data(0))
        t0, dispatch = time.perf_counter(), 0.0
        for _ in range(20):
            t1 = time.perf_counter()
            params, loss = step(params, xg, yg)
            dispatch += time.perf_counter() - t1
            np.asarray(loss.addressable_data(0))  # loss read every step, in every rank
        out[str(batch)] = (time.perf_counter() - t0) / 20 * 1e3
        out[f"dispatch_us_{batch}"] = dispatch / 20 * 1e6
    if n > 1:
        jax.distributed.shutdown()
    return out


def raw_steps(n: int, flags: str, batches: list[int]) -> dict[str, float]:
    """The raw step in ``n`` processes (one GPU each); the slowest rank's figures."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [json.dumps([p, port, n, flags, batches]) for p in range(n)]
    procs = [subprocess.Popen([sys.executable, __file__, "--raw-rank", a], stdout=subprocess.PIPE, text=True)
             for a in args]
    outs = [json.loads(p.communicate(timeout=300)[0].rsplit("RAW ", 1)[1]) for p in procs]
    return {k: max(o[k] for o in outs) for k in outs[0]}


def phases(n: int, batch: int) -> str:
    """The engine's step on ``n`` GPUs profiled per rank (in a child process of its own)."""
    prof = f"/tmp/synk_step_phases_{n}_{batch}"
    for f in glob.glob(prof + ".*"):
        os.remove(f)
    ms = in_child(_profiled_steps, (n, batch, prof), _devices())
    time.sleep(1)
    sides = {}
    for path in sorted(glob.glob(prof + ".*.json")):
        with open(path) as f:
            sides[path.rsplit(".", 2)[-2]] = json.load(f)
    return f"{n} GPU(s), batch {batch}: {ms:.2f} ms a step; " + "; ".join(
        f"{side}: " + ", ".join(f"{k} {v['median']:.0f}" for k, v in s.items()) for side, s in sides.items())


def _profiled_steps(n: int, batch: int, prof: str) -> float:
    os.environ["SYNK_PROFILE_CALL"] = prof  # before synkhronos is imported in this child
    import synkhronos as synk
    from synkhronos.engine.phases import PHASES

    train, _ = synk_training(n, batch)
    rows = slice(0, batch // n)
    for _ in range(10):
        train(batch_s=rows)
    t0 = time.perf_counter()
    for _ in range(40):
        train(batch_s=rows)
    ms = (time.perf_counter() - t0) / 40 * 1e3
    synk.close()
    if PHASES is not None:
        PHASES.dump()
    return ms


def _devices() -> list[str]:
    from synkhronos.gpu import visible_devices

    return visible_devices()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="8192,16384")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--only", default="raw,synk,ddp")
    ap.add_argument("--phases", action="store_true")
    ap.add_argument("--raw-rank", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.raw_rank:
        print("RAW", json.dumps(raw_rank(*json.loads(a.raw_rank))), flush=True)
        return
    batches = [int(b) for b in a.batches.split(",")]
    if a.phases:
        for n in (1, 2):
            for batch in batches:
                print(phases(n, batch), flush=True)
        return
    rows: dict[str, dict[str, float]] = {}
    only, variants = a.only.split(","), a.variants.split(",")
    if "raw" in only:
        rows["raw, 1 GPU"] = raw_steps(1, VARIANTS["ours"], batches)
        for key in variants:
            rows[f"raw, 2 GPUs, {key}"] = raw_steps(2, VARIANTS[key], batches)
    if "synk" in only:
        for n, keys in ((1, ["ours"]), (2, variants)):
            for key in keys:
                os.environ["SYNK_XLA_FLAGS"] = VARIANTS[key]
                r = in_child(synk_train_steps, (n, batches), _devices())
                rows[f"synk, {n} GPU(s), {key}"] = {str(b): r[b] * 1e3 for b in batches}
    if "ddp" in only:
        for n in (1, 2):
            r = ddp_steps(n, batches)
            rows[f"DDP, {n} GPU(s)"] = {str(b): r[b] * 1e3 for b in batches}
    print("\n| step (ms) | " + " | ".join(f"batch {b}" for b in batches) + " |\n|---|" + "---:|" * len(batches))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r[str(b)]:.2f}" for b in batches) + " |")
    print("\nraw dispatch (us): " + "; ".join(
        f"{name}: " + ", ".join(f"{r[f'dispatch_us_{b}']:.0f}" for b in batches)
        for name, r in rows.items() if name.startswith("raw")))


if __name__ == "__main__":
    main()
