"""The report as Markdown, to paste into a pull request: the summary, the
flags with their first examples (and their explain tables, folded), the
tokens per group and the configuration; and the table of a what-if sweep."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl

from replay.analysis.flags import SEVERITIES
from replay.analysis.report.data import ReportData
from replay.analysis.report.fmt import num, pct
from replay.analysis.report.sweep import sweep_context, sweep_table
from replay.tools.render import config_lines


def _cell(v: object) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def md_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], numeric: Sequence[int] = ()
) -> str:
    """A pipe table; ``numeric`` columns right-aligned."""
    sep = ["---:" if i in numeric else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def render_markdown(data: ReportData, first: int = 3) -> str:
    s, info = data.summary, data.info
    policy = info.get("policy", "?")
    out = [
        f"## {data.title}",
        "",
        f"Policy `{policy}`, {info.get('coordinator', '?')} coordinator, "
        f"{data.cache} cache, results `{Path(data.results_path).name}`.",
        "",
        md_table(
            ["lookups", "with a hit", "prompt tokens", "hit tokens", "hit ratio", *SEVERITIES],
            [
                [
                    num(s["lookups"]),
                    num(s["lookups_with_hit"]),
                    num(s["prompt_tokens"]),
                    num(s["hit_tokens"]),
                    pct(s["hit_ratio"]),
                    *(num(s["by_severity"][sev]) for sev in SEVERITIES),
                ]
            ],
            range(5 + len(SEVERITIES)),
        ),
        "",
    ]
    if data.trace_note:
        out += [f"> No trace: {data.trace_note}.", ""]
    out += ["### Flags", ""]
    if not data.flag_rows:
        out += ["No lookup was flagged.", ""]
    else:
        out += [
            md_table(
                ["severity", "flag", "lookups", "share", "what it means"],
                [
                    [
                        f"**{r['severity']}**" if r["severity"] == "corruption" else r["severity"],
                        f"`{r['flag']}`",
                        num(r["lookups"]),
                        pct(r["share"]),
                        r["meaning"],
                    ]
                    for r in data.flag_rows
                ],
                (2, 3),
            ),
            "",
            "#### First examples",
            "",
        ]
        explained: set[int] = set()
        for r in data.flag_rows:
            for e in data.examples.get(r["flag"], [])[:first]:
                text = None if e.seq in explained else e.explain
                explained.add(e.seq)
                detail = (
                    f": {e.detail}"
                    if e.detail
                    else f": hit {e.hit_tokens}, max_length {e.max_length}"
                )
                out.append(
                    f"- `{e.flag}` ({r['severity']}) request `{e.request_id}` (seq {e.seq}){detail}"
                )
                if text:
                    out += [
                        "",
                        f"  <details><summary><code>{data.explain_command(e)}</code></summary>",
                        "",
                        "  ```text",
                        *[("  " + line).rstrip() for line in text.splitlines()],
                        "  ```",
                        "",
                        "  </details>",
                        "",
                    ]
        out.append("")
    out += [
        "### Tokens loaded per group",
        "",
        md_table(
            ["group", "loaded blocks", "skipped blocks", "tokens loaded"],
            [
                [
                    g["label"],
                    num(g["loaded_blocks"]),
                    num(g["skipped_blocks"]),
                    num(g["tokens_saved"]),
                ]
                for g in data.groups
            ],
            (1, 2, 3),
        ),
        "",
        "<details><summary>Configuration</summary>",
        "",
        "```text",
        *config_lines(data.config, data.cache),
        "```",
        "",
        "</details>",
        "",
    ]
    return "\n".join(out)


def render_sweep_markdown(frame: pl.DataFrame, meta: dict[str, Any]) -> str:
    headers, rows = sweep_table(frame)
    numeric = [0, 2, 3, 4, 5, *range(6, len(headers))]
    return (
        "## What-if sweep\n\n"
        + sweep_context(meta, frame)
        + ".\n\n"
        + md_table(headers, rows, numeric)
        + "\n"
    )
