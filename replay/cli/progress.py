"""The one progress display of the long commands (run, check, diff,
report, minimize, synth, whatif, record): a line redrawn in place on a
terminal's stderr, with the time left when the total is known. When stderr is not
a terminal (a pipe, a log file, CI) or the command is quiet, there is no
display at all, so what is captured holds the results and nothing else."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replay.engine.answers import Progress


def clock(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    s = max(round(seconds), 0)
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Bar:
    """A one-line display on a terminal's stderr."""

    width = 24

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.shown = False

    def elapsed(self) -> float:
        """Seconds since the display began (never 0, so rates divide)."""
        return max(time.perf_counter() - self.started, 1e-9)

    def status(self, text: str) -> None:
        """Redraw the line as ``text`` (the rest of an older, longer line erased)."""
        sys.stderr.write(f"\r{text}\x1b[K")
        sys.stderr.flush()
        self.shown = True

    def count(self, done: int, total: int, what: str) -> None:
        """``done`` of ``total`` as a bar and a percentage, then ``what``, then
        the time left at the rate so far (from a second on: a rate measured
        over less is noise)."""
        fraction = min(done / total, 1.0) if total > 0 else 1.0
        filled = int(self.width * fraction)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = self.elapsed()
        eta = (
            f"  ETA {clock(elapsed * (1 - fraction) / fraction)}"
            if 0 < fraction < 1 and elapsed >= 1
            else ""
        )
        self.status(f"[{bar}] {100 * fraction:5.1f}%  {what}{eta}")

    def replay(self, p: Progress) -> None:
        """A replay's progress: events and lookups done, and their rates."""
        rate = 1 / self.elapsed()
        self.count(
            p.events,
            p.total_events,
            f"{p.events:,}/{p.total_events:,} events {p.events * rate:,.0f}/s  "
            f"{p.lookups:,} lookups {p.lookups * rate:,.0f}/s",
        )

    def steps(self, unit: str, total: int | None = None) -> Callable[[int], None]:
        """A callback given how many more ``unit`` are done (of ``total``,
        when it is known: a bar; else the count and the time)."""
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            if total is None:
                self.status(f"{done:,} {unit}  {self.elapsed():,.1f} s")
            else:
                self.count(done, total, f"{done:,}/{total:,} {unit}")

        return advance

    def note(self, text: str) -> None:
        """A message on a line of its own, below the progress line."""
        sys.stderr.write(("\n" if self.shown else "") + text + "\n")
        sys.stderr.flush()
        self.shown = False

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.shown = False


@contextlib.contextmanager
def progress_bar(quiet: bool = False) -> Iterator[Bar | None]:
    """A :class:`Bar` while the block runs, its line ended after it; ``None``
    (no display) when ``quiet`` or when stderr is not a terminal."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    bar = Bar()
    try:
        yield bar
    finally:
        bar.close()
