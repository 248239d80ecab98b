"""Run Lasagne's own test suite against synk_lasagne and count the outcomes.

The suite is Lasagne's, its assertions unedited: the released one (Lasagne 0.1's source distribution on PyPI,
downloaded here with pip: nothing of Lasagne is kept in this repository) or a checkout of Lasagne's
repository (``--source DIR``, e.g. its last commit 5d3c63c).  Its ``lasagne/tests`` runs in a
subprocess under pytest with the import renames of :mod:`lasagne_alias` (``lasagne`` ->
``synk_lasagne``, ``theano`` -> ``pytensor``), in PyTensor's ``FAST_COMPILE`` mode (no C
compilation: the suite's many tiny functions run in seconds), with synk_lasagne following the
suite's Lasagne release where 0.1 and 0.2 differ (``SYNK_LASAGNE_API``: :func:`lasagne_api`) and
the numpy indexing that numpy 1.23 removed respelled as numpy spells it now
(:data:`NUMPY_RESPELLINGS`).

Each test is counted once: passed, failed (errors included), skipped, or Theano-only -- a test of a
Theano back end that PyTensor does not have (cuDNN, cuda_convnet, corrmm: :data:`THEANO_ONLY`),
whatever its outcome, by its node id or by the reason Lasagne gives when it skips it
(``cuda_convnet not available``).  With ``--check FILE`` the run fails (exit 1) when a test
outside the Theano-only list and outside FILE (the tests known to fail today, one node id a
line, ``#`` starts a comment) does not pass, and reports the tests of FILE that pass now.

    python tests/lasagne_suite/run_suite.py                           # Lasagne 0.1 from PyPI
    python tests/lasagne_suite/run_suite.py --source /path/to/Lasagne # a checkout
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent

THEANO_ONLY = {
    r"cuda_convnet|CC(Layer|Pool)|MaxPool2DCC|Conv2DCC": "Theano's cuda_convnet wrappers (GPU, Theano only)",
    r"dnn|cudnn|Conv2DDNN|MaxPool2DDNN|Pool2DDNN|Conv3DDNN|MaxPool3DDNN|Pool3DDNN|SpatialPyramidPoolingDNN|"
    r"BatchNormDNN|batch_norm_dnn": "Theano's cuDNN wrappers (GPU, Theano only)",
    r"corrmm|Conv2DMM|MM(Layer)?\b": "Theano's GpuCorrMM wrapper (GPU, Theano only)",
}
"""Patterns of test node ids -> why the test needs a Theano-only GPU back end."""


def theano_only(nodeid: str) -> str | None:
    for pattern, why in THEANO_ONLY.items():
        if re.search(pattern, nodeid, flags=re.IGNORECASE):
            return why
    return None


def download_release(version: str, into: Path) -> Path:
    """Lasagne ``version``'s source distribution from PyPI, unpacked; its root directory."""
    import importlib.util

    # this interpreter's pip, else the one on PATH (a uv-made environment has none of its own)
    pip = [sys.executable, "-m", "pip"] if importlib.util.find_spec("pip") else [shutil.which("pip3") or "pip"]
    subprocess.run([*pip, "download", f"lasagne=={version}", "--no-deps", "--no-binary", ":all:", "-q", "-d",
                    str(into)], check=True, timeout=300)
    (archive,) = into.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    (root,) = (p for p in into.iterdir() if p.is_dir())
    return root


NUMPY_RESPELLINGS = {
    "layers/test_conv.py": [
        ("output = output[slices]", "output = output[tuple(slices)]"),
        ("output[[slice(None, None, factor) for factor in factors]] = input",
         "output[tuple(slice(None, None, factor) for factor in factors)] = input"),
    ],
}
"""Lasagne's numpy references that index an array with a list of slices (``a[[slice(...), ...]]``),
which numpy 1.23 and later refuse (``IndexError``), -> numpy's spelling of the same index,
``a[tuple(...)]`` (what the deprecation of numpy 1.15 prescribed; older numpy read the list as
that tuple).  Applied to the copy of the suite where the text occurs (Lasagne 5d3c63c's
``test_conv.py``, whose test parameters are computed with it when the module is collected); no
assertion is touched."""


def lasagne_api(source: Path) -> str:
    """The behaviour synk_lasagne follows for this suite (``SYNK_LASAGNE_API``, see
    :mod:`synk_lasagne.api`): ``"0.1"`` for Lasagne 0.1's tests, else ``"0.2"``.  The version is
    the source distribution's ``PKG-INFO``, else a checkout's ``lasagne/__init__.py``."""
    info = source / "PKG-INFO"
    text = info.read_text() if info.exists() else (source / "lasagne" / "__init__.py").read_text()
    match = re.search(r"^(?:Version:\s*|__version__\s*=\s*['\"])([0-9][^'\"\s]*)", text, flags=re.MULTILINE)
    return "0.1" if match and match.group(1).startswith("0.1") else "0.2"


def respell_numpy(tests: Path) -> None:
    """Apply :data:`NUMPY_RESPELLINGS` to the copied suite ``tests``."""
    for name, pairs in NUMPY_RESPELLINGS.items():
        path = tests / name
        if not path.exists():
            continue
        text = path.read_text()
        for old, new in pairs:
            text = text.replace(old, new)
        path.write_text(text)


def run(source: Path, workdir: Path, timeout: float, keep_report: Path | None = None) -> dict[str, str]:
    """Run ``source/lasagne/tests`` (copied alone, so that ``import lasagne`` cannot find Lasagne
    itself); the outcome of every test node id."""
    tests = workdir / "lasagne_tests"
    shutil.copytree(source / "lasagne" / "tests", tests)
    respell_numpy(tests)
    report = workdir / "report.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "PYTENSOR_FLAGS": "mode=FAST_COMPILE,on_unused_input=ignore", "SYNK_LASAGNE_API": lasagne_api(source)}
    cmd = [sys.executable, "-m", "pytest", str(tests), "-p", "lasagne_alias", "-p", "no:cacheprovider", "-q",
           "--tb=no", "--continue-on-collection-errors", "-o", "addopts=", "-o", "timeout=30",
           "--rootdir", str(workdir), f"--junitxml={report}", "-W", "ignore"]
    subprocess.run(cmd, cwd=workdir, env=env, timeout=timeout, capture_output=True, text=True)
    if keep_report:
        shutil.copyfile(report, keep_report)
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        nodeid = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag: child for child in case}
        skip = kinds.get("skipped")
        outcomes[nodeid] = ("failed" if kinds.keys() & {"failure", "error"} else
                            "passed" if skip is None else
                            "theano_only" if theano_only(skip.get("message", "")) else "skipped")
    return outcomes


def count(outcomes: dict[str, str]) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "theano_only": 0}
    for nodeid, outcome in outcomes.items():
        counts["theano_only" if theano_only(nodeid) else outcome] += 1  # outcome "theano_only": by its skip
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default="0.1", help="Lasagne release to download from PyPI (default 0.1)")
    parser.add_argument("--source", type=Path, help="a Lasagne checkout to use instead of a download")
    parser.add_argument("--check", type=Path, help="file of the node ids known to fail (# starts a comment)")
    parser.add_argument("--write-known", type=Path, help="write the node ids that fail (not Theano-only) here")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--report", type=Path, help="keep pytest's JUnit XML report (outcomes, skip reasons) here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lasagne_suite_") as tmp:
        work = Path(tmp)
        source = args.source or download_release(args.version, work / "download")
        outcomes = run(source, work, args.timeout, args.report)
    counts = count(outcomes)
    failing = sorted(n for n, o in outcomes.items() if o == "failed" and not theano_only(n))
    print(json.dumps({"suite": str(args.source or f"lasagne=={args.version}"), "tests": len(outcomes), **counts,
                      "seconds": round(time.perf_counter() - start, 1)}))
    if args.write_known:
        args.write_known.write_text("".join(f"{n}\n" for n in failing))
    if args.check:
        known = {line.split("#", 1)[0].strip() for line in args.check.read_text().splitlines()} - {""}
        new = [n for n in failing if n not in known]
        fixed = sorted(known - set(failing))
        if fixed:
            print(f"{len(fixed)} tests of {args.check.name} pass now (remove them from it):", *fixed, sep="\n  ")
        if new:
            print(f"{len(new)} tests fail that are not known to:", *new, sep="\n  ")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
