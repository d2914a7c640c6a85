"""The Markdown of ``replay report`` (analysis/report/markdown.py): the
summary to paste into a pull request, and the table of a what-if sweep."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from replay.analysis.report import build_report, render_markdown, render_sweep_markdown
from replay.analysis.report.markdown import md_table
from tests.reports import MAMBA_ROW, invoke_report, results_of


def test_report_43559_markdown(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559)
    out = tmp_path / "report.md"
    res = invoke_report([results, "-o", out, "--format", "md"])
    assert res.exit_code == 0, res.output
    lines = out.read_text().splitlines()
    assert lines[0] == "## Replay report: t43559.parquet"
    assert lines[2] == (
        "Policy `pre-49502`, reference coordinator, mooncake cache, results "
        "`t43559.results.parquet`."
    )
    # Lookups per severity, worst first.
    assert "| 1 | 1 | 65 | 64 | 98.46% | 1 | 0 | 1 | 0 |" in lines
    assert (
        "| **corruption** | `mamba_overrun` | 1 | 100.00% | Mamba resumes recurrent state past "
        "the hit or the attention KV it loads (#43559) |"
    ) in lines
    assert (
        "| performance | `eagle_not_dropped` | 1 | 100.00% | EAGLE is on but the hit covers "
        "the whole present prefix (nothing left to recompute) |"
    ) in lines
    assert (
        "- `mamba_overrun` (corruption) request `req-43559` (seq 2): group 1 resumes Mamba state at 64, "
        "16 tokens past the attention KV loaded for 48 tokens"
    ) in lines
    assert "  " + MAMBA_ROW in lines
    # One explain table per lookup, even when it carries two flags.
    assert sum(line.startswith("  request req-43559 (seq 2)") for line in lines) == 1
    assert "| 1: mamba block=16 (mamba) | 1 | 3 | 16 |" in lines


def test_md_table_escapes_pipes_and_folds_lines() -> None:
    assert md_table(["a|b", "n"], [["x\ny", 1234], ["|", 5]], (1,)).splitlines() == [
        "| a\\|b | n |",
        "| --- | ---: |",
        "| x y | 1234 |",
        "| \\| | 5 |",
    ]


def test_first_limits_the_examples(trace_43559: Path) -> None:
    data = build_report(results_of(trace_43559))
    lines = render_markdown(data, first=0).splitlines()
    assert "#### First examples" in lines
    assert not any(line.startswith("- `") for line in lines)
    assert not any("<details><summary>replay explain" in line for line in lines)


def test_sweep_markdown() -> None:
    frame = pl.DataFrame(
        {
            "capacity_blocks": [2000, 100],
            "eviction": ["lru", "belady"],
            "hit_ratio": [0.5, 0.123456],
            "hit_tokens": [12345, 0],
            "evicted_blocks": [3, 4000],
            "not_admitted": [0, 1],
            "lookups": [10, 10],
            "mamba_overrun": [0, 0],
            "eagle_not_dropped": [2, 1],
        }
    )
    meta = {"trace": "t.parquet", "cache": "gpu", "policy": "vllm-0.33", "seconds": 1.25}
    assert render_sweep_markdown(frame, meta).splitlines() == [
        "## What-if sweep",
        "",
        "trace t.parquet: 10 lookups, gpu cache, policy vllm-0.33, retention interval None, "
        "max_num_batched_tokens None; one request at a time; 2 runs in 1.2 s.",
        "",
        "| capacity (blocks) | eviction | hit ratio | hit tokens | evicted blocks | not admitted "
        "| eagle_not_dropped |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        "| 100 | belady | 12.35% | 0 | 4,000 | 1 | 1 |",
        "| 2,000 | lru | 50.00% | 12,345 | 3 | 0 | 2 |",
    ]
