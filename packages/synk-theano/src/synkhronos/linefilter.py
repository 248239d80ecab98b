"""Lines dropped from a stream, the rest forwarded as it comes: the filters of :mod:`synkhronos.quiet`.

Standard library only, so that it also runs as a filter process of its own (``python -I -S
linefilter.py KIND``: standard input to standard output, :data:`FILTERS`'s ``KIND``), without the
package's imports: a process whose standard error must stay filtered until its very end (native
code logs while the interpreter finalises) writes to such a process, which ends when the last
writer is gone.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

GLOO_PREFIX = b"[Gloo] Rank "
"""The start of gloo's lines dropped from standard output."""

WATCH_FAILED = b"WatchTasksAsync failed"
"""In the first line of the blocks of JAX's coordination client dropped from standard error."""

BLOCK_LINES = 8
"""The most lines of one dropped block after its first (those blocks hold 5, then a blank line)."""


class LineFilter:
    """Which lines of a stream pass: every line but those ``drop`` names, and after a line that
    ``starts_block`` names, the lines that follow it up to a blank one (at most :data:`BLOCK_LINES`).
    ``held(tail)``: whether a partial line waits for its end (it may still become a dropped line)
    rather than pass at once (a progress bar, a prompt)."""

    def __init__(self, drop: Callable[[bytes], bool], starts_block: Callable[[bytes], bool] | None = None,
                 held: Callable[[bytes], bool] | None = None) -> None:
        self.drop, self.starts_block = drop, starts_block
        self.held = held or (lambda tail: False)
        self._in_block = 0

    def keep(self, line: bytes) -> bool:
        """Whether ``line`` (without its newline) passes; called once per line, in order."""
        if self._in_block:
            self._in_block = 0 if not line.strip() else self._in_block - 1
            return False
        if self.starts_block is not None and self.starts_block(line):
            self._in_block = BLOCK_LINES
            return False
        return not self.drop(line)

    @property
    def in_block(self) -> bool:
        """Whether the lines that follow are dropped (a block has begun)."""
        return self._in_block > 0


def gloo_filter() -> LineFilter:
    """All but gloo's "connected" lines ("[Gloo] Rank r is NOT connected to: [...]" stays: it says
    which ranks could not be reached)."""
    return LineFilter(drop=lambda line: line.startswith(GLOO_PREFIX) and b" is connected to " in line,
                      held=lambda tail: GLOO_PREFIX.startswith(tail[:len(GLOO_PREFIX)]) or tail.startswith(GLOO_PREFIX))


def shutdown_filter() -> LineFilter:
    """All but the coordination client's ``WatchTasksAsync failed`` blocks; a partial line waits
    only while it could be one of their lines' start (a log line's ``W``, ``:``, ``===``)."""
    return LineFilter(drop=lambda line: False, starts_block=lambda line: WATCH_FAILED in line,
                      held=lambda tail: tail[:1] in (b"W", b":") or tail.startswith(b"=== "))


FILTERS: dict[str, Callable[[], LineFilter]] = {"gloo": gloo_filter, "shutdown": shutdown_filter}
"""The filters by name (a filter process's argument)."""


def forward(read_fd: int, write_fd: int, lines: LineFilter) -> None:
    """Copy ``read_fd`` to ``write_fd`` until end of file, the lines ``lines`` keeps only; closes
    ``read_fd``."""
    tail = b""
    while True:
        try:
            chunk = os.read(read_fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        split = (tail + chunk).split(b"\n")
        tail = split.pop()
        out = b"".join(line + b"\n" for line in split if lines.keep(line))
        if tail and not lines.in_block and not lines.held(tail):
            out, tail = out + tail, b""  # a partial line that cannot be a dropped one: now
        if out:
            try:
                os.write(write_fd, out)
            except OSError:
                pass
    if tail and lines.keep(tail):
        try:
            os.write(write_fd, tail)
        except OSError:
            pass
    os.close(read_fd)


def main(argv: list[str]) -> int:
    """A filter process: standard input to standard output through ``FILTERS[argv[0]]``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the writer decides
    if len(argv) != 1 or argv[0] not in FILTERS:
        sys.stderr.write(f"usage: linefilter.py {{{','.join(FILTERS)}}}\n")
        return 2
    forward(0, 1, FILTERS[argv[0]]())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
