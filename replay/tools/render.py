"""Plain text of the project's objects, shared by the CLI and the reports
(no I/O here): tables, group labels, the explain table, and every summary a
command prints (of a trace, a replay, a check, a sweep, a written or recorded trace).
The figures come from ``replay.analysis.summary``; this module only words them."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replay.base.spec import TraceConfig
from replay.base.text import counted, printable
from replay.rules.coordinator import POLICIES, LookupOutcome, hit_alignment
from replay.rules.store import LookupEvent

if TYPE_CHECKING:
    from replay.sources.stream import RecordSummary


def elapsed(seconds: float, *, millis: bool = False) -> str:
    """Time since a relative trace's start: ``+00:58:57`` (``+00:00:01.250``)."""
    if not millis:
        h, rest = divmod(round(seconds), 3600)
        return f"+{h:02d}:{rest // 60:02d}:{rest % 60:02d}"
    whole = int(seconds)
    h, rest = divmod(whole, 3600)
    return (
        f"+{h:02d}:{rest // 60:02d}:{rest % 60:02d}.{min(round((seconds - whole) * 1000), 999):03d}"
    )


def percent(ratio: float) -> str:
    """A ratio (0 to 1) as every text output spells it: ``54.24%``."""
    return f"{100 * ratio:.2f}%"


def _numeric(cell: str) -> bool:
    return cell.lstrip("+-").replace(",", "").isdigit()


def _cell(value: object, identifier: bool) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and not identifier:
        return f"{value:,}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    # A count is thousands separated like every count in the text; a seq
    # identifies a lookup and is written as the trace has it.
    ids = [h == "seq" for h in headers]
    cells = [[str(h) for h in headers]] + [
        [_cell(c, i) for c, i in zip(row, ids, strict=True)] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(
            c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths, strict=True)
        ).rstrip()
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def group_label(config: TraceConfig, gid: int) -> str:
    g = config.groups[gid]
    extra = ""
    if g.sliding_window is not None:
        extra = f" window={g.sliding_window}"
        if g.extra_retained_tokens:
            extra += f"+{g.extra_retained_tokens}"
    if g.attention_chunk_size is not None:
        extra = f" chunk={g.attention_chunk_size}"
    eagle = " eagle" if g.is_eagle_group else ""
    name = f" ({g.name})" if g.name else ""
    return f"{gid}: {g.kind.value} block={g.block_size}{extra}{eagle}{name}"


def _eagle(summary: Mapping[str, Any]) -> str:
    lookahead = summary.get("lookahead_tokens") or 0
    if not summary["eagle"]:
        return "off"
    return f"on ({lookahead} lookahead hash tokens)" if lookahead else "on"


def config_lines(config: TraceConfig, cache: str) -> list[str]:
    """The configuration, and the hit alignment of the cache that answers
    (the two caches align a hit differently: ``hit_alignment``)."""
    lines = [
        f"hash_block_size={config.hash_block_size} scheduler_block_size={config.scheduler_block_size} "
        f"use_eagle={str(config.use_eagle).lower()} "
        f"enable_partial_hash_hits={str(config.enable_partial_hash_hits).lower()}"
        + (
            f" num_hash_lookahead_tokens={config.num_hash_lookahead_tokens}"
            if config.num_hash_lookahead_tokens
            else ""
        )
        + f" cache={cache} alignment={hit_alignment(config, cache)}",
    ]
    lines += [f"  group {group_label(config, gid)}" for gid in range(config.num_groups)]
    return lines


def policy_label(policy: str | None, cache: str | None) -> str:
    """A policy as a header names it: an alias with the release it takes in
    ``cache`` (``Policy.label``)."""
    found = POLICIES.get(policy or "")
    return str(policy) if found is None or cache is None else found.label(cache)


def explain_header(
    config: TraceConfig, lookup: LookupEvent[Any], policy: str, cache: str | None = None
) -> str:
    return (
        f"request {printable(lookup.request_id)} (seq {lookup.seq}): "
        f"max_length {lookup.max_length:,}, "
        f"{counted(len(lookup.hashes), 'hash', 'hashes')} of {config.hash_block_size} tokens, "
        f"policy {policy_label(policy, cache)}" + (f", cache {cache}" if cache else "")
    )


def explain_table(config: TraceConfig, outcome: LookupOutcome) -> str:
    """The fixed point step by step, then the final hit and every group's mask."""
    rows = []
    for s in outcome.steps:
        groups = ",".join(str(g) for g in s.group_ids)
        if s.reused:
            rows.append(
                [
                    s.pass_no,
                    f"{s.spec_group} [{groups}]",
                    s.kind.value,
                    "-",
                    "-",
                    "(reuses first pass)",
                    "-",
                    s.hit_tokens,
                    s.candidate_after,
                ]
            )
            continue
        rows.append(
            [
                s.pass_no,
                f"{s.spec_group} [{groups}]",
                s.kind.value,
                s.bound,
                f"+{s.margin}" if s.margin else "0",
                s.matched_tokens,
                "yes" if s.drop else "no",
                s.hit_tokens,
                s.candidate_after,
            ]
        )
    # vLLM's own coordinator exposes no steps: its answer alone.
    out = (
        []
        if not rows
        else [
            table(
                [
                    "pass",
                    "spec group [groups]",
                    "kind",
                    "bound",
                    "margin",
                    "matched",
                    "drop",
                    "group hit",
                    "candidate",
                ],
                rows,
            ),
            "",
        ]
    )
    out.append(
        f"hit: {counted(outcome.hit_tokens, 'token')} (attention-verified "
        f"{outcome.verified_tokens:,})"
    )
    mask_rows = []
    for g in outcome.groups:
        mask = "".join("#" if m else "." for m in g.mask())
        if len(mask) > 48:
            mask = mask[:20] + f"…({len(mask) - 40} more)…" + mask[-20:]
        if g.state_tokens is None:
            state = ""
        else:
            state = f"state at {g.state_tokens:,}" if g.state_tokens else "no state"
        mask_rows.append(
            [group_label(config, g.group_id), g.mask_blocks, g.loaded_blocks, mask or "-", state]
        )
    out += [
        "",
        table(["group", "mask", "loaded", "blocks (. skipped, # loaded)", "mamba"], mask_rows),
    ]
    return "\n".join(out)


# ----------------------------------------------------------------- summaries


def kinds_text(by_kind: Mapping[str, int]) -> str:
    """Events per kind: ``store 3, remove 1, clear 0, lookup 2``."""
    k = by_kind
    return (
        f"store {k['store']:,}, remove {k['remove']:,}, clear {k['clear']:,}, "
        f"lookup {k['lookup']:,}"
    )


def _example_line(example: Mapping[str, Any]) -> str:
    """One flagged lookup (a row of ``replay.analysis.flags.flag_examples``):
    its flag, request, seq and the numbers that prove it."""
    e = example
    return f"{e['flag']}: request {printable(e['request_id'])} seq {e['seq']}: {e['detail']}"


def _example_lines(examples: Sequence[Mapping[str, Any]]) -> list[str]:
    return ["  " + _example_line(ex) for ex in examples]


def validate_line(path: Path, info: Mapping[str, Any]) -> str:
    """``replay validate``: the trace is valid, with its counts."""
    return (
        f"ok: {path}: {counted(info['events'], 'event')} ({kinds_text(info['events_by_kind'])}), "
        f"{counted(len(info['config']['kv_cache_groups']), 'KV-cache group')}"
    )


def info_lines(path: Path, info: Mapping[str, Any], config: TraceConfig, cache: str) -> list[str]:
    """``replay info``: ``replay.analysis.summary.trace_info`` of a trace whose
    replays ``cache`` answers."""
    first, last = info["seq_range"]
    span = info["time_span"]
    if span["seconds"] is None:
        when = "time: no timestamps"
    elif span.get("relative"):
        # The clock starts at zero (written as the epoch): elapsed time, not dates.
        start = datetime.fromisoformat(span["first"]).timestamp()
        end = datetime.fromisoformat(span["last"]).timestamp()
        when = (
            f"time: {elapsed(start)} .. {elapsed(end)} elapsed ({span['seconds']:,.1f} s; "
            "the trace's clock starts at zero)"
        )
    else:
        when = f"time: {span['first']} .. {span['last']} ({span['seconds']:,.1f} s)"
    lines = [
        f"trace: {path}",
        *config_lines(config, cache),
        f"events: {info['events']:,} ({kinds_text(info['events_by_kind'])}), seq {first}..{last}",
        when,
        f"hash entries: {info['hash_entries']:,}",
    ]
    lines += [
        f"distinct keys stored, group {group_label(config, gid)}: {n:,}"
        for gid, n in enumerate(info["distinct_keys_per_group"])
    ]
    lines.append(
        f"lookups: {info['lookups']:,}, prompt tokens {info['lookup_prompt_tokens']:,}, "
        f"max_length tokens {info['lookup_max_length_tokens']:,}"
    )
    return lines


def run_summary_lines(s: Mapping[str, Any], flags_text: str) -> list[str]:
    """``replay run``: ``replay.analysis.summary.run_summary`` with the flagged
    ``examples`` and the ``results`` path; ``flags_text`` words its flag
    counts (``counts_text``)."""
    lines = [
        f"replayed {counted(s['events'], 'event')} ({kinds_text(s['events_by_kind'])}) with "
        f"{s['coordinator']} coordinator, policy {s['policy']}, {s['cache']} cache",
        f"lookups: {s['lookups']:,} ({s['lookups_with_hit']:,} with a hit)",
        f"prompt tokens: {s['prompt_tokens']:,}, hit tokens: {s['hit_tokens']:,} "
        f"(hit ratio {percent(s['hit_ratio'])})",
    ]
    lines += [
        f"  group {g['group_id']} {g['kind']} block={g['block_size']}: loaded "
        f"{counted(g['loaded_blocks'], 'block')} ({counted(g['loaded_tokens'], 'token')}), "
        f"skipped {g['skipped_blocks']:,}"
        for g in s["groups"]
    ]
    observed = s["observed"]
    if observed["lookups"]:
        lines.append(
            f"observed hits: {observed['lookups']:,} reported, {observed['mismatches']:,} differ "
            "from the replay"
        )
    lines.append(
        f"time: {s['seconds']:.2f} s ({s['events_per_second'] or 0:,} events/s, "
        f"{s['lookups_per_second'] or 0:,} lookups/s), answered {s['answered']}"
    )
    if s["flags"]:
        lines.append(f"flags: {flags_text}")
        lines.append("flagged lookups (first examples):")
        lines += _example_lines(s["examples"])
    else:
        lines.append("flags: none")
    lines.append(f"results: {s['results']}")
    return lines


def check_lines(
    path: Path,
    policy: str,
    counts_text: str,
    lookups: int,
    examples: Sequence[Mapping[str, Any]],
    verdict: str,
) -> list[str]:
    """``replay check``: the verdict on ``path`` under ``policy``; ``lookups``
    is how many lookups are flagged, ``counts_text`` how many per flag (with
    severities), ``verdict`` whether that fails and why."""
    if not lookups:
        return [f"{path}: clean under {policy} (no flags)"]
    return [
        f"{path}: {counted(lookups, 'flagged lookup')} under {policy}: {counts_text}",
        *_example_lines(examples),
        verdict,
    ]


def minimize_lines(
    trace: Path, output: Path, info: Mapping[str, Any], request_id: str
) -> list[str]:
    """``replay minimize``: the sizes, and the expectation per policy."""
    lines = [
        f"{trace}: {counted(info['events_before'], 'event')} -> {output}: "
        f"{counted(info['events_after'], 'event')}"
    ]
    for e in info["expect"]:
        flags = ", ".join(e["flags"]) or "no flags"
        where = f" ({e['cache']})" if e.get("cache") else ""
        lines.append(f"  {e['policy']}{where}: {flags}; hit {e['hits'][request_id]:,}")
    return lines


def _answer_text(answer: Mapping[str, Any]) -> str:
    if "error" in answer:
        return f"raised {answer['error']}"
    masks = [[m, n] for m, n in zip(answer["mask_blocks"], answer["loaded_blocks"], strict=True)]
    text = f"hit {answer['hit_tokens']}, group hits {answer['group_hit_tokens']}, [mask, loaded] {masks}"
    state = answer.get("mamba_state_tokens")
    return text + (f", Mamba state at {state}" if state is not None else "")


def drift_lines(report: Any, version: str) -> list[str]:
    """``replay test --random``: the agreement, then the first difference
    and the regression trace written for it."""
    share = report.agreed / report.lookups if report.lookups else 1.0
    caches = ", ".join(f"{c} {a:,}/{n:,}" for c, (n, a) in sorted(report.per_cache.items()))
    lines = [
        f"drift check: {report.scenarios:,} random configurations (seed {report.seed}), "
        f"{report.lookups:,} lookups through vLLM {version} and policy {report.policy}: "
        f"{report.agreed:,} agreed ({percent(share)}; {caches}) in {report.seconds:.1f} s"
        + (
            f"; {report.inexpressible:,} configuration x cache pairs skipped: this vLLM's API "
            "cannot express them"
            if report.inexpressible
            else ""
        )
    ]
    d = report.first
    if d is None:
        return lines
    lines += [
        f"{report.differences:,} configuration x cache pairs differ; the first: configuration "
        f"{d.scenario}, request {d.request_id}, {d.cache} cache:",
        f"  policy {report.policy}: {_answer_text(d.policy_answer)}",
        f"  vLLM {version}: {_answer_text(d.vllm_answer)}",
        f"wrote the smallest differing trace ({d.events_before:,} -> {d.events_after:,} events) "
        f"to {d.written}: it pins the policy's answers in every valid cache; commit it "
        "with your regression traces. To see it fail:",
        f"  replay test --coordinator vllm {shlex.quote(str(d.written))}",
    ]
    return lines


def sweep_lines(
    trace: Path, lookups: int, meta: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]
) -> list[str]:
    """``replay whatif``: one row per run of the sweep whose metadata is
    ``meta`` (with the per-request hit-ratio percentiles when the runs have
    them), then the unbounded ceiling and the sample, when there are."""
    lines = [
        f"{trace}: {counted(lookups, 'lookup')}, {meta['cache']} cache, policy {meta['policy']}",
        f"{'capacity':>12} {'eviction':8} {'hit ratio':>9} {'hit tokens':>14} {'evicted':>10}"
        f" {'p50':>6} {'p90':>6} {'p99':>6}",
    ]

    def pct(r: Mapping[str, Any], key: str) -> str:
        value = r.get(key)
        return f"{value:>6.1%}" if value is not None else f"{'-':>6}"

    lines += [
        f"{r['capacity_blocks']:>12,} {r['eviction']:8} {percent(r['hit_ratio']):>9} "
        f"{r['hit_tokens']:>14,} {r['evicted_blocks']:>10,} "
        f"{pct(r, 'hit_ratio_p50')} {pct(r, 'hit_ratio_p90')} {pct(r, 'hit_ratio_p99')}"
        for r in rows
    ]
    ceiling = meta.get("ceiling")
    if ceiling:
        # The ceiling is a run like the rows, in their words and units; its
        # capacity is only room enough, not the least that evicts nothing.
        lines.append(
            f"{'unbounded':>12} {'':8} {percent(ceiling['hit_ratio']):>9} "
            f"{ceiling['hit_tokens']:>14,} {ceiling['evicted_blocks']:>10,} "
            f"{pct(ceiling, 'hit_ratio_p50')} {pct(ceiling, 'hit_ratio_p90')} "
            f"{pct(ceiling, 'hit_ratio_p99')}"
        )
        room = f"unbounded: a run with room for {ceiling['capacity_blocks']:,} blocks"
        if meta.get("working_set_blocks"):
            room += f" (the working set, {meta['working_set_blocks']:,}, and more)"
        room += ", never full"
        spare = [r["capacity_blocks"] for r in rows if r["evicted_blocks"] == 0]
        if spare:
            room += f"; the runs from {min(spare):,} blocks evict nothing either"
        lines.append(room)
    sample = meta.get("sample")
    if sample:
        lines.append(
            f"sample: {sample['sessions']:,} of {sample['sessions_total']:,} sessions, "
            f"{sample['requests']:,} of {sample['requests_total']:,} requests "
            f"({sample['fraction']:g}); {sample['capacities']}"
        )
    if meta.get("partial"):
        lines.append("partial: interrupted before every run finished")
    return lines


def _store_text(capacity: int | None) -> str:
    return "unbounded store" if capacity is None else f"LRU store of {counted(capacity, 'block')}"


def _events_text(s: Mapping[str, Any]) -> str:
    return (
        f"{counted(s['events'], 'event')} ({counted(s['lookups'], 'lookup')}, "
        f"{counted(s['stores'], 'store')}, {counted(s['removes'], 'remove')}, "
        f"{counted(s['clears'], 'clear')}), {counted(s['hash_entries'], 'hash entry', 'hash entries')}, "
        f"{counted(s['bytes'], 'byte')}"
    )


def _rules_text(s: Mapping[str, Any]) -> str:
    r = s["retention_interval"]
    retention = "dense retention" if r is None else f"retention interval {r}"
    return f"{s['cache']} stores ({retention}, {s['max_num_batched_tokens']:,}-token steps)"


def synth_summary_text(s: Mapping[str, Any]) -> str:
    """``replay synth``: the summary of ``replay.sources.synth.synth_trace``."""
    text = (
        f"wrote {s['path']}: model {s['model']}, EAGLE {_eagle(s)}, "
        f"{_store_text(s['capacity_blocks'])}, {_rules_text(s)}, seed {s['seed']}, "
        f"{counted(s['requests'], 'request')}: "
        f"{_events_text(s)}."
    )
    injected = s["injected_overruns"]
    if injected:
        first = injected[0]
        text += (
            f" Injected {counted(len(injected), '#43559 overrun')} (request ids "
            "overrun-NNNN-resend), "
            f"e.g. {first['request_id']}: hit {first['hit_tokens_pre_49502']} tokens under "
            f"pre-49502, {first['hit_tokens_vllm_033']} under vllm-0.33."
        )
    return text


def ingest_summary_text(s: Mapping[str, Any]) -> str:
    """``replay ingest mooncake|bailian``: the summary of ``replay.sources.mooncake.ingest``."""
    return (
        f"wrote {s['path']} from {s['source']} ({s['format']}, {s['rows']:,} rows): "
        f"model {s['model']}, EAGLE {_eagle(s)}, "
        f"{_store_text(s['capacity_blocks'])}, {_rules_text(s)}, block size {s['block_size']}: "
        f"{_events_text(s)}. Prefix reuse {percent(s['reuse_ratio'])} "
        f"({s['reused_tokens']:,} of {s['input_tokens']:,} input tokens, counted from hash_ids)."
    )


def recorded_text(s: RecordSummary, output: object) -> str:
    """``replay record``'s last line: the KV events, lookups and gaps it
    received, then every other way the stream fell short."""
    missing = sum(g["count"] for g in s.gaps)
    gaps = counted(len(s.gaps), "gap")
    if missing:
        gaps += f" ({counted(missing, 'batch', 'batches')} missing)"
    parts = [
        f"recorded {counted(s.kv_events, 'KV event')} in {counted(s.batches, 'batch', 'batches')}",
        "no lookup stream" if s.lookups is None else counted(s.lookups, "lookup"),
        gaps,
    ]
    if s.filled:
        parts.append(f"{s.filled:,} filled from the replay endpoint")
    if s.restarts:
        parts.append(counted(len(s.restarts), "publisher restart"))
    if s.skipped:
        parts.append(f"{s.skipped:,} malformed skipped")
    if s.dropped:
        parts.append(counted(s.dropped, "dropped connection"))
    where = f" to {output}"
    if s.segments is not None:
        where += f" ({counted(s.segments, 'segment')})"
    return ", ".join(parts) + where


def record_summary_text(s: RecordSummary) -> str:
    """What ``replay record`` and ``ingest kv-events`` took: batches, rows,
    and every way the stream fell short."""
    parts = [counted(s.batches, "batch", "batches"), counted(s.rows, "row")]
    if s.lookups is not None:
        parts.append(f"{counted(s.lookups, 'lookup')} placed")
    if s.filled:
        parts.append(f"{s.filled:,} filled from the replay endpoint")
    if s.gaps:
        missing = sum(g["count"] for g in s.gaps)
        parts.append(f"{missing:,} missing in {counted(len(s.gaps), 'gap')}")
    if s.restarts:
        parts.append(counted(len(s.restarts), "publisher restart"))
    if s.skipped:
        parts.append(f"{s.skipped} malformed skipped")
    return ", ".join(parts)


def flag_lines(flags: Sequence[Any]) -> str:
    """A lookup's flags (``replay.analysis.flags.lookup_flags``: worst first, each
    with its ``flag``, ``severity`` and ``detail``) as ``replay explain``
    prints them under its table."""
    if not flags:
        return "flags: none"
    return "\n".join(["flags:", *(f"  {f.flag} ({f.severity}): {f.detail}" for f in flags)])


def counts_text(counts: Sequence[tuple[str, int, str]]) -> str:
    """Lookups per flag (``replay.analysis.flags.worst_first``), each with its
    severity: ``mamba_overrun 87 (corruption), eagle_not_dropped 18 (performance)``."""
    return ", ".join(f"{f} {n:,} ({s})" for f, n, s in counts)
