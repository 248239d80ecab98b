"""Names of the shared-memory objects of a run, their clean-up and the sweep of dead runs.

Every segment and semaphore that Synkhronos creates is named ``/synk<ns>-<pid>-<start>-<rest>``:

* ``ns``    the inode of the creating run's pid namespace (hex), so that two containers that
  share ``/dev/shm`` but not their pid namespace never collide or sweep each other;
* ``pid``   the run's root process (the master: workers inherit the name through
  ``SYNK_RUN_PREFIX``);
* ``start`` that process's start time in clock ticks since boot, so that a reused pid is a
  different run.

:func:`sweep` removes what runs of the same user whose root process is gone left behind; the
per-process registry unlinks, at interpreter exit and on SIGTERM/SIGHUP, everything this process
created and has not unlinked itself.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import threading
from collections.abc import Callable

import posix_ipc

__all__ = ["run_prefix", "new_name", "register", "unregister", "unlink_name", "unlink_prefix", "sweep"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
RUN_PREFIX_ENV = "SYNK_RUN_PREFIX"
_NAME_RE = re.compile(r"^(?:sem\.)?synk(?P<ns>[0-9a-f]+)-(?P<pid>\d+)-(?P<start>\d+)-")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # pragma: no cover - no procfs
        return 0


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])


def _own_prefix() -> str:
    pid = os.getpid()
    return f"/synk{_pid_namespace():x}-{pid}-{_start_time(pid) or 0}-"


_RUN_PREFIX = os.environ.get(RUN_PREFIX_ENV) or _own_prefix()
_counter = 0
_counter_lock = threading.Lock()


def run_prefix() -> str:
    """The name prefix of this run (the master's, inherited by its workers)."""
    return _RUN_PREFIX


def new_name(kind: str, prefix: str | None = None) -> str:
    """A fresh object name under ``prefix`` (default: this run's), unique within this process.

    ``kind`` is a short tag (letters only) that says what the object is: ``d`` for Data, ``b``
    for a group buffer, ``s`` for a semaphore...  Workers pass a prefix that names their rank.
    """
    global _counter
    with _counter_lock:
        _counter += 1
        n = _counter
    return f"{prefix or _RUN_PREFIX}{kind}{os.getpid()}.{n}"


# --- registry of what this process created ----------------------------------------------------

_created: dict[str, str] = {}  # name -> "shm" | "sem"
_registry_lock = threading.Lock()


def register(name: str, kind: str) -> None:
    """Remember that this process created ``name`` (kind ``"shm"`` or ``"sem"``)."""
    with _registry_lock:
        _created[name] = kind
    _install_handlers()


def unregister(name: str) -> None:
    with _registry_lock:
        _created.pop(name, None)


def unlink_name(name: str, kind: str = "shm") -> bool:
    """Unlink one segment or semaphore; True if it existed.  Never raises for a missing name."""
    unregister(name)
    try:
        if kind == "sem":
            posix_ipc.unlink_semaphore(name)
        else:
            posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def _entries() -> list[str]:
    try:
        return os.listdir(SHM_DIR)
    except OSError:  # pragma: no cover
        return []


def _unlink_entry(entry: str) -> bool:
    if entry.startswith("sem."):
        return unlink_name("/" + entry[4:], "sem")
    return unlink_name("/" + entry, "shm")


def unlink_prefix(prefix: str) -> int:
    """Unlink every segment and semaphore whose name starts with ``prefix``; returns the count.

    Workers call it with the run prefix when they find their master gone (its atexit never ran).
    """
    bare = prefix.lstrip("/")
    n = 0
    for entry in _entries():
        if entry.startswith((bare, "sem." + bare)):
            n += _unlink_entry(entry)
    return n


def _forget_parent_objects() -> None:
    """In a forked child: what the parent created is the parent's to unlink, not ours."""
    global _registry_lock
    _registry_lock = threading.Lock()
    _created.clear()


os.register_at_fork(after_in_child=_forget_parent_objects)


def cleanup() -> int:
    """Unlink everything this process created and still holds; returns the count."""
    with _registry_lock:
        items = list(_created.items())
    return sum(unlink_name(name, kind) for name, kind in items)


def sweep() -> int:
    """Remove segments and semaphores of this user's runs whose root process is gone.

    Only names of this pid namespace are considered: a run in another container that shares
    ``/dev/shm`` cannot be judged from here and is left alone.  Returns the number removed.
    """
    ns = f"{_pid_namespace():x}"
    uid = os.getuid()
    removed = 0
    for entry in _entries():
        m = _NAME_RE.match(entry)
        if m is None or m["ns"] != ns:
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, entry)).st_uid != uid:
                continue
        except OSError:
            continue
        if _start_time(int(m["pid"])) == int(m["start"]):
            continue  # the run is alive
        removed += _unlink_entry(entry)
    if removed:
        log.info("synk_shm: swept %d shared-memory objects left by dead runs", removed)
    return removed


# --- clean-up at exit and on termination signals ----------------------------------------------

_atexit_installed = False
_signals_installed = False


def _install_handlers() -> None:
    global _atexit_installed, _signals_installed
    if not _atexit_installed:
        _atexit_installed = True
        atexit.register(cleanup)
    if _signals_installed or threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread: the next call from it will
    _signals_installed = True
    for signum in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(signum)
        if previous in (signal.SIG_DFL, None):
            signal.signal(signum, _make_handler(signum))


def _make_handler(signum: int) -> Callable[[int, object], None]:
    def handler(_signum: int, _frame: object) -> None:
        for hook in list(_termination_hooks):
            try:
                hook()
            except Exception:  # pragma: no cover - best effort on the way out
                log.exception("synk_shm: termination hook failed")
        cleanup()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    return handler


_termination_hooks: list[Callable[[], None]] = []


def on_termination(hook: Callable[[], None]) -> None:
    """Run ``hook`` (before the registry's own clean-up) when SIGTERM or SIGHUP ends this process.

    The process group layer uses it to stop and clean up its workers.
    """
    _termination_hooks.append(hook)
    _install_handlers()
