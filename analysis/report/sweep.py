"""What the report of a what-if sweep (``replay whatif``) shows besides its
chart: one table row per run and the line that says what was swept."""

from __future__ import annotations

from typing import Any

import polars as pl

from analysis.flags import FLAG_KINDS
from analysis.report.fmt import pct


def sweep_table(frame: pl.DataFrame) -> tuple[list[str], list[list[str]]]:
    """Headers and rows by capacity; a flag column only for a flag that occurs."""
    flags = [k for k in FLAG_KINDS if k in frame.columns and frame[k].sum() > 0]
    headers = [
        "capacity (blocks)",
        "eviction",
        "hit ratio",
        "hit tokens",
        "evicted blocks",
        "not admitted",
        *flags,
    ]
    rows: list[list[str]] = []
    for r in frame.sort("capacity_blocks", maintain_order=True).iter_rows(named=True):
        rows.append(
            [
                f"{r['capacity_blocks']:,}",
                r["eviction"],
                pct(r["hit_ratio"]),
                f"{r['hit_tokens']:,}",
                f"{r['evicted_blocks']:,}",
                f"{r['not_admitted']:,}",
                *(f"{r[k]:,}" for k in flags),
            ]
        )
    return headers, rows


def sweep_context(meta: dict[str, Any], frame: pl.DataFrame) -> str:
    lookups = frame["lookups"][0] if frame.height else 0
    return (
        f"trace {meta.get('trace', '?')}: {lookups:,} lookups, {meta.get('cache', '?')} cache, "
        f"policy {meta.get('policy', '?')}, retention interval "
        f"{meta.get('retention_interval')}, max_num_batched_tokens "
        f"{meta.get('max_num_batched_tokens')}; one request at a time; "
        f"{frame.height} runs in {meta.get('seconds', 0):.1f} s"
    )
