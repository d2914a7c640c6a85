"""A trace as a directory of v1 Parquet files (issue 13).

A day of a fleet's KV events does not fit one file, and files are how a
cluster's tasks divide the reading. The directory's ``*.parquet`` files, in
file-name order, are one event log: their seq ranges are disjoint and
increasing, and each carries the same ``replay.trace`` config. Both are
checked from the footers (the config, and the seq column's row-group
statistics) before any data is read, so a mismatched file fails at once with
a one-line error naming it, not after an hour of replay. Files whose
statistics are missing are checked again as their rows stream.

``TraceDir`` is a ``TraceReader``: ``open_trace`` returns one for a
directory, so every command that reads a trace accepts a directory
unchanged. Hidden files (an interrupted writer's temporary files start with
a dot) and other names are ignored.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from replay.base.errors import ReplayError, TraceError
from replay.format.paths import PARQUET, check_outputs, file_kind, staged_outputs
from replay.format.schema import TRACE_COLUMNS, TraceBatch, TraceFile
from replay.format.segments import segment_facts
from replay.format.trace import TraceReader
from replay.format.writer import TraceWriter
from replay.rules.coordinator import trace_cache

#: How ``replay split`` names its files: zero-padded so that file-name order
#: is seq order for any count up to a million files.
PART_NAME = "part-{:06d}.parquet"


def trace_files(path: Path) -> list[Path]:
    """The trace files of a directory, in the order their events come."""
    try:
        entries = sorted(os.listdir(path))
    except OSError as exc:
        raise TraceError(f"{path}: cannot list the directory ({exc.strerror or exc})") from None
    files = [
        path / name for name in entries if name.endswith(".parquet") and not name.startswith(".")
    ]
    for part in files:
        # Every part is read, or the directory is refused: a part skipped
        # would replay the trace without its events.
        _check_part(part)
    if not files:
        raise TraceError(f"{path}: no .parquet files in the directory (expected a trace's files)")
    return files


def _check_part(part: Path) -> None:
    """A part of a trace directory is a regular file to read, else one line
    naming it (a dangling symlink, a symlink loop, a FIFO, a directory)."""
    try:
        st = os.stat(part)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            what = "is a symlink loop"
        elif exc.errno == errno.ENOENT and os.path.islink(part):
            what = f"is a dangling symlink (to {os.readlink(part)})"
        else:
            what = f"cannot be read ({exc.strerror or exc})"
        raise TraceError(
            f"{part}: {what}; every .parquet file of a trace directory is a part of it"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else file_kind(st.st_mode)
        raise TraceError(
            f"{part}: is {kind}, expected a Parquet file (every .parquet file of a trace "
            "directory is a part of it)"
        )


def _seq_range(reader: TraceReader) -> tuple[int, int] | None:
    """The file's (min, max) seq from its footer, or None when a row group has
    no statistics (then the rows are checked as they stream)."""
    meta = reader._pf.metadata
    lo: int | None = None
    hi: int | None = None
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        if rg.num_rows == 0:
            continue
        col = next(
            (rg.column(c) for c in range(rg.num_columns) if rg.column(c).path_in_schema == "seq"),
            None,
        )
        stats = col.statistics if col is not None else None
        if stats is None or not stats.has_min_max:
            return None
        lo = stats.min if lo is None else min(lo, stats.min)
        hi = stats.max if hi is None else max(hi, stats.max)
    if lo is None or hi is None:
        return None
    return int(lo), int(hi)


def _skip_snapshots(files: list[_FileReader]) -> None:
    """A segment's snapshot rows (``replay.format.segments``) are skipped
    when the segment before it is in the directory and ended where the
    snapshot says: the directory then reads as the one log that was
    written. After a missing segment the snapshot is kept, and the log
    resumes from the state it rebuilds."""
    before: dict[str, Any] | None = None
    for reader in files:
        facts = segment_facts(reader._pf.metadata.metadata)
        if (
            facts is not None
            and before is not None
            and isinstance(facts.get("snapshot_rows"), int)
            and 0 < facts["snapshot_rows"] <= reader._pf.metadata.num_rows
            and facts.get("index") == _next_index(before)
            and facts.get("previous_last_seq") is not None
            and facts.get("previous_last_seq") == before.get("last_seq")
        ):
            reader.skip_rows = facts["snapshot_rows"]
        before = facts


def _next_index(facts: dict[str, Any]) -> int | None:
    index = facts.get("index")
    return index + 1 if isinstance(index, int) else None


class _FileReader(TraceReader):
    """One file of a directory: always a path."""

    path: Path


class TraceDir(TraceReader):
    """A validated, streaming view of a directory of trace files."""

    path: Path
    files: list[_FileReader]

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.name = str(self.path)
        self.files = [_FileReader(f) for f in trace_files(self.path)]
        first = self.files[0]
        self.config = first.config
        cache = trace_cache(first.config.source)
        # Row-group statistics of every file, checked before any row is read.
        before: tuple[Path, tuple[int, int]] | None = None
        for reader in self.files[1:]:
            if reader.config != self.config:
                raise TraceError(
                    f"{reader.path}: replay.trace config differs from {first.path.name}'s "
                    "(every file of a trace directory is recorded under the same config)"
                )
            if trace_cache(reader.config.source) != cache:
                raise TraceError(
                    f"{reader.path}: source.cache {trace_cache(reader.config.source)!r} differs "
                    f"from {first.path.name}'s {cache!r}"
                )
        _skip_snapshots(self.files)
        for reader in self.files:
            span = _seq_range(reader)
            if span is None:
                continue
            if before is not None and span[0] <= before[1][1]:
                raise TraceError(
                    f"{reader.path}: seq {span[0]}..{span[1]} does not come after "
                    f"{before[0].name}'s seq {before[1][0]}..{before[1][1]} (file-name order "
                    "must be seq order, the ranges disjoint)"
                )
            before = (reader.path, span)
        self.columns = [n for n in TRACE_COLUMNS if any(n in f.columns for f in self.files)]

    @property
    def num_rows(self) -> int:
        return sum(f.num_rows for f in self.files)

    @property
    def fixed_hash_width(self) -> int | None:
        widths = {f.fixed_hash_width for f in self.files}
        return widths.pop() if len(widths) == 1 else None

    def _validated(self, batch_size: int) -> Iterator[TraceBatch]:
        last: tuple[Path, int] | None = None
        for reader in self.files:
            for batch in reader._validated(batch_size):
                seq = batch.frame["seq"]
                if seq.len() and last is not None and int(seq[0]) <= last[1]:
                    raise TraceError(
                        f"{reader.path}: seq {int(seq[0])}: seq not strictly increasing "
                        f"(comes after seq {last[1]} of {last[0].name})"
                    )
                if seq.len():
                    last = (reader.path, int(seq[-1]))
                yield batch


def open_trace_dir(path: str | os.PathLike[str]) -> TraceDir:
    return TraceDir(path)


# ---------------------------------------------------------------- conversion


def batch_table(batch: TraceBatch) -> pa.Table:
    """A validated batch back as a trace table (what ``TraceWriter`` takes)."""
    frame = batch.frame.drop("n_hashes", "block_hashes").to_arrow()
    return frame.append_column("block_hashes", batch.hashes).select(list(TRACE_COLUMNS))


def split_trace(trace: str | os.PathLike[str], out_dir: str | os.PathLike[str], files: int) -> int:
    """Write ``trace`` as ``files`` files of equal rows, give or take one,
    into the new (or empty) directory ``out_dir``, whose parent must exist
    (as many files as rows when there are fewer). The directory appears
    whole or not at all. Returns the number of files written."""
    if files < 1:
        raise ReplayError(f"`files` {files}: expected at least 1")
    check_outputs({}, [trace], directories={"-o": out_dir})
    reader = open_trace(trace)
    total = reader.num_rows
    files = min(files, max(total, 1))  # never more files than rows
    # Where each file ends, in rows of the whole trace; empty files dropped.
    ends = sorted({(i + 1) * total // files for i in range(files)} - {0})
    written = 0
    with staged_outputs() as stage:
        tmp = stage.directory(out_dir)
        writer: TraceWriter | None = None
        done = 0
        try:
            for batch in reader.iter_batches(prefetch=True):
                table = batch_table(batch)
                start = 0
                while start < table.num_rows:
                    if writer is None or done == ends[written - 1]:
                        if writer is not None:
                            writer.close()
                        writer = TraceWriter(
                            tmp / PART_NAME.format(written),
                            reader.config,
                            hash_width=reader.fixed_hash_width,
                        )
                        written += 1
                    take = min(ends[written - 1] - done, table.num_rows - start)
                    writer.write_table(table.slice(start, take))
                    done += take
                    start += take
            if writer is None:  # an empty trace is one empty file
                writer = TraceWriter(
                    tmp / PART_NAME.format(0), reader.config, hash_width=reader.fixed_hash_width
                )
                written = 1
            writer.close()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
    return written


def cat_trace(trace: str | os.PathLike[str], out: str | os.PathLike[str]) -> int:
    """Write every event of ``trace`` (a directory, or a file) into the one
    file ``out``. Returns the rows written."""
    check_outputs({"-o": out}, [trace], formats={"-o": PARQUET})
    reader = open_trace(trace)
    with TraceWriter(out, reader.config, hash_width=reader.fixed_hash_width) as writer:
        for batch in reader.iter_batches(prefetch=True):
            writer.write_table(batch_table(batch))
    return writer.rows_written


#: What the commands and the library replay: a trace file, a directory of
#: them, a binary file object, or a reader already open.
TraceSource = TraceFile | TraceReader


def open_trace(path: TraceSource) -> TraceReader:
    """A reader of ``path``: a trace file, a directory of them, a binary file
    object, or a reader already open (returned as it is)."""
    if isinstance(path, TraceReader):
        return path
    if isinstance(path, str | os.PathLike) and Path(path).is_dir():
        # A directory of files is one trace (issue 13).
        return open_trace_dir(path)
    return TraceReader(path)
