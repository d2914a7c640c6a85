"""The trace reader (format v1, ``docs/format.md``): a path, a file object or
an in-memory table; the metadata and the schema are checked up front and every
row batch as it streams (replay.format.validate), so a trace larger than memory
can be read and a bad row is reported by its ``seq``. The batches are
prefetched on a thread while the caller works on the previous one."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from replay.base.errors import ConfigError, ReplayError, TraceError
from replay.base.limits import FOOTER_BYTES, GROUP_HASHES, HASH_BYTES, ROW_HASHES, TEXT_BYTES
from replay.base.spec import TraceConfig
from replay.base.text import utf8_path
from replay.format.paths import check_input
from replay.format.schema import (
    EMPTY_POLARS,
    TRACE_COLUMNS,
    TraceBatch,
    TraceFile,
    check_config_limits,
    check_schema,
    one_line,
    read_config,
)
from replay.format.validate import validate_rows
from replay.format.writer import conform, stream_name, trace_schema
from replay.rules.coordinator import check_config, trace_cache


def _ends(fh: BinaryIO) -> tuple[int, bytes, bytes]:
    """A seekable file's size, its first four bytes and its last eight (the
    footer's length, then the magic)."""
    size = fh.seek(0, os.SEEK_END)
    fh.seek(0)
    head = fh.read(4)
    fh.seek(max(0, size - 8))
    tail = fh.read(8)
    fh.seek(0)
    return size, head, tail


def open_parquet(path: TraceFile) -> pq.ParquetFile:
    source: str | BinaryIO
    if isinstance(path, str | os.PathLike):
        try:
            p = str(check_input(path, "a Parquet file"))
        except ReplayError as exc:
            raise TraceError(str(exc)) from None
        source = p
        try:
            with open(p, "rb") as fh:
                size, head, tail = _ends(fh)
        except OSError as exc:  # a file that cannot seek (/proc/self/mem) names itself
            raise TraceError(f"{p}: cannot read ({exc.strerror or exc})") from None
    else:
        source = path
        p = stream_name(path)
        try:
            size, head, tail = _ends(path)
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            raise TraceError(
                f"{p}: cannot read it as a seekable binary file ({one_line(exc)})"
            ) from None
    if size == 0:
        raise TraceError(f"{p}: empty file, expected a Parquet file")
    if head != b"PAR1":
        raise TraceError(f"{p}: not a Parquet file (no PAR1 magic at the start)")
    if tail[-4:] != b"PAR1":
        raise TraceError(f"{p}: truncated Parquet file (no PAR1 magic at the end)")
    footer = int.from_bytes(tail[:4], "little") if len(tail) == 8 else 0
    if footer > FOOTER_BYTES.value():
        raise FOOTER_BYTES.refuse(f"{p}: its footer declares", footer, TraceError)
    owned: BinaryIO | None = None
    if isinstance(source, str) and not utf8_path(source):
        # Arrow takes only UTF-8 names: any other is read through Python,
        # the file closed when the reader goes.
        source = owned = open(source, "rb")  # noqa: SIM115
    try:
        pf = pq.ParquetFile(source)
        if owned is not None:
            weakref.finalize(pf, owned.close)
        # The footer is decoded lazily: a column name or a metadata key that
        # is not UTF-8 (a damaged footer) fails here, not in a later reader.
        pf.schema_arrow  # noqa: B018
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        if owned is not None:
            owned.close()
        raise TraceError(f"{p}: unreadable Parquet file ({one_line(exc)})") from None
    return pf


T = TypeVar("T")


def prefetched(batches: Iterator[T]) -> Iterator[T]:
    """Run ``batches`` one step ahead on a thread; errors surface in order.
    Stages chain: each runs on its own thread while the caller works."""
    import queue
    import threading

    q: queue.Queue[tuple[T | None, BaseException | None]] = queue.Queue(maxsize=1)
    stop = threading.Event()

    def produce() -> None:
        try:
            for batch in batches:
                if stop.is_set():
                    return
                q.put((batch, None))
            q.put((None, None))
        except BaseException as exc:  # handed to the consumer, raised there
            q.put((None, exc))

    worker = threading.Thread(target=produce, name="trace-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            try:
                # Short waits: a signal the kernel gave a worker thread is
                # handled only once the main thread runs Python again.
                batch, exc = q.get(timeout=0.1)
            except queue.Empty:
                continue
            if exc is not None:
                raise exc
            if batch is None:
                return
            yield batch
    finally:
        stop.set()
        while worker.is_alive():
            try:
                q.get_nowait()
            except queue.Empty:
                worker.join(timeout=0.05)


def _declared_hashes(rg: Any) -> int:
    """The hashes a row group's footer declares (0 when it says nothing)."""
    for c in range(rg.num_columns):
        col = rg.column(c)
        if col.path_in_schema.startswith("block_hashes."):
            return int(col.num_values)
    return 0


def _is_text(typ: pa.DataType) -> bool:
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return True
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        return _is_text(typ.value_type)
    return False


def check_declared_text(pf: pq.ParquetFile, path: str) -> None:
    """Before any row is decoded: no text column (strings, or lists of them,
    as a results file's flags) declares more than ``--max-text-bytes`` in one
    row group. Traces and results files alike."""
    text = TEXT_BYTES.value()
    texts = {f.name for f in pf.schema_arrow if _is_text(f.type)}
    meta = pf.metadata
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        for c in range(rg.num_columns):
            col = rg.column(c)
            name = col.path_in_schema.split(".", 1)[0]
            if name in texts and col.total_uncompressed_size > text:
                raise TEXT_BYTES.refuse(
                    f"{path}: row group {i} column {col.path_in_schema!r} declares",
                    col.total_uncompressed_size,
                )


def check_declared_sizes(pf: pq.ParquetFile, path: str) -> None:
    """Before any row is decoded: the sizes the footer declares are within
    the limits of ``replay.base.limits`` (hashes per row group, per row on
    average, bytes per fixed-width hash). A refusal names the limit and the
    option that raises it."""
    hashes_type = pf.schema_arrow.field("block_hashes").type
    width = hashes_type.value_type
    if pa.types.is_fixed_size_binary(width) and width.byte_width > HASH_BYTES.value():
        raise HASH_BYTES.refuse(f"{path}: column 'block_hashes' holds hashes of", width.byte_width)
    meta = pf.metadata
    per_row, per_group = ROW_HASHES.value(), GROUP_HASHES.value()
    check_declared_text(pf, path)
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        declared = _declared_hashes(rg)
        if declared > per_group:
            raise GROUP_HASHES.refuse(f"{path}: row group {i} declares", declared)
        rows = max(1, rg.num_rows)
        if declared > rows * per_row:
            raise ROW_HASHES.refuse(
                f"{path}: row group {i} declares {declared:,} hashes in {rows:,} row{'s' * (rows != 1)}, at least",
                -(-declared // rows),
            )


class TraceReader:
    """A validated, streaming view of a trace file: a path, or a seekable
    binary file object (``io.BytesIO``, an open file), which the reader then
    reads from until it is done with it. Open once and pass it down: every
    replay, explain and report function takes a reader where it takes a path.

    ``skip_rows``: rows at the start of the file that are not read (a
    segment's snapshot, when a trace directory reads the segment before it;
    ``replay.format.segments``)."""

    skip_rows = 0

    def __init__(self, path: TraceFile) -> None:
        #: The file (None for a file object) and how errors name it.
        self.path: Path | None = None
        if isinstance(path, str | os.PathLike):
            self.path = Path(path)
            self.name = str(self.path)
        else:
            self.name = stream_name(path)
        self._pf = open_parquet(path)
        self.config = read_config(self._pf, self.name)
        self.columns = check_schema(self.name, self._pf.schema_arrow)
        check_declared_sizes(self._pf, self.name)

    @property
    def num_rows(self) -> int:
        return int(self._pf.metadata.num_rows) - self.skip_rows

    @property
    def fixed_hash_width(self) -> int | None:
        """The byte width of every hash when the file stores ``block_hashes``
        as fixed-size binary (``TraceWriter``'s ``hash_width``), else None:
        a copy of the trace (``replay split``, ``cat``) keeps that layout."""
        value = getattr(self._pf.schema_arrow.field("block_hashes").type, "value_type", None)
        return (
            value.byte_width if value is not None and pa.types.is_fixed_size_binary(value) else None
        )

    def iter_batches(
        self, batch_size: int = 65_536, *, prefetch: bool = False
    ) -> Iterator[TraceBatch]:
        """Validated row batches: every column but ``block_hashes`` as a polars
        frame (absent optional columns as nulls, plus ``n_hashes``), and the
        hashes as the Arrow list array they were read as (no copy). With
        ``prefetch`` the next batch is read, decoded and validated on a
        thread while the caller works on this one (Parquet decoding and
        polars release the GIL)."""
        batches = self._validated(batch_size)
        if not prefetch:
            yield from batches
            return
        yield from prefetched(batches)

    def _validated(self, batch_size: int) -> Iterator[TraceBatch]:
        last_seq: int | None = None
        try:
            for raw in self._batches(batch_size):
                batch, last_seq = validate_rows(self.name, self.config, raw, last_seq)
                yield batch
        except (pa.ArrowException, OSError) as exc:
            raise self._unreadable(exc) from None

    def _unreadable(self, exc: Exception) -> TraceError:
        return TraceError(
            f"{self.name}: {_unreadable_column(self._pf, self.columns)}"
            f"unreadable Parquet data ({one_line(exc)})"
        )

    def iter_frames(
        self, columns: Sequence[str] | None = None, batch_size: int = 65_536
    ) -> Iterator[pl.DataFrame]:
        """Validated row batches as polars frames with every column of the
        format; ``columns`` narrows the output, never the validation."""
        wanted = list(columns) if columns is not None else list(TRACE_COLUMNS)
        for batch in self.iter_batches(batch_size):
            frame = batch.frame.drop("n_hashes")
            if "block_hashes" in wanted:
                # Converting every hash costs: only done when asked for.
                hashes = pl.Series("block_hashes", batch.hashes).cast(pl.List(pl.Binary))
                frame = frame.with_columns(hashes)
            yield frame.select(wanted)

    #: Batches hold about this many bytes (uncompressed, all columns):
    #: small enough that the prefetch thread overlaps the caller's work and
    #: memory stays bounded whatever the row groups' size, large enough that
    #: per-batch costs vanish.
    BATCH_BYTES = 16 << 20
    #: And about this many hashes at most (where the footer declares them).
    BATCH_HASHES = 1 << 20

    def _batches(self, batch_size: int) -> Iterator[pa.RecordBatch | pa.Table]:
        skip = self.skip_rows
        for batch in self._row_group_batches(batch_size):
            if skip:
                taken = min(skip, batch.num_rows)
                skip -= taken
                batch = batch.slice(taken)
                if batch.num_rows == 0:
                    continue
            yield batch

    def _row_group_batches(self, batch_size: int) -> Iterator[pa.RecordBatch | pa.Table]:
        cols = list(self.columns)
        meta = self._pf.metadata
        for i in range(meta.num_row_groups):
            rg = meta.row_group(i)
            if rg.num_rows == 0:
                continue
            # Parquet streams within a row group, so one huge row group costs
            # a batch's memory, not the row group's.
            rows = rg.num_rows * self.BATCH_BYTES // max(1, rg.total_byte_size)
            # Dictionary-encoded hashes decode to far more than their pages:
            # the declared hash count bounds a batch too.
            hashes = _declared_hashes(rg)
            if hashes:
                rows = min(rows, rg.num_rows * self.BATCH_HASHES // hashes)
            rows = max(1, min(batch_size, rows))
            # One thread decodes a batch's columns: the hashes are nearly all
            # of the work, and the callers overlap the decoding with their
            # own threads (the replay's pipeline). Arrow's column threads
            # saved no time on 2 cores and held more buffers: the
            # 300k-request day's peak RSS 568 MB with one against 628.
            yield from self._pf.iter_batches(
                batch_size=rows, row_groups=[i], columns=cols, use_threads=False
            )

    def read_frame(self, columns: Sequence[str] | None = None) -> pl.DataFrame:
        frames = list(self.iter_frames(columns))
        if not frames:
            cols = list(columns) if columns is not None else list(TRACE_COLUMNS)
            return pl.DataFrame(schema={c: EMPTY_POLARS[c] for c in cols})
        return pl.concat(frames, rechunk=False)


class TableReader(TraceReader):
    """A trace held in memory as an Arrow table (rows a tool is shrinking or
    building), read exactly as a file would be: conformed to the format's
    types and validated batch by batch as it streams, with no Parquet in
    between. Errors name it ``name``."""

    def __init__(self, table: pa.Table, config: TraceConfig, *, name: str = "<memory>") -> None:
        self.path = None
        self.name = name
        try:
            check_config(config, trace_cache(config.source))
        except ConfigError as exc:
            raise TraceError(f"{name}: replay.trace metadata: {exc}") from None
        self.config = check_config_limits(config, f"{name}: replay.trace metadata")
        self._table = conform(name, table, trace_schema(config))
        self.columns = list(TRACE_COLUMNS)

    @property
    def num_rows(self) -> int:
        return int(self._table.num_rows)

    @property
    def fixed_hash_width(self) -> int | None:
        return None  # conformed to the format's own types

    def _batches(self, batch_size: int) -> Iterator[pa.RecordBatch | pa.Table]:
        yield from self._table.to_batches(max_chunksize=batch_size)

    def _unreadable(self, exc: Exception) -> TraceError:
        return TraceError(f"{self.name}: invalid rows ({one_line(exc)})")


def _unreadable_column(pf: pq.ParquetFile, columns: Sequence[str]) -> str:
    """Which column a read failed on (``"column 'x': "``), found by reading
    each alone: the error path only. Arrow checks UTF-8 itself when it
    decodes a dictionary-encoded string column."""
    for i in range(pf.metadata.num_row_groups):
        for name in columns:
            try:
                pf.read_row_group(i, columns=[name])
            except (pa.ArrowException, OSError) as exc:
                if "utf8" in str(exc).lower().replace("-", ""):
                    return f"column {name!r} is not valid UTF-8 text: "
                return f"column {name!r}: "
    return ""
