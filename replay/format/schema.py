"""Trace and results format v1 (docs/format.md): the schemas, the metadata keys, the
schema and config checks every reader and writer shares."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, BinaryIO

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from replay.base.errors import ConfigError, TraceError
from replay.base.limits import GROUPS
from replay.base.spec import TraceConfig
from replay.rules.coordinator import check_config, trace_cache

TRACE_META_KEY = b"replay.trace"


RESULTS_META_KEY = b"replay.results"


#: Regression traces: what replaying them must give (see replay.pytest_plugin).
EXPECT_META_KEY = b"replay.expect"


EVENT_KINDS = ("store", "remove", "clear", "lookup")
#: A ``kind`` column cast to it gives each row's index in ``EVENT_KINDS`` (its
#: physical codes), a far cheaper call than a replace on a small batch; an
#: unknown kind is an ``InvalidOperationError``.
KIND_ENUM = pl.Enum(EVENT_KINDS)


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
        # The facts every flag needs beyond the answer (replay/rules/facts.py).
        pa.field("hit_alignment", pa.int64()),
        pa.field("group_state_tokens", pa.list_(pa.int64())),
        pa.field("attention_tokens", pa.int64()),
        pa.field("first_absent_block", pa.list_(pa.int32())),
        pa.field("eagle_unit_present", pa.list_(pa.bool_())),
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
#: The facts columns: a results file from before them has none, and its
#: flags are read as written.
FACT_COLUMNS = (
    "hit_alignment",
    "group_state_tokens",
    "attention_tokens",
    "first_absent_block",
    "eagle_unit_present",
)

#: The columns the analyses add to the replay's answers and facts.
FLAG_COLUMNS = ("flags", "flag_details")

#: What the replay writes: the results but their flags (the analyses add them).
ANSWER_SCHEMA = pa.schema([f for f in RESULTS_SCHEMA if f.name not in FLAG_COLUMNS])

UNIT_PRESENT_FIELD = pa.field("unit_present", pa.list_(pa.list_(pa.bool_())))


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def int_ok(typ: pa.DataType) -> bool:
    # An unsigned 64-bit column may hold values int64 cannot: refused by type.
    return bool(pa.types.is_integer(typ)) and not pa.types.is_uint64(typ)


def string_ok(typ: pa.DataType) -> bool:
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    return bool(pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_null(typ))


# The old private names, still imported by replay/format/results.py (another
# helper's room this round: tests/base/test_private_names.py allowlists it).


def _hashes_ok(typ: pa.DataType) -> bool:
    if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)):
        return False
    value = typ.value_type
    if pa.types.is_fixed_size_binary(value):
        return bool(value.byte_width > 0)
    return bool(pa.types.is_binary(value) or pa.types.is_large_binary(value))


def _type_ok(name: str, typ: pa.DataType) -> bool:
    if name in ("seq", "group_id", "max_length", "num_tokens", "observed_hit_tokens"):
        return int_ok(typ)
    if name == "ts":
        return bool(pa.types.is_timestamp(typ) or pa.types.is_null(typ))
    if name in ("kind", "request_id", "medium"):
        return string_ok(typ)
    if name == "block_hashes":
        return _hashes_ok(typ)
    return True


#: Spellings of UTC itself.
UTC_NAMES = frozenset(("UTC", "Etc/UTC", "Z", "+00:00"))
_OFFSET = re.compile(r"[+-]([01]\d|2[0-3]):[0-5]\d")

#: What readers converted on the way (a ``ts`` in another zone, read as the
#: UTC instants it stores); the CLI says them once a command's work is done.
_READ_NOTES: list[str] = []


def take_read_notes() -> list[str]:
    """The notes readers left since the last call (each once, in order)."""
    notes = list(dict.fromkeys(_READ_NOTES))
    _READ_NOTES.clear()
    return notes


def check_ts_zone(path: str | os.PathLike[str], typ: pa.DataType) -> None:
    """The ``ts`` column is ``timestamp[us, UTC]`` (any unit is read
    exactly). A fixed offset (``+05:30``) or a time zone name the system
    knows is read as the UTC instants Arrow stores, and said (a note); no
    time zone (a wall-clock time of unknown zone) or a name that is no time
    zone is refused."""
    if not pa.types.is_timestamp(typ) or typ.tz in UTC_NAMES:
        return
    want = "expected timestamp[us, UTC]"
    if typ.tz is None:
        raise TraceError(
            f"{path}: column 'ts' has no time zone (a wall-clock time of unknown zone), {want}"
        )
    tz = typ.tz
    if not _OFFSET.fullmatch(tz):
        import zoneinfo

        try:
            zoneinfo.ZoneInfo(tz)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
            raise TraceError(
                f"{path}: column 'ts' has time zone {tz!r}, which is not a time zone, {want}"
            ) from None
    _READ_NOTES.append(
        f"{path}: column 'ts' is in time zone {tz}; read as the UTC instants it stores "
        "(the format's timestamp[us, UTC])"
    )


def check_schema(path: str | os.PathLike[str], schema: pa.Schema) -> list[str]:
    """The trace columns present, after checking the required ones exist and
    every one has a type of format v1 (the reader calls it on the footer)."""
    for name in REQUIRED_COLUMNS:
        if name not in schema.names:
            raise TraceError(f"{path}: missing column {name!r} (expected {EXPECTED_TYPE[name]})")
    for name in TRACE_COLUMNS:
        if name in schema.names:
            if schema.get_field_index(name) < 0:
                raise TraceError(f"{path}: column {name!r} appears more than once")
            if not _type_ok(name, schema.field(name).type):
                raise TraceError(
                    f"{path}: column {name!r} has type {schema.field(name).type}, "
                    f"expected {EXPECTED_TYPE[name]}"
                )
    if "ts" in schema.names:
        check_ts_zone(path, schema.field("ts").type)
    return [n for n in TRACE_COLUMNS if n in schema.names]


EXPECTED_TYPE = {
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


def json_metadata(pf: pq.ParquetFile, path: str | os.PathLike[str], key: bytes, what: str) -> Any:
    meta = pf.schema_arrow.metadata or {}
    label = key.decode()
    if key not in meta:
        raise TraceError(f"{path}: missing {label!r} metadata (not a {what})")
    try:
        obj = json.loads(meta[key])
    except ValueError as exc:  # bad JSON, bad UTF-8, an integer of > 4300 digits
        raise TraceError(
            f"{path}: {label!r} metadata is not valid JSON ({one_line(exc)})"
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
    """``config`` if every size in it is at most :data:`SIZE_LIMIT` tokens
    and its groups are at most the groups limit."""
    if config.num_groups > GROUPS.value():
        raise GROUPS.refuse(f"{where}: kv_cache_groups holds", config.num_groups, TraceError)
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
    obj = json_metadata(pf, path, TRACE_META_KEY, "replay trace v1")
    groups = obj.get("kv_cache_groups") if isinstance(obj, dict) else None
    if isinstance(groups, list) and len(groups) > GROUPS.value():  # before they are built
        raise GROUPS.refuse(
            f"{path}: replay.trace metadata: kv_cache_groups holds", len(groups), TraceError
        )
    try:
        config = TraceConfig.from_json(obj)
        # A trace must be answerable by the cache its events describe.
        check_config(config, trace_cache(config.source))
    except ConfigError as exc:
        raise TraceError(f"{path}: replay.trace metadata: {exc}") from None
    return check_config_limits(config, f"{path}: replay.trace metadata")


@dataclass(frozen=True, slots=True)
class TraceBatch:
    """One validated row batch (see ``TraceReader.iter_batches``)."""

    frame: pl.DataFrame
    hashes: pa.Array


EMPTY_POLARS: dict[str, Any] = {
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
