"""What machine a benchmark ran on, for the header line of its figures, and which of its cores a
benchmark of a few cores takes."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def physical_cores(n: int) -> list[int]:
    """The first logical CPU of each of the first ``n`` physical cores this process may run on: ``n``
    cores of which no two are one core's hyperthreads."""
    from synk_comm.cores import available, physical_core

    first: dict[tuple[int, int], int] = {}
    for cpu in available():
        first.setdefault(physical_core(cpu), cpu)
    return list(first.values())[:n]


def two_cores(spec: str | None) -> tuple[int, int]:
    """The two cores of a two-core probe: ``spec`` as ``"a,b"``, or without it the first two
    physical cores (:func:`physical_cores`).

    Raises
    ------
    ValueError
        If ``spec`` does not name two cores, or this process may run on fewer than two cores.
    """
    cores = [int(c) for c in spec.split(",")] if spec else physical_cores(2)
    if len(cores) != 2:
        raise ValueError(f"a two-core probe needs two cores, got {cores} (--cores a,b)")
    return cores[0], cores[1]
