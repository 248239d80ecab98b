"""The ResNet demo (examples/resnet/train_resnet.py) and the ResNet benchmark's dry run
(benchmarks/bench_resnet.py --dry-run), run as a user runs them: subprocesses, briefly (a
ResNet-10 of width 8 on 32x32 images, CPU mode, 2 ranks).  The demo must learn (the training loss
of its last steps far below that of its first, which is ln(4) for 4 classes), print images/s and
leave no shared memory behind (the speedup line is the MNIST job tests' to check)."""

from __future__ import annotations

import json
import os
import re

import pytest
from lasagne_testutil import ROOT, run_script

SCRIPT = os.path.join(ROOT, "examples", "resnet", "train_resnet.py")
BENCH = os.path.join(ROOT, "benchmarks", "bench_resnet.py")
TINY = ["--depth", "10", "--width", "8", "--image-size", "32", "--classes", "4", "--batch-size", "8",
        "--learning-rate", "0.05", "--n-parallel", "2", "--cpu", "--mode", "FAST_COMPILE", "--no-progress"]


def entries_of_pid(pid: int) -> list[str]:
    return sorted(e for e in os.listdir("/dev/shm") if f"-{pid}-" in e)


@pytest.mark.job
@pytest.mark.timeout(300)
def test_resnet_demo_learns(tmp_path):
    """The scatter pattern, without the one-process baseline (the MNIST job's tests run both patterns
    and the speedup line)."""
    pattern = "scatter"
    args = [SCRIPT, *TINY, "--steps", "14", "--warmup", "2", "--pattern", pattern, "--no-baseline"]
    result, pid = run_script(args, cwd=str(tmp_path))
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr}"
    assert "data: synthetic ImageNet-shaped images: 32 images of 3x32x32, 4 classes" in out
    assert "== data-parallel: 2 rank(s), CPU processes" in out
    match = re.search(r"data-parallel: ([\d.]+) images/s .* training loss ([\d.]+) \(first 2 steps\) -> ([\d.]+) "
                      r"\(last 2\); evaluation loss ([\d.]+), accuracy ([\d.]+)%", out)
    assert match, out
    rate, first, last = float(match.group(1)), float(match.group(2)), float(match.group(3))
    assert rate > 0 and first > 1.0 and last < 0.5 * first, out
    assert out.rstrip().endswith("Done.")
    assert entries_of_pid(pid) == [], "the demo left shared memory behind"


@pytest.mark.job
@pytest.mark.timeout(300)
def test_bench_resnet_dry_run(tmp_path):
    """Every row of the benchmark on CPU (tiny network, one precision: on a CPU they differ only by a
    flag): the plain PyTensor function, synk with 2 ranks, and torchvision when torch is importable;
    the JSON it writes has every figure."""
    result, pid = run_script([BENCH, "--dry-run", "--precisions", "tf32"], cwd=str(tmp_path),
                             env={"OUT": str(tmp_path)})
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr}"
    with open(tmp_path / "bench_resnet.json") as f:
        figures = json.load(f)
    rows = {row["name"] for row in figures["rows"]}
    try:
        import jax  # noqa: F401
        plain = "plain PyTensor JAX"
    except ImportError:  # the dry run's plain function falls back to FAST_COMPILE
        plain = "plain PyTensor FAST_COMPILE"
    assert {f"{plain} tf32", "synk 2 ranks tf32"} <= rows, rows
    assert all(row["images_per_s"] > 0 for row in figures["rows"])
    assert f"| {plain} tf32 |" in out and "| synk 2 ranks tf32 |" in out
    assert entries_of_pid(pid) == []
