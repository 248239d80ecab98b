"""Where the GPU time of ResNet-50's training step goes under a precision policy (default ``bf16``).

The plain PyTensor JAX step of :mod:`bench_resnet` (the same graph Synkhronos runs: forward,
gradient, momentum SGD and batch norm's statistics in one function, compiled in
``synkhronos.precision.jax_mode("JAX", policy)``, data resident on the GPU), at ``--batch``:

1. seconds per step (the loss read every step);
2. XLA's memory analysis of the compiled step (arguments, outputs, temporaries: the activations);
3. a ``jax.profiler`` trace of ``--steps`` steps, summarised: the device's busy time per step
   against the step's wall time, the time per category of XLA op (convolutions forward and
   backward by cuDNN, matrix products, element-wise and reduction fusions, copies and
   transposes, ...; each top-level op of the optimised HLO classified by its opcode, custom-call
   target and fusion kind, and its result's dtype) and the ``--top`` ops and kernels by time.

The trace (``perfetto_trace.json.gz``, for ui.perfetto.dev) and the optimised HLO are written to
``$OUT``.  ``--dry-run``: a ResNet-10 of width 8 on 32x32 images on JAX's CPU (the trace then holds
the CPU's thunks), to check the code.

    python tools/profile_precision_step.py                      # bf16, batch 256
    python tools/profile_precision_step.py --policy default --batch 128
    python tools/profile_precision_step.py --batch 128 --memory-of default,highest
    python tools/profile_precision_step.py --dry-run
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_resnet import momentum_step, random_batch

OUT = os.environ.get("OUT", "/tmp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--policy", default="bf16", choices=["default", "highest", "bf16"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="steps traced (and timed, after 5)")
    parser.add_argument("--top", type=int, default=25, help="ops and kernels listed")
    parser.add_argument("--memory-of", default="", help="comma-separated policies whose step's XLA memory analysis "
                        "is printed beside the profiled one's (each compiled and run once)")
    parser.add_argument("--dry-run", action="store_true", help="a tiny ResNet on JAX's CPU: checks the code")
    args = parser.parse_args(argv)
    args.depth, args.width, args.image_size, args.classes = 50, 64, 224, 1000
    if args.dry_run:
        args.batch, args.steps = 4, 2
        args.depth, args.width, args.image_size, args.classes = 10, 8, 32, 10
    return args


class Spy:
    """A jitted function that keeps the arguments of its first call (for ``lower``)."""

    def __init__(self, jitted: Any) -> None:
        self.jitted, self.args = jitted, None

    def __call__(self, *args: Any) -> Any:
        if self.args is None:
            self.args = args
        return self.jitted(*args)


def build(args: argparse.Namespace, policy: str) -> tuple[Any, Spy, Any, Any]:
    """The step function (PyTensor), the spy on its jitted JAX function, and a batch on the device."""
    import jax
    import pytensor

    from synkhronos import precision

    x, y, loss, params, velocities, updates, state = momentum_step(args)
    spies: list[Spy] = []
    real_jit = jax.jit

    def spy_jit(*a: Any, **k: Any) -> Spy:
        spies.append(Spy(real_jit(*a, **k)))
        return spies[-1]

    jax.jit = spy_jit  # PyTensor's JAX linker calls jax.jit once, for this function
    try:
        fn = pytensor.function([x, y], loss, updates=updates + state, mode=precision.jax_mode("JAX", policy))
    finally:
        jax.jit = real_jit
    fn.trust_input = True
    device = jax.devices()[0]
    for var in [*params, *velocities, *(s for s, _ in state)]:
        var.container.storage[0] = jax.device_put(var.get_value(), device)
    xb, yb = (jax.device_put(a, device) for a in random_batch(args, args.batch))
    if not spies:
        raise RuntimeError("PyTensor's JAX linker did not call jax.jit: this PyTensor compiles otherwise")
    return fn, spies[-1], xb, yb


# --- the optimised HLO: each instruction's category ------------------------------------------------

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"[\s)}\]]([a-z][a-z0-9\-_]*)\(")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KIND = re.compile(r"kind=(k\w+)")
_DTYPE = re.compile(r"\b(bf16|f16|f32|f64|s32|s64|u8|s8|pred|u32)\[")


def hlo_categories(text: str) -> tuple[dict[str, str], collections.Counter[str]]:
    """Every instruction of the optimised HLO ``text`` -> its category (see :func:`category`), and the
    number of the ENTRY computation's instructions (the ops the device runs) per category."""
    out, entry, in_entry = {}, collections.Counter[str](), False
    for line in text.splitlines():
        if line.startswith("ENTRY"):
            in_entry = True
        elif line.startswith("}"):
            in_entry = False
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, rest = m.groups()
        op = _OPCODE.search(" " + rest)
        if op is None:
            continue
        out[name] = category(op.group(1), rest)
        if in_entry and op.group(1) not in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
            entry[out[name]] += 1
    return out, entry


def category(opcode: str, rest: str) -> str:
    """A readable category of an HLO instruction: cuDNN convolutions by direction, matrix products
    (cuBLAS, Triton), fusions by kind, copies/transposes, collectives; with its result's dtype."""
    dtype_match = _DTYPE.search(rest)
    dtype = dtype_match.group(1) if dtype_match else "?"
    if opcode == "custom-call":
        target = (_TARGET.search(rest) or [None, "?"])[1]
        if "conv" in target.lower():
            direction = ("backward data" if "BackwardInput" in target else "backward filter"
                         if "BackwardFilter" in target else "forward")
            fused = " +bias/activation" if "BiasActivation" in target or "Fused" in target else ""
            return f"convolution {direction}{fused} (cuDNN) {dtype}"
        if "gemm" in target.lower() or "matmul" in target.lower() or "blas" in target.lower():
            return f"matrix product (cuBLAS) {dtype}"
        return f"custom-call {target} {dtype}"
    if opcode == "fusion":
        kind = (_KIND.search(rest) or [None, "?"])[1]
        if "triton_gemm" in rest or "__triton" in rest:
            return f"matrix product (Triton fusion) {dtype}"
        if "cudnn" in rest.lower():
            return f"cuDNN fusion {dtype}"
        label = {"kLoop": "element-wise fusion", "kInput": "reduction fusion", "kOutput": "output fusion",
                 "kCustom": "custom fusion"}.get(kind, f"fusion {kind}")
        return f"{label} {dtype}"
    if opcode in ("copy", "transpose", "copy-start", "copy-done", "bitcast"):
        return f"copy/transpose {dtype}"
    if opcode in ("convolution", "dot"):
        return f"{opcode} (XLA) {dtype}"
    if opcode.startswith(("all-", "reduce-scatter")):
        return f"collective {opcode} {dtype}"
    return f"{opcode} {dtype}"


# --- the trace ------------------------------------------------------------------------------------

def device_events(trace: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The trace's op events: on a GPU the ``XLA Ops`` line of the device where it has one, else its
    kernels (stream lines); on a CPU the thunks that name an HLO op.  Returns (events, source)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pids = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    tids = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = {p for p, name in pids.items() if "gpu" in name.lower() or "device" in name.lower()}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if gpu:
        on_gpu = [e for e in spans if e["pid"] in gpu]
        ops = [e for e in on_gpu if tids.get((e["pid"], e["tid"]), "") == "XLA Ops"]
        if ops:
            return ops, "XLA Ops line"
        kernels = [e for e in on_gpu if "stream" in tids.get((e["pid"], e["tid"]), "").lower()]
        return (kernels or on_gpu), "kernels (stream lines)"
    return [e for e in spans if "hlo_op" in e.get("args", {})], "CPU thunks"


def kernel_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPU's kernel (and memcpy) events: its stream lines (empty on a CPU)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pids = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    tids = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = {p for p, name in pids.items() if "gpu" in name.lower()}
    return [e for e in events if e.get("ph") == "X" and "dur" in e and e["pid"] in gpu
            and "stream" in tids.get((e["pid"], e["tid"]), "").lower()]


def busy_us(events: list[dict[str, Any]]) -> float:
    """The union of the events' intervals, in microseconds."""
    total, end = 0.0, -np.inf
    for start, stop in sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def op_name(event: dict[str, Any]) -> str:
    """The HLO instruction an event ran (``fusion.12``): its ``hlo_op``, else its long or own name's first word."""
    args = event.get("args", {})
    name = str(args.get("hlo_op") or args.get("long_name") or event["name"]).strip()
    return name.split(" ")[0].lstrip("%") or str(event["name"])


def summarise(trace: dict[str, Any], categories: dict[str, str], steps: int, wall_s: float, top: int) -> None:
    events, source = device_events(trace)
    if not events:
        print("the trace holds no op events: nothing to summarise")
        return
    kernels = kernel_events(trace)
    busy = busy_us(kernels or events) / steps
    print(f"\n## Device time per step ({source}; {steps} steps traced)\n")
    print(f"wall {wall_s * 1e3:.2f} ms/step untraced, device busy {busy / 1e3:.2f} ms/step "
          f"({busy / (wall_s * 1e6):.0%} of the wall time; the rest: the device idle, waiting for the host)")
    per_op: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.Counter()
    for e in events:
        name = op_name(e)
        per_op[name] += float(e["dur"])
        count[name] += 1
    total = sum(per_op.values())
    per_cat: dict[str, float] = collections.defaultdict(float)
    ops_in: dict[str, int] = collections.Counter()
    for name, us in per_op.items():
        cat = categories.get(name, "unclassified " + re.sub(r"[.\d]+$", "", name))
        per_cat[cat] += us
        ops_in[cat] += 1
    print(f"\n### by category ({total / steps / 1e3:.2f} ms/step of ops)\n")
    print("| category | ms/step | share | ops |\n|---|---:|---:|---:|")
    for cat, us in sorted(per_cat.items(), key=lambda kv: -kv[1]):
        print(f"| {cat} | {us / steps / 1e3:.3f} | {us / total:.1%} | {ops_in[cat]} |")
    print(f"\n### top {top} ops\n")
    print("| op | category | ms/step | share | launches/step |\n|---|---|---:|---:|---:|")
    for name, us in sorted(per_op.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {name} | {categories.get(name, '?')} | {us / steps / 1e3:.3f} | {us / total:.1%} | "
              f"{count[name] / steps:.0f} |")
    if kernels and source != "kernels (stream lines)":
        per_kernel: dict[str, float] = collections.defaultdict(float)
        for e in kernels:
            per_kernel[e["name"]] += float(e["dur"])
        ktotal = sum(per_kernel.values())
        print(f"\n### top {top} kernels\n")
        print("| kernel | ms/step | share |\n|---|---:|---:|")
        for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]:
            print(f"| {name[:100]} | {us / steps / 1e3:.3f} | {us / ktotal:.1%} |")


def compiled_of(spy: Spy) -> Any:
    """The compiled executable of the spied function (compiled again at its first call's shapes: the
    persistent compilation cache that :func:`main` turns on makes that a read of the first one)."""
    import jax

    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a, spy.args)
    return spy.jitted.lower(*structs).compile()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    cache = tempfile.mkdtemp(prefix="synk_profile_cache_")  # the second compilation (lower) reads the first's
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    print(f"ResNet-{args.depth} step, policy {args.policy!r}, batch {args.batch}, on {jax.devices()[0]}", flush=True)
    t0 = time.perf_counter()
    fn, spy, xb, yb = build(args, args.policy)
    np.asarray(fn(xb, yb))
    print(f"compiled and ran once in {time.perf_counter() - t0:.1f} s", flush=True)
    for _ in range(5):
        np.asarray(fn(xb, yb))
    t0 = time.perf_counter()
    for _ in range(args.steps):
        np.asarray(fn(xb, yb))
    wall = (time.perf_counter() - t0) / args.steps
    print(f"{wall * 1e3:.2f} ms/step, {args.batch / wall:.0f} images/s (the loss read every step)", flush=True)

    compiled = compiled_of(spy)
    os.makedirs(OUT, exist_ok=True)
    text = compiled.as_text()
    with open(os.path.join(OUT, f"profile_{args.policy}_hlo.txt"), "w") as f:
        f.write(text)
    analyses = {args.policy: compiled.memory_analysis()}
    for other in [p for p in args.memory_of.split(",") if p and p != args.policy]:
        other_fn, other_spy, _, _ = build(args, other)
        np.asarray(other_fn(xb, yb))
        analyses[other] = compiled_of(other_spy).memory_analysis()
    mib = 2.0 ** 20
    print(f"\n## XLA memory analysis of the step, batch {args.batch}\n")
    print("| policy | arguments MiB | outputs MiB | aliased MiB | temporaries MiB |\n|---|---:|---:|---:|---:|")
    for name, memory in analyses.items():
        if memory is not None:
            print(f"| {name} | {memory.argument_size_in_bytes / mib:.1f} | {memory.output_size_in_bytes / mib:.1f} | "
                  f"{memory.alias_size_in_bytes / mib:.1f} | {memory.temp_size_in_bytes / mib:.1f} |")
    categories, entry = hlo_categories(text)
    print(f"\noptimised HLO: {sum(entry.values())} ops in its ENTRY computation: "
          + ", ".join(f"{k} {v}" for k, v in entry.most_common(12)), flush=True)

    trace_dir = tempfile.mkdtemp(prefix="synk_profile_")
    np.asarray(fn(xb, yb))
    t0 = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(args.steps):
            np.asarray(fn(xb, yb))
    traced_wall = (time.perf_counter() - t0) / args.steps
    found = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not found:
        print(f"no perfetto trace under {trace_dir}")
        return 1
    shutil.copy(found[0], os.path.join(OUT, f"profile_{args.policy}_perfetto_trace.json.gz"))
    with gzip.open(found[0]) as f:
        trace = json.load(f)
    print(f"\ntraced: {traced_wall * 1e3:.2f} ms/step (the profiler's own cost included)")
    summarise(trace, categories, args.steps, wall, args.top)
    print(f"\ntrace and HLO: {OUT}/profile_{args.policy}_*")
    shutil.rmtree(trace_dir, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
