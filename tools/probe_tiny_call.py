"""Where the tiny call's time goes, over rank counts and scheduling switches (diagnosis, not a
benchmark of record; ``bench_cpu_scaling.py --only tiny`` is that).

Each configuration runs in a fresh interpreter: the call of ``bench_cpu_scaling``'s tiny
function (one scalar out), its median, and the median of each phase in the master: ``prepare``
(checks and plan), ``own`` (the master's share), ``collect`` (waiting for the workers once its
own share is done), ``gather``; from the workers (``probe_site/sitecustomize.py`` stamps their
waits): ``wake`` (master's go to the last worker's start) and ``work`` (the slowest worker's
command).

Usage: ``python tools/probe_tiny_call.py [--ranks 2,16] [--calls 1500] CONFIG ...`` where a
CONFIG is ``name:VAR=value,VAR=value`` (``SYNK_PROBE_YIELD=0``: no sched_yield while spinning;
``SYNK_PROBE_MASTER_PIN=0``: the master not pinned, the workers pinned; any SYNK_* variable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def one(n: int, calls: int) -> dict[str, float]:
    import importlib

    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk
    from synk_comm import cores
    from synk_comm import group as gm
    from synkhronos import calls as calls_mod

    if os.environ.get("SYNK_PROBE_MASTER_PIN") == "0":
        cores.pin_process = lambda c: {}  # type: ignore[assignment]
    fm = importlib.import_module("synkhronos.function")
    synk.fork(n, use_gpu=False)
    x = pt.matrix("x")
    f = synk.function([x], outputs=pt.sum(x))
    plain = pytensor.function([x], pt.sum(x), mode="JAX")
    a = np.ones((4 * n, 2), dtype=x.dtype)
    xd = synk.data(a)
    marks: dict[str, list[int]] = {}
    ns = time.perf_counter_ns
    go: list[int] = []

    def timed(owner: object, name: str, key: str) -> None:
        orig = getattr(owner, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            t0 = ns()
            try:
                return orig(*args, **kwargs)
            finally:
                marks.setdefault(key, []).append(ns() - t0)

        setattr(owner, name, wrapper)

    if hasattr(fm.Function, "_prepare"):
        timed(fm.Function, "_prepare", "prepare")
    timed(calls_mod, "share", "own")
    timed(gm.Group, "_collect", "collect")
    from synkhronos import rank_functions

    timed(rank_functions.JaxOrDefault, "__call__", "jax")
    timed(fm.Function, "_gather", "gather")
    entry = "start_command" if hasattr(gm.Group, "start_command") else "command"  # every command starts there
    start = getattr(gm.Group, entry)

    def stamped(self: object, *args: object, **kwargs: object) -> object:
        go.append(time.monotonic_ns())
        return start(self, *args, **kwargs)

    setattr(gm.Group, entry, stamped)
    for _ in range(300):
        f(xd)
        plain(a)
    marks.clear()
    first = len(go)
    totals, plains = [], []
    for _ in range(calls):
        t0 = ns()
        f(xd)
        totals.append(ns() - t0)
    for _ in range(calls):
        t0 = ns()
        plain(a)
        plains.append(ns() - t0)
    n_commands = len(go)
    synk.close()
    out = {k: statistics.median(v) / 1e3 for k, v in marks.items()}
    out["total"] = statistics.median(totals) / 1e3
    out["total_p90"] = float(np.percentile(totals, 90)) / 1e3
    out["total_mean"] = float(np.mean(totals)) / 1e3
    out["plain_jax"] = statistics.median(plains) / 1e3
    # workers: stamps are (wait entered, wait left) pairs; wait left number k = start of command k
    wake, work = [], []
    starts_ends = []
    for r in range(1, n):
        path = os.path.join(os.environ["SYNK_PROBE_DIR"], f"rank{r}.npy")
        for _ in range(50):
            if os.path.exists(path):
                break
            time.sleep(0.1)
        s = np.load(path)
        left = s[1::2]  # command starts (the first: start-up's wait... aligned below)
        entered = s[2::2]  # the wait after each command: its end
        k0 = len(left) - n_commands - 1  # the last wait (EXIT) has no end stamp
        starts_ends.append((left[k0:k0 + n_commands], entered[k0:k0 + n_commands]))
    if starts_ends:
        g = np.array(go[:n_commands])
        st = np.max([se[0] for se in starts_ends], axis=0)
        en = np.max([se[1] - se[0] for se in starts_ends], axis=0)
        wake = (st - g)[first:]
        work = en[first:]
        out["wake"] = float(np.median(wake)) / 1e3
        out["work"] = float(np.median(work)) / 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,16")
    parser.add_argument("--calls", type=int, default=1500)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("configs", nargs="*", default=["default:"])
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args.calls)), flush=True)
        return
    print(f"{os.cpu_count()} CPUs, affinity {len(os.sched_getaffinity(0))}", flush=True)
    keys = ["total", "total_p90", "total_mean", "plain_jax", "prepare", "own", "jax", "collect", "gather", "wake",
            "work"]
    print("| config | ranks | " + " | ".join(keys) + " |")
    print("|---|---:|" + "---:|" * len(keys), flush=True)
    for config in args.configs:
        name, _, spec = config.partition(":")
        extra = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
        for n in [int(v) for v in args.ranks.split(",")]:
            with tempfile.TemporaryDirectory() as d:
                env = dict(os.environ, **extra, SYNK_PROBE_DIR=d)
                env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "probe_site"), env.get("PYTHONPATH", "")])
                env.setdefault("PYTENSOR_FLAGS", "floatX=float32")
                if "floatX" not in env["PYTENSOR_FLAGS"]:
                    env["PYTENSOR_FLAGS"] += ",floatX=float32"
                try:
                    p = subprocess.run([sys.executable, __file__, "--one", str(n), "--calls", str(args.calls)],
                                       env=env, capture_output=True, text=True, timeout=150)
                    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                    r = json.loads(lines[-1][7:]) if lines else None
                    err = (p.stderr or p.stdout).strip()[-300:]
                except subprocess.TimeoutExpired:
                    r, err = None, "timed out"
            if r is None:
                print(f"| {name} | {n} | error: {err!r} |", flush=True)
                continue
            print(f"| {name} | {n} | " + " | ".join(f"{r[k]:.1f}" if k in r else "" for k in keys) + " |", flush=True)


if __name__ == "__main__":
    main()
