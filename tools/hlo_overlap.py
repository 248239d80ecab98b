"""Where XLA schedules the gradient all-reduce of the engine's training step, from its optimised HLO.

Runs the benchmark MLP's training step (``benchmarks/bench_gpu.py``'s ``synk_training``: one
program per step on the JAX engine) on every visible GPU with the workers' XLA flags plus
``--xla_dump_to``, then reads the step's module after optimisation -- its instructions in the
order XLA scheduled them (command buffers and other called computations expanded in place) --
and prints, for each all-reduce, where it starts, where it is waited for, and which matrix
products and convolutions run in between.  An all-reduce that overlaps the backward pass starts
before the last gradient products and is waited for after them.

Run on the device (``benchmarks`` on ``PYTHONPATH``)::

    python3 tools/hlo_overlap.py --batch 16384 --dump /tmp/hlo          # every visible GPU
    python3 tools/hlo_overlap.py --read /tmp/hlo                        # a dump made before

The reading only (``--read``) runs anywhere.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?:^|\s)([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"(?:calls|to_apply|called_computations)=\{?%?([\w.\-]+)")


@dataclass
class Op:
    """One scheduled instruction: its name, its kind for this report, and its text."""

    name: str
    kind: str
    text: str


def parse(text: str) -> tuple[str | None, dict[str, list[tuple[str, str]]]]:
    """The entry computation's name and every computation's instructions ``(name, right-hand side)``
    in the order the module lists them (the schedule, in a scheduled module)."""
    computations: dict[str, list[tuple[str, str]]] = {}
    entry = current = None
    for line in text.splitlines():
        if current is None:
            found = _COMPUTATION.match(line)
            if found and "HloModule" not in line:
                current = found.group(2)
                computations[current] = []
                if found.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        found = _INSTRUCTION.match(line)
        if found:
            computations[current].append((found.group(2), found.group(3)))
    return entry, computations


def kind_of(rhs: str) -> str:
    """What an instruction is, for this report: all-reduce start / done / synchronous, a matrix
    product, a convolution, a call into another computation, or other."""
    found = _OPCODE.search(rhs)
    opcode = found.group(1) if found else ""
    if opcode in ("all-reduce-start", "all-reduce-done", "all-reduce"):
        return opcode
    if opcode in ("async-start", "async-done") and "all-reduce" in rhs:
        return "all-reduce-start" if opcode == "async-start" else "all-reduce-done"
    if "__cublas" in rhs or "gemm" in rhs.split("metadata=")[0] or opcode == "dot":
        return "gemm"
    if "__cudnn$conv" in rhs or opcode == "convolution":
        return "conv"
    if opcode in ("call", "command-buffer") or ("fusion" not in opcode and _CALLED.search(rhs) and
                                                opcode not in ("reduce", "map", "sort", "scatter", "select-and-scatter",
                                                               "reduce-window", "all-reduce", "reduce-scatter")):
        return "call"
    return "other"


def schedule(entry: str, computations: dict[str, list[tuple[str, str]]]) -> list[Op]:
    """The entry computation's instructions with the computations it calls expanded in place."""
    out: list[Op] = []

    def expand(name: str, depth: int) -> None:
        for inst, rhs in computations.get(name, []):
            kind = kind_of(rhs)
            called = _CALLED.search(rhs)
            if kind == "call" and called and called.group(1) in computations and depth < 8:
                expand(called.group(1), depth + 1)
            else:
                out.append(Op(inst, kind, rhs))

    expand(entry, 0)
    return out


def report(ops: list[Op]) -> list[str]:
    """Lines: every all-reduce's start and wait positions and the products in between, and a verdict."""
    lines = []
    products = [i for i, op in enumerate(ops) if op.kind in ("gemm", "conv")]
    starts = {op.name: i for i, op in enumerate(ops) if op.kind == "all-reduce-start"}
    synchronous = [i for i, op in enumerate(ops) if op.kind == "all-reduce"]
    lines.append(f"{len(ops)} scheduled instructions, {len(products)} matrix products / convolutions, "
                 f"{len(starts)} asynchronous all-reduces, {len(synchronous)} synchronous")
    overlapped = 0
    for i, op in enumerate(ops):
        if op.kind != "all-reduce-done":
            continue
        operand = re.search(r"\(\s*%?([\w.\-]+)", op.text)
        start = starts.get(operand.group(1)) if operand else None
        if start is None:
            continue
        between = [j for j in products if start < j < i]
        after = [j for j in products if j > i]
        size = re.search(r"^\s*\(?([a-z0-9]+\[[0-9,]*\])", op.text)
        lines.append(f"  all-reduce {ops[start].name} ({size.group(1) if size else '?'}): starts at {start}, "
                     f"waited for at {i}; {len(between)} products run in between, {len(after)} after it")
        overlapped += bool(between)
    for i in synchronous:
        lines.append(f"  synchronous all-reduce {ops[i].name} at {i}: "
                     f"{len([j for j in products if j > i])} products after it")
    if starts:
        lines.append(f"overlap: {overlapped} of {len(starts)} all-reduces run while products compute"
                     if overlapped else "no overlap: every all-reduce is waited for before the next product")
    return lines


def step_module(dump: str) -> str:
    """The dumped module after optimisation that holds the most all-reduces (the training step)."""
    best, count = None, 0
    for name in sorted(os.listdir(dump)):
        if name.endswith("after_optimizations.txt"):
            with open(os.path.join(dump, name)) as f:
                text = f.read()
            n = text.count("all-reduce")
            if n > count:
                best, count = name, n
    if best is None:
        raise SystemExit(f"no module with an all-reduce in {dump}: was the step compiled with --xla_dump_to there?")
    return os.path.join(dump, best)


def run_step(dump: str, batch: int) -> None:
    """Compile and run the benchmark's training step on every visible GPU, dumping its HLO."""
    from synkhronos.engine.launch import XLA_FLAGS_ENV, XLA_GPU_FLAGS

    os.environ[XLA_FLAGS_ENV] = (os.environ.get(XLA_FLAGS_ENV, XLA_GPU_FLAGS) + f" --xla_dump_to={dump} "
                                 "--xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$")
    import bench_gpu

    import synkhronos as synk

    n = bench_gpu.gpu_count()
    train, _ = bench_gpu.synk_training(n, batch)
    for _ in range(3):
        train(batch_s=slice(0, batch // n))
    synk.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", default="/tmp/synk-hlo", help="where XLA dumps the modules")
    parser.add_argument("--read", help="only read a dump made before (a folder)")
    parser.add_argument("--batch", type=int, default=16384, help="global batch of the step")
    parser.add_argument("--keep", help="copy the step's module (optimised HLO text) to this file")
    args = parser.parse_args()
    dump = args.read or args.dump
    if not args.read:
        os.makedirs(dump, exist_ok=True)
        run_step(dump, args.batch)
    path = step_module(dump)
    with open(path) as f:
        text = f.read()
    entry, computations = parse(text)
    if entry is None:
        raise SystemExit(f"{path}: no ENTRY computation found")
    print(f"{os.path.basename(path)}: scheduled={'is_scheduled=true' in text}")
    if args.keep:
        with open(args.keep, "w") as f:
            f.write(text)
    for line in report(schedule(entry, computations)):
        print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
