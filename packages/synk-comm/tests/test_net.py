"""synk_comm.net on its own (no synkhronos): a group spanning two "hosts" on this machine, node 0's
master with 1 worker here and a bare node agent (``python -m synk_comm.net``, a process of its own,
its own shared-memory names) with 2 workers: commands, replies, the master's collectives with the
workers of both hosts, a worker's error named with its host, close, and the agent's exit when the
master's side ends.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("zmq")

import net_handlers as h
from comm_testutil import python_env, run_entries, wait_gone

import synk_comm
from synk_comm import net

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(nproc_there: int = 2) -> tuple[net.Hub, net.SpanGroup, subprocess.Popen[str]]:
    """A hub here, a bare agent with ``nproc_there`` workers, and the group over both (1 worker here)."""
    port = free_port()
    secret = net.new_secret()
    agent = subprocess.Popen([sys.executable, "-m", "synk_comm.net", f"tcp://127.0.0.1:{port}", "1",
                              str(nproc_there)], env=dict(python_env(), **{net.SECRET_ENV: secret}),
                             stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    hub = net.Hub(f"tcp://127.0.0.1:{port}", secret=secret)
    try:
        return hub, net.SpanGroup.start(hub, nnodes=2, nproc=1, imports=["net_handlers"], timeout=30), agent
    except BaseException:
        hub.shutdown()
        agent.kill()
        raise


@pytest.fixture(scope="module")
def span():
    hub, group, agent = start()
    try:
        yield group, agent
        group.close()
        hub.shutdown()  # the master's side ends: the agent exits 0
        assert agent.wait(10) == 0, agent.stderr.read()[-2000:]
        assert not run_entries(agent.pid), "the agent left shared memory"
    finally:
        hub.shutdown()
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_commands_and_replies_span_both_hosts(span):
    group, _ = span
    assert (group.size, group.workers, [p.nproc for p in group.peers]) == (4, [1, 2, 3], [2])
    with group.command(h.RANK, 7):
        pass
    replies = group.replies()
    assert sorted(replies) == [1, 2, 3]
    assert [(int(v[0][0]), int(v[0][1])) for _, v in sorted(replies.items())] == [(1, 7), (2, 7), (3, 7)]
    assert len({int(v[0][2]) for v in replies.values()}) == 3  # three processes


def test_numbers_replies_are_refused_in_a_group_spanning_hosts(span):
    """``reply_values`` writes a row that only its own host's master reads: every worker of a
    span is told to reply by message instead."""
    group, _ = span
    with group.command(h.NUMBERS):
        pass
    assert {r: int(v[0][0]) for r, v in group.replies().items()} == {1: 1, 2: 1, 3: 1}


def test_the_masters_collectives_reach_every_host(span):
    group, _ = span
    assert group.run(h.GATHER) == [None, ("rank", 1), ("rank", 2), ("rank", 3)]
    everything = group.run(h.ALL_GATHER)
    assert [len(a) for a in everything] == [0, 1, 2, 3]
    for rank, reply in group.replies().items():  # every worker of every host got the whole list
        np.testing.assert_array_equal(reply[0], [4, 0, 1, 2, 3], err_msg=f"rank {rank}")
    group.run(h.BARRIER)


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
@pytest.mark.parametrize("n", [5, 300_000])
def test_all_reduce_within_each_host_then_across_hosts(span, op, n):
    group, _ = span
    parts = np.stack([h.rank_values(r, n) for r in range(group.size)])
    expected = {"sum": parts.sum(0), "avg": parts.mean(0), "max": parts.max(0)}[op]
    result = group.run(h.ALL_REDUCE, (op, n))
    np.testing.assert_allclose(result, expected, rtol=1e-12, atol=1e-14)  # the hosts group the sum
    for rank, reply in group.replies().items():  # the same bits everywhere
        np.testing.assert_array_equal(reply[0], result, err_msg=f"rank {rank}")


def test_a_workers_error_names_its_rank_and_host_and_the_group_goes_on(span):
    group, _ = span
    with pytest.raises(synk_comm.WorkerError, match=r"rank 3 \(host .+\) raised ValueError: rank 3 fails") as info:
        group.run(h.FAIL, 3)
    assert info.value.ranks == [3]
    with pytest.raises(ValueError, match="no handler named"), group.command("net.nothing"):
        pass
    with group.command(h.RANK, 1):
        pass
    assert sorted(group.replies()) == [1, 2, 3]


def test_a_killed_agent_is_reported_by_host_within_the_timeout():
    hub, group, agent = start(nproc_there=1)
    try:
        with group.command(h.SLEEP, 0.0):
            pass
        there = int(group.replies()[2][0][0])
        t0 = time.monotonic()
        lost = pytest.raises(synk_comm.HostLostError, match=r"host .+ \(ranks 2\) was lost")
        with lost as info, group.command(h.SLEEP, 30.0):
            agent.kill()
        assert time.monotonic() - t0 < net.HOST_TIMEOUT_S + 2
        assert info.value.ranks == [2] and isinstance(info.value, synk_comm.WorkerDiedError)
        assert group.closed
        assert not wait_gone([there], 5.0), "the lost host's worker outlived its agent"
        assert not wait_gone([agent.pid], 1.0) and not run_entries(agent.pid)
    finally:
        group.close()
        hub.shutdown()
        agent.kill()
        agent.wait()


def test_identities_leave_every_value_unchanged():
    from synk_comm.ops import ReduceOp, identity

    values = {"float32": np.array([-np.inf, -3.5, 0.0, 2.0, np.inf], "float32"),
              "int16": np.array([-32768, -1, 0, 7, 32767], "int16"), "bool": np.array([False, True])}
    for name, v in values.items():
        for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN):
            if name == "bool" and op in (ReduceOp.SUM, ReduceOp.PROD):
                continue
            e = np.full_like(v, identity(op, v.dtype))
            np.testing.assert_array_equal(op.ufunc(v, e), v, err_msg=f"{op} of {name}")


class _CreatesFile:
    """A pickle that creates a file when it is unpickled (what an outsider would send)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_messages_without_the_runs_signature_are_dropped_unread(tmp_path, caplog):
    """An outsider's pickle (unsigned, signed with another secret, or a replay of a signed message)
    reaches the hub and is dropped before it is unpickled: nothing runs, one warning per address."""
    import zmq

    port = free_port()
    secret = net.new_secret()
    hub = net.Hub(f"tcp://127.0.0.1:{port}", secret=secret)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"node1-1")
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        evil = [tmp_path / f"pwned{i}" for i in range(3)]
        hello = net._pack(("hello", 1, "outsider", 1, 1, net.PROTOCOL))
        signed = net._Seal(secret.encode()).seal(b"node1-1", hello)
        with caplog.at_level("DEBUG", logger="synk_comm.net"):
            sock.send_multipart(net._pack(_CreatesFile(str(evil[0]))))
            sock.send_multipart(net._Seal(net.new_secret().encode()).seal(b"node1-1",
                                                                          net._pack(_CreatesFile(str(evil[1])))))
            sock.send_multipart([bytes(signed[0]), *net._pack(_CreatesFile(str(evil[2])))])  # a tag, not its body
            sock.send_multipart([bytes(f) for f in signed])  # the real one: a host says hello
            sock.send_multipart([bytes(f) for f in signed])  # replayed
            deadline = time.monotonic() + 10
            while hub._refused.count < 4 and time.monotonic() < deadline:
                hub.pump(0.05)
        assert not any(p.exists() for p in evil), "an unsigned pickle was unpickled"
        assert hub._refused.count == 4 and [p.host for p in hub.peers.values()] == ["outsider"]
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "without this run's signature" in warnings[0].getMessage()
        assert "127.0.0.1" in warnings[0].getMessage()
    finally:
        sock.close(0)
        ctx.term()
        hub.shutdown()


def test_a_run_without_a_secret_is_refused(monkeypatch):
    monkeypatch.delenv(net.SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="SYNK_RUN_SECRET is not set"):
        net.Hub(f"tcp://127.0.0.1:{free_port()}")
    monkeypatch.setenv(net.SECRET_ENV, "short")
    with pytest.raises(ValueError, match="fewer than 16"):
        net.Agent("tcp://127.0.0.1:1", 1, 1)
