"""The one replay call: a trace file or directory, for one or more variants,
in this process or on Ray (issue 21).

Every face calls ``replay``: ``replay run``, ``replay check``, ``replay diff``,
``replay minimize``, the pytest plugin, ``traces/build.py`` and the
benchmark. Its options are one frozen dataclass (``ReplayOptions``); a
refusal is a ``ReplayError`` (a one-line message the CLI prints). The results
hold each lookup's answer and facts; the flags are the analyses' to add
(``replay.analysis.flags.flag_results``)."""

from __future__ import annotations

import os

from replay.base.errors import ReplayError
from replay.engine.answers import Answers, ReplayResult, Variant
from replay.engine.options import ReplayOptions
from replay.engine.shard import replay_answers
from replay.format.tracedir import TraceSource, open_trace
from replay.rules.coordinator import get_coordinator

__all__ = ["ReplayOptions", "Variant", "replay"]


def replay(trace: TraceSource, options: ReplayOptions | None = None) -> list[ReplayResult]:
    """Replay every lookup of ``trace`` under each variant of ``options``,
    all from one fold of the store: one result per variant, in order.

    ``trace``: a trace file or directory, a binary file object or an open
    ``TraceReader`` (on Ray: a path). The results are the same whichever way
    it runs: one process, ``shards`` key shards, or Ray."""
    options = options or ReplayOptions()
    if options.on_ray:
        return _on_ray(trace, options)
    reader = open_trace(trace)
    variants = options.variants_for(reader.config)
    answers = Answers(reader.config, variants, unit_present=options.unit_present, where=reader.name)
    return replay_answers(
        reader,
        answers,
        shards=options.shards,
        progress=options.progress,
        progress_every=options.progress_every,
    )


def _on_ray(trace: TraceSource, options: ReplayOptions) -> list[ReplayResult]:
    where = "`ray_address`" if options.ray_address is not None else "`workers`"
    if any(
        not get_coordinator(k).on_ray
        for k in [options.coordinator, *(v.coordinator for v in options.variants)]
    ):
        raise ReplayError(
            "`coordinator` vllm runs in one process: drop `workers`/`ray_address` to use it"
        )
    if options.unit_present:
        raise ReplayError("`unit_present` runs in one process: drop `workers`/`ray_address`")
    if not isinstance(trace, str | os.PathLike):
        raise ReplayError(f"{where}: Ray replays a trace file or directory by its path")
    from replay.engine.cluster import import_ray, replay_on_ray

    import_ray()  # a missing extra is said before any reading
    return replay_on_ray(trace, options)
