"""Relay hooks: how a framework's commands cross hosts (:func:`relay`, :func:`on_agent_fork`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from synk_comm.net.agent import Agent
    from synk_comm.net.hub import Peer
    from synk_comm.net.span import SpanGroup

MasterHook = Callable[["SpanGroup", "Peer", Any], tuple[Any, Any]]
AgentHook = Callable[["Agent", Any, Any], Any]
_MASTER_HOOKS: dict[str, MasterHook] = {}
_REPLIES: dict[str, Callable[[Any], bool]] = {}
_AGENT_HOOKS: dict[str, AgentHook] = {}
_FORK_HOOKS: list[Callable[[Agent], None]] = []


def relay(name: str, *, master: MasterHook | None = None, agent: AgentHook | None = None,
          replies: Callable[[Any], bool] | None = None) -> None:
    """Register how command ``name`` crosses hosts.

    ``master(span, peer, payload) -> (payload for that host, extra)`` runs in the master for every
    other host before the command starts; ``agent(agent, payload, extra) -> payload`` runs in that
    host's agent before it starts the command in its own group.  Without hooks the payload goes
    unchanged.  ``replies(payload) -> bool``: whether every worker replies to this command (the
    replies then come back with its end, saving :meth:`SpanGroup.replies` a round trip).
    """
    if master is not None:
        _MASTER_HOOKS[name] = master
    if agent is not None:
        _AGENT_HOOKS[name] = agent
    if replies is not None:
        _REPLIES[name] = replies


def on_agent_fork(fn: Callable[[Agent], None]) -> None:
    """Call ``fn(agent)`` in every agent before it starts a new group (to drop per-group state)."""
    _FORK_HOOKS.append(fn)


