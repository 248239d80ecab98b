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
    flag): the plain PyTensor function, the hand-written JAX network, synk with 2 ranks, and
    torchvision when torch is importable;
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
    expected = {f"{plain} tf32", "synk 2 ranks tf32"} | ({"plain JAX NHWC tf32"} if plain.endswith("JAX") else set())
    assert expected <= rows, rows
    assert all(row["images_per_s"] > 0 for row in figures["rows"])
    assert all(f"| {name} |" in out for name in expected), out
    assert entries_of_pid(pid) == []


def test_the_benchmarks_hand_written_jax_resnet_is_the_same_network():
    """``benchmarks/jax_resnet.py`` (the benchmark's "plain JAX NHWC" rows) computes what
    :func:`synk_lasagne.models.build_resnet` computes: given Lasagne's weights, the same loss, and
    after one step of SGD with momentum the same loss again (so the same gradient and update)."""
    jax = pytest.importorskip("jax")
    import sys

    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    from synk_lasagne import layers, objectives
    from synk_lasagne.models import build_resnet
    from synk_lasagne.random import set_rng

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import jax_resnet
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    depth, size, classes, width = 10, 32, 5, 8
    set_rng(np.random.RandomState(3))
    x, y = pt.tensor4("x", dtype="float32"), pt.ivector("y")
    net = build_resnet(depth, size, classes, width, input_var=x)
    probabilities = pt.special.softmax(layers.get_output(net, x), axis=-1)
    loss = objectives.aggregate(objectives.categorical_crossentropy(probabilities, y))
    params = layers.get_all_params(net, trainable=True)
    updates = []
    for p, g in zip(params, pytensor.grad(loss, params)):
        v = pytensor.shared(np.zeros_like(p.get_value()))
        new_v = np.float32(0.9) * v - np.float32(0.01) * g
        updates += [(v, new_v), (p, p + new_v)]
    step = pytensor.function([x, y], loss, updates=updates, mode="FAST_COMPILE")

    weights: dict[str, dict[str, np.ndarray]] = {}
    for p in params:
        layer, _, kind = p.name.rpartition(".")  # conv1.W, conv1_bn.beta, conv1_bn.gamma, ..., fc.W, fc.b
        value = p.get_value()
        value = value.transpose(2, 3, 1, 0) if value.ndim == 4 else value  # OIHW (no flip) -> HWIO
        weights.setdefault(layer.removesuffix("_bn"), {})[{"W": "w"}.get(kind, kind)] = value
    jax_step, carry = jax_resnet.make_training(depth, width, classes, size, weights=weights)
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((6, 3, size, size)).astype("float32")
    yb = rng.integers(0, classes, 6).astype("int32")
    with jax.default_matmul_precision("highest"):
        for _ in range(2):
            expected = float(step(xb, yb))
            carry, got = jax_step(carry, np.ascontiguousarray(xb.transpose(0, 2, 3, 1)), yb)
            np.testing.assert_allclose(float(got), expected, rtol=1e-4)
