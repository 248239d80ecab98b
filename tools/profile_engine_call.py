"""Where a JAX-engine call's time goes on one GPU, piece by piece.

Three parts, each in a fresh interpreter:

``micro``   JAX alone on the GPU: what each step of a call costs (a host array onto the device by
            ``jax.device_put`` and through a jitted identity, making the global operand, dispatching
            a ``jit(shard_map)`` program, reading its result back with and without
            ``copy_to_host_async``), and the bandwidth of a batch's host -> GPU copy (32 and 64 MiB)
            from pageable numpy memory, from a shared-memory segment, the same segment registered
            with the device (``client.dma_map``), and JAX's ``pinned_host`` memory.
``engine``  ``synk.fork(1, engine="jax")`` with ``SYNK_PROFILE_CALL`` set
            (:mod:`synkhronos.engine.phases`): the median time of each phase of a tiny call and of
            the benchmark MLP's step (batch 256 and 16384) in the master and in the worker, with
            the inputs' memory registered with the GPU and without (``SYNK_PIN_INPUTS=0``).
``plain``   the reference: plain PyTensor JAX's tiny call.
``--pymc``  instead of the above: GPU mode's call path as :mod:`synkhronos.pymc` uses it, in
            float64 -- a tiny call with its outputs (one row scattered, 21 parameters broadcast as
            ``synk.data``, two outputs reduced with ``sum``), then PyMC's ``logp_dlogp_function``
            of a one-row logistic regression inside ``data_parallel`` (``bench_pymc.make_model``).

    python tools/profile_engine_call.py            # on a machine with a GPU
    python tools/profile_engine_call.py --dry-run  # JAX's CPU device, small shapes
    python tools/profile_engine_call.py --pymc     # the PyMC evaluation's call path (float64)

Run from the repository root with the packages on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def us(fn: Any, n: int) -> float:
    """Mean microseconds per call of ``fn`` (a tenth of ``n`` calls first, to warm up)."""
    for _ in range(max(n // 10, 1)):
        fn()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n / 1e3


def micro(dry: bool) -> dict[str, float]:
    import jax
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    from synkhronos.engine.program import _shard_map

    dev = jax.devices()[0]
    n = 200 if dry else 2000
    out: dict[str, float] = {}
    a = np.ones(8, np.float32)
    ad = jax.device_put(a, dev)
    local = SingleDeviceSharding(dev)
    ident = jax.jit(lambda *xs: xs, out_shardings=local, donate_argnums=(0,))
    mesh = Mesh(np.array([dev]), ("ranks",))
    rows = NamedSharding(mesh, P("ranks"))
    sm = jax.jit(_shard_map()(lambda x: jax.lax.psum(x.sum(), "ranks"), mesh=mesh, in_specs=(P("ranks"),),
                              out_specs=P(), check_vma=False))
    g = jax.make_array_from_single_device_arrays((8,), rows, [ad])
    jf = jax.jit(lambda x: x.sum())
    out["device_put_8floats"] = us(lambda: jax.device_put(a, dev), n)
    out["jit_identity_8floats"] = us(lambda: ident(a), n)
    out["make_array"] = us(lambda: jax.make_array_from_single_device_arrays((8,), rows, [ad]), n)
    out["jit_dispatch"] = us(lambda: jf(ad), n)
    out["shard_map_dispatch"] = us(lambda: sm(g), n)
    out["shard_map_block"] = us(lambda: sm(g).block_until_ready(), n)
    out["shard_map_to_host"] = us(lambda: np.asarray(sm(g).addressable_data(0)), n)

    def async_host() -> Any:
        o = sm(g).addressable_data(0)
        o.copy_to_host_async()
        return np.asarray(o)

    out["shard_map_to_host_async"] = us(async_host, n)
    out["jit_numpy_roundtrip"] = us(lambda: np.asarray(jf(a)), n)
    from synk_shm import SharedArray

    small = SharedArray.create(8, np.float32)
    small.array[...] = 1
    out["jit_shm_roundtrip"] = us(lambda: np.asarray(jf(small.array)), n)
    try:
        dev.client.dma_map(int(small.array.__array_interface__["data"][0]), small.capacity)
        out["jit_shm_dma_mapped_roundtrip"] = us(lambda: np.asarray(jf(small.array)), n)
        dev.client.dma_unmap(int(small.array.__array_interface__["data"][0]))
    except Exception as exc:
        print(f"dma_map: {type(exc).__name__}: {exc}", flush=True)
    sm1 = jax.jit(_shard_map()(lambda x: jax.lax.psum(x.sum(), "ranks"), mesh=mesh, in_specs=(P("ranks"),),
                               out_specs=P(), check_vma=False))
    out["shard_map_numpy_roundtrip"] = us(lambda: np.asarray(sm1(a)), n)
    small.close()
    small.unlink()
    out["engine_like_roundtrip"] = us(lambda: np.asarray(sm(jax.make_array_from_single_device_arrays(
        (8,), rows, [ident(a)[0]])).addressable_data(0)), n)
    for mib in ([1] if dry else [32, 64]):
        out.update(h2d_rates(mib, 5 if dry else 20))
    return out


def h2d_rates(mib: int, reps: int) -> dict[str, float]:
    """GB/s of a ``mib`` MiB host -> GPU copy from each kind of host memory."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from synk_shm import SharedArray

    dev = jax.devices()[0]
    local = SingleDeviceSharding(dev)
    ident = jax.jit(lambda *xs: xs, out_shardings=local, donate_argnums=(0,))
    out: dict[str, float] = {}
    shape = (mib * 256, 1024)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)

    def rate(src: np.ndarray, put: Any = None) -> float:
        put = put or (lambda: jax.device_put(src, dev).block_until_ready())
        return src.nbytes / us(put, reps) / 1e3

    out[f"h2d_{mib}MiB_numpy_GBps"] = rate(x)
    seg = SharedArray.create(shape, np.float32)
    seg.array[...] = x
    out[f"h2d_{mib}MiB_shm_GBps"] = rate(seg.array)
    addr = int(seg.array.__array_interface__["data"][0])
    try:
        dev.client.dma_map(addr, seg.capacity)
        out[f"h2d_{mib}MiB_shm_dma_mapped_GBps"] = rate(seg.array)
        half = seg.array[shape[0] // 4: 3 * shape[0] // 4]  # a slice of rows inside the segment
        out[f"h2d_{mib}MiB_shm_dma_mapped_slice_GBps"] = rate(half)
        out[f"h2d_{mib}MiB_identity_dma_mapped_GBps"] = rate(
            seg.array, lambda: jax.block_until_ready(ident(seg.array)))
        dev.client.dma_unmap(addr)
    except Exception as exc:
        print(f"dma_map: {type(exc).__name__}: {exc}", flush=True)
    try:
        pinned = SingleDeviceSharding(dev, memory_kind="pinned_host")
        out[f"h2d_{mib}MiB_via_pinned_host_GBps"] = rate(
            x, lambda: jax.device_put(jax.device_put(x, pinned), local).block_until_ready())
        xp = jax.device_put(x, pinned)
        out[f"h2d_{mib}MiB_from_pinned_host_GBps"] = rate(x, lambda: jax.device_put(xp, local).block_until_ready())
    except Exception as exc:
        print(f"pinned_host: {type(exc).__name__}: {exc}", flush=True)
    seg.close()
    seg.unlink()
    return out


def plain(dry: bool) -> dict[str, float]:
    import pytensor
    import pytensor.tensor as pt

    v = pt.vector("v", dtype="float32")
    g = pytensor.function([v], pt.sum(v), mode="JAX")
    g.trust_input = True
    a = np.ones(8, "float32")
    return {"tiny_us": us(lambda: np.asarray(g(a)), 200 if dry else 2000)}


def engine(dry: bool, what: str) -> dict[str, Any]:
    """``what``: ``tiny`` or a batch size of the benchmark MLP's step (``first`` or ``last`` of the
    benchmark's batches)."""
    import pytensor
    import pytensor.tensor as pt
    from bench_engine import DRY, FULL, batch_data, init_params, loss_of, sgd

    import synkhronos as synk
    from synkhronos.engine.phases import PHASES

    assert PHASES is not None
    cfg = DRY if dry else FULL
    synk.fork(1, engine="jax")
    if what == "tiny64":  # the likelihood's shape of call
        rows, theta = pt.dvector("rows"), pt.dvector("theta")
        g = synk.function([rows], bcast_inputs=[theta], outputs=[(pt.sum(rows * theta[0]), "sum"),
                                                                 (theta * pt.sum(rows), "sum")])
        r, t = synk.data(np.ones(1)), synk.data(np.full(21, 0.01))
        result = us(lambda: g(r, t), 200 if dry else 3000)
    elif what == "pymc":
        from bench_pymc import make_model

        from synkhronos.pymc import data_parallel

        model = make_model(1, 20)
        with data_parallel(model):
            fn = model.logp_dlogp_function(ravel_inputs=True)
            q = np.full(21, 0.01)
            result = us(lambda: fn(q), 200 if dry else 2000)
    elif what == "tiny":
        v = pt.vector("v", dtype="float32")
        g = synk.function([v], outputs=pt.sum(v))
        a = synk.data(np.ones(8, "float32"))
        result = us(lambda: g(a), 200 if dry else 3000)
    else:
        b = cfg["batches"][0 if what == "first" else -1]
        shared = [pytensor.shared(p) for p in init_params(cfg["dims"])]
        x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
        loss = loss_of(x, y, shared)
        f = synk.function([x, y], outputs=loss, updates=sgd(loss, shared))
        xs, ys = batch_data(cfg)
        xd, yd = synk.data(xs), synk.data(ys)
        result = us(lambda: f(xd, yd, batch=b), 10 if dry else 100)
    out = {"us": result, "master": PHASES.summary()}
    synk.close()
    return out


def run_part(part: str, env: dict[str, str], dry: bool, what: str = "") -> Any:
    cmd = [sys.executable, __file__, "--part", part, "--what", what] + (["--dry-run"] if dry else [])
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=400)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        print(f"{part} {env}: FAILED\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", flush=True)
        return None
    return json.loads(lines[0][7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--part", choices=("micro", "plain", "engine"), help=argparse.SUPPRESS)
    parser.add_argument("--what", default="", help=argparse.SUPPRESS)
    parser.add_argument("--pymc", action="store_true", help="the PyMC evaluation's call path (float64)")
    args = parser.parse_args()
    if args.part:
        result = engine(args.dry_run, args.what) if args.part == "engine" else \
            {"micro": micro, "plain": plain}[args.part](args.dry_run)
        print("RESULT " + json.dumps(result), flush=True)
        return
    base = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}
    if args.dry_run:
        base.update(SYNK_EMULATE_GPUS="1", JAX_PLATFORMS="cpu")
    tmp = tempfile.mkdtemp()
    if args.pymc:
        base.update(PYTENSOR_FLAGS="floatX=float64")
        runs = [("tiny", "1", ""), ("tiny64", "1", ""), ("tiny64", "0", ""), ("pymc", "1", ""), ("pymc", "0", "")]
    else:
        print("micro (us; GB/s):", json.dumps(run_part("micro", base, args.dry_run), indent=1), flush=True)
        print("plain:", run_part("plain", base, args.dry_run), flush=True)
        runs = [("tiny", "1", ""), ("tiny", "1", "5000"), ("first", "1", ""), ("last", "1", ""), ("last", "0", "")]
    for what, pin, spin in runs:
        path = os.path.join(tmp, f"{what}pin{pin}spin{spin}")
        env = {**base, "SYNK_PROFILE_CALL": path, "SYNK_PIN_INPUTS": pin}
        if spin:
            env["SYNK_SPIN_US"] = spin
        result = run_part("engine", env, args.dry_run, what)
        if result is None:
            continue
        worker = {}
        if os.path.exists(path + ".rank0.json"):
            with open(path + ".rank0.json") as fh:
                worker = json.load(fh)
        print(f"\nengine {what} (SYNK_PIN_INPUTS={pin}, SYNK_SPIN_US={spin or 'default'}): "
              f"{result['us']:.1f} us per call", flush=True)
        for side, phases in (("master", result["master"]), ("worker", worker)):
            print(f"  {side}: " + ", ".join(f"{k} {v['median']:.1f} [{v['p10']:.0f}-{v['p90']:.0f}]"
                                           for k, v in phases.items()), flush=True)


if __name__ == "__main__":
    main()
