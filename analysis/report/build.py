"""``build_report``: every figure of a report, from a results file and (when
it is found) its trace, each opened once; the trace gives the examples their
``replay explain`` tables."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from replay.analysis.flags import results_flags
from replay.analysis.report import data
from replay.analysis.report.data import ReportData
from replay.analysis.report.inputs import lookup_mismatch, read_report_results, resolve_trace
from replay.base.errors import ReplayError
from replay.engine.answers import Progress
from replay.engine.replay import explain_lookups
from replay.format.results import results_cache, results_config
from replay.format.trace import TraceReader
from replay.format.tracedir import TraceSource
from replay.rules.coordinator import POLICIES, hit_alignment
from replay.rules.coordinator.kinds import REFERENCE
from replay.tools.render import explain_header, explain_table


def build_report(
    results_path: str | os.PathLike[str],
    *,
    trace: TraceSource | None = None,
    examples: int = 3,
    progress: Callable[[Progress], None] | None = None,
) -> ReportData:
    """Every figure of the report. ``examples``: flagged lookups shown per
    kind. ``trace``: a path or an open ``TraceReader`` (read, never reopened)."""
    rpath = Path(results_path)
    res, info = read_report_results(rpath)
    config = results_config(info, rpath)
    cache = results_cache(info)
    reader, note = resolve_trace(rpath, info, config, trace)
    if reader is not None:
        mismatch = lookup_mismatch(reader, res)
        if mismatch is not None:
            if trace is not None:
                raise ReplayError(mismatch)
            reader, note = None, mismatch + "; pass --trace"
    flags = results_flags(res, config, cache)
    x_axis, timeline = data.timeline(res)
    flag_rows = data.flag_rows(flags, res.height)
    alignment = hit_alignment(config, cache)
    report = ReportData(
        results_path=str(rpath),
        info=info,
        config=config,
        cache=cache,
        alignment=alignment,
        summary=data.summary(res, flags),
        x_axis=x_axis,
        timeline=timeline,
        histogram=data.histogram(res, alignment),
        groups=data.groups(res, config),
        flag_rows=flag_rows,
        examples=data.flag_examples(flags, [r["flag"] for r in flag_rows], examples),
        trace_path=reader.name if reader is not None else None,
        trace_note=note,
    )
    report.extra["flag_details"] = "flag_details" in res.columns or "unit_present" in res.columns
    if reader is not None:
        explain_examples(report, reader, progress)
    return report


def explain_examples(
    report: ReportData,
    reader: TraceReader,
    progress: Callable[[Progress], None] | None = None,
) -> None:
    """Give every example its ``replay explain`` table (header and steps),
    from one pass over the trace up to the last example."""
    policy = str(report.info.get("policy"))
    if policy not in POLICIES:
        report.explain_note = (
            f"policy {policy!r} of these results is unknown to this version "
            f"(known: {', '.join(POLICIES)}); no explain tables"
        )
        return
    wanted = {e.seq for exs in report.examples.values() for e in exs}
    if not wanted:
        return
    config, found = explain_lookups(
        reader,
        lambda e: e.seq in wanted,
        policy,
        cache=report.cache,
        until_seq=max(wanted),
        progress=progress,
    )
    texts = {
        lookup.seq: explain_header(config, lookup, policy, report.cache)
        + "\n\n"
        + explain_table(config, outcome)
        for lookup, outcome, _ in found
    }
    for k, exs in report.examples.items():
        report.examples[k] = [e.explained(texts.get(e.seq)) for e in exs]
    if report.info.get("coordinator") not in (None, REFERENCE.name):
        report.explain_note = (
            f"these results come from the {report.info.get('coordinator')} coordinator; "
            "the explain tables show the reference coordinator's steps under the same policy"
        )
