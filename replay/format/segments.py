"""A trace written as closed segments, so a killed writer loses at most one.

A long-running writer (``replay record``, ``replay watch``) that writes one
Parquet file loses everything when it is killed: the footer that makes the
file readable is written at the end. :class:`SegmentedTraceWriter` writes a
*trace directory* (``replay.format.tracedir``) instead: the events go into
``segment-000000.parquet``, ``segment-000001.parquet``, ... and a segment is
closed (footer written, file synced to disk, renamed from its hidden
temporary name) every ``segment_seconds`` or every ``segment_events`` events.
After ``kill -9``, an out-of-memory kill or a power loss every closed
segment is a complete trace file; only the open one is lost (its temporary
file, ``.segment-NNNNNN.parquet.*.tmp``, is hidden from readers, and
``replay repair`` salvages its complete row groups).

**Each segment replays alone.** A segment after the first begins with a
*snapshot* of the store at its start: one ``clear`` row (every group), then
``store`` rows holding every present key, group by group, least recently
stored first. Folding a segment alone therefore gives exactly the state the
whole log had at that point, so every lookup of the segment gets the same
answer as in the whole trace. The footer key ``replay.segment`` (JSON) says
what the segment is::

    {"index": 3, "snapshot_rows": 5, "previous_last_seq": 41229,
     "first_seq": 41230, "last_seq": 52011, "events": 10777}

:class:`replay.format.tracedir.TraceDir` (what every command opens for a
directory) skips a segment's snapshot rows when the segment before it is
present and ended at ``previous_last_seq``, so the directory reads as the
one event log that was written; when a segment is missing (deleted, or
never closed) the snapshot is kept and the log resumes from the right state.

**Seq.** Snapshot rows need seq numbers of their own: the writer adds to
every row's ``seq`` the number of snapshot rows written before it
(:attr:`SegmentedTraceWriter.seq_offset`). Rows keep their order and the
first segment keeps its seqs; a caller that hands rows seq 0, 1, 2, ... finds
seq strictly increasing across the directory, with a gap where each
snapshot sits.

Usage::

    with SegmentedTraceWriter(out_dir, config, segment_seconds=60) as writer:
        for rows in stream:
            writer.write_table(rows)   # or write_rows(list of dicts)
            writer.tick()              # closes the segment once it is old enough
        writer.set_source({...})       # the last segment's (and later ones') source

Leaving the block normally (or with ``KeyboardInterrupt``: a recorder
stopped by Ctrl-C keeps what it heard) closes the open segment; leaving it
with an error removes the open segment's temporary file and keeps the
closed segments (each complete, recorded before the error), or removes the
directory when the writer created it and closed none.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import pyarrow as pa
import pyarrow.compute as pc

from replay.base.errors import ReplayError, TraceError
from replay.base.spec import TraceConfig
from replay.format.paths import (
    check_new_directory,
    new_file_mode,
    os_reason,
    signals_held,
)
from replay.format.writer import TraceWriter, events_table

#: The footer key of a segment's facts (see the module docstring).
SEGMENT_META_KEY = b"replay.segment"
#: How segments are named: file-name order is write order for a million.
SEGMENT_NAME = "segment-{:06d}.parquet"
#: Keys per snapshot ``store`` row (a few rows for a whole GPU cache).
SNAPSHOT_ROW_KEYS = 4096
#: Defaults of ``--segment``: a killed writer loses at most this much.
DEFAULT_SEGMENT_SECONDS = 60.0


def segment_facts(metadata: Mapping[bytes, bytes] | None) -> dict[str, Any] | None:
    """The ``replay.segment`` object of a file's footer metadata, or None
    (not a segment, or a value that is not a JSON object)."""
    raw = (metadata or {}).get(SEGMENT_META_KEY)
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


class _Keys:
    """The present keys per group, in the order they were last stored
    (the snapshot's order): the fold of store / remove / clear rows."""

    def __init__(self, num_groups: int) -> None:
        self.groups: list[dict[bytes, None]] = [{} for _ in range(num_groups)]

    def fold(self, table: pa.Table) -> None:
        kinds = table.column("kind").to_pylist()
        if not any(k in ("store", "remove", "clear") for k in kinds):
            return
        gids = table.column("group_id").to_pylist()
        hashes = table.column("block_hashes")
        for i, kind in enumerate(kinds):
            if kind == "store":
                keys = self.groups[gids[i]]
                for h in hashes[i].as_py() or ():
                    keys.pop(h, None)
                    keys[h] = None
            elif kind == "remove":
                keys = self.groups[gids[i]]
                for h in hashes[i].as_py() or ():
                    keys.pop(h, None)
            elif kind == "clear":
                for g, keys in enumerate(self.groups):
                    if gids[i] is None or gids[i] == g:
                        keys.clear()

    def snapshot(self) -> list[dict[str, Any]]:
        """``clear`` then ``store`` rows rebuilding this state from any state."""
        rows: list[dict[str, Any]] = [{"kind": "clear"}]
        for gid, keys in enumerate(self.groups):
            present = list(keys)
            for start in range(0, len(present), SNAPSHOT_ROW_KEYS):
                chunk = present[start : start + SNAPSHOT_ROW_KEYS]
                rows.append({"kind": "store", "group_id": gid, "block_hashes": chunk})
        return rows


class SegmentedTraceWriter:
    """Write a trace directory of segments, each closed every
    ``segment_seconds`` (None: no time bound) or ``segment_events`` rows
    (None: no count bound), whichever comes first. ``directory`` must be new
    or empty and its parent exist (it is created). ``clock`` is the time
    source of the time bound (``time.monotonic``; tests pass their own).
    ``source``: called as each segment closes, its ``source`` metadata (a
    recorder's gaps so far), until :meth:`set_source` gives the final one.
    See the module docstring for the layout and the guarantees.

    Attributes: ``rows_written`` (rows given, snapshots not counted),
    ``segments`` (the paths of the closed segments), ``seq_offset``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: TraceConfig,
        *,
        segment_seconds: float | None = DEFAULT_SEGMENT_SECONDS,
        segment_events: int | None = None,
        keep_on_interrupt: bool = True,
        clock: Callable[[], float] = time.monotonic,
        source: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        if segment_seconds is not None and not segment_seconds > 0:
            raise ReplayError(f"segment of {segment_seconds} s: expected a positive time")
        if segment_events is not None and segment_events < 1:
            raise ReplayError(f"segment of {segment_events} events: expected at least 1")
        self.path = Path(directory)
        self.name = str(self.path)
        self.config = config
        self.segment_seconds = segment_seconds
        self.segment_events = segment_events
        self.keep_on_interrupt = keep_on_interrupt
        self._clock = clock
        check_new_directory("-o", self.path)
        self._created = not self.path.exists()
        if self._created:
            with signals_held():
                try:
                    os.mkdir(self.path, new_file_mode(True))
                except OSError as exc:
                    raise TraceError(f"{self.name}: cannot write here ({os_reason(exc)})") from None
        self.rows_written = 0
        self.seq_offset = 0
        self.segments: list[Path] = []
        self._keys = _Keys(config.num_groups)
        self._open: TraceWriter | None = None
        self._opened_at = 0.0
        self._facts: dict[str, Any] = {}
        self._last_seq: int | None = None  # the last seq written (after the offset)
        self._source: Mapping[str, Any] | None = None
        self._source_of = source
        self._closed = False

    # ------------------------------------------------------------- writing

    def set_source(self, source: Mapping[str, Any]) -> None:
        """The ``source`` metadata of the open segment and every later one
        (a recorder's gap report, its stop reason)."""
        self._source = dict(source)
        if self._open is not None:
            self._open.set_source(self._source)

    def write_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Rows as dicts (``replay.format.writer.events_table``)."""
        if rows:
            self.write_table(events_table(rows, self.config))

    def write_table(self, table: pa.Table) -> None:
        """Append trace rows (their ``seq`` strictly increasing, as in a
        trace); a segment that reaches ``segment_events`` is closed at once,
        splitting ``table`` where needed."""
        if self._closed:
            raise TraceError(f"{self.name}: writer already closed")
        self.tick()
        start = 0
        while start < table.num_rows:
            writer = self._writer_for(table.slice(start, 1))
            take = table.num_rows - start
            if self.segment_events is not None:
                take = min(take, self.segment_events - self._facts["events"])
            part = table.slice(start, take)
            shifted = part.set_column(
                part.schema.get_field_index("seq"),
                "seq",
                pc.add(part.column("seq").cast(pa.int64()), self.seq_offset),
            )
            writer.write_table(shifted)
            self._keys.fold(part)
            self._facts["events"] += take
            self._facts["last_seq"] = self._last_seq = int(shifted.column("seq")[-1].as_py())
            self.rows_written += take
            start += take
            if self.segment_events is not None and self._facts["events"] >= self.segment_events:
                self._close_segment()

    def tick(self) -> bool:
        """Close the open segment if it is ``segment_seconds`` old; call it
        when idle too, so a quiet stream's segment still closes on time.
        True when a segment closed."""
        if (
            self._open is not None
            and self.segment_seconds is not None
            and self._clock() - self._opened_at >= self.segment_seconds
        ):
            self._close_segment()
            return True
        return False

    def _writer_for(self, first: pa.Table) -> TraceWriter:
        """The open segment, opened (with its snapshot) when there is none."""
        if self._open is not None:
            return self._open
        index = len(self.segments)
        path = self.path / SEGMENT_NAME.format(index)
        writer = TraceWriter(path, self.config, durable=True)
        if self._source is not None:
            writer.set_source(self._source)
        snapshot_rows = 0
        if index > 0:
            rows = self._keys.snapshot()
            # The snapshot takes the seqs just below the first row's.
            base = int(first.column("seq")[0].as_py()) + self.seq_offset
            for i, row in enumerate(rows):
                row["seq"] = base + i
            try:
                writer.write_rows(rows)
            except BaseException:
                writer.abort()
                raise
            snapshot_rows = len(rows)
            self.seq_offset += snapshot_rows
        self._open = writer
        self._opened_at = self._clock()
        self._facts = {
            "index": index,
            "snapshot_rows": snapshot_rows,
            "previous_last_seq": self._last_seq,
            "first_seq": None,
            "last_seq": None,
            "events": 0,
        }
        self._facts["first_seq"] = int(first.column("seq")[0].as_py()) + self.seq_offset
        return writer

    def _close_segment(self) -> None:
        writer, self._open = self._open, None
        if writer is None:
            return
        if self._source is None and self._source_of is not None:
            writer.set_source(self._source_of())
        writer.set_footer(SEGMENT_META_KEY, json.dumps(self._facts, sort_keys=True).encode())
        try:
            writer.close()
        except BaseException:
            writer.abort()
            raise
        self.segments.append(writer.path)

    # ------------------------------------------------------------- ending

    def close(self) -> None:
        """Close the open segment; a writer that was given no row writes one
        empty segment, so the directory is a valid (empty) trace."""
        if self._closed:
            return
        if self._open is None and not self.segments:
            empty = TraceWriter(self.path / SEGMENT_NAME.format(0), self.config, durable=True)
            if self._source is not None:
                empty.set_source(self._source)
            self._open = empty
            self._facts = {
                "index": 0,
                "snapshot_rows": 0,
                "previous_last_seq": None,
                "first_seq": None,
                "last_seq": None,
                "events": 0,
            }
        self._close_segment()
        self._closed = True

    def abort(self) -> None:
        """Remove the open segment's temporary file; the closed segments
        stay, and the directory goes too when this writer made it and
        closed none."""
        if self._closed:
            return
        self._closed = True
        writer, self._open = self._open, None
        if writer is not None:
            writer.abort()
        if self._created and not self.segments:
            with signals_held(), contextlib.suppress(OSError):
                os.rmdir(self.path)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None or (self.keep_on_interrupt and exc_type is KeyboardInterrupt):
            self.close()
        else:
            self.abort()
