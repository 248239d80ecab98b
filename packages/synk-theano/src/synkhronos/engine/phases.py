"""Where a call's time goes: ``perf_counter_ns`` marks along the engine's call path, off by default.

``SYNK_PROFILE_CALL=<path>`` (set before :func:`synkhronos.fork`; the workers inherit it) turns it
on: the master and every worker record the time between consecutive marks of each call and, at
exit, write ``<path>.<side>.json`` (``side``: ``master`` or ``rank<r>``) with each phase's median,
10th and 90th percentile in microseconds.  ``tools/profile_engine_call.py`` reads them.

Off (the default), :data:`PHASES` is None and the call path pays one ``is None`` test per mark.
"""

from __future__ import annotations

import atexit
import json
import os
from time import perf_counter_ns

import numpy as np

__all__ = ["ENV", "PHASES", "Phases", "start"]

ENV = "SYNK_PROFILE_CALL"


class Phases:
    """The durations between marks, per phase name."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.side = "master"
        self.samples: dict[str, list[int]] = {}
        self.t = 0
        atexit.register(self.dump)

    def begin(self) -> None:
        """A call starts: the next mark measures from here."""
        self.t = perf_counter_ns()

    def mark(self, name: str) -> None:
        """Phase ``name`` ends now (it began at the previous mark or :meth:`begin`)."""
        now = perf_counter_ns()
        self.samples.setdefault(name, []).append(now - self.t)
        self.t = now

    def reset(self) -> None:
        """Forget the samples so far (after a warm-up)."""
        self.samples.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase: ``median``, ``p10``, ``p90`` (microseconds) and ``count``, in mark order."""
        out = {}
        for name, values in self.samples.items():
            us = np.asarray(values[len(values) // 10:], dtype=np.float64) / 1e3  # the first tenth warms up
            if len(us):
                out[name] = {"median": float(np.median(us)), "p10": float(np.percentile(us, 10)),
                             "p90": float(np.percentile(us, 90)), "count": len(us)}
        return out

    def dump(self) -> None:
        """Write :meth:`summary` to ``<path>.<side>.json``."""
        if self.samples:
            with open(f"{self.path}.{self.side}.json", "w") as f:
                json.dump(self.summary(), f, indent=1)


def start(side: str) -> None:
    """Name this process's side of the call (a worker: ``rank<r>``)."""
    if PHASES is not None:
        PHASES.side = side


PHASES: Phases | None = Phases(os.environ[ENV]) if os.environ.get(ENV) else None
