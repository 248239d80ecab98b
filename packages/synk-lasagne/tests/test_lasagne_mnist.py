"""The MNIST data loader (IDX files, gzipped or not; scikit-learn's digits without them) and the
main job, run as a user runs it: a subprocess, briefly (2 epochs, small model), both data
patterns; it must print its accuracy and speedup, write its plot, and leave nothing behind."""

from __future__ import annotations

import gzip
import os
import re
import struct

import numpy as np
import pytest
from lasagne_testutil import ROOT, run_script

from synk_lasagne import mnist

SCRIPT = os.path.join(ROOT, "examples", "mnist", "train_mnist.py")


def write_idx(path, array, gz=False):
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}
    header = bytes([0, 0, codes[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    opener = gzip.open if gz else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


def fake_mnist(directory, n_train=30, n_test=8, gz=False, dotted=False):
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, (n_train, 4, 3), dtype=np.uint8),
        "y_train": rng.integers(0, 10, n_train, dtype=np.uint8),
        "x_test": rng.integers(0, 256, (n_test, 4, 3), dtype=np.uint8),
        "y_test": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    for key, stem in mnist.FILES.items():
        name = stem.replace("-idx", ".idx") if dotted else stem
        write_idx(os.path.join(directory, name + (".gz" if gz else "")), arrays[key], gz=gz)
    return arrays


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_read_idx(tmp_path, gz):
    values = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / ("a.idx" + (".gz" if gz else ""))
    write_idx(str(path), values, gz=gz)
    np.testing.assert_array_equal(mnist.read_idx(path), values)
    ints = np.array([1, -2, 300], dtype=">i4")
    write_idx(str(tmp_path / "b.idx"), ints)
    out = mnist.read_idx(tmp_path / "b.idx")
    assert out.dtype == np.int32 and out.tolist() == [1, -2, 300]


def test_read_idx_refuses_other_files(tmp_path):
    (tmp_path / "x").write_bytes(b"PK\x03\x04 not idx")
    with pytest.raises(ValueError, match="not an IDX"):
        mnist.read_idx(tmp_path / "x")
    write_idx(str(tmp_path / "short"), np.zeros((2, 2), dtype=np.uint8))
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-1])
    with pytest.raises(ValueError, match="bytes of data"):
        mnist.read_idx(tmp_path / "short")


@pytest.mark.parametrize("gz,dotted", [(False, False), (True, False), (True, True)])
def test_load_mnist_directory(tmp_path, gz, dotted):
    arrays = fake_mnist(str(tmp_path), gz=gz, dotted=dotted)
    data = mnist.load_mnist(tmp_path, n_valid=10)
    assert data.image_shape == (4, 3) and data.x_train.shape == (20, 12) and data.x_valid.shape == (10, 12)
    np.testing.assert_allclose(data.x_test, arrays["x_test"].reshape(8, 12) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(data.y_valid, arrays["y_train"][20:])
    assert data.y_train.dtype == np.int32 and data.x_train.dtype == np.float32


def test_load_prefers_the_directory_then_the_environment(tmp_path, monkeypatch):
    fake_mnist(str(tmp_path), n_train=12000)
    monkeypatch.setenv(mnist.ENV_VAR, str(tmp_path))
    data = mnist.load()
    assert data.source.startswith("MNIST") and len(data.x_valid) == 2000  # a sixth, below 60,000 images
    assert len(mnist.load_mnist(tmp_path / ".." / tmp_path.name, n_valid=100).x_valid) == 100
    monkeypatch.setenv(mnist.ENV_VAR, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        mnist.load()


def test_without_files_it_says_it_uses_the_digits(monkeypatch, capsys):
    pytest.importorskip("sklearn")
    monkeypatch.delenv(mnist.ENV_VAR, raising=False)
    digits = mnist.load()
    assert "scikit-learn" in capsys.readouterr().out
    assert digits.image_shape == (8, 8) and digits.x_train.shape[1] == 64
    assert len(digits.x_train) + len(digits.x_valid) + len(digits.x_test) == 1797
    assert digits.x_train.min() >= 0 and digits.x_train.max() <= 1


def learnable_mnist(directory, n_train=1200, n_test=300, side=10):
    """IDX files of a learnable stand-in for MNIST: each class a fixed random image, plus noise."""
    rng = np.random.default_rng(1)
    prototypes = rng.integers(0, 256, (10, side, side))
    for key, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = np.clip(prototypes[labels] + rng.normal(0, 60, (n, side, side)), 0, 255).astype(np.uint8)
        write_idx(os.path.join(directory, f"{key}-images-idx3-ubyte.gz"), images, gz=True)
        write_idx(os.path.join(directory, f"{key}-labels-idx1-ubyte.gz"), labels, gz=True)


def entries_of_pid(pid: int) -> list[str]:
    return sorted(e for e in os.listdir("/dev/shm") if f"-{pid}-" in e)


def check_job(result, pid, png, ranks=2, baseline=True):
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr}"
    assert f"== data-parallel: {ranks} rank(s), CPU processes" in out
    assert "0.00 s" not in out and " 0 samples/s" not in out
    if baseline:  # each run's output under its own header: the single process's after the data-parallel run's
        assert out.index("== data-parallel") < out.index("data-parallel: test accuracy") < \
            out.index("== single process") < out.index("single process: test accuracy")
        assert "not counted:" in out  # the steps that compile, apart from the throughput
    assert re.search(r"epoch \d+, train_loss [\d.]+, valid_loss [\d.]+, valid_accuracy [\d.]+, \d+ samples/s", out)
    accuracy = float(re.search(rf"final test accuracy \({ranks} ranks\): ([\d.]+)%", out).group(1)) / 100
    if baseline:
        assert re.search(rf"speedup of {ranks} CPU processes \(backend \w+\) over one process on all \d+ cores "
                         rf"\(same backend, model and steps\): \d+\.\d+x", out)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot" in out
    else:
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 1000
    assert out.rstrip().endswith("Done.")
    assert entries_of_pid(pid) == [], "the job left shared memory behind"
    return accuracy


@pytest.mark.job
@pytest.mark.timeout(300)
@pytest.mark.parametrize("pattern", ["host", "scatter"])
def test_main_job_runs(tmp_path, pattern):
    """Briefly (2 epochs, a small model) on IDX files, each data pattern, with the baseline run for the
    host pattern.  The tests' runs compile with FAST_COMPILE: on a cold cache, Numba (PyTensor's
    default, which ``nox -s demo`` uses) compiles the job's functions for a minute or two."""
    learnable_mnist(str(tmp_path))
    png = tmp_path / "plot.png"
    args = [SCRIPT, "--data-dir", str(tmp_path), "--epochs", "2", "--hidden", "32", "--batch-size", "64",
            "--n-parallel", "2", "--cpu", "--pattern", pattern, "--no-progress",
            "--plot", str(png), "--mode", "FAST_COMPILE"]
    if pattern == "scatter":
        args += ["--no-baseline", "--drop-last"]
    result, pid = run_script(args, cwd=str(tmp_path))
    assert f"data: MNIST ({tmp_path})" in result.stdout, result.stdout
    steps, trained, rows = map(int, re.search(r"2 epochs of (\d+) steps \((\d+) of (\d+) rows", result.stdout).groups())
    if pattern == "host":  # every row, in ceil(rows / 64) steps
        assert trained == rows and steps == -(-rows // 64)
    else:  # --drop-last: the learnable set does not divide by 64
        assert "the last, smaller batch dropped (--drop-last)" in result.stdout
        assert trained == 64 * steps and rows - 64 < trained < rows
    check_job(result, pid, png, baseline=pattern == "host")


def test_the_main_job_defaults_and_help(capsys, monkeypatch):
    """Epochs are passes (their default depends on the data), --min-accuracy is checked only when
    given, and --help shows every default."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_mnist", SCRIPT)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    args = job.parse_args([])
    assert args.min_accuracy is None and not args.drop_last
    digits = type("D", (), {"image_shape": (8, 8)})()
    assert job.epochs_default(args, digits) == job.DIGITS_EPOCHS
    assert job.epochs_default(args, type("M", (), {"image_shape": (28, 28)})()) == job.MNIST_EPOCHS
    assert job.epochs_default(job.parse_args(["--epochs", "5"]), digits) == 5
    args.epochs = 250
    assert job.print_every(args) == 25 and job.duration(0.0004) == "0.4 ms"
    with pytest.raises(SystemExit):
        job.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 629)", "(default: 250 on the 8x8 digits", "(default: not checked)", "(default: adam)",
                  "(default: 0.003)"):
        assert shown in text, shown
    with pytest.raises(SystemExit):
        job.parse_args(["--min-accuracy", "95"])
    assert "a fraction" in capsys.readouterr().err
    monkeypatch.delenv("SYNK_CPU_BLAS", raising=False)  # a speedup above the cores: the ranks' BLAS products
    assert "numpy's BLAS" in job.why_faster_than_cores({"one_core_ranks": True}, 2)
    monkeypatch.setenv("SYNK_CPU_BLAS", "0")  # the same product everywhere: the single process's thread pool
    assert "thread pool" in job.why_faster_than_cores({"one_core_ranks": True}, 2)


@pytest.mark.job
@pytest.mark.timeout(300)
def test_main_job_reaches_95_percent_on_the_digits(tmp_path):
    """The job's default run on its default data (scikit-learn's digits) and its default backend
    (JAX where installed, as in CI), in 3 ranks, without the baseline: >= 95% test accuracy.  (In
    FAST_COMPILE, PyTensor 3.0's Python implementations take minutes; JAX about a minute on a
    slow machine.)"""
    pytest.importorskip("sklearn")
    png = tmp_path / "plot.png"
    result, pid = run_script([SCRIPT, "--n-parallel", "3", "--cpu", "--no-baseline", "--no-progress", "--plot",
                              str(png), "--min-accuracy", "0.95"], cwd=str(tmp_path), env={mnist.ENV_VAR: ""})
    assert "scikit-learn" in result.stdout
    assert check_job(result, pid, png, ranks=3, baseline=False) >= 0.95


@pytest.mark.job
@pytest.mark.timeout(300)
def test_cnn_job_learns_on_the_digits(tmp_path):
    """The CNN of synk_lasagne.layers (``--model cnn``), 3 epochs in 2 ranks on the digits, its
    batches read from the ranks' own rows (``--pattern host``; the MLP job tests both patterns):
    the training loss falls every epoch and the test accuracy ends far above chance (10%)."""
    pattern = "host"  # the GPU-mode CNN test below runs the scatter pattern
    pytest.importorskip("sklearn")
    png = tmp_path / "plot.png"
    result, pid = run_script([SCRIPT, "--model", "cnn", "--filters", "16", "--hidden", "64", "--epochs", "3",
                              "--learning-rate", "0.003", "--batch-size", "128",
                              "--n-parallel", "2", "--cpu", "--no-baseline",
                              "--no-progress", "--pattern", pattern, "--plot", str(png), "--mode", "FAST_COMPILE",
                              "--min-accuracy", "0"], cwd=str(tmp_path), env={mnist.ENV_VAR: ""})
    assert "model: CNN 2x(conv 3x3 x16, max-pool 2)" in result.stdout, result.stdout + result.stderr
    losses = [float(v) for v in re.findall(r"epoch \d, train_loss ([\d.]+)", result.stdout)]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], losses
    assert check_job(result, pid, png, baseline=False) >= 0.7


@pytest.mark.job
@pytest.mark.timeout(300)
def test_cnn_job_in_gpu_mode_on_jax_cpu(tmp_path):
    """GPU mode's code path (every rank on PyTensor's JAX backend, the convolution and pooling Ops
    through their JAX implementations, data scattered into the ranks' JAX arrays) on JAX's CPU
    backend (``SYNK_EMULATE_GPUS``): the CNN learns as in CPU mode."""
    pytest.importorskip("sklearn")
    pytest.importorskip("jax")
    png = tmp_path / "plot.png"
    result, pid = run_script([SCRIPT, "--model", "cnn", "--filters", "16", "--hidden", "64", "--epochs", "3",
                              "--learning-rate", "0.003", "--batch-size", "128",
                              "--n-parallel", "2", "--no-baseline",
                              "--no-progress",
                              "--pattern", "scatter", "--plot", str(png), "--min-accuracy", "0"],
                             cwd=str(tmp_path), env={mnist.ENV_VAR: "", "SYNK_EMULATE_GPUS": "2"})
    assert "== data-parallel: 2 rank(s), GPUs" in result.stdout, result.stdout + result.stderr
    losses = [float(v) for v in re.findall(r"epoch \d, train_loss ([\d.]+)", result.stdout)]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], losses
    out = result.stdout.replace("GPUs", "CPU processes")  # check_job's pattern; the run itself is GPU mode
    accuracy = float(re.search(r"final test accuracy \(2 ranks\): ([\d.]+)%", out).group(1)) / 100
    assert accuracy >= 0.7 and out.rstrip().endswith("Done.")
    assert entries_of_pid(pid) == []
