"""The report's charts as inline SVG (a report must open from a mail
attachment or a CI artifact with no CDN in reach): the hit-ratio timeline,
the hit-length histogram, the tokens per group and the what-if sweep.

Each chart is returned as ``Markup``, marked safe on purpose so the HTML
templates embed it as is; every text inside (titles, labels, tooltips,
group names from the trace) goes through ``escape`` first. Every point or
bar carries ``class="mark"``, which the page's script counts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import polars as pl
from markupsafe import Markup, escape

from analysis.report.data import Bin, Point
from analysis.report.fmt import fmt_time, num
from replay.base.spec import GroupKind

_W, _H = 760, 300
_BLUE, _GREY, _MUTED, _GRID = "#2563eb", "#94a3b8", "#64748b", "#e2e8f0"
_PURPLE = "#7c3aed"

#: One colour per eviction policy of a sweep, lru (vLLM's own order) first.
POLICY_COLOURS = {"lru": _BLUE, "fifo": "#d97706", "lfu": "#059669", "belady": _PURPLE}


def nice_ticks(lo: float, hi: float, n: int = 5, *, integer: bool = False) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2, 5 steps; also 2.5 unless integer)."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    steps = (1, 2, 5, 10) if integer else (1, 2, 2.5, 5, 10)
    step = next(m * mag for m in steps if m * mag >= raw)
    if integer:
        step = max(1, round(step))
    start = math.floor(lo / step) * step
    ticks = []
    v = start
    while v < hi + step * 1e-9:
        ticks.append(v)
        v += step
    if ticks[-1] < hi:
        ticks.append(ticks[-1] + step)
    return [round(t, 10) for t in ticks]


_TIME_STEPS_S = (
    *(m * 10.0**e for e in range(-3, 0) for m in (1, 2, 5)),
    1,
    2,
    5,
    10,
    15,
    30,
    60,
    120,
    300,
    600,
    900,
    1800,
    3600,
    7200,
    10800,
    21600,
    43200,
    86400,
    172800,
    604800,
)


def time_ticks(lo_us: float, hi_us: float, most: int = 6) -> list[float]:
    """Ticks (epoch µs) at round clock times: whole seconds, minutes, hours…"""
    if hi_us <= lo_us:
        return [lo_us]
    span_s = (hi_us - lo_us) / 1e6
    step_s = next((st for st in _TIME_STEPS_S if span_s / st <= most), span_s / most)
    step = step_s * 1e6
    first = math.ceil(lo_us / step) * step
    ticks = []
    t = first
    while t <= hi_us:
        ticks.append(t)
        t += step
    return ticks or [lo_us]


def _svg_open(name: str, title: str, width: int = _W, height: int = _H) -> str:
    return (
        f'<svg class="chart" data-chart="{escape(name)}" role="img" '
        f'aria-label="{escape(title)}" viewBox="0 0 {width} {height}" width="100%" '
        'preserveAspectRatio="xMidYMid meet" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{escape(title)}</title>"
    )


def _axes(
    left: int,
    top: int,
    right: int,
    bottom: int,
    y_ticks: Sequence[tuple[float, str]],
    x_ticks: Sequence[tuple[float, str]],
    x_label: str,
    y_label: str,
) -> list[str]:
    """Grid lines, tick labels and axis titles; tick positions are in pixels."""
    out = []
    for y, text in y_ticks:
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="{_GRID}"/>'
            f'<text x="{left - 8}" y="{y + 4:.1f}" text-anchor="end" class="tick">'
            f"{escape(text)}</text>"
        )
    for x, text in x_ticks:
        out.append(
            f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 5}" stroke="{_MUTED}"/>'
            f'<text x="{x:.1f}" y="{bottom + 19}" text-anchor="middle" class="tick">'
            f"{escape(text)}</text>"
        )
    out.append(
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="{_MUTED}"/>'
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="{_MUTED}"/>'
        f'<text x="{(left + right) / 2:.1f}" y="{bottom + 42}" text-anchor="middle" '
        f'class="axis-label">{escape(x_label)}</text>'
        f'<text transform="translate(16 {(top + bottom) / 2:.1f}) rotate(-90)" '
        f'text-anchor="middle" class="axis-label">{escape(y_label)}</text>'
    )
    return out


def _series(xy: Sequence[tuple[float, float]], tips: Sequence[str], colour: str) -> list[str]:
    """A line through the points (pixels), then one mark per point with its tooltip."""
    out = []
    if len(xy) > 1:
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
    for (x, y), tip in zip(xy, tips, strict=True):
        out.append(
            f'<circle class="mark" cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{colour}" '
            f'stroke="#fff" stroke-width="1.5"><title>{escape(tip)}</title></circle>'
        )
    return out


def _no_data(name: str, title: str, left: int, right: int, top: int, bottom: int) -> Markup:
    return Markup(
        _svg_open(name, title)
        + f'<text x="{(left + right) / 2}" y="{(top + bottom) / 2}" text-anchor="middle" '
        'class="note">no lookups</text></svg>'
    )


def timeline_svg(points: Sequence[Point], x_axis: str, overall: float) -> Markup:
    """Hit ratio per bin, over time or seq, with the whole run's ratio dashed."""
    title = "Hit ratio over " + ("time" if x_axis == "time" else "the event log (seq)")
    left, right, top, bottom = 64, _W - 20, 34, _H - 56
    if not points:
        return _no_data("timeline", title, left, right, top, bottom)
    parts = [_svg_open("timeline", title)]
    xs = [p.x for p in points]
    lo, hi = min(xs), max(xs)
    if hi == lo:
        lo, hi = lo - 1, hi + 1

    def px(x: float) -> float:
        return left + 10 + (x - lo) / (hi - lo) * (right - left - 20)

    def py(r: float) -> float:
        return bottom - r * (bottom - top)

    y_ticks = [(py(t / 100), f"{t:g}%") for t in (0, 25, 50, 75, 100)]
    if x_axis == "time":
        span = max(xs) - min(xs)
        x_ticks = [(px(t), fmt_time(t, span)) for t in time_ticks(min(xs), max(xs))]
        day = datetime.fromtimestamp(min(xs) / 1e6, tz=UTC).strftime("%Y-%m-%d")
        x_label = f"time (UTC, {day})" if span < 86_400e6 else "time (UTC)"
    else:
        x_ticks = [
            (px(t), num(t)) for t in nice_ticks(min(xs), max(xs), 6, integer=True) if lo <= t <= hi
        ] or [(px(xs[0]), num(round(xs[0])))]
        x_label = "seq (position in the event log)"
    parts += _axes(
        left, top, right, bottom, y_ticks, x_ticks, x_label, "hit ratio (hit / prompt tokens)"
    )
    yo = py(overall)
    parts.append(
        f'<line x1="{left}" y1="{yo:.1f}" x2="{right}" y2="{yo:.1f}" stroke="{_GREY}" '
        f'stroke-dasharray="5 4"><title>overall {100 * overall:.2f}%</title></line>'
    )
    # The legend sits above the plot, where no point can cover it.
    lx = right - 330
    parts.append(
        f'<line x1="{lx}" y1="12" x2="{lx + 22}" y2="12" stroke="{_BLUE}" stroke-width="2"/>'
        f'<circle cx="{lx + 11}" cy="12" r="4" fill="{_BLUE}"/>'
        f'<text x="{lx + 28}" y="16" class="tick">hit ratio per bin</text>'
        f'<line x1="{lx + 150}" y1="12" x2="{lx + 172}" y2="12" stroke="{_GREY}" '
        'stroke-dasharray="5 4"/>'
        f'<text x="{lx + 178}" y="16" class="tick">whole run: {100 * overall:.1f}%</text>'
    )
    parts += _series([(px(p.x), py(p.ratio)) for p in points], [p.label for p in points], _BLUE)
    parts.append("</svg>")
    return Markup("".join(parts))


def histogram_svg(bins: Sequence[Bin]) -> Markup:
    """One bar per bin of hit lengths; the no-hit bar grey."""
    title = "Distribution of hit lengths"
    left, right, top, bottom = 64, _W - 20, 16, _H - 56
    if not bins:
        return _no_data("histogram", title, left, right, top, bottom)
    parts = [_svg_open("histogram", title)]
    top_n = max(b.lookups for b in bins)
    ticks = nice_ticks(0, max(top_n, 1), 5, integer=True)
    ymax = ticks[-1]

    def py(v: float) -> float:
        return bottom - v / ymax * (bottom - top)

    slot = (right - left) / len(bins)
    every = max(1, math.ceil(len(bins) / 12))
    x_ticks = [(left + slot * (i + 0.5), b.label) for i, b in enumerate(bins) if i % every == 0]
    width = bins[0].width
    x_label = "hit length (tokens" + (f", bins of {width})" if len(bins) > 1 else ")")
    parts += _axes(
        left, top, right, bottom, [(py(t), num(t)) for t in ticks], x_ticks, x_label, "lookups"
    )
    gap = min(6.0, slot * 0.15)
    for i, b in enumerate(bins):
        x, h = left + slot * i + gap / 2, bottom - py(b.lookups)
        colour = _GREY if b.lo == 0 else _BLUE
        parts.append(
            f'<rect class="mark" x="{x:.1f}" y="{py(b.lookups):.1f}" width="{slot - gap:.1f}" '
            f'height="{h:.1f}" fill="{colour}"><title>{escape(b.tooltip)}</title></rect>'
        )
        if b.lookups and len(bins) <= 20:
            parts.append(
                f'<text x="{x + (slot - gap) / 2:.1f}" y="{py(b.lookups) - 5:.1f}" '
                f'text-anchor="middle" class="value">{num(b.lookups)}</text>'
            )
    parts.append("</svg>")
    return Markup("".join(parts))


def groups_svg(groups: Sequence[dict[str, Any]]) -> Markup:
    """One horizontal bar per KV-cache group: the tokens its loaded blocks hold."""
    title = "Tokens loaded per KV-cache group"
    row = 34
    label_w = min(340, max(120, 7 * max(len(g["label"]) for g in groups) + 16))
    height = 24 + row * len(groups) + 50
    left, right, top = label_w, _W - 90, 12
    bottom = top + row * len(groups)
    parts = [_svg_open("groups", title, height=height)]
    top_v = max((g["tokens_saved"] for g in groups), default=0)
    ticks = nice_ticks(0, max(top_v, 1), 5, integer=True)
    xmax = ticks[-1]

    def px(v: float) -> float:
        return left + v / xmax * (right - left)

    for t in ticks:
        parts.append(
            f'<line x1="{px(t):.1f}" y1="{top}" x2="{px(t):.1f}" y2="{bottom}" stroke="{_GRID}"/>'
            f'<text x="{px(t):.1f}" y="{bottom + 18}" text-anchor="middle" class="tick">'
            f"{num(t)}</text>"
        )
    parts.append(
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="{_MUTED}"/>'
        f'<text x="{(left + right) / 2:.1f}" y="{bottom + 40}" text-anchor="middle" '
        'class="axis-label">tokens (loaded blocks × block size)</text>'
    )
    for i, g in enumerate(groups):
        y = top + row * i + 6
        w = px(g["tokens_saved"]) - left
        colour = _PURPLE if g["kind"] == GroupKind.MAMBA.value else _BLUE
        tip = (
            f"group {g['label']}: {g['loaded_blocks']:,} blocks loaded × {g['block_size']} = "
            f"{g['tokens_saved']:,} tokens ({g['skipped_blocks']:,} blocks skipped)"
        )
        parts.append(
            f'<text x="{left - 8}" y="{y + 15}" text-anchor="end" class="tick">'
            f"{escape(g['label'])}</text>"
            f'<rect class="mark" x="{left}" y="{y}" width="{max(w, 0):.1f}" height="{row - 12}" '
            f'fill="{colour}"><title>{escape(tip)}</title></rect>'
            f'<text x="{left + w + 6:.1f}" y="{y + 15}" class="value" text-anchor="start">'
            f"{num(g['tokens_saved'])}</text>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def _label_blocks(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:g}M"
    if v >= 1e4:
        return f"{v / 1e3:g}k"
    return num(v)


def sweep_svg(frame: pl.DataFrame) -> Markup:
    """Hit ratio against capacity, one line per eviction policy (log scale
    when the capacities span 10x or more)."""
    title = "Hit ratio against cache capacity"
    left, right, top, bottom = 64, _W - 20, 34, _H - 56
    parts = [_svg_open("sweep", title)]
    caps = frame["capacity_blocks"].to_list()
    lo, hi = min(caps), max(caps)
    log = hi >= 10 * lo
    if hi == lo:
        lo, hi = lo - 1, hi + 1

    def scale(v: float) -> float:
        return math.log10(v) if log else v

    def px(v: float) -> float:
        return left + 10 + (scale(v) - scale(lo)) / (scale(hi) - scale(lo)) * (right - left - 20)

    top_ratio = max(0.05, max(frame["hit_ratio"].to_list()))
    y_max = nice_ticks(0, top_ratio * 100, 5)[-1] / 100

    def py(r: float) -> float:
        return bottom - r / y_max * (bottom - top)

    y_ticks = [(py(t / 100), f"{t:g}%") for t in nice_ticks(0, y_max * 100, 5)]
    if log:
        decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
        ticks = [m * 10**d for d in decades for m in (1, 2, 5) if lo <= m * 10**d <= hi]
    else:
        ticks = [t for t in nice_ticks(lo, hi, 6, integer=True) if lo <= t <= hi]
    x_ticks = [(px(t), _label_blocks(t)) for t in ticks] or [(px(caps[0]), _label_blocks(caps[0]))]
    x_label = "capacity (blocks" + (", log scale)" if log else ")")
    parts += _axes(left, top, right, bottom, y_ticks, x_ticks, x_label, "hit ratio")
    evictions = list(dict.fromkeys(frame["eviction"].to_list()))
    for k, eviction in enumerate(evictions):
        colour = POLICY_COLOURS.get(eviction, _GREY)
        rows = frame.filter(pl.col("eviction") == eviction).sort("capacity_blocks")
        pts = list(zip(rows["capacity_blocks"].to_list(), rows["hit_ratio"].to_list(), strict=True))
        lx = left + 20 + 110 * k
        parts.append(
            f'<line x1="{lx}" y1="12" x2="{lx + 22}" y2="12" stroke="{colour}" stroke-width="2"/>'
            f'<text x="{lx + 28}" y="16" class="tick">{escape(eviction)}</text>'
        )
        parts += _series(
            [(px(c), py(r)) for c, r in pts],
            [f"{eviction}, {c:,} blocks: {100 * r:.2f}%" for c, r in pts],
            colour,
        )
    parts.append("</svg>")
    return Markup("".join(parts))
