"""Helpers of the synk-shm tests (a module of its own, not conftest: every package's tests run in one
pytest session, where the name ``conftest`` is not unique), and the bodies of spawned children."""

from __future__ import annotations

import os
import re
import signal
import time

import synk_shm

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^(?:sem\.)?synk(?P<ns>[0-9a-f]+)-(?P<pid>\d+)-(?P<start>\d+)-")


def own_entries(prefix: str | None = None) -> list[str]:
    """Entries of ``/dev/shm`` under ``prefix`` (default: this process's run prefix)."""
    bare = (prefix or synk_shm.run_prefix()).lstrip("/")
    return sorted(e for e in os.listdir(SHM_DIR) if e.startswith((bare, "sem." + bare)))


def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/pid/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def dead_run_entries() -> list[str]:
    """Synkhronos entries of this user and pid namespace whose root process is gone (judged from
    /proc here, independently of synk_shm's own helpers)."""
    ns = f"{os.stat('/proc/self/ns/pid').st_ino:x}"
    dead = []
    for entry in os.listdir(SHM_DIR):
        m = _NAME_RE.match(entry)
        if m is None or m["ns"] != ns:
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, entry)).st_uid != os.getuid():
                continue
        except FileNotFoundError:
            continue
        if proc_start_time(int(m["pid"])) != int(m["start"]):
            dead.append(entry)
    return sorted(dead)


# --- bodies of spawned child processes (importable by name in the child) --------------------------

def child_attach_and_follow(handle, commands, replies) -> None:
    """Attach ``handle`` and serve ``commands`` (tuples) from the parent until ``("stop",)``.

    ``("read",)`` -> the values; ``("write", key, value)`` -> d[key] = value in place;
    ``("update", handle)`` -> follow a reallocation; ``("check", key)`` -> d[key];
    ``("info",)`` -> (shape, tag, alloc_size, segment name).  Every reply is ``("ok", result)`` or
    ``("error", repr)``.
    """
    import numpy as np

    d = synk_shm.Data.attach(handle)
    try:
        while True:
            cmd = commands.get(timeout=30)
            try:
                if cmd[0] == "stop":
                    replies.put(("ok", None))
                    return
                if cmd[0] == "read":
                    result = np.array(d)
                elif cmd[0] == "write":
                    d[cmd[1]] = cmd[2]
                    result = None
                elif cmd[0] == "update":
                    d.update(cmd[1])
                    result = None
                elif cmd[0] == "check":
                    result = d[cmd[1]]
                elif cmd[0] == "info":
                    result = (d.shape, d.tag, d.ndim, d.handle().segment)
                elif cmd[0] == "resize":
                    d.set_length(cmd[1])
                    result = None
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                replies.put(("ok", result))
            except Exception as e:
                replies.put(("error", f"{type(e).__name__}: {e}"))
    finally:
        d.close()


def child_create_and_wait(n_segments: int, replies, how: str) -> None:
    """Create ``n_segments`` Data (and a registered semaphore), report the run prefix, then end
    ``how``: ``"exit"`` (normally, atexit cleans up), ``"sigterm"`` (signal to self) or ``"wait"``
    (sleep until killed from outside)."""
    import numpy as np
    import posix_ipc

    from synk_shm import naming

    keep = [synk_shm.Data(np.full((100, 10), i, dtype="float32")) for i in range(n_segments)]
    sem_name = naming.new_name("s")
    posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX).close()
    naming.register(sem_name, "sem")
    replies.put((synk_shm.run_prefix(), own_entries()))
    replies.close()
    replies.join_thread()  # the message is out before this process ends, whichever way
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler re-raises SIGTERM: never reached
    elif how == "wait":
        time.sleep(60)
    del keep  # "exit": leave the rest to atexit (the registry) and garbage collection


def child_forked(data, how: str) -> None:
    """In a child forked while ``data`` existed: drop it or clean up the way an exiting process
    does (``"close"``, ``"cleanup"``), or wait for the parent's SIGTERM (``"wait"``).  None of it
    may unlink the parent's segment."""
    from synk_shm import naming

    if how == "close":
        data.close()
    elif how == "cleanup":
        naming.cleanup()  # what atexit runs
    else:
        time.sleep(60)
