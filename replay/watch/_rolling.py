"""An engine's rolling trace: its rows through the one segmented writer of
``replay record`` and ``replay watch`` (``replay.format.segments``), and
where each row landed (its segment and its seq there), so that a flagged
lookup's line names the segment that explains it alone.

The writer adds to each row's seq the snapshot rows written before it
(``seq_offset``), which changes only when a segment opens; a segment opens
at the first row of a write (``tick`` closed the last one) or after the
event bound closed one. Rows are therefore written in pieces that end at
the event bound, and every row of a piece has the offset the writer has
after it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from replay.base.spec import TraceConfig
from replay.format.segments import SEGMENT_NAME, SegmentedTraceWriter
from replay.sources.values import Row


class RollingTrace:
    def __init__(
        self,
        directory: Path,
        config: TraceConfig,
        *,
        segment_seconds: float | None,
        segment_events: int | None,
    ) -> None:
        self.directory = directory
        self.writer = SegmentedTraceWriter(
            directory,
            config,
            segment_seconds=segment_seconds,
            segment_events=segment_events,
        )
        self._in_segment = 0

    def set_source(self, source: Mapping[str, Any]) -> None:
        self.writer.set_source(source)

    def tick(self) -> None:
        """Close the open segment when it is old enough (also when idle)."""
        if self.writer.tick():
            self._in_segment = 0

    def write(self, rows: Sequence[Row]) -> list[tuple[Path, int]]:
        """Write ``rows``; each row's segment file and its seq there."""
        w = self.writer
        self.tick()
        bound = w.segment_events
        where: list[tuple[Path, int]] = []
        start = 0
        while start < len(rows):
            take = len(rows) - start
            if bound is not None:
                take = min(take, bound - self._in_segment)
            closed_before = len(w.segments)
            piece = rows[start : start + take]
            w.write_rows(piece)
            ended = bound is not None and self._in_segment + take >= bound
            if ended:
                self._in_segment = 0
                segment = w.segments[-1]
            else:
                # A segment closed by time as this piece began: it is the
                # first of a new one.
                opened = len(w.segments) > closed_before
                self._in_segment = take if opened else self._in_segment + take
                segment = self.directory / SEGMENT_NAME.format(len(w.segments))
            where.extend((segment, int(row["seq"]) + w.seq_offset) for row in piece)
            start += take
        return where

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        self.writer.abort()
