"""The results format (v1): the schema, the writer and the checked reader of a
results file."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from replay.base.errors import ConfigError, ReplayError, TraceError
from replay.base.limits import TOKEN_LIMIT
from replay.base.spec import TraceConfig
from replay.base.text import readable
from replay.format.paths import arrow_file
from replay.format.schema import (
    FACT_COLUMNS,
    RESULTS_META_KEY,
    RESULTS_SCHEMA,
    SIZE_LIMIT,
    UNIT_PRESENT_FIELD,
    check_config_limits,
    int_ok,
    json_metadata,
    one_line,
    string_ok,
)
from replay.format.trace import check_declared_text, open_parquet
from replay.format.validate import check_ts, check_utf8, to_polars, utc_ts
from replay.format.writer import atomic_path
from replay.rules.coordinator import CACHES, DEFAULT_CACHE


def results_schema(metadata: Mapping[str, Any]) -> pa.Schema:
    return RESULTS_SCHEMA.with_metadata(
        {RESULTS_META_KEY: json.dumps(readable(metadata), sort_keys=True).encode()}
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
                "replay.analysis.flags.flag_results, which flags every lookup from its facts)"
            )
        if table.column(name).null_count:
            raise ReplayError(f"{path}: results with a null {name!r} (a lookup never flagged)")
    schema = results_schema(metadata)
    facts = [n for n in FACT_COLUMNS if n in table.column_names]
    if not facts:
        # A writer from before the facts: its flags are the file's, as written.
        schema = pa.schema(
            [f for f in schema if f.name not in FACT_COLUMNS], metadata=schema.metadata
        )
    elif len(facts) < len(FACT_COLUMNS):
        gone = next(n for n in FACT_COLUMNS if n not in facts)
        raise ReplayError(f"{path}: results without the fact column {gone!r} (they come together)")
    extra = [n for n in table.column_names if n not in RESULTS_SCHEMA.names]
    table = table.select(schema.names + extra)
    fields = list(schema) + [table.schema.field(n) for n in extra]
    table = table.cast(pa.schema(fields, metadata=schema.metadata))
    with atomic_path(path) as tmp, arrow_file(tmp, "wb") as where:
        pq.write_table(table, where, compression="zstd")
    return Path(path)


def results_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A results file's ``replay.results`` metadata, without reading its rows."""
    pf = open_parquet(path)
    info = json_metadata(pf, path, RESULTS_META_KEY, "results file")
    if not isinstance(info, dict):
        raise TraceError(f"{path}: 'replay.results' metadata must be a JSON object")
    return info


def is_results_file(path: str | os.PathLike[str]) -> bool:
    if Path(path).is_dir():
        return False  # a trace directory (replay.format.tracedir)
    pf = open_parquet(path)
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
        return int_ok(typ)
    if name in _RESULTS_INT_LISTS:
        return is_list(typ) and (int_ok(typ.value_type) or pa.types.is_null(typ.value_type))
    if name in ("request_id", "policy", "coordinator"):
        return string_ok(typ)
    if name == "ts":
        return bool(pa.types.is_timestamp(typ) or pa.types.is_null(typ))
    if name == "observed_match":
        return bool(pa.types.is_boolean(typ) or pa.types.is_null(typ))
    if name == "flags":
        return is_list(typ) and string_ok(typ.value_type)
    if name in ("hit_alignment", "attention_tokens"):
        return int_ok(typ) or pa.types.is_null(typ)
    if name in ("group_state_tokens", "first_absent_block"):
        return is_list(typ) and (int_ok(typ.value_type) or pa.types.is_null(typ.value_type))
    if name == "eagle_unit_present":
        return is_list(typ) and (
            pa.types.is_boolean(typ.value_type) or pa.types.is_null(typ.value_type)
        )
    if name == "unit_present":
        return (
            is_list(typ)
            and is_list(typ.value_type)
            and (pa.types.is_boolean(typ.value_type.value_type))
        )
    return True


def _flag_columns_typed(table: pa.Table) -> bool:
    """Whether ``flags`` is a list of strings and ``flag_details`` a list of
    structs with a string ``flag`` (then the two must agree)."""
    names = table.column_names
    if "flags" not in names or "flag_details" not in names:
        return False
    flags, details = table.schema.field("flags").type, table.schema.field("flag_details").type
    if not (pa.types.is_list(flags) or pa.types.is_large_list(flags)):
        return False
    if not (pa.types.is_string(flags.value_type) or pa.types.is_large_string(flags.value_type)):
        return False
    if not (pa.types.is_list(details) or pa.types.is_large_list(details)):
        return False
    inner = details.value_type
    if not pa.types.is_struct(inner) or inner.get_field_index("flag") < 0:
        return False
    flag = inner.field("flag").type
    return bool(pa.types.is_string(flag) or pa.types.is_large_string(flag))


def _check_results(path: str, table: pa.Table, config: TraceConfig) -> pl.DataFrame:
    """The results rows as a frame in the contract's types, after the checks
    a trace gets: types, nulls, ``seq`` order, one entry per group."""
    for name in table.column_names:
        check_utf8(path, table, name)
    table = utc_ts(table)
    check_ts(path, table)
    frame = to_polars(table)
    casts: list[pl.Expr] = [pl.col(n).cast(pl.Int64) for n in _RESULTS_INTS if n in frame.columns]
    casts += [pl.col(n).cast(pl.List(pl.Int64)) for n in _RESULTS_INT_LISTS if n in frame.columns]
    if "hit_alignment" in frame.columns:
        casts += [
            pl.col("hit_alignment", "attention_tokens").cast(pl.Int64),
            pl.col("group_state_tokens").cast(pl.List(pl.Int64)),
            pl.col("first_absent_block").cast(pl.List(pl.Int32)),
            pl.col("eagle_unit_present").cast(pl.List(pl.Boolean)),
        ]
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
    if _flag_columns_typed(table) and not all(c in table.column_names for c in FACT_COLUMNS):
        # Each flag a lookup lists has the numbers that prove it, and no
        # numbers prove a flag it does not list: `check` reads either. (A
        # file with the facts has its flags recomputed from them.)
        listed = pl.col("flags").list.unique().list.sort()
        proved = (
            pl.col("flag_details")
            .list.eval(pl.element().struct.field("flag"))
            .list.unique()
            .list.sort()
        )
        checks.append(
            (
                (listed != proved) & pl.col("flags").is_not_null(),
                "flags and flag_details disagree (each flag listed needs its flag_details "
                "entry, and each entry a listed flag)",
            )
        )
    if "hit_alignment" in frame.columns:
        checks.append((pl.col("hit_alignment") < 1, "hit_alignment is not a positive number"))
        for name in ("group_state_tokens", "first_absent_block", "eagle_unit_present"):
            checks.append(
                (pl.col(name).is_null(), f"{name} is null (expected one entry per group)")
            )
            checks.append(
                (pl.col(name).list.len() != n, f"{name} needs one entry per KV-cache group ({n})")
            )
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
    pf = open_parquet(path)
    if not_results is not None and RESULTS_META_KEY not in (pf.schema_arrow.metadata or {}):
        raise ReplayError(not_results)
    info = json_metadata(pf, path, RESULTS_META_KEY, "results file")
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
    facts = [n for n in FACT_COLUMNS if n in schema.names]
    if facts and len(facts) < len(FACT_COLUMNS):
        gone = next(n for n in FACT_COLUMNS if n not in schema.names)
        raise TraceError(
            f"{path}: missing column {gone!r} (the facts columns {', '.join(FACT_COLUMNS)} "
            "come together, or not at all in a file from before them)"
        )
    config = results_config(info, path)
    check_declared_text(pf, str(path))
    try:
        table = pf.read()
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(f"{path}: unreadable Parquet data ({one_line(exc)})") from None
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
