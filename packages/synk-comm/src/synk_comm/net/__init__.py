"""Groups that span hosts: one host's shared-memory group per host, joined over pyzmq.

Within a host, a group is what :func:`synk_comm.start` makes (lock-step over POSIX semaphores,
data through shared memory).  Between hosts, this module relays the master's commands:

* The **master** (the user's process, on node 0) binds a :class:`Hub` (a ZeroMQ ROUTER socket on
  ``tcp://ADDRESS:PORT``, the interface it is given) and drives a :class:`SpanGroup`: its own
  host's group (node 0's workers) and one :class:`Peer` per other host.  A :class:`SpanGroup`
  offers the master's side of a :class:`~synk_comm.Group` (``command``, ``run``, ``replies``, ``scratch``, ``barrier``,
  ``gather_object``, ``all_gather``, ``all_reduce``, ``close``), with the ranks of every host: node
  0's workers first, then each other node's in node order.
* On every other host a **node agent** (:class:`Agent`, a DEALER socket connected to the hub)
  starts that host's workers as its own shared-memory group (its own shared-memory names), in
  which the agent plays the master: it replays each command of the master into its group (the
  scratch slots, the payload, the master's part of the command: barriers and ``gather_object``)
  and sends back its workers' replies and errors.  The workers learn their ranks in the span from
  their environment (:attr:`Group.span_offset <synk_comm.group_base.GroupBase.span_offset>`,
  :attr:`Group.span_size <synk_comm.group_base.GroupBase.span_size>`).

Collectives of the workers of every host: ``all_gather`` and ``all_reduce`` of a group spanning
hosts go through each host's master (shared memory within the host, one array per host over
pyzmq); fast collectives across hosts belong to an existing distributed runtime (synkhronos' engine:
JAX's, NCCL across hosts on GPU, gloo on CPU).  Messages are pickles (protocol 5, numpy arrays as
out-of-band frames: no copy into the pickle).

Who may talk to whom: one secret per run
    Every message between the master and the agents carries an HMAC-SHA256 of its bytes under the
    run's secret (:func:`run_secret`: the ``secret`` argument, else ``SYNK_RUN_SECRET``; every host
    of the run has the same one), of the sender's (or the recipient's) ZeroMQ identity and of a
    sequence number.  A receiver checks it (:func:`hmac.compare_digest`) *before* anything is
    unpickled: a message without this run's signature, or one already seen (a replay), is dropped
    unread, and logged once per source address.  So a process that can reach the port but does not
    know the secret cannot run code in the master or an agent (a pickle is code), nor pose as a
    host, nor keep a lost host alive with heartbeats (they are signed too).  Not protected: the
    bytes are signed, not encrypted (someone who can read the network reads the data), and a flood
    of messages costs the receiver the time to check them.

    Why an HMAC rather than ZeroMQ's CURVE: CURVE needs a libzmq built with libsodium (pyzmq's own
    wheels have it, ``zmq.has("curve")``; distribution and source builds may not), and it proves
    nothing about the client by itself: the master would need a ZAP authenticator thread holding
    the allowed client keys, and every host a key pair handed out beforehand.  An HMAC needs one
    shared string and works with any libzmq; its cost is one SHA-256 pass over each message on each
    side (about 1-2 GB/s per core with the CPU's SHA extensions), against CURVE's encryption of
    every byte.

Relay hooks (:func:`relay`) let a framework rewrite a command for another host: the master's hook
gives each host its own payload and extra data (e.g. the input rows its ranks read), the agent's
hook applies them to the host's own copies (e.g. its shared-memory Data) before the command runs.

Failure, within :data:`HOST_TIMEOUT_S` (3 s) and no hang
    A worker that dies on another host: :class:`~synk_comm.WorkerDiedError` in the master (rank
    in the span, host named).  A worker's exception: :class:`~synk_comm.WorkerError` (rank and
    host in the message; the group stays usable unless the command was one program over every
    rank, see :attr:`Group.abort_grace_s <synk_comm.group_base.GroupBase.abort_grace_s>`).  An agent that stops
    answering (killed, host down, network):
    :class:`~synk_comm.HostLostError` naming the host (agents send heartbeats every
    :data:`HEARTBEAT_S`).  After any of the fatal ones the master closes its own group and tells
    every agent to close its group (their workers are stopped); the agents stay, ready for the
    next group.  An agent whose master is gone (its connection drops) stops its workers and exits
    with status 1; when the master's process ends normally, every agent exits with status 0.

Example
-------
The master's side; each other host runs ``Agent(address, node, nproc).serve()``, every process
with the same ``SYNK_RUN_SECRET``.

>>> hub = Hub("tcp://10.0.0.1:29500")                          # doctest: +SKIP
>>> group = SpanGroup.start(hub, nnodes=2, nproc=2)              # doctest: +SKIP
"""

from __future__ import annotations

from synk_comm.net.agent import Agent
from synk_comm.net.agent import MasterLostError as MasterLostError
from synk_comm.net.agent import main as main
from synk_comm.net.hooks import AgentHook as AgentHook
from synk_comm.net.hooks import MasterHook as MasterHook
from synk_comm.net.hooks import on_agent_fork as on_agent_fork
from synk_comm.net.hooks import relay
from synk_comm.net.hub import Hub, Peer
from synk_comm.net.span import SpanGroup
from synk_comm.net.wire import CLOSE_TIMEOUT_S as CLOSE_TIMEOUT_S
from synk_comm.net.wire import CONNECT_TIMEOUT_S as CONNECT_TIMEOUT_S
from synk_comm.net.wire import HEARTBEAT_S, HOST_TIMEOUT_S, SECRET_ENV, new_secret, run_secret
from synk_comm.net.wire import MIN_SECRET_BYTES as MIN_SECRET_BYTES
from synk_comm.net.wire import POLL_S as POLL_S
from synk_comm.net.wire import PROTOCOL as PROTOCOL
from synk_comm.net.wire import _pack as _pack
from synk_comm.net.wire import _Seal as _Seal
from synk_comm.net.wire import connect_timeout as connect_timeout

__all__ = ["Agent", "HEARTBEAT_S", "HOST_TIMEOUT_S", "Hub", "Peer", "SECRET_ENV", "SpanGroup", "new_secret", "relay",
           "run_secret"]
