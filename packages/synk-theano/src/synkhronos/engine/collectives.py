"""Collectives on shared variables under the JAX engine: jitted programs of the ranks' runtime.

The semantics are those of :mod:`synkhronos.collectives` with compute rank 0 in the master's
place; the checks there run first.  The master holds no value of its own
(:mod:`synkhronos.engine.master`): it sends one ``COLLECT`` command, which every worker carries
out (:func:`_collect`), and reads the replies.  Values that move between ranks never pass
through the master:

=============  ==================================================================================
broadcast      a program over the ranks' mesh: ``psum`` of rank 0's value (zeros in the others,
               whatever shape they held)
all_reduce     a program: ``psum`` / ``pmean`` / ``pmax`` / ``pmin``, ``prod`` of an
               ``all_gather`` (booleans reduce as integers); every rank stores the result
reduce         the same program; compute rank 0 stores the result (``in_place``) or replies it
all_gather     a program: each rank's value padded to the longest, ``all_gather``, then each
               rank's rows cut out (the lengths are static: one program per set of lengths)
scatter, set   each worker reads its own rows from the Data's shared memory (a numpy value given
_value,        by the user travels with the command)
broadcast of
values
gather,        each worker replies its value (they are the master's result); ``get_shapes`` and
get_value,     ``get_lengths`` reply the shapes only
get_shapes
=============  ==================================================================================

A program needs the same shape in every rank, so the master first asks for the shapes (one
small command) where they may differ: ``reduce`` and ``all_reduce`` refuse different shapes
there, ``all_gather`` needs them for its lengths, ``broadcast`` for the root's shape.  Shapes
found equal stay known (:attr:`~synkhronos.engine.master.Orchestrator.agreed`) while only
reductions and fetches follow: a loop of all-reduces asks once.

A *submitted* ``all_reduce`` (``synk.all_reduce.submit``, in the window's dispatch thread) is
done once every worker has queued its program behind everything before it
(:func:`synkhronos.engine.worker.queue_collective`): its effect is what every later operation
sees, and the next command reaches the workers while it runs, so a loop of them keeps the devices
busy.  A worker keeps at most :data:`~synkhronos.engine.worker.QUEUED_COLLECTIVES` such programs
unfinished (it waits for the oldest before it replies).  A failure on the devices (a peer gone)
surfaces in a later command.  The other collectives, submitted, run as they do when called, after
the call in flight is fetched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from synk_comm import Group, handler
from synkhronos.calls import normalise_positions
from synkhronos.engine import COLLECT, master
from synkhronos.engine.launch import ABORT_GRACE_S
from synkhronos.engine.program import AXIS, _shard_map
from synkhronos.engine.program import _reduce as _over_ranks
from synkhronos.engine.worker import Pending, queue_collective
from synkhronos.ops import without_empty_collective
from synkhronos.runtime import Runtime, current

if TYPE_CHECKING:
    from synkhronos.engine.device import EngineDevice

__all__ = ["run", "zero_ranks"]

Shapes = list[list[tuple[int, ...]]]
"""``[rank][variable]`` shapes."""


# --- the master ----------------------------------------------------------------------------------

_REPLIES = ("shapes", "read", "get", "reduce")
"""The actions whose workers reply (the others only act)."""


def _known_equal(rt: Runtime, sids: list[int]) -> bool:
    """Whether every rank is known to hold the same shape of each variable (no command since the
    last that found so could have changed one)."""
    orchestrator = rt.engine
    if orchestrator.agreed_at != rt.group.commands:
        orchestrator.agreed.clear()
        return False
    return all(sid in orchestrator.agreed for sid in sids)


def _still_equal(rt: Runtime, sids: list[int], before: int) -> None:
    """A command that changed no shape ran (the count was ``before`` it): the shapes known equal
    still are, and so are those of ``sids``, which it found equal."""
    orchestrator = rt.engine
    if orchestrator.agreed_at != before:
        orchestrator.agreed.clear()
    orchestrator.agreed.update(sids)
    orchestrator.agreed_at = rt.group.commands


def _command(rt: Runtime, action: str, sids: list[int], arg: Any = None) -> list[list[Any]]:
    """One ``COLLECT`` command; every compute rank's reply, in rank order ([] for an action
    without replies).  A worker that fails alone inside a collective's program leaves the others
    waiting in it: the master stops the group after the grace (whatever the last call set)."""
    rt.group.abort_grace_s = ABORT_GRACE_S
    with rt.group.command(COLLECT, (action, sids, arg)):
        pass
    if action not in _REPLIES:
        return []
    replies = rt.group.replies()
    return [replies[r + 1] for r in range(rt.size)]


def _shapes(rt: Runtime, sids: list[int]) -> Shapes:
    return [[tuple(int(n) for n in s) for s in reply] for reply in _command(rt, "shapes", sids)]


def _same_shapes(shapes: Shapes, sids: list[int]) -> None:
    for i in range(len(sids)):
        found = [s[i] for s in shapes]
        if len(set(found)) > 1:
            raise ValueError(f"every rank must hold the same shape to reduce; the ranks hold {found} "
                             "(nothing was reduced)")


def _broadcast(rt: Runtime, sids: list[int], values: list[Any] | None, **_: Any) -> None:
    if values is None:
        _command(rt, "broadcast", sids, _shapes(rt, sids)[0])
    else:
        _command(rt, "assign", sids, (values, None, None))


def _scatter(rt: Runtime, sids: list[int], values: list[Any], rows: list[Any], **_: Any) -> None:
    _command(rt, "assign", sids, (values, rows, "scatter"))


def _gather(rt: Runtime, sids: list[int], **_: Any) -> list[list[np.ndarray]]:
    return _command(rt, "read", sids)


def _all_gather(rt: Runtime, sids: list[int], **_: Any) -> None:
    shapes = _shapes(rt, sids)
    for i in range(len(sids)):
        rest = {s[i][1:] for s in shapes}
        if len(rest) > 1:
            raise ValueError(f"all_gather: the ranks' values differ in shape beyond axis 0 {[s[i] for s in shapes]}; "
                             "they cannot be concatenated (nothing was gathered)")
    _command(rt, "all_gather", sids, [tuple(s[i][0] for s in shapes) for i in range(len(sids))])


def _check_equal(rt: Runtime, sids: list[int]) -> int:
    """ValueError unless every rank holds the same shape of each variable (asked unless known);
    returns the command count after the check."""
    if not _known_equal(rt, sids):
        before = rt.group.commands
        _same_shapes(_shapes(rt, sids), sids)
        _still_equal(rt, sids, before)
    return rt.group.commands


def _reduce(rt: Runtime, sids: list[int], op: str, in_place: bool, **_: Any) -> list[np.ndarray]:
    before = _check_equal(rt, sids)
    result = _command(rt, "reduce", sids, (op, in_place, False))[0]
    _still_equal(rt, sids, before)
    return result


def _all_reduce(rt: Runtime, sids: list[int], op: str, **_: Any) -> None:
    before = _check_equal(rt, sids)
    _command(rt, "all_reduce", sids, (op, True, False))
    _still_equal(rt, sids, before)


def _all_reduce_pipelined(rt: Runtime, sids: list[int], op: str, **_: Any) -> None:
    """A submitted ``all_reduce``: done once every worker has queued it (its command also brings back
    the outputs of the pipelined call before it, if one is held)."""
    before = _check_equal(rt, sids)
    orchestrator = rt.engine
    previous, orchestrator.pipelined = orchestrator.pipelined, None
    rt.group.abort_grace_s = ABORT_GRACE_S
    try:
        with rt.group.command(COLLECT, ("all_reduce", sids, (op, True, True))):
            pass
    except BaseException as exc:
        if previous is not None:
            master.after_failure(rt, previous, exc)
        raise
    replies = rt.group.replies()
    if previous is not None:  # [lengths, *the previous call's reply]
        previous.resolve(rt, [replies[r + 1][1:1 + int(replies[r + 1][0][0])] for r in range(rt.size)])
    _still_equal(rt, sids, before)


def _set_value(rt: Runtime, sids: list[int], values: list[Any], rows: list[Any], target: int, **_: Any) -> None:
    _command(rt, "assign", sids, (values, rows, int(target)))


def _get_value(rt: Runtime, sids: list[int], target: int, **_: Any) -> list[np.ndarray]:
    return _command(rt, "get", sids, int(target))[target]


def _get_shapes(rt: Runtime, sids: list[int], **_: Any) -> list[list[tuple[int, ...]]]:
    shapes = _shapes(rt, sids)
    return [[s[i] for s in shapes] for i in range(len(sids))]


def zero_ranks(rt: Runtime, sids: list[int], ranks: list[int]) -> None:
    """Set the variables to zeros (of their shapes there) in compute ranks ``ranks``."""
    if ranks:
        _command(rt, "zero", sids, list(ranks))


_RUN: dict[str, Callable[..., Any]] = {
    "broadcast": _broadcast, "scatter": _scatter, "gather": _gather, "all_gather": _all_gather, "reduce": _reduce,
    "all_reduce": _all_reduce, "set_value": _set_value, "get_value": _get_value, "get_shapes": _get_shapes,
}


def run(rt: Runtime, name: str, payload: dict[str, Any], defer: bool = False) -> Any:
    """Collective ``name`` (checked by :mod:`synkhronos.collectives`) with its payload there;
    returns what the per-rank engine's command returns in the master.  ``defer`` (a submitted
    collective, in the window's dispatch thread): an ``all_reduce`` is only queued (see the module
    docstring); the others run after the call in flight is fetched."""
    args = {k: v for k, v in payload.items() if k != "nccl"}
    if defer and name == "all_reduce":
        return _all_reduce_pipelined(rt, **args)
    master.fetch(rt)
    return _RUN[name](rt, **args)


# --- a worker ------------------------------------------------------------------------------------

_PROGRAMS: dict[tuple[Any, ...], Any] = {}
"""The jitted collectives of this worker, by kind and static arguments (``jax.jit`` keeps one
executable per operand shapes); a worker serves one engine run, so the mesh never changes."""


def _jitted(rt: Runtime, key: tuple[Any, ...], body: Callable[..., tuple[Any, ...]], n: int) -> Any:
    """``jax.jit(shard_map(body))`` over the ranks' mesh, ``n`` replicated operands and results
    (each rank's own value: as in :mod:`synkhronos.engine.program`)."""
    program = _PROGRAMS.get(key)
    if program is None:
        import jax
        from jax.sharding import PartitionSpec as P

        specs = tuple([P()] * n)
        program = jax.jit(_shard_map()(body, mesh=rt.engine.mesh, in_specs=specs, out_specs=specs, check_vma=False))
        _PROGRAMS[key] = program
    return program


def _reduced(op: str, value: Any) -> Any:
    """``value`` reduced over the ranks by ``op`` (inside ``shard_map``; booleans as integers)."""
    dtype = np.dtype(value.dtype)
    if dtype.kind == "b":
        return _over_ranks(value.astype(np.int32), op, np.dtype(np.int32)).astype(dtype)
    return _over_ranks(value, op, dtype)


def _operands(rt: Runtime, variables: list[Any], shapes: list[tuple[int, ...]] | None = None) -> list[Any]:
    """Each variable's value as a replicated operand of a program (zeros of ``shapes[i]`` where
    this rank's value has another shape)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    device = cast("EngineDevice", rt.device)
    sharding = NamedSharding(rt.engine.mesh, P())
    out = []
    for i, var in enumerate(variables):
        value = device.global_value(var, sharding)
        if shapes is not None and tuple(value.shape) != tuple(shapes[i]):
            local = jax.numpy.zeros(shapes[i], dtype=var.type.dtype, device=device.device)
            value = jax.make_array_from_single_device_arrays(tuple(shapes[i]), sharding, [local])
        out.append(value)
    return out


def _decode(rt: Runtime, encoded: tuple[str, Any]) -> np.ndarray:
    """A value as :func:`synkhronos.collectives._encode` sent it: a Data's array (read in place from its
    shared memory), or the value itself."""
    kind, value = encoded
    if kind == "data":
        arr = rt.data[value].data
        assert arr is not None
        return arr
    return np.asarray(value)


def _own_rows(rt: Runtime, value: np.ndarray, rows: Any) -> np.ndarray:
    """This rank's part of ``value[rows]`` when it is scattered over the ranks."""
    count = len(range(*rows.indices(len(value)))) if isinstance(rows, slice) else len(rows)
    a, b = (int(p) for p in normalise_positions(count, rt.size)[rt.rank])
    return value[rows][a:b] if isinstance(rows, slice) else value[np.asarray(rows)[a:b]]


def _assign(rt: Runtime, variables: list[Any], values: list[Any], rows: list[Any] | None, how: Any) -> None:
    """Set values from the host: every rank (``how`` None), each rank its rows (``"scatter"``), or rank ``how``."""
    if isinstance(how, int) and how != rt.rank:
        return
    for i, var in enumerate(variables):
        value = _decode(rt, values[i])
        if how == "scatter":
            value = _own_rows(rt, value, rows[i])  # type: ignore[index]
        elif rows is not None and rows[i] is not ...:
            value = value[rows[i]]
        rt.device.set(var, value)


def _store(rt: Runtime, variables: list[Any], results: Any, wait: bool = True) -> None:
    """Keep a program's results as the variables' values, once it has finished (``wait``: a failure
    inside it, a peer gone from the collective, surfaces in this command, as in a call), or as
    dispatched (a submitted all-reduce, :func:`synkhronos.engine.worker.queue_collective`)."""
    import jax

    if wait:
        jax.block_until_ready(results)
    device = cast("EngineDevice", rt.device)
    for var, glob in zip(variables, results):
        device.store(var, glob)


@handler(COLLECT)
def _collect(group: Group, payload: tuple[str, list[int], Any]) -> None:
    if group.is_master:
        return
    rt = current()
    if rt is None or rt.engine is None:
        raise RuntimeError("this worker has not joined the engine's runtime (the JOIN command comes first)")
    action, sids, arg = payload
    variables = [rt.shared_var(sid) for sid in sids]
    device = rt.device
    if action == "shapes":
        group.reply([np.array(np.shape(device.raw(var)), dtype=np.int64) for var in variables])
    elif action == "read":
        group.reply([device.get(var) for var in variables])
    elif action == "get":
        group.reply([device.get(var) for var in variables] if rt.rank == arg else [])
    elif action == "assign":
        _assign(rt, variables, *arg)
    elif action == "zero":
        if rt.rank in arg:
            for var in variables:
                device.set(var, device.xp.zeros_like(device.raw(var)))
    elif action == "broadcast":
        import jax

        def bcast(*xs: Any) -> tuple[Any, ...]:
            first = jax.lax.axis_index(AXIS) == 0
            return tuple(_reduced("sum", jax.numpy.where(first, x, jax.numpy.zeros_like(x))) for x in xs)

        _store(rt, variables, _jitted(rt, ("broadcast", len(sids)), bcast, len(sids))(*_operands(rt, variables, arg)))
    elif action in ("all_reduce", "reduce"):
        import jax

        op, in_place, pipelined = arg

        def reduce(*xs: Any) -> tuple[Any, ...]:
            return tuple(_reduced(op, x) for x in xs)

        program = _jitted(rt, ("reduce", op, len(sids)), reduce, len(sids))
        if pipelined:  # stored as dispatched; its end is waited for with the next pipelined command
            def start() -> Pending:
                results = program(*_operands(rt, variables))
                _store(rt, variables, results, wait=False)
                return Pending([], [], results)

            queue_collective(group, rt, start)
            return
        results = program(*_operands(rt, variables))
        jax.block_until_ready(results)
        if action == "all_reduce" or (in_place and rt.rank == 0):
            _store(rt, variables, results)
        if action == "reduce":
            group.reply([np.asarray(r.addressable_data(0)) for r in results] if rt.rank == 0 and not in_place else [])
    elif action == "all_gather":
        _all_gather_here(rt, variables, arg)
    else:
        raise ValueError(f"unknown engine collective {action!r}")


def _all_gather_here(rt: Runtime, variables: list[Any], lengths: list[tuple[int, ...]]) -> None:
    """This rank's part of ``all_gather``: its values padded to the longest rank's, gathered in the
    program, each rank's rows cut out (``lengths[i][r]``: rank ``r``'s rows of variable ``i``)."""
    import jax
    import jax.numpy as jnp

    device = rt.device
    longest = [max(ls) for ls in lengths]
    for var, n in zip(variables, longest):  # pad this rank's value (a local op on its device)
        value = device.raw(var)
        if value.shape[0] < n:
            device.set(var, jnp.concatenate([value, jnp.zeros((n - value.shape[0], *value.shape[1:]), value.dtype)]))
    key = ("all_gather", tuple(tuple(ls) for ls in lengths))

    def gather(*xs: Any) -> tuple[Any, ...]:
        out = []
        for x, ls in zip(xs, lengths):
            stacked = without_empty_collective(lambda v: jax.lax.all_gather(v, AXIS))(x)
            out.append(jnp.concatenate([stacked[r, :n] for r, n in enumerate(ls)], axis=0))
        return tuple(out)

    _store(rt, variables, _jitted(rt, key, gather, len(variables))(*_operands(rt, variables)))
