"""The HTML page of ``replay report`` (analysis/report/html.py and its
templates): what a reviewer reads in it, escaped, and self-contained."""

from __future__ import annotations

import dataclasses
import html
import re
import shlex
from pathlib import Path

import pytest
from markupsafe import escape

from replay import __version__
from replay.analysis.report import build_report, render_html
from replay.base.spec import TraceConfig
from replay.format.writer import write_trace
from tests.analysis.test_diff import write_workload
from tests.builders import full_mamba, issue_43559_rows
from tests.conftest import run_cli
from tests.reports import MAMBA_ROW, invoke_report, marks, results_of


def test_report_43559_html(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559)
    out = tmp_path / "out" / "report.html"
    out.parent.mkdir()  # an output directory is never created
    res = invoke_report([results, "-o", out])
    assert (res.exit_code, res.output) == (0, f"wrote {out}\n")
    page = out.read_text()
    assert "<title>Replay report: t43559.parquet</title>" in page
    assert '<div class="v">98.46%</div><div class="k">hit ratio</div>' in page
    assert (
        '<div class="card bad sev-corruption"><div class="v">1</div><div class="k">corruption</div>'
        in page
    )
    assert (
        '<div class="card bad sev-performance"><div class="v">1</div><div class="k">performance</div>'
        in page
    )
    assert page.index('<div class="k">corruption</div>') < page.index(
        '<div class="k">performance</div>'
    )
    # The flag table row, then the example with its detail.
    assert (
        '<tr class="sev-corruption"><td><span class="severity">corruption</span></td>'
        '<td><a href="#flag-mamba_overrun"><code>mamba_overrun</code></a></td>'
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
    assert (
        re.findall(r"https?://[^\"' ]+", page)
        == [
            "http://www.w3.org/2000/svg",
            "http://www.w3.org/1999/xlink",
        ]
        * 3
    )
    assert "<link" not in page
    assert "<script src" not in page
    assert sorted(p.name for p in out.parent.iterdir()) == ["report.html"]


def test_report_clean_run(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559, policy="vllm-0.33")
    out = tmp_path / "r.html"
    assert invoke_report([results, "-o", out]).exit_code == 0
    page = out.read_text()
    assert '<p class="ok">No lookup was flagged.</p>' in page
    assert '<div class="v">73.85%</div><div class="k">hit ratio</div>' in page
    assert "<pre>request" not in page


def test_results_in_another_folder_lead_to_their_trace(
    tmp_path: Path, trace_43559: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case: results written into another folder used to lose
    every explain table; they record where their trace is, and each table's
    command line runs as printed (from where the report was made)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    results_of(trace_43559, out=elsewhere / "r.results.parquet")
    monkeypatch.chdir(tmp_path)
    res = invoke_report(["elsewhere/r.results.parquet", "-o", "r.html"])
    assert (res.exit_code, res.output) == (0, "wrote r.html\n")
    page = (tmp_path / "r.html").read_text()
    command = (
        "replay explain t43559.parquet --request req-43559 --seq 2 --policy pre-49502 "
        "--cache mooncake"
    )
    assert f"<summary><code>{command}</code></summary>" in page
    assert MAMBA_ROW in page
    ran = run_cli(command.split()[1:])
    assert ran.exit_code == 0 and MAMBA_ROW in ran.stdout


def test_report_without_trace_says_so(tmp_path: Path, trace_43559: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    results = results_of(trace_43559, out=elsewhere / "r.results.parquet")
    trace_43559.rename(tmp_path / "moved.parquet")  # where the results lead: nothing
    out = tmp_path / "r.html"
    res = invoke_report([results, "-o", out])
    note = (
        f"trace t43559.parquet not found: looked for {tmp_path / 't43559.parquet'} (where the "
        f"results lead) and {elsewhere / 't43559.parquet'} (beside them); pass --trace to add "
        "the explain tables"
    )
    assert (res.exit_code, res.output) == (0, f"wrote {out} ({note})\n")
    page = out.read_text()
    assert f'<p class="notice">No trace: {note}.</p>' in page
    # The flags and their details still come from the results alone.
    assert '<a href="#flag-mamba_overrun"><code>mamba_overrun</code></a>' in page
    assert "16 tokens past the attention KV loaded for 48 tokens" in page
    assert "<pre>request" not in page
    # ... and --trace brings the explain tables back.
    assert invoke_report([results, "-o", out, "--trace", tmp_path / "moved.parquet"]).exit_code == 0
    assert MAMBA_ROW in out.read_text()


def test_report_examples_zero(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559)
    out = tmp_path / "r.html"
    assert invoke_report([results, "-o", out, "--examples", "0"]).exit_code == 0
    page = out.read_text()
    assert "<code>mamba_overrun</code>" in page
    assert "<pre>request" not in page


def test_report_workload_page(tmp_path: Path) -> None:
    results = results_of(write_workload(tmp_path / "work.parquet"))
    out = tmp_path / "r.html"
    assert invoke_report([results, "-o", out]).exit_code == 0
    page = out.read_text()
    assert marks(page) == {"timeline": 40, "histogram": 6, "groups": 2}
    assert ">time (UTC, 2025-06-01)</text>" in page
    assert ">12:00:10</text>" in page
    assert ">whole run: 61.8%</text>" in page
    assert (
        "40 points, each the hit tokens over the prompt tokens of the lookups in one bin of lookup timestamps (ts)"
        in page
    )
    assert '<td>0: full_attention block=16 (attn)</td><td class="n">145</td>' in page
    # Only the first explain table of each kind starts open.
    assert page.count("<details open") == 1
    # 56 lookups carry each flag, 3 of each are shown.
    assert (
        '<h3 id="flag-mamba_overrun" class="sev-corruption"><span class="flag">mamba_overrun</span> '
        '<span class="severity">corruption</span> — 56 lookups, first 3</h3>'
    ) in page


def test_report_without_lookups(tmp_path: Path) -> None:
    trace = tmp_path / "empty.parquet"
    write_trace(trace, full_mamba(), issue_43559_rows()[:2])
    out = tmp_path / "r.html"
    assert invoke_report([results_of(trace), "-o", out]).exit_code == 0
    page = out.read_text()
    assert marks(page) == {"timeline": 0, "histogram": 0, "groups": 2}
    assert page.count('fill="#64748b">no lookups</text>') == 2
    assert '<div class="v">0.00%</div><div class="k">hit ratio</div>' in page


HOSTILE = "<script>alert(1)</script>&\"'"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;&amp;&#34;&#39;"


def _hostile_trace(path: Path) -> Path:
    """The #43559 trace with a request id and a group name that are markup."""
    base = full_mamba()
    groups = (base.groups[0], dataclasses.replace(base.groups[1], name=HOSTILE))
    config = TraceConfig(
        groups=groups,
        hash_block_size=base.hash_block_size,
        scheduler_block_size=base.scheduler_block_size,
        use_eagle=base.use_eagle,
    )
    rows = issue_43559_rows()
    rows[2] = {**rows[2], "request_id": HOSTILE}
    write_trace(path, config, rows)
    return path


def test_markup_in_the_trace_is_escaped_in_the_page_and_the_svg(tmp_path: Path) -> None:
    trace = _hostile_trace(tmp_path / "t.parquet")
    page = render_html(build_report(results_of(trace)))
    assert "<script>alert(1)" not in page
    # The request: its example rows (one per flag), the explain summary and
    # table, and the link back from the second flag.
    assert page.count(f"<td>{ESCAPED}</td>") == 2
    words = ["replay", "explain", str(trace), "--request", HOSTILE, "--seq", "2"]
    command = shlex.join([*words, "--policy", "pre-49502", "--cache", "mooncake"])
    assert f"<code>{escape(command)}</code>" in page
    assert f"<pre>request {ESCAPED} (seq 2): max_length 64" in page
    assert f"Explain table of {ESCAPED} (seq 2):" in page
    # The group name: the group table, the configuration, and inside the
    # groups chart its label and its bar's tooltip.
    label = f"1: mamba block=16 ({ESCAPED})"
    assert f"<td>{label}</td>" in page
    svg = re.search(r'<svg [^>]*data-chart="groups".*?</svg>', page, re.S)
    assert svg is not None
    # Vega escapes < and & in a text node, and the quote too in an attribute.
    text = html.escape(f"1: mamba block=16 ({HOSTILE})", quote=False)
    attr = text.replace('"', "&quot;")
    assert f">{text}</text>" in svg.group(0)
    assert (
        f'<path aria-label="group {attr}: 1 block loaded × 16 = 16 tokens (3 blocks skipped)"'
        in svg.group(0)
    )
    # Unescaped once, every text is what the trace holds.
    assert html.unescape(ESCAPED) == HOSTILE


def test_flags_column_only_says_where_the_flags_come_from(
    tmp_path: Path, trace_43559: Path
) -> None:
    data = build_report(results_of(trace_43559))
    data.extra["flag_details"] = False
    page = render_html(data)
    assert (
        '<p class="caption">From the results file\'s <code>flags</code> column (it has no '
        "<code>unit_present</code> column to recompute the details from).</p>"
    ) in page
    assert "From the results file" not in render_html(build_report(results_of(trace_43559)))


def test_page_ends_with_the_footer(tmp_path: Path, trace_43559: Path) -> None:
    page = render_html(build_report(results_of(trace_43559)))
    assert page.startswith('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n')
    assert page.endswith(
        f"<footer>Generated by cache-trace-replay {__version__} (<code>replay report</code>).</footer>\n"
        "</main></body></html>\n"
    )
    # The script that stamps the charts, and the styles, inline.
    assert page.count("<script>") == 1
    assert "document.body.setAttribute('data-rendered'," in page
    assert "svg.chart { display: block; max-width: 100%; height: auto; }" in page
