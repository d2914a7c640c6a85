"""Trace and results formats, version 1 (``shared/design/trace-format.md``).

The only module, with ``engine``, that reads or writes these files. Writers
are atomic (a temporary file in the target's folder, renamed on success), so
an error never leaves a partial file behind. The reader validates the
metadata and the schema up front and every row batch as it streams, so a
trace larger than memory can be read and a bad row is reported by its
``seq``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from replay.coordinator import CACHES, DEFAULT_CACHE, check_config, trace_cache
from replay.errors import ConfigError, ReplayError, TraceError
from replay.spec import TraceConfig

TRACE_META_KEY = b"replay.trace"
RESULTS_META_KEY = b"replay.results"
#: Regression traces: what replaying them must give (see replay.pytest_plugin).
EXPECT_META_KEY = b"replay.expect"
EVENT_KINDS = ("store", "remove", "clear", "lookup")

TRACE_SCHEMA = pa.schema(
    [
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("ts", pa.timestamp("us", tz="UTC")),
        pa.field("kind", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("group_id", pa.int32()),
        pa.field("block_hashes", pa.list_(pa.binary())),
        pa.field("request_id", pa.string()),
        pa.field("max_length", pa.int64()),
        pa.field("num_tokens", pa.int64()),
        pa.field("observed_hit_tokens", pa.int64()),
        pa.field("medium", pa.string()),
    ]
)
TRACE_COLUMNS = tuple(TRACE_SCHEMA.names)
REQUIRED_COLUMNS = ("seq", "kind", "group_id", "block_hashes", "request_id", "max_length")

RESULTS_SCHEMA = pa.schema(
    [
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("request_id", pa.string()),
        pa.field("max_length", pa.int64()),
        pa.field("hit_tokens", pa.int64()),
        pa.field("mask_blocks", pa.list_(pa.int32())),
        pa.field("loaded_blocks", pa.list_(pa.int32())),
        # The project's own columns (the contract allows adding).
        pa.field("num_tokens", pa.int64()),
        pa.field("group_hit_tokens", pa.list_(pa.int64())),
        pa.field("verified_tokens", pa.int64()),
        pa.field("mamba_state_tokens", pa.int64()),
        pa.field("observed_hit_tokens", pa.int64()),
        pa.field("observed_match", pa.bool_()),
        pa.field("ts", pa.timestamp("us", tz="UTC")),
        pa.field("flags", pa.list_(pa.string())),
        pa.field("policy", pa.dictionary(pa.int8(), pa.string())),
        pa.field("coordinator", pa.dictionary(pa.int8(), pa.string())),
        pa.field("cache", pa.dictionary(pa.int8(), pa.string())),
        # Each flag with the numbers that prove it (analysis/flags.py).
        pa.field(
            "flag_details",
            pa.list_(
                pa.struct(
                    [
                        pa.field("flag", pa.string()),
                        pa.field("group_id", pa.int32()),
                        pa.field("actual", pa.int64()),
                        pa.field("expected", pa.int64()),
                        pa.field("detail", pa.string()),
                    ]
                )
            ),
        ),
    ]
)
#: Per lookup, per group_id, per hash unit: whether the group held a key for
#: that unit's hash when the lookup ran (the store state the lookup saw).
UNIT_PRESENT_FIELD = pa.field("unit_present", pa.list_(pa.list_(pa.bool_())))


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


# ---------------------------------------------------------------- writing


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it over ``path`` on success,
    delete it on any error."""
    target = Path(path)
    if target.is_dir():
        raise ReplayError(f"{target}: is a directory, expected a file path to write")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise ReplayError(f"{target}: cannot write here ({exc.strerror or exc})") from None
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # mkstemp makes the file private; give it the mode any new file gets.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_path, 0o666 & ~umask)
        try:
            os.replace(tmp_path, target)
        except OSError as exc:
            raise ReplayError(f"{target}: cannot write here ({exc.strerror or exc})") from None
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


#: Row groups the project writes stay below both bounds, so a reader holds
#: one at a time in modest memory and a column chunk decodes in one go.
ROW_GROUP_HASH_BYTES = 32 << 20
ROW_GROUP_ROWS = 65_536


def write_bounded(writer: pq.ParquetWriter, table: pa.Table) -> None:
    """Write ``table`` as row groups of at most ``ROW_GROUP_ROWS`` rows and
    about ``ROW_GROUP_HASH_BYTES`` of block hashes (a row is never split)."""
    if table.num_rows == 0:
        return
    hashes = table.column("block_hashes")
    sizes = np.concatenate(
        [pc.binary_length(c.flatten()).fill_null(0).to_numpy() for c in hashes.chunks]
        or [np.zeros(0, np.int64)]
    )
    lengths = np.concatenate(
        [pc.list_value_length(c).fill_null(0).to_numpy() for c in hashes.chunks]
    )
    per_row = np.zeros(table.num_rows, dtype=np.int64)
    if sizes.size:
        ends = np.cumsum(lengths)
        cum = np.concatenate([[0], np.cumsum(sizes.astype(np.int64))])
        per_row = cum[ends] - cum[ends - lengths]
    start = 0
    total = np.cumsum(per_row)
    while start < table.num_rows:
        before = total[start - 1] if start else 0
        stop = int(np.searchsorted(total, before + ROW_GROUP_HASH_BYTES, side="right"))
        stop = min(max(stop, start + 1), start + ROW_GROUP_ROWS, table.num_rows)
        writer.write_table(table.slice(start, stop - start))
        start = stop


def trace_schema(config: TraceConfig) -> pa.Schema:
    return TRACE_SCHEMA.with_metadata({TRACE_META_KEY: config.dumps().encode()})


def events_table(rows: Sequence[Mapping[str, Any]], config: TraceConfig) -> pa.Table:
    """A trace table from row dicts (missing columns are null; ``seq`` defaults
    to the row index). For tests, generators and importers of modest size."""
    columns: dict[str, list[Any]] = {name: [] for name in TRACE_COLUMNS}
    for index, row in enumerate(rows):
        unknown = set(row) - set(TRACE_COLUMNS)
        if unknown:
            raise TraceError(f"row {index}: unknown trace columns {sorted(unknown)}")
        for name in TRACE_COLUMNS:
            value = row.get(name)
            if name == "seq" and value is None:
                value = index
            columns[name].append(value)
    return pa.table(columns, schema=trace_schema(config))


class TraceWriter:
    """Write a trace in row groups as events arrive; atomic on ``close``.

    Used as a context manager: leaving the block normally publishes the
    file; leaving it with an exception removes the temporary file, except
    ``KeyboardInterrupt`` when ``keep_on_interrupt`` is set (a recorder closes
    a valid file on Ctrl-C).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: TraceConfig,
        *,
        keep_on_interrupt: bool = False,
    ) -> None:
        self.path = Path(path)
        self.config = config
        self.keep_on_interrupt = keep_on_interrupt
        self._cm = atomic_path(self.path)
        self._tmp = self._cm.__enter__()
        self._schema = trace_schema(config)
        # No stored Arrow schema: then the footer's key-value metadata is the
        # schema metadata, and close() can replace the config's ``source``
        # (a recorder's gap report) without rewriting the file.
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(
            str(self._tmp), self._schema, compression="zstd", store_schema=False
        )
        self.rows_written = 0
        self._last_seq: int | None = None

    def set_source(self, source: Mapping[str, Any]) -> None:
        """Replace the ``source`` metadata (e.g. a recorder's gap report); it is
        written into the footer at ``close``."""
        self._pending_source = dict(source)

    def write_table(self, table: pa.Table) -> None:
        if self._writer is None:
            raise TraceError(f"{self.path}: writer already closed")
        table = table.select(list(TRACE_COLUMNS)).cast(self._schema)
        if table.num_rows == 0:
            return
        seqs = table.column("seq")
        first = seqs[0].as_py()
        if self._last_seq is not None and first <= self._last_seq:
            raise TraceError(
                f"{self.path}: seq {first}: out of order, expected a seq greater than "
                f"{self._last_seq}"
            )
        self._last_seq = seqs[-1].as_py()
        write_bounded(self._writer, table)
        self.rows_written += table.num_rows

    def write_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self.write_table(events_table(rows, self.config))

    def close(self) -> None:
        if self._writer is None:
            return
        config = self.config
        source = getattr(self, "_pending_source", None)
        if source is not None:
            config = TraceConfig.from_json({**config.to_json(), "source": source})
        self._writer.add_key_value_metadata({TRACE_META_KEY: config.dumps().encode()})
        self._writer.close()
        self._writer = None
        self._cm.__exit__(None, None, None)

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None or (self.keep_on_interrupt and exc_type is KeyboardInterrupt):
            self.close()
        else:
            self.abort()


def write_trace(
    path: str | os.PathLike[str],
    config: TraceConfig,
    table: pa.Table | Sequence[Mapping[str, Any]],
    *,
    expect: Mapping[str, Any] | None = None,
) -> Path:
    """Write a whole trace at once (atomic). Rows are validated on the way.
    ``expect`` goes to the ``replay.expect`` metadata (regression traces)."""
    if not isinstance(table, pa.Table):
        table = events_table(table, config)
    schema = trace_schema(config)
    if expect is not None:
        meta = {**schema.metadata, EXPECT_META_KEY: json.dumps(expect, sort_keys=True).encode()}
        schema = schema.with_metadata(meta)
    table = table.select(list(TRACE_COLUMNS)).cast(schema)
    frame = _canonical_frame(table.drop_columns(["block_hashes"])).with_columns(
        pl.Series("n_hashes", pc.list_value_length(table.column("block_hashes")), dtype=pl.Int64)
    )
    _validate_batch(str(path), config, frame, None)
    with (
        atomic_path(path) as tmp,
        pq.ParquetWriter(str(tmp), table.schema, compression="zstd") as writer,
    ):
        write_bounded(writer, table)
    return Path(path)


# ---------------------------------------------------------------- reading


def _open_parquet(path: str | os.PathLike[str]) -> pq.ParquetFile:
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file")
    if p.is_dir():
        raise TraceError(f"{p}: is a directory, expected a Parquet file")
    size = p.stat().st_size
    if size == 0:
        raise TraceError(f"{p}: empty file, expected a Parquet file")
    with open(p, "rb") as fh:
        head = fh.read(4)
        fh.seek(max(0, size - 4))
        tail = fh.read(4)
    if head != b"PAR1":
        raise TraceError(f"{p}: not a Parquet file (no PAR1 magic at the start)")
    if tail != b"PAR1":
        raise TraceError(f"{p}: truncated Parquet file (no PAR1 magic at the end)")
    try:
        return pq.ParquetFile(str(p))
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(f"{p}: unreadable Parquet file ({_one_line(exc)})") from None


def _type_ok(name: str, typ: pa.DataType) -> bool:
    if name == "seq" or name in ("max_length", "num_tokens", "observed_hit_tokens"):
        return bool(pa.types.is_integer(typ))
    if name == "group_id":
        return bool(pa.types.is_integer(typ))
    if name == "ts":
        return bool(pa.types.is_timestamp(typ) or pa.types.is_null(typ))
    if name in ("kind", "request_id", "medium"):
        if pa.types.is_dictionary(typ):
            typ = typ.value_type
        return bool(
            pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_null(typ)
        )
    if name == "block_hashes":
        if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)):
            return False
        value = typ.value_type
        return bool(
            pa.types.is_binary(value)
            or pa.types.is_large_binary(value)
            or pa.types.is_fixed_size_binary(value)
        )
    return True


_EXPECTED_TYPE = {
    "seq": "int64",
    "ts": "timestamp[us, UTC]",
    "kind": "string",
    "group_id": "int32",
    "block_hashes": "list<binary>",
    "request_id": "string",
    "max_length": "int64",
    "num_tokens": "int64",
    "observed_hit_tokens": "int64",
    "medium": "string",
}


def _json_metadata(pf: pq.ParquetFile, path: str | os.PathLike[str], key: bytes, what: str) -> Any:
    meta = pf.schema_arrow.metadata or {}
    label = key.decode()
    if key not in meta:
        raise TraceError(f"{path}: missing {label!r} metadata (not a {what})")
    try:
        return json.loads(meta[key])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(
            f"{path}: {label!r} metadata is not valid JSON ({_one_line(exc)})"
        ) from None


def read_config(pf: pq.ParquetFile, path: str | os.PathLike[str]) -> TraceConfig:
    obj = _json_metadata(pf, path, TRACE_META_KEY, "replay trace v1")
    try:
        config = TraceConfig.from_json(obj)
        # A trace must be answerable by the cache its events describe.
        check_config(config, trace_cache(config.source))
    except ConfigError as exc:
        raise TraceError(f"{path}: replay.trace metadata: {exc}") from None
    return config


@dataclass(frozen=True, slots=True)
class TraceBatch:
    """One validated row batch (see ``TraceReader.iter_batches``)."""

    frame: pl.DataFrame
    hashes: pa.Array


@dataclass(frozen=True, slots=True)
class HashWords:
    """A batch's ``block_hashes`` as fixed-width words, for compiled code.

    Row ``r`` owns hashes ``row_offsets[r]:row_offsets[r + 1]``; hash ``h`` is
    ``words[word_offsets[h]:word_offsets[h + 1]]`` (zero-padded to whole
    words) and ``nbytes[h]`` bytes long. Every array is read-only.
    """

    row_offsets: np.ndarray[Any, np.dtype[np.int64]]
    words: np.ndarray[Any, np.dtype[np.uint64]]
    word_offsets: np.ndarray[Any, np.dtype[np.int64]]
    nbytes: np.ndarray[Any, np.dtype[np.int64]]

    @property
    def max_words(self) -> int:
        if self.nbytes.size == 0:
            return 0
        return int(np.diff(self.word_offsets).max())


def _readonly(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    a.flags.writeable = False
    return a


def hash_words(hashes: pa.Array) -> HashWords:
    """View ``hashes`` (list of binary / large_binary / fixed_size_binary) as
    words: zero-copy over the Arrow values buffer when every hash is a whole
    number of 8-byte words and the buffer is aligned (vLLM's 32-byte digests,
    the importers' 8- and 16-byte hashes); otherwise copied, padded."""
    list_off = np.asarray(hashes.offsets, dtype=np.int64)
    lo, hi = int(list_off[0]), int(list_off[-1])
    row_offsets = _readonly(list_off - lo)
    values = hashes.values
    n = hi - lo
    if pa.types.is_fixed_size_binary(values.type):
        width = values.type.byte_width
        voff = (np.arange(lo, hi + 1, dtype=np.int64) + values.offset) * width
        data_buf = values.buffers()[1]
    else:
        wide = pa.types.is_large_binary(values.type)
        offs = np.frombuffer(values.buffers()[1], dtype=np.int64 if wide else np.int32)
        voff = offs[values.offset + lo : values.offset + hi + 1].astype(np.int64)
        data_buf = values.buffers()[2]
    if n == 0 or data_buf is None or voff[-1] == voff[0]:
        zeros = np.zeros(n + 1, dtype=np.int64)
        return HashWords(
            row_offsets=row_offsets,
            words=_readonly(np.zeros(0, dtype=np.uint64)),
            word_offsets=_readonly(zeros),
            nbytes=_readonly(np.zeros(n, dtype=np.int64)),
        )
    lens = np.diff(voff)
    base = int(voff[0])
    if not (lens & 7).any() and (data_buf.address + base) % 8 == 0:
        words = np.frombuffer(
            data_buf, dtype=np.uint64, count=(int(voff[-1]) - base) // 8, offset=base
        )
        woff = (voff - base) >> 3
        return HashWords(
            row_offsets=row_offsets,
            words=words,
            word_offsets=_readonly(woff),
            nbytes=_readonly(lens),
        )
    data = np.frombuffer(data_buf, dtype=np.uint8)
    nwords = (lens + 7) >> 3
    woff = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(nwords, out=woff[1:])
    padded = np.zeros(int(woff[-1]) * 8, dtype=np.uint8)
    for width in np.unique(lens).tolist():
        rows = np.flatnonzero(lens == width)
        span = np.arange(width, dtype=np.int64)
        padded[(woff[rows] * 8)[:, None] + span] = data[voff[rows][:, None] + span]
    return HashWords(
        row_offsets=row_offsets,
        words=_readonly(padded.view(np.uint64)),
        word_offsets=_readonly(woff),
        nbytes=_readonly(lens),
    )


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
            batch, exc = q.get()
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


class TraceReader:
    """A validated, streaming view of a trace file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._pf = _open_parquet(self.path)
        self.config = read_config(self._pf, self.path)
        schema = self._pf.schema_arrow
        for name in REQUIRED_COLUMNS:
            if name not in schema.names:
                raise TraceError(
                    f"{self.path}: missing column {name!r} (expected {_EXPECTED_TYPE[name]})"
                )
        for name in TRACE_COLUMNS:
            if name in schema.names and not _type_ok(name, schema.field(name).type):
                raise TraceError(
                    f"{self.path}: column {name!r} has type {schema.field(name).type}, "
                    f"expected {_EXPECTED_TYPE[name]}"
                )
        self.columns = [n for n in TRACE_COLUMNS if n in schema.names]

    @property
    def num_rows(self) -> int:
        return int(self._pf.metadata.num_rows)

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
                hashes = raw.column("block_hashes")
                if isinstance(hashes, pa.ChunkedArray):
                    hashes = hashes.combine_chunks()
                frame = _canonical_frame(raw.drop_columns(["block_hashes"])).with_columns(
                    pl.Series("n_hashes", pc.list_value_length(hashes), dtype=pl.Int64)
                )
                last_seq = _validate_batch(str(self.path), self.config, frame, last_seq)
                yield TraceBatch(frame=frame, hashes=hashes)
        except (pa.ArrowException, OSError) as exc:
            raise TraceError(f"{self.path}: unreadable Parquet data ({_one_line(exc)})") from None

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

    def _batches(self, batch_size: int) -> Iterator[pa.RecordBatch | pa.Table]:
        cols = list(self.columns)
        meta = self._pf.metadata
        for i in range(meta.num_row_groups):
            rg = meta.row_group(i)
            if rg.num_rows == 0:
                continue
            # Parquet streams within a row group, so one huge row group costs
            # a batch's memory, not the row group's.
            rows = rg.num_rows * self.BATCH_BYTES // max(1, rg.total_byte_size)
            rows = max(1, min(batch_size, rows))
            yield from self._pf.iter_batches(batch_size=rows, row_groups=[i], columns=cols)

    def read_frame(self, columns: Sequence[str] | None = None) -> pl.DataFrame:
        frames = list(self.iter_frames(columns))
        if not frames:
            cols = list(columns) if columns is not None else list(TRACE_COLUMNS)
            return pl.DataFrame(schema={c: _EMPTY_POLARS[c] for c in cols})
        return pl.concat(frames, rechunk=False)


_EMPTY_POLARS: dict[str, Any] = {
    "seq": pl.Int64,
    "ts": pl.Datetime("us", "UTC"),
    "kind": pl.String,
    "group_id": pl.Int32,
    "block_hashes": pl.List(pl.Binary),
    "request_id": pl.String,
    "max_length": pl.Int64,
    "num_tokens": pl.Int64,
    "observed_hit_tokens": pl.Int64,
    "medium": pl.String,
}


def _canonical_frame(batch: pa.RecordBatch | pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(batch)
    assert isinstance(frame, pl.DataFrame)
    exprs = []
    for name, dtype in _EMPTY_POLARS.items():
        if name in frame.columns:
            exprs.append(pl.col(name).cast(dtype))
        else:
            exprs.append(pl.lit(None, dtype=dtype).alias(name))
    return frame.select(exprs)


def _first_bad(frame: pl.DataFrame, mask: pl.Series) -> int | None:
    idx = mask.arg_true()
    if idx.len() == 0:
        return None
    return int(frame["seq"][int(idx[0])])


def _validate_batch(
    path: str, config: TraceConfig, frame: pl.DataFrame, last_seq: int | None
) -> int | None:
    """Check one batch; return its last seq. Raises TraceError naming the seq."""
    if frame.height == 0:
        return last_seq
    seq = frame["seq"]
    if seq.null_count():
        raise TraceError(f"{path}: column 'seq': null value (every row needs a seq)")
    prev = seq.shift(1)
    if last_seq is not None:
        prev = prev.fill_null(last_seq)
    bad = (seq <= prev).fill_null(False)
    if bad.any():
        i = int(bad.arg_true()[0])
        before = last_seq if i == 0 else int(seq[i - 1])
        raise TraceError(
            f"{path}: seq {int(seq[i])}: seq not strictly increasing (comes after seq {before})"
        )
    kind = frame["kind"]
    if kind.null_count():
        s = _first_bad(frame, kind.is_null())
        raise TraceError(
            f"{path}: seq {s}: column 'kind' is null, expected one of {', '.join(EVENT_KINDS)}"
        )
    unknown = ~kind.is_in(EVENT_KINDS)
    if unknown.any():
        i = int(unknown.arg_true()[0])
        raise TraceError(
            f"{path}: seq {int(seq[i])}: unknown event kind {kind[i]!r}, "
            f"expected one of {', '.join(EVENT_KINDS)}"
        )
    gid = frame["group_id"]
    is_lookup = kind == "lookup"
    is_keyed = kind.is_in(("store", "remove"))
    checks: list[tuple[pl.Series, str]] = [
        (
            is_keyed & gid.is_null(),
            "{kind} has no group_id (store and remove name the group whose keys change)",
        ),
        (is_keyed & frame["n_hashes"].is_null(), "{kind} has no block_hashes"),
        (
            gid.is_not_null() & ((gid < 0) | (gid >= config.num_groups)),
            f"group_id {{gid}} names no group (the trace has {config.num_groups}: "
            f"0..{config.num_groups - 1})",
        ),
        (is_lookup & frame["request_id"].is_null(), "lookup has no request_id"),
        (is_lookup & frame["max_length"].is_null(), "lookup has no max_length"),
        (is_lookup & frame["n_hashes"].is_null(), "lookup has no block_hashes"),
        (
            is_lookup & (frame["max_length"] < 0).fill_null(False),
            "lookup has a negative max_length {max_length}",
        ),
    ]
    # vLLM indexes a group's hash view up to max_length // block_size, so a
    # lookup may not ask for more than its hashes can cover (vLLM's scheduler
    # always asks for num_tokens - 1, below (len + 1) * hash_block_size).
    n_hashes = frame["n_hashes"].fill_null(0)
    too_long = is_lookup & (
        frame["max_length"] >= (n_hashes + 1) * config.hash_block_size
    ).fill_null(False)
    checks.append(
        (
            too_long,
            "lookup max_length {max_length} exceeds what its {n_hashes} block_hashes cover "
            f"(expected below (len(block_hashes) + 1) * hash_block_size {config.hash_block_size})",
        )
    )
    for mask, message in checks:
        mask = mask.fill_null(False)
        if mask.any():
            i = int(mask.arg_true()[0])
            text = message.format(
                kind=kind[i], gid=gid[i], max_length=frame["max_length"][i], n_hashes=n_hashes[i]
            )
            raise TraceError(f"{path}: seq {int(seq[i])}: {text}")
    return int(seq[-1])


def open_trace(path: str | os.PathLike[str]) -> TraceReader:
    if Path(path).is_dir():
        # A directory of files is one trace (issue 13): replay.tracedir.
        from replay.tracedir import open_trace_dir

        return open_trace_dir(path)
    return TraceReader(path)


# ---------------------------------------------------------------- results


def results_schema(metadata: Mapping[str, Any]) -> pa.Schema:
    return RESULTS_SCHEMA.with_metadata(
        {RESULTS_META_KEY: json.dumps(metadata, sort_keys=True).encode()}
    )


def write_results(
    path: str | os.PathLike[str], table: pa.Table, metadata: Mapping[str, Any]
) -> Path:
    schema = results_schema(metadata)
    extra = [n for n in table.column_names if n not in RESULTS_SCHEMA.names]
    table = table.select(list(RESULTS_SCHEMA.names) + extra)
    fields = list(schema) + [table.schema.field(n) for n in extra]
    table = table.cast(pa.schema(fields, metadata=schema.metadata))
    with atomic_path(path) as tmp:
        pq.write_table(table, str(tmp), compression="zstd")
    return Path(path)


def is_results_file(path: str | os.PathLike[str]) -> bool:
    if Path(path).is_dir():
        return False  # a trace directory (replay.tracedir)
    pf = _open_parquet(path)
    return RESULTS_META_KEY in (pf.schema_arrow.metadata or {})


def read_results(path: str | os.PathLike[str]) -> tuple[pl.DataFrame, dict[str, Any]]:
    pf = _open_parquet(path)
    info = _json_metadata(pf, path, RESULTS_META_KEY, "results file")
    if not isinstance(info, dict):
        raise TraceError(f"{path}: 'replay.results' metadata must be a JSON object")
    missing = [
        n
        for n in ("seq", "request_id", "max_length", "hit_tokens", "mask_blocks", "loaded_blocks")
        if n not in pf.schema_arrow.names
    ]
    if missing:
        raise TraceError(f"{path}: missing column {missing[0]!r} (not a results file v1)")
    try:
        frame = pl.read_parquet(str(path))
    except Exception as exc:  # polars raises several types for corrupt data
        raise TraceError(f"{path}: unreadable Parquet data ({_one_line(exc)})") from None
    return frame, info


def results_config(info: Mapping[str, Any], path: str | os.PathLike[str]) -> TraceConfig:
    try:
        return TraceConfig.from_json(info.get("trace_config"))
    except ConfigError as exc:
        raise TraceError(f"{path}: replay.results metadata: trace_config: {exc}") from None


def results_cache(info: Mapping[str, Any]) -> str:
    """The cache whose coordinator answered; results written before caches
    were named came from the Mooncake mirror."""
    named = info.get("cache")
    return named if isinstance(named, str) and named in CACHES else DEFAULT_CACHE


KEYS_SCHEMA = pa.schema(
    [
        pa.field("group_id", pa.int32(), nullable=False),
        pa.field("hash", pa.binary(), nullable=False),
    ]
)


def write_keys(path: str | os.PathLike[str], keys: Sequence[tuple[int, Sequence[bytes]]]) -> int:
    """Write present keys, one row per (group_id, hash) (``replay state -o``)."""
    gids = [gid for gid, hashes in keys for _ in hashes]
    hashes = [h for _, hs in keys for h in hs]
    table = pa.table({"group_id": gids, "hash": hashes}, schema=KEYS_SCHEMA)
    with atomic_path(path) as tmp:
        pq.write_table(table, str(tmp))
    return len(hashes)
