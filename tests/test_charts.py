"""The SVG charts (analysis/report/charts.py): ticks, marks, scales, and
every text escaped inside markup that is marked safe."""

from __future__ import annotations

import re

import polars as pl
from markupsafe import Markup

from analysis.report.charts import (
    groups_svg,
    histogram_svg,
    nice_ticks,
    sweep_svg,
    time_ticks,
    timeline_svg,
)
from analysis.report.data import Bin, Point


def _texts(svg: str) -> list[str]:
    return re.findall(r"<text[^>]*>([^<]*)</text>", svg)


def _group(label: str, loaded: int, kind: str = "full_attention") -> dict[str, object]:
    return {
        "group_id": 0,
        "label": label,
        "kind": kind,
        "block_size": 16,
        "loaded_blocks": loaded,
        "skipped_blocks": 1,
        "tokens_saved": 16 * loaded,
    }


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


def test_timeline_marks_and_axes_by_seq() -> None:
    points = [
        Point(x=float(x), ratio=r, lookups=1, hit_tokens=0, prompt_tokens=1, label=f"p{x}")
        for x, r in [(0, 0.0), (10, 0.5), (20, 1.0)]
    ]
    svg = timeline_svg(points, "seq", 0.5)
    assert isinstance(svg, Markup)
    assert svg.startswith(
        '<svg class="chart" data-chart="timeline" role="img" aria-label="Hit ratio over the event log (seq)"'
    )
    assert svg.count('class="mark"') == 3
    assert re.findall(r"<circle class=\"mark\"[^>]*><title>([^<]*)</title>", svg) == [
        "p0",
        "p10",
        "p20",
    ]
    assert svg.count("<polyline") == 1
    texts = _texts(svg)
    assert texts[:5] == ["0%", "25%", "50%", "75%", "100%"]
    assert "seq (position in the event log)" in texts
    assert "whole run: 50.0%" in texts
    # x from 0 to 20: ticks every 5 (integer steps).
    assert texts[5:10] == ["0", "5", "10", "15", "20"]


def test_timeline_by_time_labels_the_day() -> None:
    us = 1_748_779_200_000_000.0  # 2025-06-01 12:00:00 UTC
    points = [
        Point(x=us + s * 1e6, ratio=0.5, lookups=1, hit_tokens=1, prompt_tokens=2, label="x")
        for s in (1.3, 38.7)
    ]
    texts = _texts(timeline_svg(points, "time", 0.5))
    assert "time (UTC, 2025-06-01)" in texts
    assert [t for t in texts if t.startswith("12:")] == ["12:00:10", "12:00:20", "12:00:30"]


def test_empty_charts_say_no_lookups() -> None:
    for svg in (timeline_svg([], "seq", 0.0), histogram_svg([])):
        assert svg.count('class="mark"') == 0
        assert svg.endswith('class="note">no lookups</text></svg>')


def test_histogram_bars_grey_for_no_hit_and_counted() -> None:
    bins = [
        Bin(lo=0, width=16, lookups=4, label="0", tooltip="hit 0 tokens: 4 lookups"),
        Bin(lo=16, width=16, lookups=0, label="16", tooltip="hit 16 tokens: 0 lookups"),
        Bin(lo=32, width=16, lookups=13, label="32", tooltip="hit 32 tokens: 13 lookups"),
    ]
    svg = histogram_svg(bins)
    fills = re.findall(r'<rect class="mark"[^>]*fill="(#[0-9a-f]+)"', svg)
    assert fills == ["#94a3b8", "#2563eb", "#2563eb"]
    assert re.findall(r'class="value">([^<]*)</text>', svg) == ["4", "13"]
    assert "hit length (tokens, bins of 16)" in _texts(svg)
    assert re.findall(r"<title>([^<]*)</title>", svg)[1:] == [b.tooltip for b in bins]


def test_groups_bars_scale_to_the_largest() -> None:
    svg = groups_svg([_group("0: attn", 145), _group("1: mamba", 56, "mamba")])
    widths = [float(w) for w in re.findall(r'<rect class="mark"[^>]*width="([0-9.]+)"', svg)]
    # 2320 and 896 tokens on an axis to 2500 drawn 550 px wide (120 to 670).
    assert widths == [510.4, 197.1]
    assert re.findall(r'class="value" text-anchor="start">([^<]*)</text>', svg) == ["2,320", "896"]
    assert re.findall(r'<rect class="mark"[^>]*fill="(#[0-9a-f]+)"', svg) == ["#2563eb", "#7c3aed"]
    assert _texts(svg)[:6] == ["0", "500", "1,000", "1,500", "2,000", "2,500"]


def test_every_text_is_escaped_inside_the_svg() -> None:
    label = "<script>alert(1)</script>&\"'"
    svg = groups_svg([_group(label, 2)])
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;&amp;&#34;&#39;"
    assert "<script>" not in svg
    assert f'class="tick">{escaped}</text>' in svg
    assert (
        f"<title>group {escaped}: 2 blocks loaded × 16 = 32 tokens (1 blocks skipped)</title>"
        in svg
    )
    points = [Point(x=0.0, ratio=0.0, lookups=1, hit_tokens=0, prompt_tokens=1, label=label)]
    assert f"<title>{escaped}</title></circle>" in timeline_svg(points, "seq", 0.0)


def test_sweep_one_line_per_eviction_log_scale() -> None:
    frame = pl.DataFrame(
        {
            "capacity_blocks": [100, 1000, 100, 1000],
            "eviction": ["lru", "lru", "<b>", "<b>"],
            "hit_ratio": [0.1, 0.4, 0.2, 0.5],
        }
    )
    svg = sweep_svg(frame)
    assert svg.count("<polyline") == 2
    assert svg.count('class="mark"') == 4
    texts = _texts(svg)
    assert "capacity (blocks, log scale)" in texts
    assert [t for t in texts if t in ("100", "200", "500", "1,000")] == [
        "100",
        "200",
        "500",
        "1,000",
    ]
    assert "&lt;b&gt;" in texts
    assert "<title>&lt;b&gt;, 1,000 blocks: 50.00%</title>" in svg
    assert "<title>lru, 100 blocks: 10.00%</title>" in svg


def test_groups_an_order_of_magnitude_apart_go_on_a_log_axis() -> None:
    """The issue's case: a 4,816-token Mamba bar beside 370,448 on one linear
    axis was a sliver; a log axis shows both."""
    import re

    from analysis.report.charts import groups_svg

    def group(gid: int, kind: str, tokens: int) -> dict[str, object]:
        return {
            "group_id": gid,
            "label": f"{gid}: {kind}",
            "kind": kind,
            "block_size": 16,
            "loaded_blocks": tokens // 16,
            "skipped_blocks": 0,
            "tokens_saved": tokens,
        }

    svg = str(groups_svg([group(0, "full_attention", 370_448), group(1, "mamba", 4_816)]))
    assert ">tokens (loaded blocks × block size, log scale)</text>" in svg
    ticks = re.findall(r'class="tick">([\d,]+)</text>', svg)
    assert ticks == ["1", "10", "100", "1,000", "10,000", "100,000", "1,000,000"]
    close = str(groups_svg([group(0, "full_attention", 48), group(1, "mamba", 16)]))
    assert ">tokens (loaded blocks × block size)</text>" in close
