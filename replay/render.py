"""Plain-text rendering shared by the CLI and the reports (no I/O here)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from replay.coordinator import LookupOutcome, hit_alignment
from replay.spec import TraceConfig
from replay.store import LookupEvent


def _numeric(cell: str) -> bool:
    return cell.lstrip("+-").isdigit()


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
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


def config_lines(config: TraceConfig, cache: str) -> list[str]:
    """The configuration, and the hit alignment of the cache that answers
    (the two caches align a hit differently: ``hit_alignment``)."""
    lines = [
        f"hash_block_size={config.hash_block_size} scheduler_block_size={config.scheduler_block_size} "
        f"use_eagle={str(config.use_eagle).lower()} "
        f"enable_partial_hash_hits={str(config.enable_partial_hash_hits).lower()}"
        + f" cache={cache} alignment={hit_alignment(config, cache)}",
    ]
    lines += [f"  group {group_label(config, gid)}" for gid in range(config.num_groups)]
    return lines


def explain_header(
    config: TraceConfig, lookup: LookupEvent[Any], policy: str, cache: str | None = None
) -> str:
    return (
        f"request {lookup.request_id} (seq {lookup.seq}): max_length {lookup.max_length}, "
        f"{len(lookup.hashes)} hashes of {config.hash_block_size} tokens, policy {policy}"
        + (f", cache {cache}" if cache else "")
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
    out = [
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
        f"hit: {outcome.hit_tokens} tokens (attention-verified {outcome.verified_tokens})",
    ]
    mask_rows = []
    for g in outcome.groups:
        mask = "".join("#" if m else "." for m in g.mask())
        if len(mask) > 48:
            mask = mask[:20] + f"…({len(mask) - 40} more)…" + mask[-20:]
        if g.state_tokens is None:
            state = ""
        else:
            state = f"state at {g.state_tokens}" if g.state_tokens else "no state"
        mask_rows.append(
            [group_label(config, g.group_id), g.mask_blocks, g.loaded_blocks, mask or "-", state]
        )
    out += [
        "",
        table(["group", "mask", "loaded", "blocks (. skipped, # loaded)", "mamba"], mask_rows),
    ]
    return "\n".join(out)
