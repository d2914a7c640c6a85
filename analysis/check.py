"""`replay check`'s input: the flags of a trace (replayed now) or of a
results file (as written). Apart from replay.analysis.flags so that the flag rules
never import the replay that calls them (issue 21)."""

from __future__ import annotations

import os
from collections.abc import Callable

import polars as pl

from replay.analysis.flags import result_flags, results_flags
from replay.base.errors import ReplayError
from replay.engine.answers import Progress
from replay.engine.run import ReplayOptions, replay
from replay.format.results import is_results_file, read_results, results_cache, results_config
from replay.rules.coordinator import DEFAULT_COORDINATOR, DEFAULT_POLICY


def check_path(
    path: str | os.PathLike[str],
    *,
    policy: str | None,
    coordinator: str = DEFAULT_COORDINATOR,
    cache: str | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> tuple[pl.DataFrame, str]:
    """Flags of a trace (replayed now, under ``policy`` or the default) or of a
    results file (as written; a ``policy`` other than its own is an error).
    Returns the flags and the policy they were computed under. A trace or
    results file without lookups has nothing to check: an error."""
    if is_results_file(path):
        frame, info = read_results(path)
        made_under = str(info.get("policy", "?"))
        if policy is not None and policy != made_under:
            raise ReplayError(
                f"{path}: these results were made under policy {made_under}, not `policy` "
                f"{policy} (check the trace to replay it under {policy}, or drop `policy`)"
            )
        made_in = results_cache(info)
        if cache is not None and cache != made_in:
            raise ReplayError(
                f"{path}: these results were replayed in the {made_in} cache, not {cache} "
                f"(replay the trace with `cache` {cache}, or drop `cache`)"
            )
        if frame.height == 0:
            raise ReplayError(f"{path}: no lookups, nothing to check")
        return results_flags(frame, results_config(info, path), made_in), made_under
    used = policy or DEFAULT_POLICY
    (result,) = replay(
        path,
        ReplayOptions(
            policies=(used,), caches=(cache,), coordinator=coordinator, progress=progress
        ),
    )
    if result.results.height == 0:
        raise ReplayError(f"{path}: the trace has no lookups, nothing to check")
    return result_flags(result), used
