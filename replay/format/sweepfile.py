"""The sweep file (replay whatif -o): one row per run of a what-if sweep, its
settings in the metadata."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from replay.base.errors import ReplayError
from replay.format.writer import atomic_path

SWEEP_META_KEY = b"replay.sweep"
#: The columns every sweep file has; one count per flag follows them
#: (replay.whatif.sweep.SWEEP_COLUMNS).
SWEEP_BASE_COLUMNS = (
    "capacity_blocks",
    "capacity_bytes",
    "eviction",
    "cache",
    "policy",
    "lookups",
    "prompt_tokens",
    "hit_tokens",
    "hit_ratio",
    "evicted_blocks",
    "not_admitted",
    "preempted",
    "seconds",
)


def write_sweep_frame(
    path: str | os.PathLike[str], frame: pl.DataFrame, metadata: dict[str, Any]
) -> Path:
    """Write a sweep's frame atomically, ``metadata`` as JSON under its key."""
    import json

    table = frame.to_arrow()
    table = table.replace_schema_metadata({SWEEP_META_KEY: json.dumps(metadata).encode()})
    with atomic_path(path) as tmp:
        pq.write_table(table, str(tmp))
    return Path(path)


def is_sweep_file(path: str | os.PathLike[str]) -> bool:
    try:
        meta = pq.read_schema(str(path)).metadata or {}
    except (OSError, pa.ArrowInvalid):
        return False
    return SWEEP_META_KEY in meta


def read_sweep(path: str | os.PathLike[str]) -> tuple[pl.DataFrame, dict[str, Any]]:
    import json

    if not is_sweep_file(path):
        raise ReplayError(f"{path}: not a sweep file (replay whatif writes them)")
    table = pq.read_table(str(path))
    meta = json.loads((table.schema.metadata or {})[SWEEP_META_KEY])
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    missing = [c for c in SWEEP_BASE_COLUMNS if c not in frame.columns]
    if missing:
        raise ReplayError(f"{path}: sweep file lacks column {missing[0]!r}")
    return frame, meta
