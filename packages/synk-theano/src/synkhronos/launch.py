"""``python -m synkhronos.launch``: one Synkhronos run over several hosts.

Run the same command on every host (as with ``torchrun``)::

    python -m synkhronos.launch --nnodes 2 --node-rank R --nproc-per-node 8 \\
        --coordinator node0.example:29500 train.py --epochs 10

* On node 0 it runs ``train.py`` (the master: the user's program) with the environment of
  :mod:`synkhronos.multinode`; the script's ``synk.fork()`` (no arguments) waits for the other
  hosts and forms one run over every host's ranks.  The launcher exits with the script's status.
* On every other node it runs the node agent: it starts that host's ``--nproc-per-node`` workers
  when the master forks, serves them, and exits 0 when the master's script ends (1 if the master
  was lost).  The script's name is ignored there.

Every host needs the run's secret in ``SYNK_RUN_SECRET`` (the same random value on every host,
e.g. ``export SYNK_RUN_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')`` before
``srun``, which passes the environment on): the master and the agents sign every message with it
and drop, unread, any message without it (:mod:`synk_comm.net`).  :class:`LocalNodes` makes one for
the hosts it simulates.

Under Slurm (one task per node: ``srun --ntasks-per-node=1``) the options default to the job's
``SLURM_NNODES``, ``SLURM_NODEID``, the first host of ``SLURM_JOB_NODELIST`` (port 29500; the list
expanded by ``scontrol show hostnames``, else by :func:`expand_hostlist`) and the node's GPUs (or
``SLURM_CPUS_ON_NODE``-based CPU ranks); ``SYNK_COORDINATOR`` also sets the coordinator.

Ports on the coordinator's host: ``PORT`` (the master, pyzmq, bound on the coordinator's address
or ``--bind``) and ``PORT + 1`` (JAX's coordination service, which listens on every interface),
reachable from every host; the ranks' own collectives (gloo on CPU, NCCL on GPU) connect every
host to every other on ports they pick.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from types import TracebackType
from typing import IO

from synk_comm.net import SECRET_ENV, new_secret, run_secret
from synkhronos.multinode import BIND_ENV, COORDINATOR_ENV, DEFAULT_PORT, NNODES_ENV, NPROC_ENV, split_address

__all__ = ["LocalNodes", "PortPair", "expand_hostlist", "first_host", "free_port_pair", "hostnames", "main"]

log = logging.getLogger("synkhronos")


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in the Slurm host list {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in the Slurm host list {text!r}")
    parts.append("".join(current))
    return parts


def _expand_range(body: str, text: str) -> list[str]:
    """``"01-03,7"`` -> ``["01", "02", "03", "7"]`` (a range keeps the width of its lower bound)."""
    out: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cannot read {item!r} in the Slurm host list {text!r} (expected N or N-M)")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"the range {item!r} in the Slurm host list {text!r} runs backwards")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist(nodelist: str) -> list[str]:
    """Every host of a Slurm host list, in order (Slurm's own syntax, as ``scontrol show hostnames``).

    Comma-separated items; in each, any number of bracket groups of numbers and ranges (``[1-3,7]``),
    each range zero-padded to the width of its lower bound; several groups in one item give every
    combination, the last group varying fastest.

    Raises
    ------
    ValueError
        For unbalanced brackets or a group that is not numbers and ranges.

    Examples
    --------
    >>> expand_hostlist("rack[1-2]-node[01-02],login")
    ['rack1-node01', 'rack1-node02', 'rack2-node01', 'rack2-node02', 'login']
    >>> expand_hostlist("gpu[08-10,12]")
    ['gpu08', 'gpu09', 'gpu10', 'gpu12']
    """
    hosts: list[str] = []
    for item in _split_top(nodelist.strip()):
        item = item.strip()
        if not item:
            continue
        pieces: list[list[str]] = []
        for literal, group in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", item):
            if literal:
                pieces.append([literal])
            if group:
                pieces.append(_expand_range(group, nodelist))
        hosts.extend("".join(combo) for combo in itertools.product(*pieces))
    if not hosts:
        raise ValueError(f"the Slurm host list {nodelist!r} names no host")
    return hosts


def hostnames(nodelist: str) -> list[str]:
    """Every host of a Slurm host list: ``scontrol show hostnames`` where Slurm's ``scontrol`` is on
    the ``PATH`` (Slurm's own reading), else :func:`expand_hostlist`."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=30, check=True).stdout.split()
        except (OSError, subprocess.SubprocessError) as exc:
            log.debug("synkhronos.launch: scontrol show hostnames failed (%s); reading the list here", exc)
        else:
            if out:
                return out
    return expand_hostlist(nodelist)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (:func:`hostnames`): ``"rack[1-2]-node[01-04]"`` ->
    ``"rack1-node01"``."""
    return hostnames(nodelist)[0]


_RUN_ENV = {"SYNK_RUN_PREFIX", "SYNK_GROUP_PREFIX", "SYNK_RANK", "SYNK_SIZE", "SYNK_MASTER_RANK", "SYNK_MASTER_PID",
            "SYNK_SCRATCH_SIZE", "SYNK_SPAN_OFFSET", "SYNK_SPAN_SIZE", NNODES_ENV, NPROC_ENV, COORDINATOR_ENV}
"""What a simulated host's launcher does not inherit from this process (a run of its own)."""


class PortPair:
    """Two consecutive ports on 127.0.0.1, ``port`` (the master's) and ``port + 1`` (JAX's coordination
    service), chosen by the OS and held until they are used, so that nothing else takes them between
    the choice and the run's binds.

    Both are held by sockets with ``SO_REUSEPORT`` that never listen: JAX's coordination service (gRPC,
    which binds with ``SO_REUSEPORT``) binds ``port + 1`` while it is held, and only it receives the
    connections; nothing else (no outgoing connection's source port, no other bind) gets it.  The
    master's pyzmq socket cannot share a port: :meth:`release_master` frees ``port`` right before it
    binds (:class:`LocalNodes` does both at once).  :meth:`close` frees both.
    """

    def __init__(self, attempts: int = 50) -> None:
        self._held: list[socket.socket | None] = []
        for _ in range(attempts):
            first = self._hold(0)
            port = int(first.getsockname()[1])
            try:
                second = self._hold(port + 1)
            except OSError:
                first.close()
                continue
            self.port = port
            self._held = [first, second]
            return
        raise OSError("no two consecutive free ports on 127.0.0.1")

    @staticmethod
    def _hold(port: int) -> socket.socket:
        s = socket.socket()
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            raise
        return s

    def release_master(self) -> None:
        """Free ``port`` for the master's socket (bind it right after)."""
        if self._held and self._held[0] is not None:
            self._held[0].close()
            self._held[0] = None

    def close(self) -> None:
        """Free both ports."""
        for s in self._held:
            if s is not None:
                s.close()
        self._held = []

    def __enter__(self) -> PortPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def free_port_pair() -> PortPair:
    """Two consecutive free ports on 127.0.0.1, held (:class:`PortPair`; ``.port`` is the first)."""
    return PortPair()


class LocalNodes:
    """Hosts simulated on this machine: nodes ``1..nnodes-1`` as launchers of their own (their own
    runs, so their own shared-memory names; everything between them and this process goes through
    the network path), and this process as node 0's master.

    For tests, benchmarks and trying a launch without a cluster::

        with LocalNodes(nnodes=2, nproc_per_node=2, here=1):
            synk.fork()             # 3 ranks: 1 here, 2 on "node 1"

    Parameters
    ----------
    nnodes : int
        Hosts, this one included.
    nproc_per_node : int
        Ranks on each simulated host.
    here : int
        Ranks of node 0 (this process's workers).
    port : int, optional
        The coordinator's port (default: a :class:`PortPair` chosen by the OS and held until used).
    log : file, optional
        Where the launchers' output goes (default: discarded).
    split_cores : bool
        Give each simulated host its own share of this machine's cores (this process and its
        workers the first, until the end of the ``with``), as separate machines would have: for
        measurements.  Default: every process may use every core.

    Within the ``with``, this process's environment has the simulated run's settings and a fresh
    ``SYNK_RUN_SECRET`` (which the simulated hosts' launchers inherit), and the master's socket is
    bound on 127.0.0.1.
    """

    def __init__(self, nnodes: int = 2, nproc_per_node: int = 1, here: int = 1, port: int | None = None,
                 log: IO[bytes] | None = None, split_cores: bool = False) -> None:
        self.nnodes, self.nproc, self.here = nnodes, nproc_per_node, here
        self._ports = free_port_pair() if port is None else None
        self.port = port if self._ports is None else self._ports.port
        self.log = log
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._saved: dict[str, str | None] = {}
        self._cores: list[list[int]] | None = None
        self._affinity: set[int] | None = None
        if split_cores:
            from synk_comm import cores as cores_mod

            available = cores_mod.available()
            if len(available) < nnodes:
                raise ValueError(f"split_cores: {nnodes} hosts on {len(available)} cores")
            self._cores = cores_mod.split(available, nnodes)

    @staticmethod
    def host_name(node: int) -> str:
        """The name node ``node`` reports (``sim-host-<node>``)."""
        return f"sim-host-{node}"

    def start(self, node: int) -> subprocess.Popen[bytes]:
        """Start (or start again) node ``node``'s launcher."""
        env = {k: v for k, v in os.environ.items() if k not in _RUN_ENV}  # a run of its own
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # this machine: the master's modules
        cmd = [sys.executable, "-m", "synkhronos.launch", "--nnodes", str(self.nnodes), "--node-rank", str(node),
               "--nproc-per-node", str(self.nproc), "--coordinator", f"127.0.0.1:{self.port}",
               "--host-name", self.host_name(node)]
        if self._cores is not None:  # the launcher (and so its workers) on the host's own cores
            cmd[1:3] = ["-c", f"import os, runpy, sys; os.sched_setaffinity(0, {self._cores[node]!r}); "
                              f"sys.argv[0] = 'synkhronos.launch'; runpy.run_module('synkhronos.launch', "
                              "run_name='__main__', alter_sys=True)"]
        out = self.log if self.log is not None else subprocess.DEVNULL
        self.procs[node] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        return self.procs[node]

    def __enter__(self) -> LocalNodes:
        from synkhronos import multinode

        keys = (NNODES_ENV, NPROC_ENV, COORDINATOR_ENV, BIND_ENV, SECRET_ENV)
        self._saved = {k: os.environ.get(k) for k in keys}
        os.environ.pop(BIND_ENV, None)
        os.environ.update({NNODES_ENV: str(self.nnodes), NPROC_ENV: str(self.here),
                           COORDINATOR_ENV: f"127.0.0.1:{self.port}", SECRET_ENV: new_secret()})
        multinode.reset()
        if self._ports is not None:
            self._ports.release_master()
        multinode.hub()  # bound now, on the port just released: nothing takes it in between
        if self._cores is not None:
            self._affinity = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self._cores[0])
        for node in range(1, self.nnodes):
            self.start(node)
        return self

    def stop(self, timeout: float = 15.0) -> dict[int, int | None]:
        """Close the run, end the master's side (the launchers then exit 0) and return each
        launcher's exit status (None: it did not exit in time and was killed)."""
        import synkhronos
        from synkhronos import multinode

        synkhronos.close()
        multinode.reset()
        if self._ports is not None:
            self._ports.close()
        codes: dict[int, int | None] = {}
        for node, proc in self.procs.items():
            try:
                codes[node] = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes[node] = None
        return codes

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.stop()
        finally:
            if self._ports is not None:
                self._ports.close()
            if self._affinity is not None:
                os.sched_setaffinity(0, self._affinity)
            for key, value in self._saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _default_nproc() -> int:
    from synkhronos import cpu
    from synkhronos.forking import gpu_count

    gpus = gpu_count()
    if gpus:
        return gpus
    cores = int(os.environ.get("SLURM_CPUS_ON_NODE", "0")) or len(os.sched_getaffinity(0))
    return cpu.default_ranks(cores)


def _require_jax() -> None:
    """A run over several hosts is the JAX engine's: say so here, not from a worker."""
    import importlib.util

    if importlib.util.find_spec("jax") is None:
        raise SystemExit("a run over several hosts runs on JAX, which is not installed here: "
                         "pip install 'synk-theano' again (JAX is one of its dependencies) or pip install jax")


def _parser() -> argparse.ArgumentParser:
    env = os.environ
    parser = argparse.ArgumentParser(prog="python -m synkhronos.launch",
                                     description="One Synkhronos run over several hosts: run this on every host; "
                                                 "node 0 runs the script (docs/guides/multinode.rst).")
    parser.add_argument("--nnodes", type=int, default=int(env.get("SLURM_NNODES", "1")),
                        help="hosts in the run (default: SLURM_NNODES, else 1)")
    parser.add_argument("--node-rank", type=int, default=int(env.get("SLURM_NODEID", "0")),
                        help="this host's rank, 0 runs the script (default: SLURM_NODEID, else 0)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="ranks on this host (default: its GPUs, else CPU mode's default ranks)")
    default_coord = env.get(COORDINATOR_ENV)
    if not default_coord and env.get("SLURM_JOB_NODELIST"):
        default_coord = f"{first_host(env['SLURM_JOB_NODELIST'])}:{DEFAULT_PORT}"
    parser.add_argument("--coordinator", default=default_coord or f"127.0.0.1:{DEFAULT_PORT}",
                        help="HOST:PORT of node 0, reachable from every host; ports PORT and PORT+1 are used "
                             "(default: SYNK_COORDINATOR, else the first host of SLURM_JOB_NODELIST, port 29500)")
    parser.add_argument("--bind", default=env.get(BIND_ENV) or None,
                        help="node 0: the address the master listens on, that of the interface the other hosts "
                             "reach (default: SYNK_BIND_ADDRESS, else the coordinator's host)")
    parser.add_argument("--host-name", default=None, help="this host's name in messages (default: its hostname)")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="log each host's connection and each run's start (default: warnings and errors only)")
    parser.add_argument("script", nargs="?", help="the program, run on node 0 (ignored elsewhere)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The launcher (see the module docstring); returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise SystemExit(f"--node-rank must be in [0, --nnodes={args.nnodes}), got {args.node_rank}")
    if args.nnodes > 1:
        _require_jax()
        try:
            run_secret()
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    nproc = args.nproc_per_node or _default_nproc()
    if nproc < 1:
        raise SystemExit(f"--nproc-per-node must be >= 1, got {nproc}")
    host, port = split_address(args.coordinator)
    if args.node_rank > 0:
        from synkhronos import multinode

        name = args.host_name or socket.gethostname()
        return multinode.serve(f"tcp://{host}:{port}", args.node_rank, nproc, host=name)
    if not args.script:
        raise SystemExit("node 0 runs the program: python -m synkhronos.launch [options] script.py [args]")
    env = dict(os.environ, **{NNODES_ENV: str(args.nnodes), NPROC_ENV: str(nproc),
                              COORDINATOR_ENV: f"{host}:{port}"})
    if args.bind:
        env[BIND_ENV] = args.bind
    proc = subprocess.Popen([sys.executable, args.script, *args.args], env=env)

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    code = proc.wait()
    return code if code >= 0 else 128 - code  # killed by a signal: as a shell reports it


if __name__ == "__main__":
    raise SystemExit(main())
