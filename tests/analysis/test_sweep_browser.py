"""The what-if sweep report in headless Chromium: the Altair chart (inline
SVG, rendered offline by vl-convert) is parsed and painted by a real
browser, with its lines, the unbounded ceiling and the trace's capacity."""

from __future__ import annotations

import random
import re
import struct
from pathlib import Path

import pytest

from replay.base.spec import TraceConfig
from replay.format.writer import write_trace
from replay.sources.archetypes import archetype_config
from tests.analysis.test_report_browser import CHROMIUM, _browser
from tests.builders import random_prompts, unit_hashes
from tests.conftest import run_cli

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no chromium binary on PATH (install the Debian package `chromium`)",
    ),
]


def _sweep_page(tmp_path: Path) -> Path:
    base = archetype_config("full+mamba", 16, 16, True)
    # The trace says the capacity it was recorded with: the chart marks it.
    config = TraceConfig.from_json({**base.to_json(), "source": {"capacity_blocks": 400}})
    prompts = random_prompts(random.Random(4), 16, 60)
    rows = [
        {
            "kind": "lookup",
            "request_id": f"r{i}",
            "block_hashes": unit_hashes(p, 16),
            "max_length": len(p) - 1,
            "num_tokens": len(p),
        }
        for i, p in enumerate(prompts)
    ]
    trace = write_trace(tmp_path / "t.parquet", config, rows)
    sweep = tmp_path / "sweep.parquet"
    args = ["whatif", str(trace), "--cache", "gpu", "-q", "-o", str(sweep)]
    result = run_cli(
        [*args, "--points", "5", "--min", "100", "--max", "2k", "--eviction", "lru,lfu"]
    )
    assert result.exit_code == 0, result.output
    page = tmp_path / "sweep.html"
    assert run_cli(["report", str(sweep), "-o", str(page)]).exit_code == 0
    return page


def test_sweep_chart_renders_in_chromium(tmp_path: Path) -> None:
    page = _sweep_page(tmp_path)
    proc = _browser(tmp_path, "--dump-dom", page.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    assert len(re.findall(r"<svg id=\"sweep-chart\"", dom)) == 1
    lines = re.findall(r'class="mark-line role-mark (concat_\d)', dom)
    # two evictions: their hit-ratio lines, and p50/p90/p99 of each below
    assert lines.count("concat_0") == 2 and lines.count("concat_1") == 6
    assert "unbounded ceiling" in dom and "trace's capacity" in dom
    assert "capacity (blocks, log scale)" in dom
    # Each run's point shows its numbers on hover (a <title>, no script).
    tips = re.findall(r'aria-roledescription="point"[^>]*><title>([^<]*)</title>', dom)
    assert len(tips) == 2 * 5 + 2 * 5 * 3  # the runs, then p50/p90/p99 of each
    assert (
        tips[0]
        == "eviction: lru; blocks: 100; hit ratio: 10.01%; hit tokens: 1,312; evicted blocks: 688"
    )
    shot = tmp_path / "sweep.png"
    proc = _browser(tmp_path, "--window-size=900,1400", f"--screenshot={shot}", page.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (900, 1400)
    # A blank page compresses to a few kB; the chart and the table do not.
    assert len(data) > 40_000
