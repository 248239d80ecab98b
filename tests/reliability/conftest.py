"""The reliability suite: bad input, faults with real processes, and the summary table.

Every test here carries ``@pytest.mark.reliability(kind, package)``: ``kind`` is ``"input"`` (one
kind of bad input) or ``"fault"`` (one injected fault), ``package`` the layer it exercises
(``synk_shm``, ``synk_comm`` or ``synkhronos``).  At the end of the run
:func:`pytest_terminal_summary` prints a table of what was tried, what held, and the leaks found
(every test checks for leftover worker processes and ``/dev/shm`` entries and records what it
finds in :data:`reliability_lib.LEAKS`).  Fault tests also record their measured seconds (the
``seconds`` user property) and the table shows the slowest.

The helpers live in :mod:`reliability_lib` and :mod:`reliability_ops` (not here: every test
directory of the monorepo runs in one pytest session, where the name ``conftest`` is not unique);
this directory goes on ``sys.path`` so that they import by name, in the workers too.

``SYNK_TEST_GPU=1`` runs every scenario in GPU mode (:data:`reliability_lib.USE_GPU`, the rule of
the synkhronos suite); scenarios that mean nothing there skip with their reason.  The table's title
names the mode.
"""

from __future__ import annotations

import gc
import os
import sys
from collections import defaultdict
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import reliability_lib as rl  # noqa: E402

_OUTCOMES: dict[str, dict[str, Any]] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "reliability(kind, package): a reliability case (kind 'input' or 'fault') "
                                       "of one package, counted in the reliability summary table")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    marker = item.get_closest_marker("reliability")
    if marker is None:
        return report
    kind, package = marker.args
    entry = _OUTCOMES.setdefault(item.nodeid, {"kind": kind, "package": package, "outcome": "passed",
                                               "seconds": None})
    if report.when == "call" and hasattr(report, "wasxfail"):
        entry["outcome"] = "xfailed" if report.skipped else "xpassed"
    elif report.failed:
        entry["outcome"] = "failed"
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        longrepr = report.longrepr
        entry["reason"] = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    for name, value in item.user_properties:
        if name == "seconds":
            entry["seconds"] = value
    return report


@pytest.fixture(scope="session", autouse=True)
def reliability_nothing_left():
    """After the suite: no worker process of ours, and nothing in /dev/shm that the suite made."""
    before = set(rl.own_entries(rl.run_prefix()))
    yield
    gc.collect()
    rl.check_no_leak("worker processes after the suite", rl.wait_gone(rl.worker_pids(), 5.0))
    rl.check_no_leak("/dev/shm entries after the suite", sorted(set(rl.own_entries(rl.run_prefix())) - before))


def summary_rows() -> list[tuple[str, ...]]:
    """The rows of the summary table: per (kind, package), tried / held / xfail / failed / skipped
    (a scenario that means nothing in this mode: its reason is printed under the table) / slowest."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for entry in _OUTCOMES.values():
        groups[(entry["kind"], entry["package"])].append(entry)
    rows = []
    for (kind, package), entries in sorted(groups.items(), key=lambda kv: (kv[0][0] != "input", kv[0][1])):
        count = defaultdict(int)
        for e in entries:
            count[e["outcome"]] += 1
        times = [e["seconds"] for e in entries if e["seconds"] is not None]
        label = "bad input kinds" if kind == "input" else "faults"
        rows.append((label, package, str(len(entries)), str(count["passed"]), str(count["xfailed"]),
                     str(count["failed"] + count["xpassed"]), str(count["skipped"]),
                     f"{max(times):.2f}" if times else "-"))
    return rows


def mode_name() -> str:
    """The mode the suite ran in, for the table's title."""
    if not rl.USE_GPU:
        return "CPU mode"
    from synkhronos.emulation import emulated_gpus

    where = f"emulated on JAX's CPU devices (SYNK_EMULATE_GPUS={emulated_gpus()})" if emulated_gpus() else "on GPUs"
    return f"GPU mode ({'the JAX engine' if rl.ON_ENGINE else 'the per-rank engine'}), {where}"


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not _OUTCOMES:
        return
    rows = summary_rows()
    header = ("what", "package", "tried", "held", "xfail", "failed", "skipped", "slowest s")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    tr = terminalreporter
    tr.section(f"reliability summary, {mode_name()}")
    tr.write_line(line(header))
    tr.write_line("  ".join("-" * w for w in widths))
    for row in rows:
        tr.write_line(line(row))
    inputs = [e for e in _OUTCOMES.values() if e["kind"] == "input"]
    faults = [e for e in _OUTCOMES.values() if e["kind"] == "fault"]
    survived = sum(e["outcome"] == "passed" for e in faults)
    skipped = [(nodeid.split("::", 1)[1], e) for nodeid, e in _OUTCOMES.items() if e["outcome"] == "skipped"]
    ran = len(faults) - sum(e["outcome"] == "skipped" for e in faults)
    tr.write_line(f"bad input kinds tried: {len(inputs)} (held: {sum(e['outcome'] == 'passed' for e in inputs)}); "
                  f"faults survived (promise held): {survived} of {ran} run "
                  f"(xfail, a broken promise: {sum(e['outcome'] == 'xfailed' for e in faults + inputs)}); "
                  f"leaks found: {len(rl.LEAKS)}")
    for what, left in rl.LEAKS:
        tr.write_line(f"  leak: {what}: {left}")
    if skipped:
        tr.write_line(f"skipped in {mode_name()}:")
        for name, e in skipped:
            tr.write_line(f"  {name}: {e.get('reason', '')}")
    timed = [(nodeid.split("::", 1)[1], e) for nodeid, e in _OUTCOMES.items() if e["seconds"] is not None]
    if timed:
        tr.write_line("faults, seconds until the error (or the end of the dead master's workers):")
        for name, e in timed:
            tr.write_line(f"  {e['seconds']:6.2f}  {e['outcome']:8s} {name}")
