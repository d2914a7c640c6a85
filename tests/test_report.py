"""`replay report`: one self-contained HTML page (or Markdown) per results file."""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from analysis.report import build_report, nice_ticks, time_ticks
from replay.cli.analysis import report
from replay.engine import replay_trace, save_results
from replay.spec import GroupKind, GroupSpec, TraceConfig
from replay.trace import write_trace
from tests.conftest import full_mamba, issue_43559_rows
from tests.test_diff import write_workload

MAMBA_ROW = (
    "1: mamba block=16 (mamba)             4       1  ...#                          state at 64"
)


def invoke(args: Sequence[Any]) -> Result:
    return CliRunner().invoke(report, [str(a) for a in args], catch_exceptions=False)


def results_of(trace: Path, policy: str = "pre-49502", out: Path | None = None) -> Path:
    out = out or trace.with_name(trace.name.removesuffix(".parquet") + ".results.parquet")
    save_results(replay_trace(trace, policy=policy), out)
    return out


def marks(page: str) -> dict[str, int]:
    """Marks (points, bars) per chart, by the chart's data-chart name."""
    out = {}
    for m in re.finditer(r'<svg class="chart" data-chart="([a-z]+)".*?</svg>', page, re.S):
        out[m.group(1)] = len(re.findall(r'class="mark"', m.group(0)))
    return out


def test_report_43559_html(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559)
    out = tmp_path / "out" / "report.html"
    out.parent.mkdir()  # an output directory is never created
    res = invoke([results, "-o", out])
    assert (res.exit_code, res.output) == (0, f"wrote {out}\n")
    page = out.read_text()
    assert "<title>Replay report: t43559.parquet</title>" in page
    assert '<div class="v">98.46%</div><div class="k">hit ratio</div>' in page
    assert (
        '<div class="card bad"><div class="v">1</div><div class="k">flagged lookups</div>' in page
    )
    # The flag table row, then the example with its detail.
    assert (
        '<tr><td><a href="#flag-mamba_overrun"><code>mamba_overrun</code></a></td>'
        '<td class="n">1</td><td class="n"><span class="meter" style="width:60px"></span>'
        "100.00%</td><td>Mamba resumes recurrent state past the hit or the attention KV it "
        "loads (#43559)</td></tr>"
    ) in page
    assert (
        '<tr><td>req-43559</td><td class="n">2</td><td class="n">64</td><td class="n">64</td>'
        "<td>1</td><td>group 1 resumes Mamba state at 64, 16 tokens past the "
        "attention KV loaded for 48 tokens</td></tr>"
    ) in page
    # The explain table of the example, once (eagle_not_dropped links back to it).
    assert page.count("<pre>request req-43559 (seq 2): max_length 64") == 1
    assert "hit: 64 tokens (attention-verified 48)" in page
    assert MAMBA_ROW in page
    assert '<a href="#explain-2">above</a>' in page
    # Charts: one point (one lookup), hit-length bars 0..64 by 16, one bar per group.
    assert marks(page) == {"timeline": 1, "histogram": 5, "groups": 2}
    assert "seq (the lookups have no timestamps)" in page
    assert ">seq (position in the event log)</text>" in page
    assert ">hit length (tokens, bins of 16)</text>" in page
    assert ">tokens (loaded blocks × block size)</text>" in page
    assert '<td>0: full_attention block=16 (attn)</td><td class="n">3</td>' in page
    assert (
        "hash_block_size=16 scheduler_block_size=16 use_eagle=true "
        "enable_partial_hash_hits=false cache=mooncake alignment=16"
    ) in page
    # Self-contained: nothing fetched from anywhere.
    assert re.findall(r"https?://[^\"' ]+", page) == ["http://www.w3.org/2000/svg"] * 3
    assert "<link" not in page
    assert "<script src" not in page
    assert sorted(p.name for p in out.parent.iterdir()) == ["report.html"]


def test_report_43559_markdown(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559)
    out = tmp_path / "report.md"
    res = invoke([results, "-o", out, "--format", "md"])
    assert res.exit_code == 0, res.output
    lines = out.read_text().splitlines()
    assert lines[0] == "## Replay report: t43559.parquet"
    assert lines[2] == (
        "Policy `pre-49502`, reference coordinator, mooncake cache, results "
        "`t43559.results.parquet`."
    )
    assert "| 1 | 1 | 65 | 64 | 98.46% | 1 |" in lines
    assert (
        "| `mamba_overrun` | 1 | 100.00% | Mamba resumes recurrent state past the hit or "
        "the attention KV it loads (#43559) |"
    ) in lines
    assert (
        "- `mamba_overrun` request `req-43559` (seq 2): group 1 resumes Mamba state at 64, "
        "16 tokens past the attention KV loaded for 48 tokens"
    ) in lines
    assert "  " + MAMBA_ROW in lines
    # One explain table per lookup, even when it carries two flags.
    assert sum(line.startswith("  request req-43559 (seq 2)") for line in lines) == 1
    assert "| 1: mamba block=16 (mamba) | 1 | 3 | 16 |" in lines


def test_report_clean_run(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559, policy="vllm-0.33")
    out = tmp_path / "r.html"
    assert invoke([results, "-o", out]).exit_code == 0
    page = out.read_text()
    assert '<p class="ok">No lookup was flagged.</p>' in page
    assert '<div class="v">73.85%</div><div class="k">hit ratio</div>' in page
    assert "<pre>request" not in page


def test_report_default_output_path(trace_43559: Path) -> None:
    results = results_of(trace_43559)
    res = invoke([results, "--format", "md"])
    expected = trace_43559.with_name("t43559.report.md")
    assert (res.exit_code, res.output) == (0, f"wrote {expected}\n")
    assert expected.is_file()


def test_report_without_trace_says_so(tmp_path: Path, trace_43559: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    results = results_of(trace_43559, out=elsewhere / "r.results.parquet")
    out = tmp_path / "r.html"
    res = invoke([results, "-o", out])
    note = (
        f"trace t43559.parquet not found next to r.results.parquet (looked for "
        f"{elsewhere / 't43559.parquet'}); pass --trace to add the explain tables"
    )
    assert (res.exit_code, res.output) == (0, f"wrote {out} ({note})\n")
    page = out.read_text()
    assert f'<p class="notice">No trace: {note}.</p>' in page
    # The flags and their details still come from the results alone.
    assert '<a href="#flag-mamba_overrun"><code>mamba_overrun</code></a>' in page
    assert "16 tokens past the attention KV loaded for 48 tokens" in page
    assert "<pre>request" not in page
    # ... and --trace brings the explain tables back.
    assert invoke([results, "-o", out, "--trace", trace_43559]).exit_code == 0
    assert MAMBA_ROW in out.read_text()


def test_report_examples_zero(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559)
    out = tmp_path / "r.html"
    assert invoke([results, "-o", out, "--examples", "0"]).exit_code == 0
    page = out.read_text()
    assert "<code>mamba_overrun</code>" in page
    assert "<pre>request" not in page


def test_report_workload_with_timestamps(tmp_path: Path) -> None:
    trace = write_workload(tmp_path / "work.parquet")
    results = results_of(trace)
    data = build_report(results)
    assert data.x_axis == "time"
    assert len(data.timeline) == 40
    assert sum(p.lookups for p in data.timeline) == 60
    assert [(b.lo, b.lookups) for b in data.histogram] == [
        (0, 4),
        (16, 0),
        (32, 13),
        (48, 10),
        (64, 20),
        (80, 13),
    ]
    assert [(g["loaded_blocks"], g["tokens_saved"]) for g in data.groups] == [
        (145, 2320),
        (56, 896),
    ]
    assert [(r["flag"], r["lookups"]) for r in data.flag_rows] == [
        ("mamba_overrun", 56),
        ("eagle_not_dropped", 56),
    ]
    assert [e.request_id for e in data.examples["mamba_overrun"]] == [
        "req-001",
        "req-002",
        "req-003",
    ]
    out = tmp_path / "r.html"
    assert invoke([results, "-o", out]).exit_code == 0
    page = out.read_text()
    assert marks(page) == {"timeline": 40, "histogram": 6, "groups": 2}
    assert ">time (UTC, 2025-06-01)</text>" in page
    assert ">12:00:10</text>" in page
    assert ">whole run: 61.8%</text>" in page
    assert '<td>0: full_attention block=16 (attn)</td><td class="n">145</td>' in page
    # Only the first explain table of each kind starts open.
    assert page.count("<details open") == 1


def test_report_workload_without_timestamps(tmp_path: Path) -> None:
    trace = write_workload(tmp_path / "work.parquet", timestamps=False)
    data = build_report(results_of(trace))
    assert data.x_axis == "seq-no-ts"
    assert len(data.timeline) == 40


def test_histogram_bins_widen_for_long_hits() -> None:
    import polars as pl

    from analysis.report import _histogram

    frame = pl.DataFrame({"hit_tokens": [0, 16, 47, 48, 1000]})
    bins = _histogram(frame, 16)
    # 1000 // 16 + 1 = 63 units of 16 > 30 bars: bars of 3 units (48 tokens), 21 of them.
    assert (len(bins), {b.width for b in bins}) == (21, {48})
    assert [b.lookups for b in bins[:2]] == [3, 1]
    assert bins[-1].lookups == 1
    assert bins[0].tooltip == "hit 0–47 tokens: 3 lookups"


def test_ticks() -> None:
    assert nice_ticks(0, 20, 5, integer=True) == [0, 5, 10, 15, 20]
    assert nice_ticks(0, 1, 5, integer=True) == [0, 1]
    assert nice_ticks(0, 2320, 5, integer=True) == [0, 500, 1000, 1500, 2000, 2500]
    assert nice_ticks(3, 3) == [3]
    us = 1_748_779_200_000_000  # 2025-06-01 12:00:00 UTC
    assert time_ticks(us + 1_300_000, us + 38_700_000) == [
        us + 10_000_000,
        us + 20_000_000,
        us + 30_000_000,
    ]
    assert time_ticks(us, us) == [us]


# ---------------------------------------------------------------- bad input


def _error(args: Sequence[Any]) -> str:
    res = invoke(args)
    assert res.exit_code == 2, res.output
    lines = res.output.splitlines()
    assert len(lines) == 1, res.output
    return lines[0]


def test_bad_trace_given_as_results(tmp_path: Path, trace_43559: Path) -> None:
    out = tmp_path / "r.html"
    assert _error([trace_43559, "-o", out]) == (
        f"error: {trace_43559}: is not a results file (no 'replay.results' metadata), "
        f"expected the output of `replay run` (for a trace, run `replay run {trace_43559}` "
        "first)"
    )
    assert not out.exists()


def test_bad_missing_results(tmp_path: Path) -> None:
    p = tmp_path / "nope.parquet"
    assert _error([p]) == f"error: {p}: no such file"


def test_bad_explicit_trace_missing(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559)
    out = tmp_path / "r.html"
    missing = tmp_path / "missing.parquet"
    assert _error([results, "-o", out, "--trace", missing]) == f"error: {missing}: no such file"
    assert not out.exists()


def test_bad_explicit_trace_other_config(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559)
    other = TraceConfig(
        groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),),
        hash_block_size=16,
        scheduler_block_size=16,
    )
    other_trace = tmp_path / "other.parquet"
    write_trace(other_trace, other, [{**issue_43559_rows()[0]}, issue_43559_rows()[2]])
    msg = _error([results, "-o", tmp_path / "r.html", "--trace", other_trace])
    assert msg.startswith(f"error: {other_trace}: KV-cache config ")
    assert msg.endswith("expected the trace of these results")
    assert not (tmp_path / "r.html").exists()


def test_bad_explicit_trace_other_lookups(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559)
    work = write_workload(tmp_path / "work.parquet", n_requests=3)
    assert _error([results, "-o", tmp_path / "r.html", "--trace", work]) == (
        f"error: trace {work} has no lookup 'req-43559' at seq 2: it is not the trace of "
        "these results"
    )


def test_bad_output_is_directory(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559)
    assert _error([results, "-o", tmp_path]) == (
        f"error: {tmp_path}: is a directory, expected a file path to write"
    )


def test_no_partial_file_when_writing_fails(
    tmp_path: Path, trace_43559: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = results_of(trace_43559)
    out = tmp_path / "out"
    out.mkdir()
    real_write = Path.write_text

    def half_then_fail(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        real_write(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    assert _error([results, "-o", out / "r.html"]) == (
        f"error: {out / 'r.html'}: cannot write here (No space left on device)"
    )
    assert list(out.iterdir()) == []


def test_results_copied_with_trace_elsewhere_resolves_by_name(
    tmp_path: Path, trace_43559: Path
) -> None:
    results = results_of(trace_43559)
    dest = tmp_path / "copy"
    dest.mkdir()
    shutil.copy(results, dest / "x.results.parquet")
    shutil.copy(trace_43559, dest / trace_43559.name)
    data = build_report(dest / "x.results.parquet")
    assert data.trace_path == str(dest / "t43559.parquet")
    assert data.trace_note is None


def test_report_without_lookups(tmp_path: Path) -> None:
    trace = tmp_path / "empty.parquet"
    write_trace(trace, full_mamba(), issue_43559_rows()[:2])
    out = tmp_path / "r.html"
    assert invoke([results_of(trace), "-o", out]).exit_code == 0
    page = out.read_text()
    assert marks(page) == {"timeline": 0, "histogram": 0, "groups": 2}
    assert page.count('class="note">no lookups</text>') == 2
    assert '<div class="v">0.00%</div><div class="k">hit ratio</div>' in page
