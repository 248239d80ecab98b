"""What coupling two ranks costs the main job's step on two cores, in plain JAX with nothing of
Synkhronos around it (a diagnosis, not a benchmark of record; its finding is in
the CPU guide, docs/guides/cpu.rst).

The main job's model (8 x 64 ReLU, 10 classes) and step (Adam over one flat gradient), batch 1024,
float32, each configuration in fresh interpreters pinned to their cores, the configurations taking
turns round by round; every step timed on its own (``jax.block_until_ready``):

``one process, 2 cores``
    The whole batch, gradient and update in one program, JAX's threads over both cores: the
    single process that data parallelism has to beat.
``2 ranks, one program each``
    One rank per core, half the batch each; gradient, all-reduce and update in ONE XLA program,
    the all-reduce a custom call into C++ over shared memory (``probe_coupled_ranks.cc``, an XLA
    FFI handler, compiled here with ``c++`` against JAX's headers): the step of an in-graph CPU
    all-reduce, with no Python between its parts.
``2 ranks, two calls each``
    The same with the chain's shape: a gradient call, then a program of the all-reduce and the
    update (the second call that Synkhronos's CPU chain makes).
``2 independent processes``
    Half the batch each and no all-reduce: the bound.  Its second figure pairs the two processes'
    i-th steps and takes the slower of each pair: what the same steps would cost in lock-step if
    every step's time were drawn independently of the other rank's (the tax of waiting for the
    slower rank each step).  The same independent processes also run the two coupled
    configurations' code, each process a group of one (its all-reduce a copy): what the custom
    call and the second call cost without a peer to meet.

Usage::

    python tools/probe_coupled_ranks.py [--cores 0,1] [--steps 400] [--rounds 3] [--spin 20000]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
CAPACITY = 1 << 20
"""Bytes of each rank's buffers in the shared segment (the flat gradient: 134 KB)."""
MODES = {"one": "one process, 2 cores", "fused": "2 ranks, one program each",
         "two": "2 ranks, two calls each", "indep": "2 independent processes",
         "fused1": "2 independent processes, fused's program", "two1": "2 independent processes, two calls"}
"""The configurations; ``fused1`` and ``two1`` run ``fused``'s and ``two``'s code in independent
processes (each a group of one: the all-reduce a copy), which parts the coupling from the calls."""


def build_handler(directory: str) -> str:
    """``probe_coupled_ranks.cc`` compiled into ``directory``: the shared library's path."""
    import jax.ffi

    library = os.path.join(directory, "probe_coupled_ranks.so")
    subprocess.run(["c++", "-O3", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
                    os.path.join(HERE, "probe_coupled_ranks.cc"), "-o", library], check=True)
    return library


def child(mode: str, cores: list[int], rank: int, size: int, rows: int, steps: int, segment: str, library: str,
          spin: int) -> None:
    """One process of a configuration: build its step, warm up, say ready, wait for "go" on stdin,
    time ``steps`` steps one by one, print their times (s) and a checksum of the parameters as JSON."""
    os.sched_setaffinity(0, set(cores))
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", len(cores) > 1)  # as Synkhronos's CPU ranks
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    widths = [64] * 9 + [10]
    params = []
    for a, b in itertools.pairwise(widths):
        bound = np.sqrt(6.0 / (a + b))
        params += [jnp.asarray(rng.uniform(-bound, bound, (a, b)).astype("float32")), jnp.zeros(b, "float32")]
    x_all = rng.random((4096, 64)).astype("float32")
    y_all = rng.integers(0, 10, 4096).astype("int32")
    batches = [rng.permutation(4096)[:rows] for _ in range(16)]

    def flat_gradient(ps: list[Any], x: Any, y: Any) -> tuple[Any, Any]:
        def loss(ps: list[Any]) -> Any:
            h = x
            for i in range(0, len(ps) - 2, 2):
                h = jnp.maximum(h @ ps[i] + ps[i + 1], 0)
            logp = jax.nn.log_softmax(h @ ps[-2] + ps[-1])
            return -jnp.sum(logp[jnp.arange(y.shape[0]), y])

        value, grads = jax.value_and_grad(loss)(ps)
        return value, jnp.concatenate([g.ravel() for g in grads] + [jnp.full(1, y.shape[0], "float32")])

    def adam(ps: list[Any], m: Any, v: Any, flat: Any) -> tuple[list[Any], Any, Any]:
        g = flat[:-1] / flat[-1]  # [sum of row gradients, rows]: the mean over all ranks' rows
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        step = 3e-3 * m / (jnp.sqrt(v) + 1e-8)
        out, k = [], 0
        for p in ps:
            out.append(p - step[k:k + p.size].reshape(p.shape))
            k += p.size
        return out, m, v

    def all_reduce(flat: Any) -> Any:
        # Without has_side_effect: with it, JAX orders the program's effects and every call of it
        # costs 60-190 us more (a no-op handler, measured with this probe); the result is used, so XLA
        # keeps the call, and a program holds one all-reduce, so none can be merged with another
        call = jax.ffi.ffi_call("synk_probe_all_reduce_sum", jax.ShapeDtypeStruct(flat.shape, flat.dtype))
        return call(flat, base=np.int64(base), rank=np.int64(rank), size=np.int64(size),
                    capacity=np.int64(CAPACITY), spin=np.int64(spin))

    base = 0
    if mode in ("fused", "two", "fused1", "two1"):
        handler = ctypes.cdll.LoadLibrary(library).SynkProbeAllReduceSum
        jax.ffi.register_ffi_target("synk_probe_all_reduce_sum", jax.ffi.pycapsule(handler), platform="cpu")
        with open(segment, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), 0)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mapped))

    if mode in ("two", "two1"):
        gradient = jax.jit(flat_gradient)
        reduce_and_update = jax.jit(lambda ps, m, v, flat: adam(ps, m, v, all_reduce(flat)))

        def step(ps: list[Any], m: Any, v: Any, x: Any, y: Any) -> tuple[Any, ...]:
            value, flat = gradient(ps, x, y)
            float(value)  # the chain's first call returns its outputs
            return (*reduce_and_update(ps, m, v, flat), value)
    else:
        reduce = all_reduce if mode in ("fused", "fused1") else (lambda flat: flat)

        @jax.jit
        def step(ps: list[Any], m: Any, v: Any, x: Any, y: Any) -> tuple[Any, ...]:
            value, flat = flat_gradient(ps, x, y)
            return (*adam(ps, m, v, reduce(flat)), value)

    n = sum(p.size for p in params)
    m, v = jnp.zeros(n, "float32"), jnp.zeros(n, "float32")
    times = []
    for i in range(60 + steps):
        if i == 60:
            print("ready", flush=True)
            sys.stdin.readline()
        rows_i = batches[i % 16]
        t0 = time.perf_counter()
        params, m, v, value = step(params, m, v, x_all[rows_i], y_all[rows_i])
        jax.block_until_ready(params)
        float(value)
        if i >= 60:
            times.append(time.perf_counter() - t0)
    print(json.dumps({"times": times, "checksum": float(sum(float(jnp.sum(p)) for p in params))}), flush=True)


def run_mode(mode: str, coresets: list[list[int]], rows: int, steps: int, library: str,
             spin: int) -> list[dict[str, Any]]:
    """One child per core set, all let go at once: their results.  Modes ending in 1: each child a
    group of one, with a segment of its own."""
    from together import run_together

    groups = [[cores] for cores in coresets] if mode.endswith("1") else [coresets]
    with contextlib.ExitStack() as stack:
        commands = []
        for group in groups:
            segment = stack.enter_context(tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="synk_probe_"))
            segment.truncate(2 * 4096 + 2 * len(group) * CAPACITY)
            commands += [[sys.executable, __file__, "--child", mode, ",".join(map(str, cores)), str(rank),
                          str(len(group)), str(rows), str(steps), segment.name, library, str(spin)]
                         for rank, cores in enumerate(group)]
        return run_together(commands)


def main() -> None:
    from together import add_probe_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_arguments(parser)
    parser.add_argument("--spin", type=int, default=20000, help="pauses a wait spins before yielding its core")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from machine import two_cores

    a, b = two_cores(args.cores)
    rows: dict[str, list[float]] = {name: [] for name in MODES.values()}
    paired: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        library = build_handler(tmp)
        for _ in range(args.rounds):
            for mode, name in MODES.items():
                sets = [[a, b]] if mode == "one" else [[a], [b]]
                rows_each = args.batch_size // len(sets)
                out = run_mode(mode, sets, rows_each, args.steps, library, args.spin)
                rows[name].append(max(statistics.median(o["times"]) for o in out))
                if mode in ("fused", "two") and abs(out[0]["checksum"] - out[1]["checksum"]) > 1e-6:
                    raise RuntimeError(f"{name}: the ranks' parameters differ ({out[0]['checksum']} and "
                                       f"{out[1]['checksum']}): the all-reduce is wrong")
                if mode == "indep":
                    paired.append(statistics.median(max(s, t) for s, t in zip(out[0]["times"], out[1]["times"])))
    base = statistics.median(rows[MODES["one"]])
    print(f"cores {a},{b}; batch {args.batch_size}; {args.steps} steps a run; ms per step, median over rounds "
          "(each round's median step); speedup over one process")
    named = list(rows.items())
    named.insert(list(MODES).index("indep") + 1, ("  the same steps paired, the slower of each pair", paired))
    for name, values in named:
        med = statistics.median(values)
        print(f"  {name:52s} {med * 1e3:7.3f}  ({', '.join(f'{v * 1e3:.3f}' for v in values)})  {base / med:.2f}x")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], [int(c) for c in sys.argv[3].split(",")], int(sys.argv[4]), int(sys.argv[5]),
              int(sys.argv[6]), int(sys.argv[7]), sys.argv[8], sys.argv[9], int(sys.argv[10]))
    else:
        main()
