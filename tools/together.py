"""Processes that a benchmark lets go at the same moment: each warms up on its own, then all
start their timed work together (probes of several independent or coupled processes), and the
options those probes share."""

from __future__ import annotations

import argparse
import json
import subprocess
from typing import Any


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that every two-core probe of the main job's step takes: ``--cores``,
    ``--batch-size``, ``--steps``, ``--rounds`` (with :func:`machine.two_cores` for ``--cores``)."""
    parser.add_argument("--cores", default=None, help="two cores (default: the first two physical cores)")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)


def run_together(commands: list[list[str]], timeout: float = 600) -> list[dict[str, Any]]:
    """Start one process per command and let them all go at once: each prints ``ready`` when it
    has warmed up and then reads a line (``go``) from its stdin before its timed work; once every
    one is ready, every one gets ``go``.  Returns the JSON object that each printed last, in the
    order of ``commands``.

    Raises
    ------
    RuntimeError
        If a process says something other than ``ready`` first, or exits with an error.
    """
    procs = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for command in commands]
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"{p.args!r} did not start: it said {line!r}")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout)
            if p.returncode:
                raise RuntimeError(f"{p.args!r} failed (exit status {p.returncode})")
            results.append(json.loads(stdout.strip().splitlines()[-1]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
