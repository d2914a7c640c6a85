"""The two files behind a report, each opened once: the results file, and the
trace it was replayed from (named with ``--trace``, else found by the name
in the results' metadata), checked to be that trace."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import polars as pl

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.format.link import linked_trace
from replay.format.results import read_results
from replay.format.trace import TraceReader
from replay.format.tracedir import TraceSource, open_trace


def read_report_results(path: Path) -> tuple[pl.DataFrame, dict[str, Any]]:
    """The results frame and its metadata, in one opening; a trace given in
    their place is named as such."""
    return read_results(
        path,
        not_results=f"{path}: is not a results file (no 'replay.results' metadata), expected "
        f"the output of `replay run` (for a trace, run `replay run {path}` first)",
    )


def resolve_trace(
    results_path: Path, info: dict[str, Any], config: TraceConfig, trace: TraceSource | None
) -> tuple[TraceReader | None, str | None]:
    """The trace the results came from, opened, or why there is none. An
    explicit ``--trace`` that does not fit is an error; the default is best
    effort."""
    if trace is not None:
        reader = open_trace(trace)
        if reader.config != config:
            raise ReplayError(
                f"{reader.name}: KV-cache config {reader.config.dumps()} differs from the one "
                f"{results_path} was replayed with ({config.dumps()}); expected the trace of "
                "these results"
            )
        return reader, None
    # Where the results lead; a changed trace there is refused, a missing one
    # is looked for by name beside the results.
    linked = linked_trace(results_path, info, missing_ok=True)
    if linked is not None:
        reader = open_trace(linked)
        if reader.config != config:
            raise ReplayError(
                f"{linked}: KV-cache config differs from the one {results_path} was replayed "
                "with, though its fingerprint matches (please report)"
            )
        return reader, None
    name = info.get("trace")
    if not name:
        return None, (
            f"{results_path.name} does not name its trace; pass --trace to explain the examples"
        )
    candidate = results_path.parent / str(name)
    if not candidate.exists():  # a file, or a trace directory
        looked = f"{candidate} (beside them)"
        rel = info.get("trace_path")
        if isinstance(rel, str) and rel:
            led = Path(os.path.normpath(results_path.parent / rel))
            if led != candidate:
                looked = f"{led} (where the results lead) and {looked}"
        return None, (
            f"trace {name} not found: looked for {looked}; pass --trace to add the explain tables"
        )
    try:
        reader = open_trace(candidate)
    except ReplayError as exc:
        return None, f"trace {candidate} is not usable ({exc}); pass --trace"
    if reader.config != config:
        return None, (
            f"trace {candidate} has a different KV-cache config than these results; pass --trace"
        )
    return reader, None


def lookup_mismatch(reader: TraceReader, res: pl.DataFrame) -> str | None:
    """Why the trace is not the one of these results (a lookup of the results
    that it does not hold at that seq), or None."""
    frame = reader.read_frame(["seq", "kind", "request_id"])
    lookups = frame.filter(pl.col("kind") == "lookup").select("seq", "request_id")
    joined = res.select("seq", "request_id").join(lookups, on="seq", how="left", suffix="_t")
    bad = joined.filter(
        pl.col("request_id_t").is_null() | (pl.col("request_id") != pl.col("request_id_t"))
    )
    if bad.height:
        r = bad.row(0, named=True)
        return (
            f"trace {reader.name} has no lookup {r['request_id']!r} at seq {r['seq']}: "
            "it is not the trace of these results"
        )
    return None
