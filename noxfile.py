"""Every routine task of the Synkhronos monorepo is a nox session.

    nox -s tests        every package's tests on Python 3.12, CPU mode, then the synkhronos and
                        reliability suites in GPU mode (the JAX engine) on JAX's CPU devices
                        (SYNK_EMULATE_GPUS); on Python 3.11 the graph tests of synk-theano and
                        synk-lasagne, whose code paths depend on PyTensor's version
    nox -s lint         ruff
    nox -s typecheck    mypy on the packages
    nox -s demo         the main job (see README)
    nox -s bench        the benchmarks under benchmarks/ (figures go to benchmarks/RESULTS.md)
    nox -s docs         the Sphinx site (warnings are errors)
    nox -s reliability  bad-input and fault suites with their summary table, then the soak; in CPU
                        mode, then in GPU mode (on the GPUs, else emulated on JAX's CPU devices)

Each session builds its own environment and installs the packages from their own metadata
(``packages/*/pyproject.toml``), never from what happens to be installed on the machine.

Interpreters: ``tests`` runs on Python 3.11 and 3.12, each one that this machine has (a missing
one is reported and skipped, except under ``CI``, where nox makes it an error): the whole suite on
the newest, the PyTensor-dependent suites on the other; the other sessions run on one of them
(3.11 if it runs here, else 3.12).  pyenv's 3.11/3.12 count even
without an active shim: the noxfile puts their ``bin`` folders on ``PATH``.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import nox

ROOT = Path(__file__).parent
# Import order: a package comes after the ones it imports.
LAYERS = ["synk-shm", "synk-comm", "synk-theano", "synk-lasagne"]
PACKAGES = [ROOT / "packages" / name for name in LAYERS if (ROOT / "packages" / name / "pyproject.toml").exists()]
PYTHONS = ["3.11", "3.12"]


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", name))


def _runs(version: str) -> bool:
    """Whether ``python<version>`` starts on this machine."""
    try:
        return subprocess.run([f"python{version}", "-c", "pass"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _add_pyenv_interpreters() -> None:
    """Put the newest pyenv build of each of :data:`PYTHONS` first on ``PATH`` (a pyenv shim of a
    version that is not active fails instead of running, and nox would count that as a failure)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if not root.is_dir():
        return
    for version in PYTHONS:
        if _runs(version):
            continue
        builds = sorted((p for p in root.glob(f"{version}.*") if re.fullmatch(rf"{re.escape(version)}\.\d+", p.name)
                         and (p / "bin" / f"python{version}").exists()), key=lambda p: _version_key(p.name))
        if builds:
            os.environ["PATH"] = f"{builds[-1] / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"


_add_pyenv_interpreters()
PYTHONS_HERE = [v for v in PYTHONS if _runs(v)]
"""The supported interpreters this machine runs."""
ONE_PYTHON = PYTHONS_HERE[0] if PYTHONS_HERE else PYTHONS[0]
"""The interpreter of the sessions that run once (lint, typecheck, demo, docs, bench, reliability)."""
NEWEST_PYTHON = PYTHONS_HERE[-1] if PYTHONS_HERE else PYTHONS[-1]
"""The interpreter of the whole test suite (the newest PyTensor); the others run :data:`GRAPH_MODULES`."""
GRAPH_MODULES = [ROOT / "packages" / "synk-theano" / "tests" / name for name in (
    "test_synk_calls.py", "test_synk_ops.py", "test_synk_cpu.py", "test_synk_slicing.py", "test_synk_shared.py",
    "test_synk_chain.py", "test_synk_blas.py", "test_synk_precision.py", "test_synk_gradient_rule.py")] + [
    ROOT / "packages" / "synk-lasagne" / "tests" / name for name in (
    "test_lasagne_ops.py", "test_lasagne_layers.py", "test_lasagne_api.py", "test_lasagne_updates.py",
    "test_lasagne_parallel.py")]
"""The modules whose code paths depend on PyTensor's version -- graphs, rewrites, gradients, the JAX
translation, the layers and their Ops -- run on every interpreter.  synk_shm and synk_comm know
nothing of PyTensor; the process, data and failure modules, GPU mode's engine (whose machines run
the newest Python), the jobs, the reliability and multi-host suites test processes rather than
graphs: the newest interpreter alone runs them, as it runs the tests marked ``process`` (processes,
cores, failures) in the graph modules."""
TEST_DEPS = ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "pytest-xdist>=3.5"]
SIDE_BY_SIDE = ["-n", "2", "--dist", "loadfile"] if (os.cpu_count() or 1) >= 2 else []
"""The newest interpreter's CPU-mode pass runs its test modules two at a time (pytest-xdist, one
module's tests in one worker, so that its ``ranks`` group is forked once): a pass keeps about 1.5 of
2 cores busy alone (forks, compiles and fresh interpreters wait on each other), and two modules at
once fill the rest -- 584 s against 782 s for the 3.12 pass on the 2-core VM.  The reliability
suites' summary table is then printed by the emulated GPU pass and by ``nox -s reliability``."""
NO_C_COMPILER = "cxx="
"""PyTensor's flag for the newest interpreter's passes: PyTensor's own functions (the tests'
references, and the Ops that a rank's graph runs outside JAX) run their Python implementations
instead of C code that ``g++`` compiles for each new graph, about a second a module on 2 cores,
and CI's machine always starts with an empty compile directory (two modules' tests: 34.3 s with an
empty one, 23.0 s with a warm one, 25.6 s without ``g++``); what the tests check (the ranks against
the references) is the same either way.  The older
interpreter's pass keeps PyTensor's C code, so that CI still runs the graph modules through it."""

nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
nox.options.reuse_existing_virtualenvs = True
CI_BACKEND = "uv|virtualenv"
"""The environments of the README's test command (tests, lint, typecheck, docs): uv makes them and
installs into them several times faster than virtualenv and pip (``.ci/run`` installs ``nox[uv]``);
without uv, virtualenv and pip.  The other sessions keep pip (its configuration, local wheels
included, which uv does not read)."""
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")  # uv takes this machine's interpreters, never downloads one


def _pytensor_flags(*flags: str) -> str:
    """``PYTENSOR_FLAGS`` of this environment with ``flags`` added (later flags win)."""
    return ",".join(f for f in (os.environ.get("PYTENSOR_FLAGS", ""), *flags) if f)


def install_packages(session: nox.Session, *extra: str, env: dict[str, str] | None = None) -> None:
    """Install every package of the monorepo and ``extra`` requirements in one install call (local
    dependencies resolve, and each package builds once); ``env`` adds to the installer's environment."""
    session.install(*[str(p) for p in PACKAGES], *extra, env=env)


@nox.session(python=PYTHONS, venv_backend=CI_BACKEND)
def tests(session: nox.Session) -> None:
    """Every package's tests on the newest interpreter (:data:`NEWEST_PYTHON`): CPU mode, GPU tests
    skip without 2 GPUs, the whole-job tests (marker ``job``) too, then the synkhronos and
    reliability suites again in GPU mode (the JAX engine) on JAX's CPU devices.  On the older
    interpreter, the parts that differ by PyTensor version (:data:`GRAPH_MODULES`, without the
    jobs and the ``process`` tests).  With both interpreters, the ``ranks`` fixtures fork groups of
    2 on the newest and of 3 on the other (``SYNK_TEST_RANKS``), so that each group size runs once.
    Arguments after ``--`` go to pytest, on every interpreter."""
    # the digits data (MNIST job test); JAX, CPU mode's default backend and GPU mode's engine
    # (synk-theano[cpu])
    # Byte-compiled at install, as pip does and uv does not by default: under
    # PYTHONDONTWRITEBYTECODE=1 (set on some machines) every test process and worker would otherwise
    # compile JAX's and PyTensor's sources again at import, 3x the import time.
    install_packages(session, f"{ROOT / 'packages' / 'synk-lasagne'}[mnist]",
                     f"{ROOT / 'packages' / 'synk-theano'}[cpu,pymc]", *TEST_DEPS, env={"UV_COMPILE_BYTECODE": "1"})
    env = {"PYTHONUNBUFFERED": "1"}
    newest = session.python == NEWEST_PYTHON
    if session.posargs:
        paths, select = [], []
    elif newest:
        paths = [str(p / "tests") for p in PACKAGES if (p / "tests").exists()]
        paths += [str(ROOT / "tests")] if (ROOT / "tests").exists() else []
        select = SIDE_BY_SIDE
        if len(PYTHONS_HERE) > 1:  # the other interpreter's pass forks the groups of 3
            env["SYNK_TEST_RANKS"] = "2"
        env["PYTENSOR_FLAGS"] = _pytensor_flags(NO_C_COMPILER)
    else:
        paths, select = [str(p) for p in GRAPH_MODULES], ["-m", "not job and not process"]
        env["SYNK_TEST_RANKS"] = "3"  # the groups of 3 (uneven shares, more ranks than cores) run here
    # the slowest tests in every CI log, to see where CI's time goes
    session.run("pytest", "--durations=25", *select, *paths, *session.posargs, env=env)
    if newest and not session.posargs:
        # GPU mode's code paths on JAX's CPU devices: the whole suite on the JAX engine (GPU mode's
        # engine), its workers joined by JAX's multi-process runtime, collectives over gloo -- what
        # CI can check of GPU mode; test_synk_engine.py also runs the engine in 2 and 3 workers; the
        # reliability suites' bad inputs and faults on the engine.
        session.run("pytest", "--durations=15", str(ROOT / "packages" / "synk-theano" / "tests"),
                    str(ROOT / "tests" / "reliability"),
                    env={"PYTHONUNBUFFERED": "1", "SYNK_EMULATE_GPUS": "2", "SYNK_TEST_GPU": "1",
                         "PYTENSOR_FLAGS": _pytensor_flags("floatX=float64", NO_C_COMPILER)})


@nox.session(python=ONE_PYTHON, venv_backend=CI_BACKEND)
def lint(session: nox.Session) -> None:
    """ruff over the whole repository."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")


@nox.session(python=ONE_PYTHON, venv_backend=CI_BACKEND)
def typecheck(session: nox.Session) -> None:
    """mypy on every package's sources."""
    install_packages(session, "mypy>=1.10")
    session.run("mypy", *[str(p / "src") for p in PACKAGES])


@nox.session(python=ONE_PYTHON)
def demo(session: nox.Session) -> None:
    """The main job (see README): data-parallel MNIST training with synk-lasagne, on every GPU or CPU
    core; MNIST IDX files from $SYNK_MNIST_DIR, else scikit-learn's digits.  Flags go after ``--``."""
    install_packages(session, f"{ROOT / 'packages' / 'synk-lasagne'}[mnist]",
                     f"{ROOT / 'packages' / 'synk-theano'}[cpu]")
    session.run("python", "examples/mnist/train_mnist.py", *session.posargs, env={"PYTHONUNBUFFERED": "1"})


@nox.session(python=ONE_PYTHON, venv_backend=CI_BACKEND)
def docs(session: nox.Session) -> None:
    """The Sphinx site of docs/ (HTML in docs/_build/html); any warning, broken references included, fails.

    Every page is rebuilt each time (``-E``), so a warning of an unchanged page fails too.  Extra
    sphinx-build options go after ``--``.
    """
    install_packages(session, "sphinx>=7.3", "myst-parser>=3")  # napoleon (NumPy docstrings) ships with Sphinx
    session.run("sphinx-build", "-E", "-W", "--keep-going", "-n", "-q", "-b", "html", *session.posargs,
                "docs", "docs/_build/html")


@nox.session(python=ONE_PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks; each prints a table and appends nothing by itself (copy into RESULTS.md)."""
    install_packages(session, "torch==2.13.0", f"{ROOT / 'packages' / 'synk-theano'}[cpu]")
    scripts = session.posargs or sorted(str(p) for p in (ROOT / "benchmarks").glob("bench_*.py"))
    for script in scripts:
        session.run("python", script)


@nox.session(python=ONE_PYTHON)
def reliability(session: nox.Session) -> None:
    """Bad-input and fault-injection suites (tests/reliability, with their summary table), then the
    100,000-call soak (tests/reliability/soak.py: memory, file descriptors and /dev/shm stay flat), in CPU
    mode; then both again in GPU mode (``SYNK_TEST_GPU=1``, the JAX engine): on the GPUs when 2 or
    more are visible, else on JAX's CPU devices (``SYNK_EMULATE_GPUS=2``), the soak there 20,000
    calls (about 2 ms a step emulated: 100,000 would take 4 minutes).  Each suite prints its table."""
    theano = ROOT / "packages" / "synk-theano"
    install_packages(session, f"{theano}[cpu]", *TEST_DEPS)  # JAX: CPU mode's default backend, as in ``tests``
    suite, soak = str(ROOT / "tests" / "reliability"), str(ROOT / "tests" / "reliability" / "soak.py")
    env = {"PYTHONUNBUFFERED": "1"}
    session.log("reliability: CPU mode")
    session.run("pytest", suite, *session.posargs, env=env)
    session.run("python", soak, env=env)
    count = session.run("python", "-c", "from synkhronos.forking import gpu_count; print(gpu_count())",
                        silent=True, env={"SYNK_EMULATE_GPUS": ""})
    gpus = int(str(count).strip().splitlines()[-1])
    gpu_env = {**env, "SYNK_TEST_GPU": "1", "PYTENSOR_FLAGS": "floatX=float64"}
    if gpus >= 2:
        session.install(f"{theano}[gpu]")
        session.log(f"reliability: GPU mode, the JAX engine on {gpus} GPUs")
    else:
        gpu_env["SYNK_EMULATE_GPUS"] = "2"
        session.log(f"reliability: GPU mode, the JAX engine emulated on JAX's CPU devices ({gpus} GPU(s) visible)")
    session.run("pytest", suite, *session.posargs, env=gpu_env)
    session.run("python", soak, "--calls", "20000", "--sample", "5000", env=gpu_env)
