"""Probe: what JAX's multi-process runtime does to the survivors when a peer process is SIGKILLed.

Two ranks on JAX CPU devices (gloo collectives), joined by ``jax.distributed.initialize``.  One rank
(the victim) is SIGKILLed while the survivor is idle (sleeping in Python) or inside an all-reduce
(``psum``) that waits for the victim.  Options: ``jax_enable_recoverability``, the heartbeat timeout,
which rank is killed (rank 0 hosts the coordination service by default), and the coordination
service in a separate small process.  ``reinit`` checks whether one process can
``jax.distributed.shutdown()`` and ``initialize()`` again.

    python tests/reliability/probe_engine_failure.py            # every scenario, a table on stdout
    python tests/reliability/probe_engine_failure.py 9 10       # scenarios 9 and 10 of SCENARIOS only

The evidence behind the engine's failure design (docs/guides/gpu.rst, "Engine").
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

WAIT_AFTER_KILL_S = 30.0


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rank_main(rank: int, port: int, phase: str, rec: bool, hb: int, service: str) -> None:
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if rec:
        jax.config.update("jax_enable_recoverability", True)
    if service == "separate":  # the service runs in another process: this one is a client only
        _connect_client(rank, port, hb)
    else:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank,
                                   heartbeat_timeout_seconds=hb)
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    try:
        from jax import shard_map
    except ImportError:  # pragma: no cover
        from jax.experimental.shard_map import shard_map
    mesh = Mesh(np.array(jax.devices()), ("r",))
    f = jax.jit(shard_map(lambda a: jax.lax.psum(a, "r"), mesh=mesh, in_specs=P("r"), out_specs=P("r"),
                          check_vma=False))
    g = jax.make_array_from_single_device_arrays((2, 4), NamedSharding(mesh, P("r")),
                                                 [jax.device_put(np.ones((1, 4), np.float32), jax.local_devices()[0])])
    jax.block_until_ready(f(g))
    print(f"READY {rank}", flush=True)
    if (phase == "psum" and rank == 0) or (phase == "psum0" and rank == 1):
        try:
            jax.block_until_ready(f(g))  # waits for the victim, which never joins
            print("RESULT psum returned", flush=True)
        except Exception as exc:
            print(f"RESULT exception {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    time.sleep(WAIT_AFTER_KILL_S + 20)
    print("RESULT alive (idle)", flush=True)


def _connect_client(rank: int, port: int, hb: int) -> None:
    """What ``jax.distributed.initialize`` does in a process other than 0: the client alone."""
    from jax._src import distributed
    from jax._src.lib import _jax  # type: ignore[attr-defined]

    state = distributed.global_state
    state.coordinator_address = f"127.0.0.1:{port}"
    state.process_id, state.num_processes = rank, 2
    state.client = _jax.get_distributed_runtime_client(state.coordinator_address, rank, init_timeout=60,
                                                       use_compression=True, heartbeat_timeout=hb)
    state.client.connect()


def service_main(port: int, rec: bool, hb: int) -> None:
    import jax
    from jax._src.lib import _jax  # type: ignore[attr-defined]

    if rec:
        jax.config.update("jax_enable_recoverability", True)
    svc = _jax.get_distributed_runtime_service(f"[::]:{port}", 2, heartbeat_timeout=hb, shutdown_timeout=5,
                                               recoverable=rec)
    print("SERVICE up", flush=True)
    time.sleep(WAIT_AFTER_KILL_S + 30)
    svc.shutdown()


def reinit_main() -> None:
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    out = []
    for attempt in range(2):
        try:
            jax.distributed.initialize(f"127.0.0.1:{_port()}", num_processes=1, process_id=0)
            out.append(f"init{attempt} ok, sum={float(jax.numpy.sum(jax.numpy.ones(3)))}")
            jax.distributed.shutdown()
            out.append(f"shutdown{attempt} ok")
        except Exception as exc:
            out.append(f"attempt {attempt}: {type(exc).__name__}: {str(exc)[:100]}")
            break
    print("RESULT " + "; ".join(out), flush=True)
    del np


def scenario(phase: str, victim: int, rec: bool, hb: int, service: str) -> str:
    """Run one scenario; returns what happened to the survivor."""
    port = _port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    svc = None
    if service == "separate":
        svc = subprocess.Popen([sys.executable, __file__, "service", str(port), str(int(rec)), str(hb)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert svc.stdout is not None
        svc.stdout.readline()
    procs = [subprocess.Popen([sys.executable, __file__, "rank", str(r), str(port), phase, str(int(rec)), str(hb),
                               service], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    for p in procs:
        assert p.stdout is not None
        while not (line := p.stdout.readline()).startswith("READY"):
            if not line:
                return "failed to start"
    time.sleep(2.0)  # the survivor is now idle, or inside the psum
    procs[victim].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    survivor = procs[1 - victim]
    try:
        survivor.wait(timeout=WAIT_AFTER_KILL_S)
        fate = f"exited {survivor.returncode} ({_signame(survivor.returncode)}) after {time.monotonic() - t0:.1f} s"
    except subprocess.TimeoutExpired:
        fate = f"still running {WAIT_AFTER_KILL_S:.0f} s after the kill"
        survivor.kill()
        survivor.wait()
    out = survivor.stdout.read() if survivor.stdout else ""
    results = [ln[7:] for ln in out.splitlines() if ln.startswith("RESULT")]
    aborted = [ln for ln in out.splitlines() if "Terminating process" in ln or "F0000" in ln or "Check failed" in ln]
    if svc is not None:
        svc.kill()
        svc.wait()
    detail = "; ".join(results) or (aborted[0][:110] if aborted else "")
    return f"{fate}{' | ' + detail if detail else ''}"


def _signame(rc: int | None) -> str:
    if rc is not None and rc < 0:
        return signal.Signals(-rc).name
    return "exit code"


SCENARIOS = [  # (phase, victim, recoverability, heartbeat s, service)
    ("idle", 1, False, 100, "rank"),
    ("psum", 1, False, 100, "rank"),
    ("idle", 1, False, 3, "rank"),
    ("psum", 1, False, 3, "rank"),
    ("idle", 1, True, 3, "rank"),
    ("psum", 1, True, 3, "rank"),
    ("idle", 0, False, 3, "rank"),
    ("psum0", 0, False, 3, "rank"),
    ("idle", 0, True, 3, "rank"),
    ("idle", 1, False, 3, "separate"),
    ("psum", 1, False, 3, "separate"),
]


def main() -> None:
    import jax

    print(f"jax {jax.__version__}, python {sys.version.split()[0]}, CPU devices, gloo; survivor's fate after "
          "the victim's SIGKILL")
    print("phase | killed rank | recoverability | heartbeat s | coordination service in | survivor")
    chosen = [int(a) for a in sys.argv[1:]] or range(len(SCENARIOS))
    for phase, victim, rec, hb, service in [SCENARIOS[i] for i in chosen]:
        fate = scenario(phase, victim, rec, hb, service)
        print(f"{phase} | {victim} | {rec} | {hb} | {'rank 0' if service == 'rank' else 'separate process'} | {fate}",
              flush=True)
    if sys.argv[1:]:
        return
    out = subprocess.run([sys.executable, __file__, "reinit"], capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    print("shutdown + initialize again in one process: " +
          "; ".join(ln[7:] for ln in out.stdout.splitlines() if ln.startswith("RESULT")) + out.stderr[-300:])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1", int(sys.argv[6]), sys.argv[7])
    elif len(sys.argv) > 1 and sys.argv[1] == "service":
        service_main(int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "reinit":
        reinit_main()
    else:
        main()
