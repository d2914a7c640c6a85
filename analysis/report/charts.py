"""The report's charts, drawn with Altair and rendered to inline SVG offline
by vl-convert (``replay.analysis.report.vega``): a report must open from a mail
attachment or a CI artifact with no CDN in reach. The hit-ratio timeline,
the hit-length histogram and the tokens per group; the what-if sweep's
chart is ``replay.analysis.report.sweep``'s.

Ticks and their labels are the report's own (``nice_ticks``, ``time_ticks``,
``fmt.num``, ``fmt.fmt_time``), so a chart spells a number or a time as the
cards and tables do, and a relative trace's time as elapsed (``+00:58:57``).
Each point or bar carries its tooltip text as ``description`` (the item's
``aria-label``); Vega escapes it."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from markupsafe import Markup

from replay.analysis.report.data import Bin, Point
from replay.analysis.report.fmt import fmt_time, is_relative, num, utc_datetime
from replay.analysis.report.vega import data, render_svg
from replay.base.spec import GroupKind
from replay.base.text import counted

_W, _H = 680, 220
_BLUE, _GREY, _PURPLE = "#2563eb", "#94a3b8", "#7c3aed"


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


def _axis(title: str, ticks: Sequence[tuple[float, str]], **extra: Any) -> Any:
    """An axis at the given values, each labelled with the report's own text."""
    import altair as alt

    expr = "''"
    for value, text in reversed(ticks):
        expr = f"datum.value == {value!r} ? {json.dumps(text)} : {expr}"
    return alt.Axis(title=title, values=[v for v, _ in ticks], labelExpr=expr, **extra)


def _render(chart: Any, name: str, title: str) -> Markup:
    spec: dict[str, Any] = chart.properties(title=title).to_dict()
    return render_svg(spec, name=name, label=title)


def _no_data(name: str, title: str) -> Markup:
    import altair as alt

    note = (
        alt.Chart(data([{"text": "no lookups"}]))
        .mark_text(color="#64748b", fontSize=14, aria=False)
        .encode(text="text:N")
        .properties(width=_W, height=_H)
    )
    return _render(note, name, title)


def timeline_svg(points: Sequence[Point], x_axis: str, overall: float) -> Markup:
    """Hit ratio per bin, over time or seq, with the whole run's ratio dashed."""
    import altair as alt

    title = "Hit ratio over " + ("time" if x_axis == "time" else "the event log (seq)")
    if not points:
        return _no_data("timeline", title)
    xs = [p.x for p in points]
    lo, hi = min(xs), max(xs)
    if x_axis == "time":
        span = hi - lo
        ticks = [(t, fmt_time(t, span)) for t in time_ticks(lo, hi)]
        day = utc_datetime(lo).strftime("%Y-%m-%d")
        x_label = f"time (UTC, {day})" if span < 86_400e6 else "time (UTC)"
        if is_relative(hi):
            x_label = "elapsed time since the trace's start (h:mm:ss)"
    else:
        ticks = [(t, num(t)) for t in nice_ticks(lo, hi, 6, integer=True) if lo <= t <= hi]
        ticks = ticks or [(xs[0], num(round(xs[0])))]
        x_label = "seq (position in the event log)"
    if not hi - lo > 0:
        # One x, or xs beyond 2**53 that floats cannot tell apart: a span
        # wide enough to be one in floating point.
        pad = max(1.0, abs(lo) * 1e-9)
        lo, hi = lo - pad, hi + pad
    x = alt.X(
        "x:Q",
        scale=alt.Scale(domain=[lo, hi], nice=False, zero=False, padding=8),
        axis=_axis(x_label, ticks),
    )
    y = alt.Y(
        "ratio:Q",
        scale=alt.Scale(domain=[0, 1]),
        axis=_axis(
            "hit ratio (hit / prompt tokens)", [(t / 100, f"{t}%") for t in (0, 25, 50, 75, 100)]
        ),
    )
    series = "hit ratio per bin"
    whole = f"whole run: {100 * overall:.1f}%"
    colour = alt.Color(
        "series:N",
        scale=alt.Scale(domain=[series, whole], range=[_BLUE, _GREY]),
        legend=alt.Legend(title=None, orient="top"),
    )
    rows = [{"x": p.x, "ratio": p.ratio, "tip": p.label, "series": series} for p in points]
    base = alt.Chart(data(rows))
    line = base.mark_line(strokeWidth=2, aria=False).encode(x=x, y=y, color=colour)
    dots = base.mark_point(filled=True, size=50, stroke="#fff", strokeWidth=1.5, opacity=1).encode(
        x=x, y=y, color=colour, description="tip:N"
    )
    rule = (
        alt.Chart(data([{"ratio": overall, "series": whole}]))
        .mark_rule(strokeDash=[5, 4], aria=False)
        .encode(y="ratio:Q", color=colour)
    )
    chart = alt.layer(rule, line, dots).properties(width=_W, height=_H)
    return _render(chart, "timeline", title)


def histogram_svg(bins: Sequence[Bin]) -> Markup:
    """One bar per bin of hit lengths, in order; the no-hit bar grey."""
    import altair as alt

    title = "Distribution of hit lengths"
    if not bins:
        return _no_data("histogram", title)
    top_n = max(b.lookups for b in bins)
    y_ticks = [(t, num(t)) for t in nice_ticks(0, max(top_n, 1), 5, integer=True)]
    width = bins[-1].width
    x_label = "hit length (tokens" + (f", bins of {width})" if len(bins) > 1 else ")")
    every = max(1, math.ceil(len(bins) / 12))
    shown = [b.label for i, b in enumerate(bins) if i % every == 0]
    no_hit, hit = "no hit", "hit"
    rows = [
        {
            "bin": b.label,
            "lookups": b.lookups,
            "count": num(b.lookups),
            "tip": b.tooltip,
            "kind": no_hit if b.lo == 0 else hit,
        }
        for b in bins
    ]
    x = alt.X(
        "bin:N",
        sort=[b.label for b in bins],
        axis=alt.Axis(title=x_label, values=shown, labelAngle=0),
    )
    y = alt.Y(
        "lookups:Q",
        scale=alt.Scale(domain=[0, y_ticks[-1][0]], nice=False),
        axis=_axis("lookups", y_ticks),
    )
    base = alt.Chart(data(rows)).encode(x=x, y=y)
    bars = base.mark_bar().encode(
        color=alt.Color(
            "kind:N", scale=alt.Scale(domain=[no_hit, hit], range=[_GREY, _BLUE]), legend=None
        ),
        description="tip:N",
    )
    layers: list[Any] = [bars]
    if len(bins) <= 20:
        layers.append(
            base.transform_filter("datum.lookups > 0")
            .mark_text(dy=-6, color="#1e293b", aria=False)
            .encode(text="count:N")
        )
    chart = alt.layer(*layers).properties(width=_W, height=_H)
    return _render(chart, "histogram", title)


def groups_svg(groups: Sequence[dict[str, Any]]) -> Markup:
    """One horizontal bar per KV-cache group: the tokens its loaded blocks hold."""
    import altair as alt

    title = "Tokens loaded per KV-cache group"
    top_v = max((g["tokens_saved"] for g in groups), default=0)
    low_v = min((g["tokens_saved"] for g in groups if g["tokens_saved"] > 0), default=0)
    # Values an order of magnitude or more apart (a Mamba group's one state block
    # beside an attention group's whole prefix) go on a log axis.
    log = low_v > 0 and top_v >= 10 * low_v
    ticks: list[float]
    if log:
        ticks = [10.0**d for d in range(0, math.ceil(math.log10(top_v)) + 1)]
    else:
        ticks = nice_ticks(0, max(top_v, 1), 5, integer=True)
    rows = [
        {
            "label": g["label"],
            "tokens": g["tokens_saved"],
            "count": num(g["tokens_saved"]),
            "kind": "mamba" if g["kind"] == GroupKind.MAMBA.value else "attention",
            "tip": (
                f"group {g['label']}: {counted(g['loaded_blocks'], 'block')} loaded × "
                f"{g['block_size']} = {counted(g['tokens_saved'], 'token')} "
                f"({counted(g['skipped_blocks'], 'block')} skipped)"
            ),
        }
        for g in groups
    ]
    x_label = f"tokens (loaded blocks × block size{', log scale' if log else ''})"
    scale = (
        alt.Scale(type="log", domain=[ticks[0], ticks[-1]], nice=False)
        if log
        else alt.Scale(domain=[0, ticks[-1]], nice=False)
    )
    x = alt.X("tokens:Q", scale=scale, axis=_axis(x_label, [(t, num(t)) for t in ticks]))
    y = alt.Y(
        "label:N", sort=[g["label"] for g in groups], axis=alt.Axis(title=None, labelLimit=340)
    )
    base = alt.Chart(data(rows)).encode(x=x, y=y)
    # On a log axis a bar starts at the axis' 1, not at 0 (which has no log).
    start = {"x2": alt.datum(ticks[0])} if log else {}
    bars = base.mark_bar().encode(
        **start,
        color=alt.Color(
            "kind:N",
            scale=alt.Scale(domain=["attention", "mamba"], range=[_BLUE, _PURPLE]),
            legend=None,
        ),
        description="tip:N",
    )
    values = base.mark_text(align="left", dx=6, color="#1e293b", aria=False).encode(text="count:N")
    chart = alt.layer(bars, values).properties(width=_W - 160, height=alt.Step(30))
    return _render(chart, "groups", title)
