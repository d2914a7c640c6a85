"""Figures about a trace (``replay info``) and about a replay (``replay run``),
as plain dicts so the CLI can print them or dump them as JSON."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import polars as pl

from replay.engine.answers import ReplayResult
from replay.engine.shard import StoredKeys
from replay.format.tracedir import TraceSource, open_trace


def prompt_tokens_expr() -> pl.Expr:
    # vLLM asks for num_tokens - 1 at most, so max_length + 1 stands in for a
    # missing prompt length.
    return pl.col("num_tokens").fill_null(pl.col("max_length") + 1)


#: A trace whose clock starts before this holds elapsed times, not dates: the
#: public Mooncake and bailian traces start at zero, which their importers
#: write as the Unix epoch. No recording is that old.
RELATIVE_BEFORE = datetime(1971, 1, 1, tzinfo=UTC)


def is_relative(first: datetime | None) -> bool:
    """Whether a trace whose first timestamp is ``first`` has a relative clock."""
    return first is not None and first < RELATIVE_BEFORE


def trace_info(trace: TraceSource) -> dict[str, Any]:
    """Counts, time span and distinct keys of a trace (a path or an open reader)."""
    reader = open_trace(trace)
    config = reader.config
    counts = {"store": 0, "remove": 0, "clear": 0, "lookup": 0}
    # Distinct stored keys per group: the engine's fold, counted at the end.
    stored = StoredKeys(config.num_groups)
    first_ts: datetime | None = None
    last_ts: datetime | None = None
    first_seq = last_seq = None
    lookups = prompt = max_len = 0
    hash_entries = 0
    for batch in reader.iter_batches():
        frame = batch.frame
        for kind, n in frame.group_by("kind").len().iter_rows():
            counts[kind] += n
        if frame.height:
            first_seq = frame["seq"][0] if first_seq is None else first_seq
            last_seq = frame["seq"][-1]
        ts = frame["ts"].drop_nulls()
        lo, hi = ts.min(), ts.max()
        if isinstance(lo, datetime) and isinstance(hi, datetime):
            first_ts = lo if first_ts is None else min(first_ts, lo)
            last_ts = hi if last_ts is None else max(last_ts, hi)
        hash_entries += int(frame["n_hashes"].fill_null(0).sum())
        stored.add(batch)
        lk = frame.filter(pl.col("kind") == "lookup")
        lookups += lk.height
        prompt += int(lk.select(prompt_tokens_expr()).sum().item() or 0)
        max_len += int(lk["max_length"].sum() or 0)
    span = (
        (last_ts - first_ts).total_seconds()
        if first_ts is not None and last_ts is not None
        else None
    )
    return {
        "path": reader.name,
        "config": config.to_json(),
        "events": sum(counts.values()),
        "events_by_kind": counts,
        "seq_range": [first_seq, last_seq],
        "time_span": {
            "first": first_ts.isoformat() if first_ts else None,
            "last": last_ts.isoformat() if last_ts else None,
            "seconds": span,
            "relative": is_relative(first_ts),
        },
        "hash_entries": hash_entries,
        "distinct_keys_per_group": stored.group_counts(),
        "lookups": lookups,
        "lookup_prompt_tokens": prompt,
        "lookup_max_length_tokens": max_len,
    }


def hit_figures(res: pl.DataFrame) -> dict[str, Any]:
    """The figures of a results frame that `replay run` and the reports share."""
    prompt = int(res.select(prompt_tokens_expr()).sum().item() or 0) if res.height else 0
    hit = int(res["hit_tokens"].sum() or 0) if res.height else 0
    observed = res["observed_hit_tokens"] if "observed_hit_tokens" in res.columns else None
    n_obs = 0 if observed is None else int(observed.is_not_null().sum())
    mismatches = (
        0 if observed is None else int((observed != res["hit_tokens"]).fill_null(False).sum())
    )
    return {
        "lookups": res.height,
        "lookups_with_hit": int((res["hit_tokens"] > 0).sum()) if res.height else 0,
        "prompt_tokens": prompt,
        "hit_tokens": hit,
        "hit_ratio": round(hit / prompt, 6) if prompt else 0.0,
        "observed": {"lookups": n_obs, "mismatches": mismatches},
    }


def run_summary(result: ReplayResult, flag_counts: dict[str, int] | None = None) -> dict[str, Any]:
    res = result.results
    config = result.config
    groups = []
    for gid, g in enumerate(config.groups):
        loaded = int(res["loaded_blocks"].list.get(gid).sum() or 0) if res.height else 0
        mask = int(res["mask_blocks"].list.get(gid).sum() or 0) if res.height else 0
        verified = int(res["group_hit_tokens"].list.get(gid).sum() or 0) if res.height else 0
        groups.append(
            {
                "group_id": gid,
                "kind": g.kind.value,
                "block_size": g.block_size,
                "loaded_blocks": loaded,
                "skipped_blocks": mask - loaded,
                "loaded_tokens": loaded * g.block_size,
                "verified_tokens": verified,
            }
        )
    seconds = result.seconds
    return {
        "trace": result.trace_path,
        "policy": result.policy,
        "coordinator": result.coordinator,
        "cache": result.cache,
        "events": result.events,
        "events_by_kind": result.events_by_kind,
        **hit_figures(res),
        "groups": groups,
        "flags": flag_counts if flag_counts is not None else {},
        "seconds": round(seconds, 3),
        "events_per_second": round(result.events / seconds) if seconds > 0 else None,
        "lookups_per_second": round(res.height / seconds) if seconds > 0 else None,
        "answered": result.answered,
    }
