"""The charts (analysis/report/charts.py, Altair rendered by vl-convert):
ticks, marks, scales, and every text escaped inside markup marked safe."""

from __future__ import annotations

import math
import re

from markupsafe import Markup

from replay.analysis.report.charts import (
    groups_svg,
    histogram_svg,
    nice_ticks,
    time_ticks,
    timeline_svg,
)
from replay.analysis.report.data import Bin, Point


def _texts(svg: str) -> list[str]:
    return re.findall(r"<text[^>]*>([^<]*)</text>", svg)


def _marks(svg: str, role: str) -> list[tuple[str, str]]:
    """(aria-label, fill) of each mark item of one kind (bar, point)."""
    return re.findall(
        rf'<path aria-label="([^"]*)" role="graphics-symbol" aria-roledescription="{role}"'
        r'[^>]*?fill="(#[0-9a-f]+)"',
        svg,
    )


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
    assert svg.startswith("<svg ")
    assert (
        ' class="chart marks" data-chart="timeline" role="img" '
        'aria-label="Hit ratio over the event log (seq)"'
    ) in svg
    assert _marks(svg, "point") == [("p0", "#2563eb"), ("p10", "#2563eb"), ("p20", "#2563eb")]
    texts = _texts(svg)
    # x from 0 to 20: ticks every 5 (integer steps), then the y axis.
    assert texts[:5] == ["0", "5", "10", "15", "20"]
    assert texts[5] == "seq (position in the event log)"
    assert texts[6:12] == ["0%", "25%", "50%", "75%", "100%", "hit ratio (hit / prompt tokens)"]
    assert "whole run: 50.0%" in texts
    assert "<script" not in svg and "http" not in svg.replace("http://www.w3.org/", "")


def test_timeline_by_time_labels_the_day() -> None:
    us = 1_748_779_200_000_000.0  # 2025-06-01 12:00:00 UTC
    points = [
        Point(x=us + s * 1e6, ratio=0.5, lookups=1, hit_tokens=1, prompt_tokens=2, label="x")
        for s in (1.3, 38.7)
    ]
    texts = _texts(timeline_svg(points, "time", 0.5))
    assert "time (UTC, 2025-06-01)" in texts
    assert [t for t in texts if t.startswith("12:")] == ["12:00:10", "12:00:20", "12:00:30"]


def test_timeline_of_a_relative_trace_shows_elapsed_time() -> None:
    points = [
        Point(x=s * 1e6, ratio=0.5, lookups=1, hit_tokens=1, prompt_tokens=2, label="x")
        for s in (0.0, 3537.0)
    ]
    texts = _texts(timeline_svg(points, "time", 0.5))
    assert "elapsed time since the trace's start (h:mm:ss)" in texts
    assert [t for t in texts if t.startswith("+")] == [
        "+00:00:00",
        "+00:10:00",
        "+00:20:00",
        "+00:30:00",
        "+00:40:00",
        "+00:50:00",
    ]
    assert not [t for t in texts if "1970" in t]


def test_empty_charts_say_no_lookups() -> None:
    for svg in (timeline_svg([], "seq", 0.0), histogram_svg([])):
        assert 'role="graphics-symbol" aria-roledescription="point"' not in svg
        assert 'aria-roledescription="bar"' not in svg
        assert "no lookups" in _texts(svg)


def test_histogram_bars_grey_for_no_hit_and_counted() -> None:
    bins = [
        Bin(lo=0, width=16, lookups=4, label="0", tooltip="hit 0 tokens: 4 lookups"),
        Bin(lo=16, width=16, lookups=0, label="16", tooltip="hit 16 tokens: 0 lookups"),
        Bin(lo=32, width=16, lookups=13, label="32", tooltip="hit 32 tokens: 13 lookups"),
    ]
    svg = histogram_svg(bins)
    assert _marks(svg, "bar") == [
        ("hit 0 tokens: 4 lookups", "#94a3b8"),
        ("hit 16 tokens: 0 lookups", "#2563eb"),
        ("hit 32 tokens: 13 lookups", "#2563eb"),
    ]
    texts = _texts(svg)
    # The bins in order, the y axis, then the counts above the non-empty bars.
    assert texts == [
        "0",
        "16",
        "32",
        "hit length (tokens, bins of 16)",
        "0",
        "5",
        "10",
        "15",
        "lookups",
        "4",
        "13",
        "Distribution of hit lengths",
    ]


def _bar_widths(svg: str) -> list[float]:
    return [
        float(w) for w in re.findall(r'aria-roledescription="bar" d="M0,[0-9.]+h([0-9.]+)v', svg)
    ]


def test_groups_bars_scale_to_the_largest() -> None:
    svg = groups_svg([_group("0: attn", 145), _group("1: mamba", 56, "mamba")])
    # 2320 and 896 tokens on an axis to 2500 drawn 520 px wide.
    assert _bar_widths(svg) == [482.56, 186.368]
    assert [f for _, f in _marks(svg, "bar")] == ["#2563eb", "#7c3aed"]
    texts = _texts(svg)
    assert texts[:6] == ["0", "500", "1,000", "1,500", "2,000", "2,500"]
    assert texts[-3:-1] == ["2,320", "896"]


def test_every_text_is_escaped_inside_the_svg() -> None:
    label = "<script>alert(1)</script>&\"'"
    svg = groups_svg([_group(label, 2)])
    assert "<script>" not in svg
    # A text node needs < and & escaped; an attribute also its quote.
    assert ">&lt;script&gt;alert(1)&lt;/script&gt;&amp;\"'</text>" in svg
    attr = "&lt;script&gt;alert(1)&lt;/script&gt;&amp;&quot;'"
    assert (
        f'<path aria-label="group {attr}: 2 blocks loaded × 16 = 32 tokens (1 block skipped)"'
        in svg
    )
    points = [Point(x=0.0, ratio=0.0, lookups=1, hit_tokens=0, prompt_tokens=1, label=label)]
    timeline = timeline_svg(points, "seq", 0.0)
    assert "<script>" not in timeline
    assert _marks(timeline, "point") == [(attr, "#2563eb")]


def test_groups_an_order_of_magnitude_apart_go_on_a_log_axis() -> None:
    """The issue's case: a 4,816-token Mamba bar beside 370,448 on one linear
    axis was a sliver; a log axis shows both."""

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
    ticks = [t for t in _texts(svg) if re.fullmatch(r"[\d,]+", t)]
    assert ticks[:7] == ["1", "10", "100", "1,000", "10,000", "100,000", "1,000,000"]
    # On a log axis to 10^6, 4,816 is 61% of the way, not 1.3%.
    widths = _bar_widths(svg)
    assert round(widths[1] / 520, 3) == round(math.log10(4_816) / 6, 3)
    close = str(groups_svg([group(0, "full_attention", 48), group(1, "mamba", 16)]))
    assert ">tokens (loaded blocks × block size)</text>" in close


def _titles(svg: str, role: str) -> list[tuple[str, str]]:
    """(aria-label, <title> text) of each mark item of one kind, read by an
    XML parser: what a browser shows on hover, unescaped."""
    from xml.etree import ElementTree

    root = ElementTree.fromstring(str(svg))
    return [
        (el.get("aria-label", ""), el.findtext("{http://www.w3.org/2000/svg}title", ""))
        for el in root.iter()
        if el.get("role") == "graphics-symbol" and el.get("aria-roledescription") == role
    ]


def test_hovering_a_mark_shows_its_tooltip_offline() -> None:
    """Issue 26: the Altair charts lost their hover text when rendered to
    SVG; each point and bar carries it as a <title> child again."""
    points = [
        Point(x=float(x), ratio=0.5, lookups=2, hit_tokens=16, prompt_tokens=32, label=f"seq {x}")
        for x in (0, 10)
    ]
    assert _titles(timeline_svg(points, "seq", 0.5), "point") == [
        ("seq 0", "seq 0"),
        ("seq 10", "seq 10"),
    ]
    bins = [
        Bin(lo=0, width=16, lookups=2, label="0", tooltip="no hit: 2 lookups"),
        Bin(lo=1, width=16, lookups=5, label="1-16", tooltip="hit 1-16 tokens: 5 lookups"),
    ]
    assert _titles(histogram_svg(bins), "bar") == [
        ("no hit: 2 lookups", "no hit: 2 lookups"),
        ("hit 1-16 tokens: 5 lookups", "hit 1-16 tokens: 5 lookups"),
    ]
    tip = "group 0: attn: 145 blocks loaded × 16 = 2,320 tokens (1 block skipped)"
    assert _titles(groups_svg([_group("0: attn", 145)]), "bar") == [(tip, tip)]
    # Marks without a tooltip (the line, the whole-run rule, the labels) have no title.
    assert str(timeline_svg(points, "seq", 0.5)).count("<title>") == 2


def test_a_title_is_escaped_text() -> None:
    label = "<script>alert(1)</script>&\"'"
    svg = str(groups_svg([_group(label, 2)]))
    assert "<script>" not in svg
    tip = f"group {label}: 2 blocks loaded × 16 = 32 tokens (1 block skipped)"
    assert _titles(svg, "bar") == [(tip, tip)]
    assert (
        "<title>group &lt;script&gt;alert(1)&lt;/script&gt;&amp;&#34;&#39;: 2 blocks loaded" in svg
    )


def test_the_sweep_chart_points_show_their_run_on_hover() -> None:
    import polars as pl

    from replay.analysis.report.sweep import sweep_chart_svg

    frame = pl.DataFrame(
        {
            "capacity_blocks": [1000, 5000],
            "eviction": ["lru", "lru"],
            "hit_ratio": [0.232, 0.5162],
            "hit_tokens": [158_416, 352_512],
            "evicted_blocks": [28_989, 13_617],
            "hit_ratio_p50": [0.0, 0.6281],
            "hit_ratio_p90": [0.847, 0.9011],
            "hit_ratio_p99": [0.9517, 0.9566],
        }
    )
    svg = sweep_chart_svg(frame, {"capacity_unit": "blocks"})
    assert [t for _, t in _titles(svg, "point")] == [
        "eviction: lru; blocks: 1,000; hit ratio: 23.20%; hit tokens: 158,416; evicted blocks: 28,989",
        "eviction: lru; blocks: 5,000; hit ratio: 51.62%; hit tokens: 352,512; evicted blocks: 13,617",
        "eviction: lru; percentile: p50; hit ratio: 0.00%",
        "eviction: lru; percentile: p90; hit ratio: 84.70%",
        "eviction: lru; percentile: p99; hit ratio: 95.17%",
        "eviction: lru; percentile: p50; hit ratio: 62.81%",
        "eviction: lru; percentile: p90; hit ratio: 90.11%",
        "eviction: lru; percentile: p99; hit ratio: 95.66%",
    ]
    assert str(svg).count("<title>") == 8  # the lines, rules and labels have none
