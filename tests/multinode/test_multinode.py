"""Synkhronos over several hosts, simulated on this machine: two "hosts" (this test process is node
0's master with 1 worker; a launcher ``python -m synkhronos.launch --node-rank 1`` of its own, with
its own shared-memory names, serves 2 more), every byte between them through the network path
(pyzmq over TCP; JAX's gloo between the ranks).  CPU mode, the JAX engine: 3 ranks in all.

References are numpy and plain PyTensor: the seed's examples (scatter, broadcast inputs, ``batch=``,
output reductions, shared-variable collectives), training with synk-lasagne against the
single-process step, and failures (a rank's exception, a killed remote worker, a killed remote
launcher): the same exceptions as on one host, within 5 s, the host named, nothing left behind,
``synk.fork()`` working again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("zmq")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
# synk_engine_ops (the Stall Op, which the workers of both hosts unpickle: the launcher passes this
# sys.path on) and the synkhronos and synk-lasagne test helpers
for _path in (os.path.join(ROOT, "packages", "synk-theano", "tests"),
              os.path.join(ROOT, "packages", "synk-lasagne", "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from synk_engine_ops import Stall  # noqa: E402
from synk_testutil import worker_pids  # noqa: E402

import synkhronos as synk  # noqa: E402
from synk_comm import HostLostError, WorkerDiedError, WorkerError  # noqa: E402
from synk_comm.net import SpanGroup  # noqa: E402
from synkhronos.launch import LocalNodes  # noqa: E402
from synkhronos.runtime import current  # noqa: E402

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:Numba will use object mode:UserWarning")]

HERE_RANKS, THERE_RANKS = 1, 2
RANKS = HERE_RANKS + THERE_RANKS
HOST = LocalNodes.host_name(1)
FAIL_S = 5.0
"""A failure on the other host reaches the master within this many seconds."""


class OtherHost:
    """Node 1, a launcher of its own (see :class:`synkhronos.launch.LocalNodes`)."""

    def __init__(self, nodes: LocalNodes) -> None:
        self.nodes = nodes

    @property
    def proc(self):
        return self.nodes.procs[1]

    def start(self) -> None:
        self.nodes.start(1)

    def workers(self) -> list[int]:
        return worker_pids(self.proc.pid)

    def shm_entries(self, pid: int | None = None) -> list[str]:
        """Its shared-memory objects (names carry its pid: ``synk<ns>-<pid>-``)."""
        pid = self.proc.pid if pid is None else pid
        return [e for e in os.listdir("/dev/shm") if f"-{pid}-" in e.split("synk", 1)[-1][:40]]


@pytest.fixture(scope="module")
def other():
    with tempfile.TemporaryFile() as log:
        nodes = LocalNodes(nnodes=2, nproc_per_node=THERE_RANKS, here=HERE_RANKS, log=log)
        with nodes:
            yield OtherHost(nodes)
            codes = nodes.stop()  # the master's side ends: the other launcher exits 0
            log.seek(0)
            assert codes == {1: 0}, log.read().decode(errors="replace")[-3000:]


@pytest.fixture
def ranks(other):
    """A run over both hosts (forked again where a test broke the last one)."""
    rt = current()
    if rt is None or rt.group.closed:
        synk.close()
        assert synk.fork(use_gpu=False) == RANKS
    return RANKS


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 4))


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(condition())


# --- the run --------------------------------------------------------------------------------------

def test_fork_spans_both_hosts(ranks, other):
    rt = current()
    assert isinstance(rt.group, SpanGroup) and rt.engine is not None
    assert rt.size == RANKS and [p.host for p in rt.group.peers] == [HOST]
    assert len(other.workers()) == THERE_RANKS and other.shm_entries()  # its own names
    with pytest.raises(RuntimeError, match="already forked"):
        synk.fork()


class _CreatesFile:
    """A pickle whose unpickling creates a file: what an outsider sends to run code in the master."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_an_outsiders_pickle_runs_nothing_and_the_run_goes_on(ranks, other, tmp_path):
    """During the run, a process outside it connects to the master's port (that of the agents) and
    sends pickles that would create a file, bare and with a forged signature, under two identities
    (one named as agents are): each is dropped unread (the file never appears), and the run's calls
    give the right results."""
    import zmq

    from synk_comm import net
    from synkhronos import multinode

    hub = multinode.hub()
    before = hub._refused.count
    evil = [tmp_path / f"ran{i}" for i in range(4)]
    ctx = zmq.Context()
    try:
        for i, ident in enumerate([b"outsider", b"node1-1"]):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.IDENTITY, ident)
            sock.connect(f"tcp://127.0.0.1:{other.nodes.port}")
            sock.send_multipart(net._pack(_CreatesFile(str(evil[2 * i]))))
            forged = net._Seal(b"not the run's secret, a guess")
            sock.send_multipart(forged.seal(ident, net._pack(_CreatesFile(str(evil[2 * i + 1])))))
            sock.close()
        x = pt.matrix("x")
        f = synk.function([x], outputs=[(pt.sum(x), "sum"), (x, "gather")])
        values = rows(30, seed=9)
        deadline = time.monotonic() + 10
        while hub._refused.count < before + 4 and time.monotonic() < deadline:
            total, gathered = f(synk.data(values))  # the master reads its socket during calls
            np.testing.assert_allclose(total, values.sum())
            np.testing.assert_allclose(gathered, values)
        assert hub._refused.count == before + 4, "the outsider's messages did not arrive"
        assert not any(p.exists() for p in evil), "an outsider's pickle was unpickled in the master"
        assert [p.host for p in current().group.peers] == [HOST]
    finally:
        ctx.term()


def test_scatter_broadcast_batch_and_output_reductions(ranks):
    x, y = pt.matrix("x"), pt.vector("y")
    z = x @ y
    f = synk.function([x], bcast_inputs=[y], outputs=[pt.mean(z), (pt.sum(z), "sum"), (pt.max(z), "max"),
                                                      (z, "gather")])
    x_dat, y_dat = rows(101), np.arange(4.0)
    x_data, y_data = synk.data(x_dat), synk.data(y_dat)
    for what, batch in [("even rows, one program", 99), ("uneven rows, per rank", slice(1, 101)),
                        ("batch indices", np.random.default_rng(1).permutation(100)[:40]),
                        ("one row: the other host's ranks have none", np.array([5]))]:
        expect = x_dat[:batch] @ y_dat if isinstance(batch, int) else x_dat[batch] @ y_dat
        mean, total, top, gathered = f(x_data, y_data, batch=batch)
        np.testing.assert_allclose(mean, expect.mean(), err_msg=what)
        np.testing.assert_allclose(total, expect.sum(), err_msg=what)
        np.testing.assert_allclose(top, expect.max(), err_msg=what)
        np.testing.assert_allclose(gathered, expect, err_msg=what)
    # the rows change in place and by reallocation: the other host reads the new ones
    x_data.set_value(rows(33, seed=5))
    np.testing.assert_allclose(f(x_data, y_data)[1], (rows(33, seed=5) @ y_dat).sum())
    x_data.data[:] *= -1
    np.testing.assert_allclose(f(x_data, y_data)[1], -(rows(33, seed=5) @ y_dat).sum())
    mini = synk.data(rows(12, seed=3), minibatch=True)
    np.testing.assert_allclose(f(mini, y_data, batch=np.arange(12))[0], (rows(12, seed=3) @ y_dat).mean())


def test_shared_variable_collectives(ranks):
    """The seed's shared-variable example on 3 ranks over 2 hosts."""
    s_init = np.ones(2, dtype="float32")
    x = pt.matrix("x", dtype="float32")
    s = pytensor.shared(s_init, name="s")
    f = synk.function([x], updates=[(s, pt.sum(x * s, axis=0))])
    x_data = synk.data(np.repeat(np.arange(1, 7, dtype="float32")[:, None], 2, axis=1))
    f(x_data)  # rank r sums rows 2r, 2r+1: 4r + 3
    np.testing.assert_array_equal(synk.gather(s, nd_up=1), [[3, 3], [7, 7], [11, 11]])
    synk.reduce(s, op="sum")
    np.testing.assert_array_equal(s.get_value(), [21, 21])
    np.testing.assert_array_equal(synk.gather(s, nd_up=1), [[21, 21], [7, 7], [11, 11]])
    synk.broadcast(s, s_init)
    f(x_data)
    synk.all_reduce(s, op="sum")
    np.testing.assert_array_equal(synk.gather(s, nd_up=1), [[21, 21]] * 3)
    v = pytensor.shared(np.zeros((2, 3)), name="v")
    synk.function([x], outputs=pt.sum(v) + pt.sum(x))
    synk.distribute()
    values = np.arange(21.0).reshape(7, 3)
    synk.scatter(v, values)  # 3, 2, 2 rows
    np.testing.assert_array_equal(synk.gather(v, nd_up=0), values)
    assert [shape for shape in synk.get_shapes(v)] == [(3, 3), (2, 3), (2, 3)]


def test_batch_s_on_each_hosts_own_rows(ranks, caplog):
    """Data kept on each host (sliceable shared variables, batch_s): one program when the windows
    fit every rank (the ranks' shapes are compared across hosts), per rank otherwise."""
    data = np.arange(18.0).reshape(9, 2)
    s = pytensor.shared(np.zeros((0, 2)), name="S")
    g = synk.function([], outputs=(s[:, 0], None), sliceable_shareds=[s])
    total = synk.function([], outputs=(pt.sum(s), "sum"), sliceable_shareds=[s])
    synk.scatter(s, data)  # rows 0-2, 3-5, 6-8
    with caplog.at_level("INFO", logger="synkhronos"):
        np.testing.assert_array_equal(g(batch_s=slice(1, 3)), data[[1, 2, 4, 5, 7, 8], 0])
        assert total(batch_s=slice(0, 2)) == data[[0, 1, 3, 4, 6, 7]].sum()
    assert "per-rank" not in caplog.text, caplog.text  # one program over the 3 ranks
    with caplog.at_level("INFO", logger="synkhronos"):
        np.testing.assert_array_equal(g(batch_s=[[2], [0, 1], [2]]), data[[2, 3, 4, 8], 0])
    assert "runs as per-rank programs" in caplog.text
    assert total(num_slices=2) == data.sum()


def test_a_rank_error_on_the_other_host_names_rank_and_host(ranks):
    x = pt.matrix("x")
    f = synk.function([x], outputs=(pt.sum(Stall(0.0, fail_rank=2)(x)), "sum"))
    bad = synk.data(-np.ones((7, 4)))
    with pytest.raises(WorkerError, match=f"rank 3 \\(host {HOST}\\) raised ") as info:
        f(bad, num_slices=2)  # num_slices: per-rank programs, so the group stays usable
    assert info.value.ranks == [3] and "fails on purpose" in str(info.value)
    assert f(synk.data(np.ones((7, 4)))) == 28.0


def test_a_rank_error_in_one_program_closes_the_run_after_the_grace(ranks, other):
    synk.close()
    synk.fork(use_gpu=False)
    x = pt.matrix("x")
    f = synk.function([x], outputs=(pt.sum(Stall(0.0, fail_rank=2)(x)), "sum"))
    t0 = time.monotonic()  # the first call of the run: each host learns the grace with the call
    with pytest.raises(WorkerError, match=f"rank 3 \\(host {HOST}\\) raised ") as info:
        f(synk.data(-np.ones((6, 4))))  # even rows: one program; the others wait in its psum for rank 2
    # the grace, plus the first call's compile in every rank (8.5 s seen on a loaded 2-core runner); a
    # hang would last until the group's timeouts, minutes
    assert time.monotonic() - t0 < FAIL_S + 10
    assert "did not finish" in "".join(getattr(info.value, "__notes__", []))
    assert current().group.closed
    synk.close()
    assert wait_until(lambda: not other.workers()) and not worker_pids()
    assert other.shm_entries() == [], "the other host's copies of the Data outlive the run"


# --- failures --------------------------------------------------------------------------------------

def _slow_call_killed(kill, seconds: float = 4.0):
    """Start a call that runs ``seconds`` (its first: compiling, then sleeping); ``kill()`` after 1 s;
    return (exception, seconds from the kill)."""
    x = pt.matrix("x")
    f = synk.function([x], outputs=(pt.sum(Stall(seconds)(x)), "sum"))
    data = synk.data(np.ones((6, 4)))
    killed: list[float] = []

    def later() -> None:
        time.sleep(1.0)
        kill()
        killed.append(time.monotonic())

    thread = threading.Thread(target=later)
    thread.start()
    with pytest.raises(WorkerDiedError) as info:
        f(data)
    thread.join()
    return info.value, time.monotonic() - killed[0]


def test_a_killed_worker_on_the_other_host(ranks, other):
    victim = other.workers()[1]
    exc, seconds = _slow_call_killed(lambda: os.kill(victim, signal.SIGKILL))
    assert seconds < FAIL_S, f"the master took {seconds:.1f} s to see the death"
    assert not isinstance(exc, HostLostError)
    assert exc.rank == 3 and f"host {HOST}" in str(exc) and "SIGKILL" in str(exc)
    synk.close()
    assert wait_until(lambda: not other.workers()), f"workers left on the other host: {other.workers()}"
    assert not worker_pids(), "workers left on this host"
    assert other.proc.poll() is None  # its launcher serves the next run
    assert synk.fork(use_gpu=False) == RANKS
    x = pt.matrix("x")
    assert synk.function([x], outputs=(pt.sum(x), "sum"))(synk.data(np.ones((6, 4)))) == 24.0


def test_a_killed_launcher_on_the_other_host(ranks, other):
    pid = other.proc.pid
    workers = other.workers()
    exc, seconds = _slow_call_killed(lambda: os.kill(pid, signal.SIGKILL))
    assert seconds < FAIL_S, f"the master took {seconds:.1f} s to see the lost host"
    assert isinstance(exc, HostLostError) and exc.host == HOST and exc.ranks == [2, 3]
    assert f"host {HOST}" in str(exc)
    other.proc.wait(5)
    synk.close()
    # its workers leave by themselves (their master is gone) and remove the host's shared memory
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{w}") for w in workers)), "orphaned workers"
    assert wait_until(lambda: not other.shm_entries(pid)), f"shared memory left: {other.shm_entries(pid)}"
    assert not worker_pids(), "workers left on this host"
    other.start()  # the host's launcher comes back: a new run spans both hosts again
    assert synk.fork(use_gpu=False) == RANKS
    x = pt.matrix("x")
    assert synk.function([x], outputs=(pt.sum(x), "sum"))(synk.data(np.ones((6, 4)))) == 24.0


MASTER = """
import sys, time
import numpy as np, pytensor.tensor as pt
import synkhronos as synk
from synkhronos.launch import LocalNodes
nodes = LocalNodes(nnodes=2, nproc_per_node=1, here=1).__enter__()
synk.fork(use_gpu=False)
x = pt.matrix("x")
print(synk.function([x], outputs=(pt.sum(x), "sum"))(synk.data(np.ones((4, 2)))), nodes.procs[1].pid, flush=True)
time.sleep(120)
"""


def test_a_killed_master_ends_the_other_hosts_launcher(tmp_path):
    script = tmp_path / "master.py"
    script.write_text(MASTER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNK_")}
    master = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        line = [""]
        while line and line[0] != "8.0":  # the workers' gloo says hello on the same stdout
            line = master.stdout.readline().split()
        assert line, "the master script ended early"
        launcher = int(line[1])
        workers = worker_pids(launcher)
        assert workers
        master.kill()
        t0 = time.monotonic()
        assert wait_until(lambda: not os.path.exists(f"/proc/{launcher}") or _zombie(launcher), FAIL_S)
        assert time.monotonic() - t0 < FAIL_S
        assert wait_until(lambda: not any(os.path.exists(f"/proc/{w}") and not _zombie(w) for w in workers))
        assert wait_until(lambda: not [e for e in os.listdir("/dev/shm") if f"-{launcher}-" in e])
    finally:
        master.kill()
        master.wait()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# --- training ---------------------------------------------------------------------------------------

def test_training_with_synk_lasagne_equals_the_single_process_step(ranks):
    from lasagne_testutil import NumpyRule, Reference, initial_params, loss_graph, make_data, shared_params

    from synk_lasagne import make_train_function, updates

    x, y = make_data(40)
    x_data, y_data = synk.data(x), synk.data(y)
    xs, ys = pt.matrix("x"), pt.ivector("y")
    params = shared_params(initial_params())
    train = make_train_function(loss_graph(xs, ys, params), params, [xs, ys], updates.adam, learning_rate=0.01)
    reference, rule, ref = Reference(), NumpyRule("adam", learning_rate=0.01), initial_params()
    order = np.random.default_rng(2).permutation(40)
    for step, idx in enumerate([order[:9], order[9:15], order[15:22], order[22:34]]):  # 9, 6, 7, 12 rows
        loss = train(x_data, y_data, batch=idx)
        ref_loss, grads = reference(x[idx], y[idx], ref)
        ref = rule.step(ref, grads)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-9, err_msg=f"loss of step {step}")
        for p, gathered, expected in zip(params, synk.gather(params, nd_up=1), ref):
            for r in range(RANKS):
                np.testing.assert_allclose(gathered[r], expected, rtol=1e-9, atol=1e-12,
                                           err_msg=f"step {step} ({len(idx)} rows): {p.name} in rank {r}")


def test_a_host_that_never_connects_is_named(monkeypatch):
    if current() is not None:
        synk.close()
    monkeypatch.setenv("SYNK_CONNECT_TIMEOUT_S", "1")
    nodes = LocalNodes(nnodes=3, nproc_per_node=1, here=1)
    nodes.start = lambda node: None  # node 1 and node 2 never come
    with nodes, pytest.raises(TimeoutError, match=r"node\(s\) \[1, 2\] did not connect"):
        synk.fork(use_gpu=False)
    assert current() is None and not worker_pids()


EXAMPLE_LINES = {  # what each example prints itself (the start of each of its lines)
    "introductory.py": ("2 ranks: synkhronos ", "All assertions passed."),
    "batch_vs_batch_s.py": ("batch ", "batch_s slice(0, 2) -> ", "All assertions passed."),
}


@pytest.mark.parametrize("example, floatx", [("introductory.py", "float32"), ("batch_vs_batch_s.py", "float64")])
def test_the_seeds_examples_through_the_launcher_on_two_hosts(example, floatx):
    """``python -m synkhronos.launch`` on both "hosts", the seed's script unchanged on node 0 (its
    ``synk.fork(2, use_gpu=False)`` spans 1 rank here and 1 there); both launchers exit 0, and
    print nothing but the script's own lines: no gloo connection lines from the workers, no JAX
    warnings about float64 truncated on float32 work, no launcher logs.
    (``shared_variables.py`` fails under the JAX engine on one host too: after ``f.as_theano``,
    ``s.get_value()`` reads compute rank 0's value, not the master's; its collectives are
    :func:`test_shared_variable_collectives`.)"""
    from synk_comm.net import SECRET_ENV, new_secret
    from synkhronos.launch import free_port_pair

    ports = free_port_pair()
    port = ports.port
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNK_")}
    env[SECRET_ENV] = new_secret()  # the same on both hosts
    env["PYTENSOR_FLAGS"] = ",".join(filter(None, [env.get("PYTENSOR_FLAGS"), f"floatX={floatx}"]))

    def launcher(node: int, *script: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "synkhronos.launch", "--nnodes", "2", "--node-rank", str(node),
                                 "--nproc-per-node", "1", "--coordinator", f"127.0.0.1:{port}", *script],
                                env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    there = launcher(1)
    ports.release_master()  # node 0's master binds it
    here = launcher(0, os.path.join("examples", example))
    try:
        out, _ = here.communicate(timeout=100)
        assert here.returncode == 0 and "All assertions passed." in out, out[-3000:]
        assert there.wait(15) == 0
        others = there.stdout.read()
        noise = [line for line in out.splitlines() if not line.startswith(EXAMPLE_LINES[example])]
        assert not noise, f"lines the user cannot act on, from node 0: {noise}"
        assert not others, f"node 1's launcher printed: {others[-3000:]}"
    finally:
        ports.close()
        for proc in (here, there):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# --- the launcher's options --------------------------------------------------------------------------

SLURM_LISTS = {  # Slurm's host lists and their expansions by `scontrol show hostnames`
    "node[007-010]": ["node007", "node008", "node009", "node010"],
    "rack[1-2]-node[01-03]": ["rack1-node01", "rack1-node02", "rack1-node03",
                              "rack2-node01", "rack2-node02", "rack2-node03"],
    "gpu[03-05,07],cpu1": ["gpu03", "gpu04", "gpu05", "gpu07", "cpu1"],
    "a1,b2": ["a1", "b2"],
    "n[8-10]": ["n8", "n9", "n10"],
    "n[098-101]x": ["n098x", "n099x", "n100x", "n101x"],
    "login,c[1,3]-ib[0-1],d": ["login", "c1-ib0", "c1-ib1", "c3-ib0", "c3-ib1", "d"],
    "single": ["single"],
}


@pytest.mark.parametrize("nodelist", sorted(SLURM_LISTS))
def test_slurm_host_lists_expand_as_slurm_does(nodelist, monkeypatch):
    from synkhronos.launch import expand_hostlist, first_host

    monkeypatch.setenv("PATH", "")  # no scontrol: the parser
    assert expand_hostlist(nodelist) == SLURM_LISTS[nodelist]
    assert first_host(nodelist) == SLURM_LISTS[nodelist][0]


@pytest.mark.parametrize("bad", ["node[1-", "node]1[", "node[a-b]", "node[3-1]", ""])
def test_a_bad_slurm_host_list_is_refused(bad):
    from synkhronos.launch import expand_hostlist

    with pytest.raises(ValueError, match="Slurm host list"):
        expand_hostlist(bad)


def test_scontrol_reads_the_host_list_where_it_is_installed(tmp_path, monkeypatch):
    """With Slurm's ``scontrol`` on the PATH its expansion is used (a stand-in here that records its
    arguments); without it, or when it fails, the parser's."""
    from synkhronos.launch import first_host, hostnames

    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\necho from-scontrol-1\necho from-scontrol-2\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert hostnames("rack[1-2]-node[01-04]") == ["from-scontrol-1", "from-scontrol-2"]
    assert (tmp_path / "args").read_text().split() == ["show", "hostnames", "rack[1-2]-node[01-04]"]
    fake.write_text("#!/bin/sh\nexit 1\n")  # scontrol fails (no controller): the parser
    assert first_host("rack[1-2]-node[01-04]") == "rack1-node01"


def test_the_launcher_reads_slurm(monkeypatch):
    from synkhronos.launch import _parser

    for key in list(os.environ):
        if key.startswith("SYNK_COORDINATOR") or key == "SYNK_BIND_ADDRESS":
            monkeypatch.delenv(key)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setenv("SLURM_NNODES", "4")
    monkeypatch.setenv("SLURM_NODEID", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "rack[1-2]-node[007-010]")
    args = _parser().parse_args(["train.py", "--epochs", "3"])
    assert (args.nnodes, args.node_rank, args.coordinator) == (4, 2, "rack1-node007:29500")
    assert args.script == "train.py" and args.args == ["--epochs", "3"] and args.bind is None


def test_a_launch_without_the_runs_secret_is_refused(monkeypatch):
    from synkhronos.launch import main

    monkeypatch.delenv("SYNK_RUN_SECRET", raising=False)
    with pytest.raises(SystemExit, match="SYNK_RUN_SECRET is not set"):
        main(["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--coordinator", "127.0.0.1:1"])


def test_gpu_modes_code_across_hosts_on_emulated_gpus(monkeypatch):
    """GPU mode's code (the engine on one device per rank, each host its own devices) on JAX's CPU
    backend (``SYNK_EMULATE_GPUS``): 2 hosts of 1 emulated GPU."""
    if current() is not None:
        synk.close()
    monkeypatch.setenv("SYNK_EMULATE_GPUS", "1")
    with LocalNodes(nnodes=2, nproc_per_node=1, here=1) as nodes:
        assert synk.fork(use_gpu=True) == 2
        x = pt.matrix("x")
        w = pytensor.shared(np.ones(3), name="w")
        f = synk.function([x], outputs=[(pt.sum(x @ w), "sum"), pt.mean(x)], updates=[(w, w * 2)])
        value = np.arange(12.0).reshape(4, 3)
        total, mean = f(synk.data(value))
        np.testing.assert_allclose([total, mean], [value.sum(), value.mean()])
        np.testing.assert_array_equal(synk.gather(w, nd_up=1), np.full((2, 3), 2.0))
        assert nodes.stop() == {1: 0}
