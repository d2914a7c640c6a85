"""The sweep file (replay whatif -o): one row per run of a what-if sweep, its
settings in the metadata. Its schema is defined here and nowhere else."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from replay.base.errors import ReplayError
from replay.base.text import readable
from replay.format.paths import arrow_file
from replay.format.writer import atomic_path

SWEEP_META_KEY = b"replay.sweep"
#: Per request, hit tokens over prompt tokens: its 50th, 90th and 99th
#: percentiles (``replay.whatif.sweep.hit_ratio_percentiles``).
PERCENTILE_COLUMNS = ("hit_ratio_p50", "hit_ratio_p90", "hit_ratio_p99")
#: The sweep file's columns and their types, in order: one row per run. One
#: count per flag kind follows them (the analyses' judgement of the run's
#: facts, ``replay.analysis.flags.sweep_flag_counts``), each an Int64.
SWEEP_SCHEMA: dict[str, Any] = {
    "capacity_blocks": pl.Int64,
    "capacity_bytes": pl.Int64,
    "eviction": pl.String,
    "cache": pl.String,
    "policy": pl.String,
    "lookups": pl.Int64,
    "prompt_tokens": pl.Int64,
    "hit_tokens": pl.Int64,
    "hit_ratio": pl.Float64,
    **dict.fromkeys(PERCENTILE_COLUMNS, pl.Float64),
    "evicted_blocks": pl.Int64,
    "not_admitted": pl.Int64,
    "preempted": pl.Int64,
    "seconds": pl.Float64,
    #: How a row was computed: ``PER_CAPACITY`` or ``ONE_PASS``.
    "method": pl.String,
    #: Which code computed it: ``COMPILED`` or ``PYTHON``.
    "simulator": pl.String,
}
SWEEP_COLUMNS = tuple(SWEEP_SCHEMA)
#: The columns a sweep file must have to be read: every one but those added
#: later (the percentiles, method and simulator), so older files still chart.
SWEEP_REQUIRED_COLUMNS = tuple(
    c for c in SWEEP_COLUMNS if c not in (*PERCENTILE_COLUMNS, "method", "simulator")
)
#: A row's ``method``: its own simulation, or the one pass over every LRU
#: capacity (``replay.whatif.stack``, where it is exact).
PER_CAPACITY, ONE_PASS = "per-capacity", "one-pass"
#: A row's ``simulator``: a compiled kernel (``replay.whatif.kernel``,
#: ``mooncake_kernel``, ``stack``) or the Python model (the configurations,
#: policies or emitted traces they do not cover).
COMPILED, PYTHON = "compiled", "python"


def sweep_frame(rows: Sequence[Mapping[str, Any]]) -> pl.DataFrame:
    """The runs as the sweep file's frame: ``SWEEP_SCHEMA``, then the counts
    per flag kind the rows carry, in the rows' order (other keys of a row,
    such as its facts, are not written)."""
    schema = dict(SWEEP_SCHEMA)
    counts = [
        c for c in (rows[0] if rows else {}) if c not in schema and c not in ("facts", "_hits")
    ]
    schema.update(dict.fromkeys(counts, pl.Int64))
    return pl.DataFrame([{c: r[c] for c in schema} for r in rows], schema=schema)


def write_sweep(
    path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]], metadata: dict[str, Any]
) -> Path:
    """Write a sweep's rows atomically, ``metadata`` as JSON under its key."""
    return write_sweep_frame(path, sweep_frame(rows), metadata)


def write_sweep_frame(
    path: str | os.PathLike[str], frame: pl.DataFrame, metadata: dict[str, Any]
) -> Path:
    """Write a sweep's frame atomically, ``metadata`` as JSON under its key."""
    import json

    table = frame.to_arrow()
    table = table.replace_schema_metadata({SWEEP_META_KEY: json.dumps(readable(metadata)).encode()})
    with atomic_path(path) as tmp, arrow_file(tmp, "wb") as where:
        pq.write_table(table, where)
    return Path(path)


def is_sweep_file(path: str | os.PathLike[str]) -> bool:
    try:
        with arrow_file(path) as source:
            meta = pq.read_schema(source).metadata or {}
    except (OSError, pa.ArrowInvalid):
        return False
    return SWEEP_META_KEY in meta


def read_sweep(path: str | os.PathLike[str]) -> tuple[pl.DataFrame, dict[str, Any]]:
    import json

    if not is_sweep_file(path):
        raise ReplayError(f"{path}: not a sweep file (replay whatif writes them)")
    with arrow_file(path) as source:
        table = pq.read_table(source)
    meta = json.loads((table.schema.metadata or {})[SWEEP_META_KEY])
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    missing = [c for c in SWEEP_REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise ReplayError(f"{path}: sweep file lacks column {missing[0]!r}")
    return frame, meta
