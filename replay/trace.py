"""Trace and results formats, version 1 (``docs/format.md``).

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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Self, TypeVar

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from replay.coordinator import CACHES, DEFAULT_CACHE, check_config, trace_cache
from replay.errors import ConfigError, ReplayError, TraceError
from replay.limits import GROUP_HASHES, HASH_BYTES, ROW_HASHES
from replay.paths import atomic_output, check_input, pause_point
from replay.spec import TraceConfig

TRACE_META_KEY = b"replay.trace"
RESULTS_META_KEY = b"replay.results"
#: Regression traces: what replaying them must give (see replay.pytest_plugin).
EXPECT_META_KEY = b"replay.expect"
EVENT_KINDS = ("store", "remove", "clear", "lookup")

#: Where a trace is read from or written to: a path, or a binary file
#: object (seekable to read: ``io.BytesIO``, an open file).
TraceFile = str | os.PathLike[str] | BinaryIO

#: A small set of names (event kinds, policies, caches) as a dictionary column.
LABEL = pa.dictionary(pa.int8(), pa.string())

TRACE_SCHEMA = pa.schema(
    [
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("ts", pa.timestamp("us", tz="UTC")),
        pa.field("kind", LABEL, nullable=False),
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

# A lookup's own columns are carried into its results row as the trace has them.
_lookup = TRACE_SCHEMA.field
RESULTS_SCHEMA = pa.schema(
    [
        _lookup("seq"),
        _lookup("request_id"),
        _lookup("max_length"),
        pa.field("hit_tokens", pa.int64()),
        pa.field("mask_blocks", pa.list_(pa.int32())),
        pa.field("loaded_blocks", pa.list_(pa.int32())),
        # The project's own columns (the contract allows adding).
        _lookup("num_tokens"),
        pa.field("group_hit_tokens", pa.list_(pa.int64())),
        pa.field("verified_tokens", pa.int64()),
        pa.field("mamba_state_tokens", pa.int64()),
        _lookup("observed_hit_tokens"),
        pa.field("observed_match", pa.bool_()),
        _lookup("ts"),
        pa.field("flags", pa.list_(pa.string())),
        *(pa.field(name, LABEL) for name in ("policy", "coordinator", "cache")),
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


#: Every writer of this module publishes through the one output helper.
atomic_path = atomic_output


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
    schema = trace_schema(config)
    arrays = []
    for f in schema:
        try:
            arrays.append(pa.array(columns[f.name], type=f.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, UnicodeEncodeError) as exc:
            raise TraceError(
                f"column {f.name!r}: a value does not fit {_EXPECTED_TYPE[f.name]} "
                f"({_one_line(exc)})"
            ) from None
    return pa.Table.from_arrays(arrays, schema=schema)


def _conform(path: str | os.PathLike[str], table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with the trace columns in the contract's types, or a one-line error."""
    names = set(table.column_names)
    missing = [n for n in TRACE_COLUMNS if n not in names]
    if missing:
        raise TraceError(f"{path}: missing column {missing[0]!r} in the rows to write")
    try:
        return table.select(list(TRACE_COLUMNS)).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise TraceError(f"{path}: rows do not fit the trace format ({_one_line(exc)})") from None


def stream_name(stream: BinaryIO) -> str:
    """How errors name a file object: its file's name, else ``<stream>``."""
    name = getattr(stream, "name", None)
    return name if isinstance(name, str) else "<stream>"


@contextlib.contextmanager
def _parquet_sink(target: TraceFile) -> Iterator[Any]:
    """Where a Parquet writer writes ``target``: a path through the output
    helper (a temporary file, renamed on success); a file object gets the
    bytes only once the file is complete, so an error writes nothing to it."""
    if isinstance(target, str | os.PathLike):
        with atomic_path(target) as tmp:
            yield str(tmp)
        return
    buffer = pa.BufferOutputStream()
    yield buffer
    target.write(buffer.getvalue().to_pybytes())


class TraceWriter:
    """Write a trace in row groups as events arrive; atomic on ``close``.

    Used as a context manager: leaving the block normally publishes the
    file; leaving it with an exception removes the temporary file, except
    ``KeyboardInterrupt`` when ``keep_on_interrupt`` is set (a recorder closes
    a valid file on Ctrl-C).
    """

    def __init__(
        self,
        path: TraceFile,
        config: TraceConfig,
        *,
        keep_on_interrupt: bool = False,
    ) -> None:
        #: How errors name the output (a file object: ``stream_name``).
        self.name = str(path) if isinstance(path, str | os.PathLike) else stream_name(path)
        self.path = Path(self.name)
        self.config = config
        self.keep_on_interrupt = keep_on_interrupt
        self._cm = _parquet_sink(path)
        self._tmp = self._cm.__enter__()
        self._schema = trace_schema(config)
        # No stored Arrow schema: then the footer's key-value metadata is the
        # schema metadata, and close() can replace the config's ``source``
        # (a recorder's gap report) without rewriting the file.
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(
            self._tmp, self._schema, compression="zstd", store_schema=False
        )
        self.rows_written = 0
        self._last_seq: int | None = None
        self._finished = False

    def set_source(self, source: Mapping[str, Any]) -> None:
        """Replace the ``source`` metadata (e.g. a recorder's gap report); it is
        written into the footer at ``close``."""
        self._pending_source = dict(source)

    def write_table(self, table: pa.Table) -> None:
        if self._writer is None:
            raise TraceError(f"{self.name}: writer already closed")
        table = _conform(self.name, table, self._schema)
        if table.num_rows == 0:
            return
        # A writer never makes a trace the readers would refuse.
        _, self._last_seq = validate_rows(self.name, self.config, table, self._last_seq)
        write_bounded(self._writer, table)
        self.rows_written += table.num_rows
        if isinstance(self._tmp, str):
            pause_point("rows", Path(self._tmp))

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
        self._finished = True
        self._cm.__exit__(None, None, None)

    def abort(self) -> None:
        writer, self._writer = self._writer, None
        if self._finished:
            return
        self._finished = True
        try:
            if writer is not None:
                writer.close()
        except (pa.ArrowException, OSError):
            pass  # the file is discarded anyway
        finally:
            # The output helper removes its temporary file, and never touches
            # a target it did not create (/dev/null).
            self._cm.__exit__(TraceError, TraceError("aborted"), None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None or (self.keep_on_interrupt and exc_type is KeyboardInterrupt):
            self.close()
        else:
            self.abort()


def write_trace(
    path: TraceFile,
    config: TraceConfig,
    table: pa.Table | Sequence[Mapping[str, Any]],
    *,
    expect: Mapping[str, Any] | None = None,
) -> Path:
    """Write a whole trace at once (atomic; to a file object, in one write
    once complete). Rows are validated on the way. ``expect`` goes to the
    ``replay.expect`` metadata (regression traces). Returns the path (a file
    object: its name)."""
    name = str(path) if isinstance(path, str | os.PathLike) else stream_name(path)
    if not isinstance(table, pa.Table):
        table = events_table(table, config)
    schema = trace_schema(config)
    if expect is not None:
        meta = {**schema.metadata, EXPECT_META_KEY: json.dumps(expect, sort_keys=True).encode()}
        schema = schema.with_metadata(meta)
    table = _conform(name, table, schema)
    validate_rows(name, config, table, None)
    with (
        _parquet_sink(path) as where,
        pq.ParquetWriter(where, table.schema, compression="zstd") as writer,
    ):
        write_bounded(writer, table)
    return Path(name)


# ---------------------------------------------------------------- reading


def _ends(fh: BinaryIO) -> tuple[int, bytes, bytes]:
    """A seekable file's size and its first and last four bytes."""
    size = fh.seek(0, os.SEEK_END)
    fh.seek(0)
    head = fh.read(4)
    fh.seek(max(0, size - 4))
    tail = fh.read(4)
    fh.seek(0)
    return size, head, tail


def _open_parquet(path: TraceFile) -> pq.ParquetFile:
    source: str | BinaryIO
    if isinstance(path, str | os.PathLike):
        try:
            p = str(check_input(path, "a Parquet file"))
        except ReplayError as exc:
            raise TraceError(str(exc)) from None
        source = p
        with open(p, "rb") as fh:
            size, head, tail = _ends(fh)
    else:
        source = path
        p = stream_name(path)
        try:
            size, head, tail = _ends(path)
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            raise TraceError(
                f"{p}: cannot read it as a seekable binary file ({_one_line(exc)})"
            ) from None
    if size == 0:
        raise TraceError(f"{p}: empty file, expected a Parquet file")
    if head != b"PAR1":
        raise TraceError(f"{p}: not a Parquet file (no PAR1 magic at the start)")
    if tail != b"PAR1":
        raise TraceError(f"{p}: truncated Parquet file (no PAR1 magic at the end)")
    try:
        pf = pq.ParquetFile(source)
        # The footer is decoded lazily: a column name or a metadata key that
        # is not UTF-8 (a damaged footer) fails here, not in a later reader.
        pf.schema_arrow  # noqa: B018
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{p}: unreadable Parquet file ({_one_line(exc)})") from None
    return pf


def _int_ok(typ: pa.DataType) -> bool:
    # An unsigned 64-bit column may hold values int64 cannot: refused by type.
    return bool(pa.types.is_integer(typ)) and not pa.types.is_uint64(typ)


def _string_ok(typ: pa.DataType) -> bool:
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    return bool(pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_null(typ))


def _hashes_ok(typ: pa.DataType) -> bool:
    if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)):
        return False
    value = typ.value_type
    if pa.types.is_fixed_size_binary(value):
        return bool(value.byte_width > 0)
    return bool(pa.types.is_binary(value) or pa.types.is_large_binary(value))


def _type_ok(name: str, typ: pa.DataType) -> bool:
    if name in ("seq", "group_id", "max_length", "num_tokens", "observed_hit_tokens"):
        return _int_ok(typ)
    if name == "ts":
        return bool(pa.types.is_timestamp(typ) or pa.types.is_null(typ))
    if name in ("kind", "request_id", "medium"):
        return _string_ok(typ)
    if name == "block_hashes":
        return _hashes_ok(typ)
    return True


def check_schema(path: str | os.PathLike[str], schema: pa.Schema) -> list[str]:
    """The trace columns present, after checking the required ones exist and
    every one has a type of format v1 (the reader calls it on the footer)."""
    for name in REQUIRED_COLUMNS:
        if name not in schema.names:
            raise TraceError(f"{path}: missing column {name!r} (expected {_EXPECTED_TYPE[name]})")
    for name in TRACE_COLUMNS:
        if name in schema.names:
            if schema.get_field_index(name) < 0:
                raise TraceError(f"{path}: column {name!r} appears more than once")
            if not _type_ok(name, schema.field(name).type):
                raise TraceError(
                    f"{path}: column {name!r} has type {schema.field(name).type}, "
                    f"expected {_EXPECTED_TYPE[name]}"
                )
    return [n for n in TRACE_COLUMNS if n in schema.names]


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
        obj = json.loads(meta[key])
    except ValueError as exc:  # bad JSON, bad UTF-8, an integer of > 4300 digits
        raise TraceError(
            f"{path}: {label!r} metadata is not valid JSON ({_one_line(exc)})"
        ) from None
    except RecursionError:
        raise TraceError(f"{path}: {label!r} metadata is nested too deeply") from None
    try:
        # Python reads "\ud800" escapes into strings no file can hold.
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise TraceError(
            f"{path}: {label!r} metadata holds a lone surrogate escape (not text)"
        ) from None
    return obj


#: Sizes in tokens above this are refused: derived bounds (a lookup's
#: (len(block_hashes) + 1) * hash_block_size, windows, alignments) must fit int64.
SIZE_LIMIT = (1 << 31) - 1


def check_config_limits(config: TraceConfig, where: str) -> TraceConfig:
    """``config`` if every size in it is at most :data:`SIZE_LIMIT` tokens."""
    sizes: list[tuple[str, int | None]] = [("hash_block_size", config.hash_block_size)]
    sizes.append(("scheduler_block_size", config.scheduler_block_size))
    for gid, g in enumerate(config.groups):
        for name in ("block_size", "sliding_window", "extra_retained_tokens"):
            sizes.append((f"kv_cache_groups[{gid}]: {name}", getattr(g, name)))
        sizes.append((f"kv_cache_groups[{gid}]: attention_chunk_size", g.attention_chunk_size))
    for name, value in sizes:
        # Fields a group's kind does not use are not checked by the spec.
        if isinstance(value, int) and value > SIZE_LIMIT:
            raise TraceError(f"{where}: {name} {value} is above {SIZE_LIMIT} tokens")
    return config


def read_config(pf: pq.ParquetFile, path: str | os.PathLike[str]) -> TraceConfig:
    obj = _json_metadata(pf, path, TRACE_META_KEY, "replay trace v1")
    try:
        config = TraceConfig.from_json(obj)
        # A trace must be answerable by the cache its events describe.
        check_config(config, trace_cache(config.source))
    except ConfigError as exc:
        raise TraceError(f"{path}: replay.trace metadata: {exc}") from None
    return check_config_limits(config, f"{path}: replay.trace metadata")


def _declared_hashes(rg: Any) -> int:
    """The hashes a row group's footer declares (0 when it says nothing)."""
    for c in range(rg.num_columns):
        col = rg.column(c)
        if col.path_in_schema.startswith("block_hashes."):
            return int(col.num_values)
    return 0


def check_declared_sizes(pf: pq.ParquetFile, path: str) -> None:
    """Before any row is decoded: the sizes the footer declares are within
    the limits of ``replay.limits`` (hashes per row group, per row on
    average, bytes per fixed-width hash). A refusal names the limit and the
    option that raises it."""
    hashes_type = pf.schema_arrow.field("block_hashes").type
    width = hashes_type.value_type
    if pa.types.is_fixed_size_binary(width) and width.byte_width > HASH_BYTES.value():
        raise HASH_BYTES.refuse(f"{path}: column 'block_hashes' holds hashes of", width.byte_width)
    meta = pf.metadata
    per_row, per_group = ROW_HASHES.value(), GROUP_HASHES.value()
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        declared = _declared_hashes(rg)
        if declared > per_group:
            raise GROUP_HASHES.refuse(f"{path}: row group {i} declares", declared)
        rows = max(1, rg.num_rows)
        if declared > rows * per_row:
            raise ROW_HASHES.refuse(
                f"{path}: row group {i} declares {declared:,} hashes in {rows:,} rows, at least",
                -(-declared // rows),
            )


def check_hash_sizes(path: str, raw: pa.RecordBatch | pa.Table, hashes: pa.Array) -> None:
    """Each row's hash count and each hash's width within the limits."""
    counts = pc.list_value_length(hashes)
    most = pc.max(counts).as_py()
    if most is not None and most > ROW_HASHES.value():
        i = _first(pc.equal(counts, most))
        assert i is not None
        raise ROW_HASHES.refuse(f"{path}: {_where(raw, i)}: block_hashes holds", most)
    values = hashes.values
    if len(values) == 0 or pa.types.is_fixed_size_binary(values.type):
        return  # a fixed width is checked from the schema
    width = np.int64 if pa.types.is_large_binary(values.type) else np.int32
    offsets = np.frombuffer(values.buffers()[1], dtype=width)
    lo, hi = int(hashes.offsets[0].as_py()), int(hashes.offsets[-1].as_py())
    lens = np.diff(offsets[values.offset + lo : values.offset + hi + 1])
    if lens.size and int(lens.max()) > HASH_BYTES.value():
        j = int(np.argmax(lens))
        row = int(pc.list_parent_indices(hashes)[j].as_py())
        k = j - (int(hashes.offsets[row].as_py()) - lo)
        raise HASH_BYTES.refuse(
            f"{path}: {_where(raw, row)}: block_hashes[{k}] holds", int(lens[j])
        )


@dataclass(frozen=True, slots=True)
class TraceBatch:
    """One validated row batch (see ``TraceReader.iter_batches``)."""

    frame: pl.DataFrame
    hashes: pa.Array


@dataclass(frozen=True, slots=True)
class HashWords:
    """A batch's ``block_hashes`` as fixed-width words, for compiled code,
    without an array per hash where the Arrow buffers allow it.

    Row ``r`` owns hashes ``row_offsets[r]:row_offsets[r + 1]``. Hash ``h``
    is ``nbytes[h]`` bytes long: ``value_offsets[h + 1] - value_offsets[h]``
    (the Arrow offsets themselves, int32 or int64), or ``width`` for every
    hash when ``value_offsets`` is empty (fixed-size binary). Its words,
    zero-padded, start at ``words[h * stride]`` when ``stride`` is positive
    (a padded copy of hashes of one width), at ``words[value_offsets[n + 1
    + h]]`` when ``stride`` is -1 (a packed copy of mixed widths, each
    padded to its own words only: ``value_offsets`` is then the byte
    offsets followed by each hash's first word), else at
    ``words[(value_offsets[h] - base) // 8]`` (the Arrow values buffer
    viewed in place). Every array is read-only.
    """

    row_offsets: np.ndarray[Any, np.dtype[np.int64]]
    words: np.ndarray[Any, np.dtype[np.uint64]]
    value_offsets: np.ndarray[Any, Any]
    base: int = 0
    stride: int = 0
    width: int = 0

    @property
    def num_hashes(self) -> int:
        return int(self.row_offsets[-1])

    @property
    def _byte_offsets(self) -> np.ndarray[Any, Any]:
        if self.stride < 0:
            return self.value_offsets[: self.value_offsets.shape[0] // 2]
        return self.value_offsets

    @property
    def nbytes(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Each hash's length in bytes."""
        if self.value_offsets.shape[0] == 0:
            return _readonly(np.full(self.num_hashes, self.width, dtype=np.int64))
        return _readonly(np.diff(self._byte_offsets.astype(np.int64)))

    @property
    def word_offsets(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Hash ``h`` is ``words[word_offsets[h]:word_offsets[h + 1]]``, its
        zero padding included."""
        if self.stride < 0:
            return _readonly(self.value_offsets[self.value_offsets.shape[0] // 2 :].copy())
        if self.stride:
            return _readonly(np.arange(self.num_hashes + 1, dtype=np.int64) * self.stride)
        return _readonly((self.value_offsets.astype(np.int64) - self.base) >> 3)

    @property
    def max_bytes(self) -> int:
        """The longest hash's bytes (0 without hashes)."""
        if self.num_hashes == 0:
            return 0
        if self.value_offsets.shape[0] == 0:
            return self.width
        return int(np.diff(self._byte_offsets).max())


def _readonly(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    a.flags.writeable = False
    return a


_NO_OFFSETS = _readonly(np.zeros(0, dtype=np.int32))


def hash_words(hashes: pa.Array) -> HashWords:
    """View ``hashes`` (list of binary / large_binary / fixed_size_binary) as
    words: zero-copy over the Arrow values buffer when every hash is a whole
    number of 8-byte words and the buffer is aligned (vLLM's 32-byte digests,
    the importers' 8- and 16-byte hashes); otherwise copied, each padded to
    the longest hash's words. The checks reduce the offsets in place: no
    array per hash is made on the zero-copy path."""
    list_off = np.asarray(hashes.offsets, dtype=np.int64)
    lo, hi = int(list_off[0]), int(list_off[-1])
    row_offsets = _readonly(list_off - lo)
    values = hashes.values
    n = hi - lo
    if pa.types.is_fixed_size_binary(values.type):
        width = values.type.byte_width
        data_buf = values.buffers()[1]
        start = (lo + values.offset) * width
        if n and width % 8 == 0 and (data_buf.address + start) % 8 == 0:
            words = np.frombuffer(data_buf, dtype=np.uint64, count=n * width // 8, offset=start)
            return HashWords(row_offsets, words, _NO_OFFSETS, stride=width // 8, width=width)
        voff = np.arange(lo + values.offset, hi + values.offset + 1, dtype=np.int64) * width
    else:
        wide = pa.types.is_large_binary(values.type)
        offs = np.frombuffer(values.buffers()[1], dtype=np.int64 if wide else np.int32)
        voff = offs[values.offset + lo : values.offset + hi + 1]
        data_buf = values.buffers()[2]
    voff = _readonly(voff)
    if n == 0 or data_buf is None or voff[-1] == voff[0]:
        return HashWords(row_offsets, _readonly(np.zeros(0, dtype=np.uint64)), voff, stride=1)
    base = int(voff[0])
    # Every offset a multiple of 8 into an aligned buffer: whole words, in place.
    if data_buf.address % 8 == 0 and not int(np.bitwise_or.reduce(voff)) & 7:
        words = np.frombuffer(
            data_buf, dtype=np.uint64, count=(int(voff[-1]) - base) // 8, offset=base
        )
        return HashWords(row_offsets, words, voff, base=base)
    data = np.frombuffer(data_buf, dtype=np.uint8)
    lens = np.diff(voff.astype(np.int64))
    widths = np.unique(lens)
    if widths.shape[0] == 1:  # one width: a copy at a fixed stride
        stride = (int(widths[0]) + 7) >> 3
        first = np.arange(n + 1, dtype=np.int64) * stride
    else:
        # Mixed widths: each hash padded to its own words, never to the
        # widest (one long hash among short ones would pad them all).
        stride = -1
        first = np.zeros(n + 1, dtype=np.int64)
        np.cumsum((lens + 7) >> 3, out=first[1:])
    padded = np.zeros(int(first[-1]) * 8, dtype=np.uint8)
    starts = first[:-1] * 8
    src = voff[:-1].astype(np.int64)
    for width in widths.tolist():
        rows = np.flatnonzero(lens == width)
        # In slices of rows: the index arrays stay near 64 MB whatever the width.
        step = max(1, (8 << 20) // max(1, width))
        span = np.arange(width, dtype=np.int64)
        for lo in range(0, rows.shape[0], step):
            part = rows[lo : lo + step]
            padded[starts[part][:, None] + span] = data[src[part][:, None] + span]
    if stride < 0:
        voff = _readonly(np.concatenate([voff.astype(np.int64), first]))
    return HashWords(row_offsets, _readonly(padded.view(np.uint64)), voff, stride=stride)


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


class TraceReader:
    """A validated, streaming view of a trace file: a path, or a seekable
    binary file object (``io.BytesIO``, an open file), which the reader then
    reads from until it is done with it. Open once and pass it down: every
    replay, explain and report function takes a reader where it takes a path."""

    def __init__(self, path: TraceFile) -> None:
        #: The file (None for a file object) and how errors name it.
        self.path: Path | None = None
        if isinstance(path, str | os.PathLike):
            self.path = Path(path)
            self.name = str(self.path)
        else:
            self.name = stream_name(path)
        self._pf = _open_parquet(path)
        self.config = read_config(self._pf, self.name)
        self.columns = check_schema(self.name, self._pf.schema_arrow)
        check_declared_sizes(self._pf, self.name)

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
                batch, last_seq = validate_rows(self.name, self.config, raw, last_seq)
                yield batch
        except (pa.ArrowException, OSError) as exc:
            raise self._unreadable(exc) from None

    def _unreadable(self, exc: Exception) -> TraceError:
        return TraceError(
            f"{self.name}: {_unreadable_column(self._pf, self.columns)}"
            f"unreadable Parquet data ({_one_line(exc)})"
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
            yield from self._pf.iter_batches(batch_size=rows, row_groups=[i], columns=cols)

    def read_frame(self, columns: Sequence[str] | None = None) -> pl.DataFrame:
        frames = list(self.iter_frames(columns))
        if not frames:
            cols = list(columns) if columns is not None else list(TRACE_COLUMNS)
            return pl.DataFrame(schema={c: _EMPTY_POLARS[c] for c in cols})
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
        self._table = _conform(name, table, trace_schema(config))
        self.columns = list(TRACE_COLUMNS)

    @property
    def num_rows(self) -> int:
        return int(self._table.num_rows)

    def _batches(self, batch_size: int) -> Iterator[pa.RecordBatch | pa.Table]:
        yield from self._table.to_batches(max_chunksize=batch_size)

    def _unreadable(self, exc: Exception) -> TraceError:
        return TraceError(f"{self.name}: invalid rows ({_one_line(exc)})")


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


#: Token counts above this are refused: sums over millions of lookups
#: (hit ratios, report totals) must stay inside int64.
TOKEN_LIMIT = 1 << 48
_INT32 = (-(1 << 31), (1 << 31) - 1)
#: What Python's datetime can hold (the commands turn timestamps into it).
_TS_RANGE_S = (-62_135_596_800, 253_402_300_799)  # 0001-01-01 .. 9999-12-31T23:59:59
_PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}


def _combined(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _where(raw: pa.RecordBatch | pa.Table, i: int) -> str:
    seq = _combined(raw.column("seq"))[i].as_py() if "seq" in raw.column_names else None
    return f"seq {seq}" if seq is not None else f"row {i}"


def _first(mask: pa.Array) -> int | None:
    idx = pc.indices_nonzero(pc.fill_null(mask, False))
    return int(idx[0].as_py()) if len(idx) else None


def _bad_utf8(arr: pa.Array) -> int | None:
    """The first row whose string is not valid UTF-8 (the rare error path)."""
    if pa.types.is_dictionary(arr.type):
        bad = _bad_utf8(arr.dictionary)
        return None if bad is None else _first(pc.equal(arr.indices, bad))
    view = arr.view(pa.large_binary() if pa.types.is_large_string(arr.type) else pa.binary())
    for i, value in enumerate(view):
        data = value.as_py()
        if data is not None:
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                return i
    return None


def _check_utf8(path: str, raw: pa.RecordBatch | pa.Table, name: str) -> None:
    """Column ``name`` holds only valid UTF-8 (nested strings included: a
    results file's ``flags``); the row is named where the column is flat."""
    if name not in raw.column_names:
        return
    col = _combined(raw.column(name))
    try:
        col.validate(full=True)
    except pa.ArrowInvalid as exc:
        i = _bad_utf8(col) if _string_ok(col.type) else None
        if "utf8" not in str(exc).lower():
            raise TraceError(f"{path}: column {name!r}: invalid data ({_one_line(exc)})") from None
        where = "" if i is None else f"{_where(raw, i)}: "
        raise TraceError(f"{path}: {where}column {name!r} is not valid UTF-8 text") from None


def _check_ts(path: str, raw: pa.RecordBatch | pa.Table) -> None:
    if "ts" not in raw.column_names or not pa.types.is_timestamp(raw.schema.field("ts").type):
        return
    ts = _combined(raw.column("ts"))
    per = _PER_SECOND[ts.type.unit]
    # In nanoseconds the whole int64 range is representable: clip the bounds.
    lo, hi = (min(max(b * per, -(1 << 63)), (1 << 63) - 1) for b in _TS_RANGE_S)
    if ts.null_count == len(ts):
        return
    values = ts.cast(pa.int64())
    i = _first(pc.or_(pc.less(values, lo), pc.greater(values, hi)))
    if i is not None:
        raise TraceError(
            f"{path}: {_where(raw, i)}: ts {values[i].as_py()} {ts.type.unit} since the "
            "epoch is outside the representable range (expected a time between "
            "0001-01-01 and 9999-12-31)"
        )


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


def check_arrow_batch(path: str, config: TraceConfig, raw: pa.RecordBatch | pa.Table) -> pa.Array:
    """What must hold before a batch is decoded (polars panics or wraps on
    these): strings are UTF-8, timestamps fit a datetime, group_id fits
    int32, and every hash is non-null, non-empty bytes. Returns the batch's
    ``block_hashes`` as one Arrow array."""
    for name in ("kind", "request_id", "medium"):
        _check_utf8(path, raw, name)
    _check_ts(path, raw)
    gid = _combined(raw.column("group_id"))
    narrow = pa.types.is_integer(gid.type) and gid.type.bit_width < 32
    if not narrow and gid.null_count < len(gid) and not pa.types.is_null(gid.type):
        i = _first(pc.or_(pc.less(gid, _INT32[0]), pc.greater(gid, _INT32[1])))
        if i is not None:
            n = config.num_groups
            raise TraceError(
                f"{path}: {_where(raw, i)}: group_id {gid[i].as_py()} names no group "
                f"(the trace has {n}: 0..{n - 1})"
            )
    hashes = _combined(raw.column("block_hashes"))
    values = hashes.flatten()
    j: int | None = None
    what = "is null"
    if values.null_count:
        j = _first(pc.is_null(values))
    elif len(values) and not pa.types.is_fixed_size_binary(values.type):
        # An empty value is two equal offsets: far cheaper than binary_length.
        width = np.int64 if pa.types.is_large_binary(values.type) else np.int32
        offsets = np.frombuffer(values.buffers()[1], dtype=width)
        offsets = offsets[values.offset : values.offset + len(values) + 1]
        empty = np.flatnonzero(offsets[1:] == offsets[:-1])
        j, what = (int(empty[0]) if empty.size else None), "is empty"
    if j is not None:
        row = int(pc.list_parent_indices(hashes)[j].as_py())
        k = j - (int(hashes.offsets[row].as_py()) - int(hashes.offsets[0].as_py()))
        raise TraceError(
            f"{path}: {_where(raw, row)}: block_hashes[{k}] {what} "
            "(expected a hash: non-empty bytes)"
        )
    check_hash_sizes(path, raw, hashes)
    return hashes


def validate_rows(
    path: str, config: TraceConfig, raw: pa.RecordBatch | pa.Table, last_seq: int | None
) -> tuple[TraceBatch, int | None]:
    """Every check of format v1 on one batch of trace rows, in file order
    after ``last_seq``; the reader and every writer go through it. Returns
    the decoded batch and its last seq."""
    hashes = check_arrow_batch(path, config, raw)
    frame = _canonical_frame(raw.drop_columns(["block_hashes"])).with_columns(
        pl.Series("n_hashes", pc.list_value_length(hashes), dtype=pl.Int64)
    )
    return TraceBatch(frame=frame, hashes=hashes), _validate_batch(path, config, frame, last_seq)


def _to_polars(data: pa.RecordBatch | pa.Table) -> pl.DataFrame:
    """``data`` as a polars frame, leaving its schema and field metadata
    behind: polars panics on metadata that is not UTF-8 (a damaged footer),
    and the columns are all the frame needs."""
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    plain = pa.Table.from_arrays(data.columns, names=data.column_names)
    frame = pl.from_arrow(plain)
    assert isinstance(frame, pl.DataFrame)
    return frame


def _canonical_frame(batch: pa.RecordBatch | pa.Table) -> pl.DataFrame:
    frame = _to_polars(batch)
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
    max_length, num_tokens = frame["max_length"], frame["num_tokens"]
    observed = frame["observed_hit_tokens"]
    checks += [
        (num_tokens < 0, "num_tokens {num_tokens} is negative"),
        (
            num_tokens < max_length,
            "num_tokens {num_tokens} cannot hold max_length {max_length} "
            "(expected num_tokens >= max_length)",
        ),
        (observed < 0, "observed_hit_tokens {observed} is negative"),
    ]
    for name, col in (
        ("max_length", max_length),
        ("num_tokens", num_tokens),
        ("observed_hit_tokens", observed),
    ):
        checks.append((col > TOKEN_LIMIT, f"{name} {{{name}}} is above 2**48 tokens"))
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
                kind=kind[i],
                gid=gid[i],
                max_length=max_length[i],
                n_hashes=n_hashes[i],
                num_tokens=num_tokens[i],
                observed=observed[i],
                observed_hit_tokens=observed[i],
            )
            raise TraceError(f"{path}: seq {int(seq[i])}: {text}")
    return int(seq[-1])


#: What the commands and the library replay: a trace file, a directory of
#: them, a binary file object, or a reader already open.
TraceSource = TraceFile | TraceReader


def open_trace(path: TraceSource) -> TraceReader:
    """A reader of ``path``: a trace file, a directory of them, a binary file
    object, or a reader already open (returned as it is)."""
    if isinstance(path, TraceReader):
        return path
    if isinstance(path, str | os.PathLike) and Path(path).is_dir():
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
    # A results file written through the library carries each lookup's flags
    # (issue 14): ``replay check``, ``diff`` and ``report`` read them as they are.
    for name in ("flags", "flag_details"):
        if name not in table.column_names:
            raise ReplayError(
                f"{path}: results without their {name!r} column (replay with "
                "replay.engine.replay_trace, which flags every lookup)"
            )
        if table.column(name).null_count:
            raise ReplayError(f"{path}: results with a null {name!r} (a lookup never flagged)")
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


_RESULTS_REQUIRED = (
    "seq",
    "request_id",
    "max_length",
    "hit_tokens",
    "mask_blocks",
    "loaded_blocks",
)
_RESULTS_INTS: tuple[str, ...] = ("seq", "max_length", "hit_tokens", "num_tokens")
_RESULTS_INTS += ("verified_tokens", "mamba_state_tokens", "observed_hit_tokens")
_RESULTS_INT_LISTS = ("mask_blocks", "loaded_blocks", "group_hit_tokens")


_RESULTS_OPTIONAL: dict[str, Any] = {
    **{n: pl.Int64 for n in _RESULTS_INTS},
    "group_hit_tokens": pl.List(pl.Int64),
    "observed_match": pl.Boolean,
    "ts": pl.Datetime("us", "UTC"),
    "policy": pl.String,
    "coordinator": pl.String,
}


def _results_type_ok(name: str, typ: pa.DataType) -> bool:
    def is_list(t: pa.DataType) -> bool:
        return bool(pa.types.is_list(t) or pa.types.is_large_list(t))

    if name in _RESULTS_INTS:
        return _int_ok(typ)
    if name in _RESULTS_INT_LISTS:
        return is_list(typ) and (_int_ok(typ.value_type) or pa.types.is_null(typ.value_type))
    if name in ("request_id", "policy", "coordinator"):
        return _string_ok(typ)
    if name == "ts":
        return bool(pa.types.is_timestamp(typ) or pa.types.is_null(typ))
    if name == "observed_match":
        return bool(pa.types.is_boolean(typ) or pa.types.is_null(typ))
    if name == "flags":
        return is_list(typ) and _string_ok(typ.value_type)
    if name == "unit_present":
        return (
            is_list(typ)
            and is_list(typ.value_type)
            and (pa.types.is_boolean(typ.value_type.value_type))
        )
    return True


def _check_results(path: str, table: pa.Table, config: TraceConfig) -> pl.DataFrame:
    """The results rows as a frame in the contract's types, after the checks
    a trace gets: types, nulls, ``seq`` order, one entry per group."""
    for name in table.column_names:
        _check_utf8(path, table, name)
    _check_ts(path, table)
    frame = _to_polars(table)
    casts: list[pl.Expr] = [pl.col(n).cast(pl.Int64) for n in _RESULTS_INTS if n in frame.columns]
    casts += [pl.col(n).cast(pl.List(pl.Int64)) for n in _RESULTS_INT_LISTS if n in frame.columns]
    for name in ("policy", "coordinator", "request_id"):
        if name in frame.columns:
            casts.append(pl.col(name).cast(pl.String))
    if "ts" in frame.columns:
        casts.append(pl.col("ts").cast(pl.Datetime("us", "UTC")))
    frame = frame.with_columns(casts)
    # Absent optional columns read as nulls, as a trace's do; ``flags`` and
    # ``unit_present`` stay absent (their absence means an older writer).
    absent = [(n, d) for n, d in _RESULTS_OPTIONAL.items() if n not in frame.columns]
    frame = frame.with_columns(pl.lit(None, dtype=d).alias(n) for n, d in absent)
    if frame.height == 0:
        return frame
    seq = frame["seq"]
    if seq.null_count():
        raise TraceError(f"{path}: column 'seq': null value (every row needs a seq)")
    bad = (seq <= seq.shift(1)).fill_null(False)
    if bad.any():
        i = int(bad.arg_true()[0])
        raise TraceError(
            f"{path}: seq {int(seq[i])}: seq not strictly increasing (comes after seq "
            f"{int(seq[i - 1])})"
        )
    n = config.num_groups
    checks: list[tuple[pl.Expr, str]] = [
        (pl.col("request_id").is_null(), "request_id is null"),
    ]
    for name in ("max_length", "hit_tokens"):
        checks.append((pl.col(name).is_null(), f"{name} is null"))
    for name in _RESULTS_INTS[1:]:
        checks.append((pl.col(name) < 0, f"{name} is negative"))
        checks.append((pl.col(name) > TOKEN_LIMIT, f"{name} is above 2**48 tokens"))
    for name in _RESULTS_INT_LISTS:
        col = pl.col(name)
        if name != "group_hit_tokens":
            checks.append((col.is_null(), f"{name} is null (expected one entry per group)"))
        checks.append((col.list.len() != n, f"{name} needs one entry per KV-cache group ({n})"))
        checks.append((col.list.eval(pl.element().is_null()).list.any(), f"{name} holds a null"))
        checks.append((col.list.min() < 0, f"{name} holds a negative number"))
        limit = TOKEN_LIMIT if name == "group_hit_tokens" else SIZE_LIMIT
        checks.append((col.list.max() > limit, f"{name} holds a number above {limit}"))
    if "unit_present" in frame.columns:
        up = pl.col("unit_present")
        checks.append((up.is_null(), "unit_present is null (expected one list per group)"))
        checks.append((up.list.len() != n, f"unit_present needs one list per KV-cache group ({n})"))
        lens = up.list.eval(pl.element().list.len())
        checks.append(
            (lens.list.max() != lens.list.min(), "unit_present lists differ in length by group")
        )
        checks.append(
            (
                up.list.eval(pl.element().list.eval(pl.element().is_null()).list.any()).list.any(),
                "unit_present holds a null",
            )
        )
    exprs = [mask.fill_null(False).alias(f"c{i}") for i, (mask, _) in enumerate(checks)]
    found = frame.select(exprs)
    for i, (_, message) in enumerate(checks):
        hit = found[f"c{i}"]
        if hit.any():
            row = int(hit.arg_true()[0])
            raise TraceError(f"{path}: seq {int(seq[row])}: {message}")
    over = frame.select(
        pl.any_horizontal(
            pl.col("loaded_blocks").list.get(g) > pl.col("mask_blocks").list.get(g)
            for g in range(n)
        )
    ).to_series()
    if over.any():
        row = int(over.arg_true()[0])
        raise TraceError(
            f"{path}: seq {int(seq[row])}: loaded_blocks exceeds mask_blocks "
            "(a group loads at most the blocks of its mask)"
        )
    return frame.with_columns(
        pl.col("mask_blocks", "loaded_blocks").cast(pl.List(pl.Int32)),
    )


def read_results(
    path: str | os.PathLike[str], *, not_results: str | None = None
) -> tuple[pl.DataFrame, dict[str, Any]]:
    """A results file, validated like a trace (see ``_check_results``), in
    one opening. ``not_results``: the error for a Parquet file that is not a
    results file (the caller says what the user should have given)."""
    pf = _open_parquet(path)
    if not_results is not None and RESULTS_META_KEY not in (pf.schema_arrow.metadata or {}):
        raise ReplayError(not_results)
    info = _json_metadata(pf, path, RESULTS_META_KEY, "results file")
    if not isinstance(info, dict):
        raise TraceError(f"{path}: 'replay.results' metadata must be a JSON object")
    schema = pf.schema_arrow
    missing = [n for n in _RESULTS_REQUIRED if n not in schema.names]
    if missing:
        raise TraceError(f"{path}: missing column {missing[0]!r} (not a results file v1)")
    for name in schema.names:
        if schema.get_field_index(name) < 0:
            raise TraceError(f"{path}: column {name!r} appears more than once")
        typ = schema.field(name).type
        if not _results_type_ok(name, typ):
            expected = str(UNIT_PRESENT_FIELD.type) if name == "unit_present" else None
            if expected is None:
                expected = str(RESULTS_SCHEMA.field(name).type)
            raise TraceError(f"{path}: column {name!r} has type {typ}, expected {expected}")
    config = results_config(info, path)
    try:
        table = pf.read()
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(f"{path}: unreadable Parquet data ({_one_line(exc)})") from None
    return _check_results(str(path), table, config), info


def results_config(info: Mapping[str, Any], path: str | os.PathLike[str]) -> TraceConfig:
    try:
        config = TraceConfig.from_json(info.get("trace_config"))
    except ConfigError as exc:
        raise TraceError(f"{path}: replay.results metadata: trace_config: {exc}") from None
    return check_config_limits(config, f"{path}: replay.results metadata: trace_config")


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
