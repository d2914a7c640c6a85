"""A results file as one self-contained report: HTML (inline SVG charts, no
network) for a reviewer, or Markdown to paste into a pull request.

``build_report`` gathers every figure from the results file (and, when the
trace is found, the flags with their details and the ``replay explain``
table of each example); ``render_html`` / ``render_markdown`` only format.
The charts are drawn here as SVG strings: a report must open from a mail
attachment or a CI artifact with no CDN in reach. A short inline script
stamps each chart with its number of marks once the page has laid out
(``data-marks``, ``data-rendered`` on ``<body>``), which the browser test
reads back.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl

from analysis.flags import FLAG_KINDS, results_flags
from replay import __version__
from replay.coordinator import POLICIES, hit_alignment
from replay.engine import explain_lookups
from replay.errors import ReplayError
from replay.paths import OutputTarget, write_text
from replay.render import config_lines, explain_header, explain_table, group_label
from replay.spec import GroupKind, TraceConfig
from replay.summary import hit_figures, prompt_tokens_expr
from replay.trace import (
    TraceReader,
    TraceSource,
    open_trace,
    read_results,
    results_cache,
    results_config,
)

FORMATS = ("html", "md")
TIMELINE_BINS = 40
HISTOGRAM_BINS = 30

FLAG_MEANINGS: dict[str, str] = {
    "mamba_overrun": "Mamba resumes recurrent state past the hit or the attention KV it loads (#43559)",
    "mamba_state_mismatch": "Mamba resumes state at a position other than the hit",
    "hit_beyond_max_length": "the hit is longer than the lookup's max_length",
    "hit_misaligned": "the hit is not a multiple of the hit alignment",
    "missing_block": "a block the hit relies on is absent from the store at that seq",
    "eagle_not_dropped": "EAGLE is on but the hit covers the whole present prefix "
    "(nothing left to recompute)",
    "observed_mismatch": "the production-reported hit differs from the replayed one",
}


# ---------------------------------------------------------------- data


@dataclass(frozen=True, slots=True, kw_only=True)
class Point:
    x: float
    ratio: float
    lookups: int
    hit_tokens: int
    prompt_tokens: int
    label: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Bin:
    lo: int
    width: int
    lookups: int
    label: str
    tooltip: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Example:
    flag: str
    seq: int
    request_id: str
    hit_tokens: int
    max_length: int
    group_id: int | None = None
    actual: int | None = None
    expected: int | None = None
    detail: str | None = None
    explain: str | None = None


@dataclass(slots=True, kw_only=True)
class ReportData:
    results_path: str
    info: dict[str, Any]
    config: TraceConfig
    summary: dict[str, Any]
    x_axis: str  # "time", "seq" (some ts missing) or "seq-no-ts"
    timeline: list[Point]
    histogram: list[Bin]
    groups: list[dict[str, Any]]
    flag_rows: list[dict[str, Any]]
    examples: dict[str, list[Example]]
    trace_path: str | None = None
    trace_note: str | None = None
    explain_note: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return f"Replay report: {self.info.get('trace') or Path(self.results_path).name}"


def _summary(res: pl.DataFrame) -> dict[str, Any]:
    figures = hit_figures(res)
    observed = figures.pop("observed")
    flagged = int((res["flags"].list.len() > 0).sum()) if "flags" in res.columns else 0
    return {
        **figures,
        "flagged_lookups": flagged,
        "observed": observed["lookups"],
        "observed_mismatches": observed["mismatches"],
        "mean_hit": float(res["hit_tokens"].mean() or 0.0) if res.height else 0.0,  # type: ignore[arg-type]
        "median_hit": float(res["hit_tokens"].median() or 0.0) if res.height else 0.0,  # type: ignore[arg-type]
    }


def _fmt_time(us: float, span_us: float) -> str:
    t = datetime.fromtimestamp(us / 1e6, tz=UTC)
    if span_us < 10e6:
        return t.strftime("%H:%M:%S.%f")[:-3]
    if span_us < 86_400e6:
        return t.strftime("%H:%M:%S")
    return t.strftime("%Y-%m-%d %H:%M")


def _timeline(res: pl.DataFrame) -> tuple[str, list[Point]]:
    """Hit ratio per bin of time (or of seq when any lookup lacks a timestamp)."""
    if res.height == 0:
        return "seq", []
    use_time = "ts" in res.columns and res["ts"].null_count() == 0
    x = pl.col("ts").dt.epoch("us") if use_time else pl.col("seq")
    frame = res.select(
        x.cast(pl.Int64).alias("x"),
        pl.col("hit_tokens").cast(pl.Int64),
        prompt_tokens_expr().cast(pl.Int64).alias("prompt"),
    )
    lo, hi = int(frame["x"].min()), int(frame["x"].max())  # type: ignore[arg-type]
    nbins = min(res.height, TIMELINE_BINS)
    span = hi - lo + 1
    bins = (
        frame.with_columns(((pl.col("x") - lo) * nbins // span).alias("bin"))
        .group_by("bin")
        .agg(
            pl.len().alias("n"),
            pl.col("hit_tokens").sum().alias("hit"),
            pl.col("prompt").sum().alias("prompt"),
            pl.col("x").mean().alias("xm"),
            pl.col("x").min().alias("x0"),
            pl.col("x").max().alias("x1"),
        )
        .sort("bin")
    )
    points = []
    for r in bins.iter_rows(named=True):
        if use_time:
            where = _fmt_time(r["x0"], hi - lo)
            if r["x1"] != r["x0"]:
                where += f" – {_fmt_time(r['x1'], hi - lo)}"
        else:
            where = f"seq {r['x0']}" + (f"–{r['x1']}" if r["x1"] != r["x0"] else "")
        ratio = r["hit"] / r["prompt"] if r["prompt"] else 0.0
        points.append(
            Point(
                x=float(r["xm"]),
                ratio=ratio,
                lookups=int(r["n"]),
                hit_tokens=int(r["hit"]),
                prompt_tokens=int(r["prompt"]),
                label=f"{where}: {r['n']} lookups, hit ratio {100 * ratio:.1f}% "
                f"({r['hit']} of {r['prompt']} tokens)",
            )
        )
    if use_time:
        return "time", points
    no_ts = "ts" not in res.columns or res["ts"].null_count() == res.height
    return ("seq-no-ts" if no_ts else "seq"), points


def _histogram(res: pl.DataFrame, alignment: int) -> list[Bin]:
    if res.height == 0:
        return []
    top = int(res["hit_tokens"].max() or 0)  # type: ignore[arg-type]
    units = top // alignment + 1
    width = alignment * math.ceil(units / HISTOGRAM_BINS)
    counts = res.select((pl.col("hit_tokens") // width).alias("b")).group_by("b").len().sort("b")
    by_bin = {int(b): int(n) for b, n in counts.iter_rows()}
    out = []
    for b in range(top // width + 1):
        lo = b * width
        n = by_bin.get(b, 0)
        what = f"hit {lo} tokens" if width == alignment else f"hit {lo}–{lo + width - 1} tokens"
        out.append(
            Bin(
                lo=lo,
                width=width,
                lookups=n,
                label=str(lo),
                tooltip=f"{what}: {n} lookup{'s' if n != 1 else ''}",
            )
        )
    return out


def _groups(res: pl.DataFrame, config: TraceConfig) -> list[dict[str, Any]]:
    out = []
    for gid, g in enumerate(config.groups):
        loaded = int(res["loaded_blocks"].list.get(gid).sum() or 0) if res.height else 0
        mask = int(res["mask_blocks"].list.get(gid).sum() or 0) if res.height else 0
        out.append(
            {
                "group_id": gid,
                "label": group_label(config, gid),
                "kind": g.kind.value,
                "block_size": g.block_size,
                "loaded_blocks": loaded,
                "skipped_blocks": mask - loaded,
                "tokens_saved": loaded * g.block_size,
            }
        )
    return out


def _resolve_trace(
    results_path: Path, info: dict[str, Any], config: TraceConfig, trace: TraceSource | None
) -> tuple[TraceReader | None, str | None]:
    """The trace the results came from, opened once, or why there is none.
    An explicit ``--trace`` that does not fit is an error; the default is
    best effort."""
    if trace is not None:
        reader = open_trace(trace)
        other = reader.config
        if other != config:
            raise ReplayError(
                f"{reader.name}: KV-cache config {other.dumps()} differs from the one "
                f"{results_path} was replayed with ({config.dumps()}); expected the trace of "
                "these results"
            )
        return reader, None
    name = info.get("trace")
    if not name:
        return None, (
            f"{results_path.name} does not name its trace; pass --trace to explain the examples"
        )
    candidate = results_path.parent / str(name)
    if not candidate.exists():  # a file, or a trace directory
        return None, (
            f"trace {name} not found next to {results_path.name} (looked for {candidate}); "
            "pass --trace to add the explain tables"
        )
    try:
        found = open_trace(candidate)
    except ReplayError as exc:
        return None, f"trace {candidate} is not usable ({exc}); pass --trace"
    if found.config != config:
        return None, (
            f"trace {candidate} has a different KV-cache config than these results; pass --trace"
        )
    return found, None


def _check_lookups(trace: str, trace_frame: pl.DataFrame, res: pl.DataFrame) -> str | None:
    lookups = trace_frame.filter(pl.col("kind") == "lookup").select("seq", "request_id")
    joined = res.select("seq", "request_id").join(lookups, on="seq", how="left", suffix="_t")
    bad = joined.filter(
        pl.col("request_id_t").is_null() | (pl.col("request_id") != pl.col("request_id_t"))
    )
    if bad.height:
        r = bad.row(0, named=True)
        return (
            f"trace {trace} has no lookup {r['request_id']!r} at seq {r['seq']}: "
            "it is not the trace of these results"
        )
    return None


def build_report(
    results_path: str | os.PathLike[str],
    *,
    trace: TraceSource | None = None,
    examples: int = 3,
) -> ReportData:
    """Every figure of the report. ``examples``: flagged lookups shown per
    kind. ``trace``: a path or an open ``TraceReader`` (read, never reopened)."""
    rpath = Path(results_path)
    res, info = read_results(
        rpath,
        not_results=f"{rpath}: is not a results file (no 'replay.results' metadata), expected "
        f"the output of `replay run` (for a trace, run `replay run {rpath}` first)",
    )
    config = results_config(info, rpath)
    reader, note = _resolve_trace(rpath, info, config, trace)
    if reader is not None:
        tframe = reader.read_frame(["seq", "kind", "request_id"])
        mismatch = _check_lookups(reader.name, tframe, res)
        if mismatch is not None:
            if trace is not None:
                raise ReplayError(mismatch)
            reader, note = None, mismatch + "; pass --trace"
    detailed = "flag_details" in res.columns or "unit_present" in res.columns
    flags = results_flags(res, config, results_cache(info))
    summary = _summary(res)
    summary["flagged_lookups"] = int(flags["seq"].n_unique()) if flags.height else 0
    x_axis, timeline = _timeline(res)

    counts = (
        {
            str(f): int(n)
            for f, n in flags.group_by("flag").agg(pl.col("seq").n_unique()).iter_rows()
        }
        if flags.height
        else {}
    )
    kinds = [k for k in FLAG_KINDS if k in counts] + sorted(set(counts) - set(FLAG_KINDS))
    flag_rows = [
        {
            "flag": k,
            "lookups": counts[k],
            "share": counts[k] / res.height if res.height else 0.0,
            "meaning": FLAG_MEANINGS.get(k, ""),
        }
        for k in kinds
    ]
    ex: dict[str, list[Example]] = {}
    for k in kinds:
        part = flags.filter(pl.col("flag") == k).unique("seq", keep="first", maintain_order=True)
        ex[k] = [
            Example(
                flag=k,
                seq=int(r["seq"]),
                request_id=str(r["request_id"]),
                hit_tokens=int(r["hit_tokens"]),
                max_length=int(r["max_length"]),
                group_id=r.get("group_id"),
                actual=r.get("actual"),
                expected=r.get("expected"),
                detail=r.get("detail"),
            )
            for r in part.head(max(examples, 0)).iter_rows(named=True)
        ]
    data = ReportData(
        results_path=str(rpath),
        info=info,
        config=config,
        summary=summary,
        x_axis=x_axis,
        timeline=timeline,
        histogram=_histogram(res, hit_alignment(config, results_cache(info))),
        groups=_groups(res, config),
        flag_rows=flag_rows,
        examples=ex,
        trace_path=reader.name if reader is not None else None,
        trace_note=note,
    )
    data.extra["flag_details"] = detailed
    if reader is not None:
        _explain_examples(data, reader)
    return data


def _explain_examples(data: ReportData, trace: TraceReader) -> None:
    policy = str(data.info.get("policy"))
    if policy not in POLICIES:
        data.explain_note = (
            f"policy {policy!r} of these results is unknown to this version "
            f"(known: {', '.join(POLICIES)}); no explain tables"
        )
        return
    wanted = {e.seq for exs in data.examples.values() for e in exs}
    if not wanted:
        return
    cache = results_cache(data.info)
    config, found = explain_lookups(
        trace, lambda e: e.seq in wanted, policy, cache=cache, until_seq=max(wanted)
    )
    texts: dict[int, str] = {}
    for lookup, outcome, _ in found:
        texts[lookup.seq] = (
            explain_header(config, lookup, policy, cache) + "\n\n" + explain_table(config, outcome)
        )
    for k, exs in data.examples.items():
        data.examples[k] = [
            Example(**{**_example_fields(e), "explain": texts.get(e.seq)}) for e in exs
        ]
    if data.info.get("coordinator") not in (None, "reference"):
        data.explain_note = (
            f"these results come from the {data.info.get('coordinator')} coordinator; "
            "the explain tables show the reference coordinator's steps under the same policy"
        )


def _example_fields(e: Example) -> dict[str, Any]:
    return {name: getattr(e, name) for name in Example.__dataclass_fields__}


# ---------------------------------------------------------------- SVG charts

_W, _H = 760, 300
_BLUE, _GREY, _RED, _INK, _MUTED, _GRID = (
    "#2563eb",
    "#94a3b8",
    "#dc2626",
    "#1e293b",
    "#64748b",
    "#e2e8f0",
)


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _num(v: float) -> str:
    if float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:,.2f}".rstrip("0").rstrip(".")


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
        f'<svg class="chart" data-chart="{_e(name)}" role="img" aria-label="{_e(title)}" '
        f'viewBox="0 0 {width} {height}" width="100%" preserveAspectRatio="xMidYMid meet" '
        f'xmlns="http://www.w3.org/2000/svg"><title>{_e(title)}</title>'
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
            f'<text x="{left - 8}" y="{y + 4:.1f}" text-anchor="end" class="tick">{_e(text)}</text>'
        )
    for x, text in x_ticks:
        out.append(
            f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 5}" stroke="{_MUTED}"/>'
            f'<text x="{x:.1f}" y="{bottom + 19}" text-anchor="middle" class="tick">'
            f"{_e(text)}</text>"
        )
    out.append(
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="{_MUTED}"/>'
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="{_MUTED}"/>'
        f'<text x="{(left + right) / 2:.1f}" y="{bottom + 42}" text-anchor="middle" '
        f'class="axis-label">{_e(x_label)}</text>'
        f'<text transform="translate(16 {(top + bottom) / 2:.1f}) rotate(-90)" '
        f'text-anchor="middle" class="axis-label">{_e(y_label)}</text>'
    )
    return out


def timeline_svg(points: Sequence[Point], x_axis: str, overall: float) -> str:
    title = "Hit ratio over " + ("time" if x_axis == "time" else "the event log (seq)")
    left, right, top, bottom = 64, _W - 20, 34, _H - 56
    parts = [_svg_open("timeline", title)]
    if not points:
        return parts[0] + _no_data(left, right, top, bottom) + "</svg>"
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
        x_ticks = [(px(t), _fmt_time(t, span)) for t in time_ticks(min(xs), max(xs))]
        day = datetime.fromtimestamp(min(xs) / 1e6, tz=UTC).strftime("%Y-%m-%d")
        x_label = f"time (UTC, {day})" if span < 86_400e6 else "time (UTC)"
    else:
        x_ticks = [
            (px(t), _num(t)) for t in nice_ticks(min(xs), max(xs), 6, integer=True) if lo <= t <= hi
        ] or [(px(xs[0]), _num(round(xs[0])))]
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
    if len(points) > 1:
        path = " ".join(f"{px(p.x):.1f},{py(p.ratio):.1f}" for p in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{_BLUE}" stroke-width="2"/>')
    for p in points:
        parts.append(
            f'<circle class="mark" cx="{px(p.x):.1f}" cy="{py(p.ratio):.1f}" r="4" '
            f'fill="{_BLUE}" stroke="#fff" stroke-width="1.5"><title>{_e(p.label)}</title>'
            "</circle>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _no_data(left: int, right: int, top: int, bottom: int) -> str:
    return (
        f'<text x="{(left + right) / 2}" y="{(top + bottom) / 2}" text-anchor="middle" '
        'class="note">no lookups</text>'
    )


def histogram_svg(bins: Sequence[Bin]) -> str:
    title = "Distribution of hit lengths"
    left, right, top, bottom = 64, _W - 20, 16, _H - 56
    parts = [_svg_open("histogram", title)]
    if not bins:
        return parts[0] + _no_data(left, right, top, bottom) + "</svg>"
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
        left, top, right, bottom, [(py(t), _num(t)) for t in ticks], x_ticks, x_label, "lookups"
    )
    gap = min(6.0, slot * 0.15)
    for i, b in enumerate(bins):
        x, h = left + slot * i + gap / 2, bottom - py(b.lookups)
        colour = _GREY if b.lo == 0 else _BLUE
        parts.append(
            f'<rect class="mark" x="{x:.1f}" y="{py(b.lookups):.1f}" width="{slot - gap:.1f}" '
            f'height="{h:.1f}" fill="{colour}"><title>{_e(b.tooltip)}</title></rect>'
        )
        if b.lookups and len(bins) <= 20:
            parts.append(
                f'<text x="{x + (slot - gap) / 2:.1f}" y="{py(b.lookups) - 5:.1f}" '
                f'text-anchor="middle" class="value">{_num(b.lookups)}</text>'
            )
    parts.append("</svg>")
    return "".join(parts)


def groups_svg(groups: Sequence[dict[str, Any]]) -> str:
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
            f"{_num(t)}</text>"
        )
    parts.append(
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="{_MUTED}"/>'
        f'<text x="{(left + right) / 2:.1f}" y="{bottom + 40}" text-anchor="middle" '
        'class="axis-label">tokens (loaded blocks × block size)</text>'
    )
    for i, g in enumerate(groups):
        y = top + row * i + 6
        w = px(g["tokens_saved"]) - left
        colour = "#7c3aed" if g["kind"] == GroupKind.MAMBA.value else _BLUE
        tip = (
            f"group {g['label']}: {g['loaded_blocks']:,} blocks loaded × {g['block_size']} = "
            f"{g['tokens_saved']:,} tokens ({g['skipped_blocks']:,} blocks skipped)"
        )
        parts.append(
            f'<text x="{left - 8}" y="{y + 15}" text-anchor="end" class="tick">'
            f"{_e(g['label'])}</text>"
            f'<rect class="mark" x="{left}" y="{y}" width="{max(w, 0):.1f}" height="{row - 12}" '
            f'fill="{colour}"><title>{_e(tip)}</title></rect>'
            f'<text x="{left + w + 6:.1f}" y="{y + 15}" class="value" text-anchor="start">'
            f"{_num(g['tokens_saved'])}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


# ---------------------------------------------------------------- HTML

_CSS = """
:root { color-scheme: light; }
body { font: 15px/1.5 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
  color: #1e293b; background: #f8fafc; margin: 0; }
main { max-width: 1040px; margin: 0 auto; padding: 24px 28px 64px; }
h1 { font-size: 26px; margin: 8px 0 4px; }
h2 { font-size: 20px; margin: 36px 0 8px; padding-bottom: 4px; border-bottom: 1px solid #e2e8f0; }
h3 { font-size: 16px; margin: 24px 0 6px; }
.sub { color: #64748b; margin: 0 0 16px; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(150px, 1fr)); gap: 12px;
  margin: 16px 0; }
.card { background: #fff; border: 1px solid #e2e8f0; border-radius: 8px; padding: 10px 14px; }
.card .v { font-size: 22px; font-weight: 600; font-variant-numeric: tabular-nums; }
.card .k { color: #64748b; font-size: 13px; }
.card.bad .v { color: #dc2626; }
.panel { background: #fff; border: 1px solid #e2e8f0; border-radius: 8px; padding: 12px 16px;
  margin: 10px 0; }
.caption { color: #64748b; font-size: 13px; margin: 4px 0 0; }
table { border-collapse: collapse; margin: 8px 0; background: #fff; font-size: 14px; }
th, td { padding: 5px 12px; border-bottom: 1px solid #e2e8f0; text-align: left;
  vertical-align: top; }
th { background: #f1f5f9; font-weight: 600; }
tbody tr:nth-child(even) td { background: #f8fafc; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
code, pre { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace;
  font-size: 13px; }
pre { background: #0f172a; color: #e2e8f0; padding: 12px 14px; border-radius: 6px;
  overflow-x: auto; line-height: 1.4; }
details { margin: 6px 0 12px; }
summary { cursor: pointer; color: #1d4ed8; }
.note { fill: #64748b; font-size: 12px; }
.notice { background: #fef9c3; border: 1px solid #fde047; border-radius: 6px;
  padding: 8px 12px; }
.ok { color: #15803d; }
.flag { color: #b91c1c; font-weight: 600; }
.meter { display: inline-block; height: 9px; background: #dc2626; border-radius: 2px;
  vertical-align: middle; margin-right: 6px; }
svg.chart { display: block; max-width: 100%; height: auto; }
svg .tick { fill: #475569; font-size: 12px; }
svg .axis-label { fill: #1e293b; font-size: 13px; font-weight: 600; }
svg .value { fill: #1e293b; font-size: 12px; }
svg .mark:hover { opacity: 0.75; }
footer { color: #64748b; font-size: 13px; margin-top: 40px; }
nav { font-size: 14px; margin: 4px 0 8px; }
nav a, h3 a { color: #1d4ed8; }
"""

_JS = """
document.addEventListener('DOMContentLoaded', function () {
  var charts = document.querySelectorAll('svg.chart');
  var marks = 0, visible = 0;
  charts.forEach(function (svg) {
    var n = svg.querySelectorAll('.mark').length;
    var box = svg.getBoundingClientRect();
    svg.setAttribute('data-marks', String(n));
    if (box.width > 0 && box.height > 0) { visible += 1; }
    marks += n;
  });
  document.body.setAttribute('data-rendered',
    charts.length + ' charts, ' + visible + ' visible, ' + marks + ' marks');
});
"""


def _table_html(
    headers: Sequence[str] | None,
    rows: Sequence[Sequence[object]],
    numeric: Sequence[int] = (),
) -> str:
    """A table; ``numeric`` columns right-aligned, their ints with thousands
    separators (except a ``seq`` column: people copy those)."""
    head = ""
    if headers is not None:
        head = (
            "<thead><tr>"
            + "".join(
                f'<th class="n">{_e(h)}</th>' if i in numeric else f"<th>{_e(h)}</th>"
                for i, h in enumerate(headers)
            )
            + "</tr></thead>"
        )
    body = []
    for r in rows:
        cells = []
        for i, c in enumerate(r):
            if isinstance(c, _Raw):
                raw = str(c)
            elif (
                i in numeric
                and isinstance(c, int)
                and not isinstance(c, bool)
                and (headers is None or headers[i] != "seq")
            ):
                raw = _e(f"{c:,}")
            else:
                raw = _e(c)
            cells.append(f'<td class="n">{raw}</td>' if i in numeric else f"<td>{raw}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table>{head}<tbody>{''.join(body)}</tbody></table>"


class _Raw(str):
    """Already-escaped HTML for a table cell."""

    __slots__ = ()


def _pct(v: float) -> str:
    return f"{100 * v:.2f}%"


def render_html(data: ReportData) -> str:
    s, info = data.summary, data.info
    policy = info.get("policy", "?")
    coord = info.get("coordinator", "?")
    flagged = s["flagged_lookups"]
    cards = [
        ("lookups", _num(s["lookups"]), False),
        ("with a hit", _num(s["lookups_with_hit"]), False),
        ("prompt tokens", _num(s["prompt_tokens"]), False),
        ("hit tokens", _num(s["hit_tokens"]), False),
        ("hit ratio", _pct(s["hit_ratio"]), False),
        ("flagged lookups", _num(flagged), flagged > 0),
    ]
    if s["observed"]:
        cards.append(
            ("observed ≠ replay", f"{s['observed_mismatches']:,} / {s['observed']:,}", False)
        )
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(data.title)}</title>",
        f"<style>{_CSS}</style>",
        f"<script>{_JS}</script>",
        "</head><body><main>",
        f"<h1>{_e(data.title)}</h1>",
        f'<p class="sub">policy <code>{_e(policy)}</code> · {_e(coord)} coordinator · '
        f"{_e(results_cache(info))} cache · "
        f"results <code>{_e(Path(data.results_path).name)}</code></p>",
        '<div class="cards">'
        + "".join(
            f'<div class="card{" bad" if bad else ""}"><div class="v">{_e(v)}</div>'
            f'<div class="k">{_e(k)}</div></div>'
            for k, v, bad in cards
        )
        + "</div>",
    ]
    out.append(
        '<nav><a href="#flags">Flags</a> · <a href="#hit-ratio">Hit ratio over time</a> · '
        '<a href="#hit-lengths">Hit lengths</a> · <a href="#groups">Tokens per group</a> · '
        '<a href="#config">Configuration</a></nav>'
    )
    if data.trace_note:
        out.append(f'<p class="notice">No trace: {_e(data.trace_note)}.</p>')

    # Flags first: they are what a reviewer opens the report for.
    out.append('<section id="flags"><h2>Flags</h2>')
    if not data.flag_rows:
        out.append('<p class="ok">No lookup was flagged.</p>')
    else:
        rows = []
        for r in data.flag_rows:
            meter = f'<span class="meter" style="width:{max(2, round(60 * r["share"]))}px"></span>'
            rows.append(
                [
                    _Raw(f'<a href="#flag-{_e(r["flag"])}"><code>{_e(r["flag"])}</code></a>'),
                    r["lookups"],
                    _Raw(meter + _e(_pct(r["share"]))),
                    r["meaning"],
                ]
            )
        out.append(
            _table_html(["flag", "lookups", "share of lookups", "what it means"], rows, (1, 2))
        )
        if not data.extra.get("flag_details"):
            out.append(
                '<p class="caption">From the results file\'s <code>flags</code> column (it has '
                "no <code>unit_present</code> column to recompute the details from).</p>"
            )
        if data.explain_note:
            out.append(f'<p class="caption">{_e(data.explain_note)}.</p>')
        explained: set[int] = set()
        for r in data.flag_rows:
            exs = data.examples.get(r["flag"], [])
            out.append(
                f'<h3 id="flag-{_e(r["flag"])}"><span class="flag">{_e(r["flag"])}</span> '
                f"— {r['lookups']:,} lookup{'s' if r['lookups'] != 1 else ''}"
                f"{f', first {len(exs)}' if len(exs) < r['lookups'] else ''}</h3>"
            )
            ex_rows = [
                [
                    e.request_id,
                    e.seq,
                    e.max_length,
                    e.hit_tokens,
                    "-" if e.group_id is None else e.group_id,
                    e.detail or "-",
                ]
                for e in exs
            ]
            out.append(
                _table_html(
                    ["request", "seq", "max_length", "hit", "group", "detail"], ex_rows, (1, 2, 3)
                )
            )
            for e in exs:
                if not e.explain:
                    continue
                if e.seq in explained:
                    out.append(
                        f'<p class="caption">Explain table of {_e(e.request_id)} (seq {e.seq}): '
                        f'<a href="#explain-{e.seq}">above</a>.</p>'
                    )
                    continue
                explained.add(e.seq)
                is_open = " open" if e is exs[0] else ""
                out.append(
                    f'<details{is_open} id="explain-{e.seq}"><summary><code>replay explain '
                    f"--request {_e(e.request_id)} --policy {_e(policy)}</code> "
                    f"(seq {e.seq})</summary><pre>{_e(e.explain)}</pre></details>"
                )

    out.append("</section>")
    out.append('<section id="hit-ratio"><h2>Hit ratio over time</h2>')
    by = {
        "time": "lookup timestamps (ts)",
        "seq": "seq (some lookups have no timestamp)",
        "seq-no-ts": "seq (the lookups have no timestamps)",
    }[data.x_axis]
    out.append(
        f'<div class="panel">{timeline_svg(data.timeline, data.x_axis, s["hit_ratio"])}'
        f'<p class="caption">{len(data.timeline)} point{"s" if len(data.timeline) != 1 else ""}, '
        f"each the hit tokens over the prompt tokens of the lookups in one bin of {_e(by)}; "
        "dashed: the whole run.</p></div>"
    )
    out.append("</section>")
    out.append('<section id="hit-lengths"><h2>Hit lengths</h2>')
    alignment = hit_alignment(data.config, results_cache(data.info))
    bar_w = data.histogram[0].width if data.histogram else alignment
    out.append(
        f'<div class="panel">{histogram_svg(data.histogram)}'
        f'<p class="caption">Lookups per hit length; grey: no hit. Median '
        f"{_num(s['median_hit'])} tokens, mean {_num(round(s['mean_hit'], 1))}; each bar is "
        f"{bar_w} token{'s' if bar_w != 1 else ''} wide (hit alignment "
        f"{alignment}).</p></div>"
    )
    out.append("</section>")
    out.append('<section id="groups"><h2>Tokens loaded per group</h2>')
    out.append(
        f'<div class="panel">{groups_svg(data.groups)}'
        '<p class="caption">Loaded blocks × block size, summed over every lookup (for Mamba, '
        "the one state block each hit resumes).</p></div>"
    )
    out.append(
        _table_html(
            ["group", "loaded blocks", "skipped blocks", "tokens loaded"],
            [
                [g["label"], g["loaded_blocks"], g["skipped_blocks"], g["tokens_saved"]]
                for g in data.groups
            ],
            (1, 2, 3),
        )
    )
    out.append("</section>")
    out.append('<section id="config"><h2>Configuration</h2>')
    meta_rows = [
        ["results", data.results_path],
        ["trace", data.trace_path or f"not found ({data.trace_note})"],
        ["policy", f"{policy}: {info.get('policy_description', '')}".rstrip(": ")],
        ["coordinator", coord],
        ["cache", f"{results_cache(info)}: {info.get('cache_description', '')}".rstrip(": ")],
        ["keys", info.get("keys", "-")],
    ]
    out.append(_table_html(None, meta_rows))
    config_text = chr(10).join(config_lines(data.config, results_cache(data.info)))
    out.append(f"<pre>{_e(config_text)}</pre>")
    out.append("</section>")
    out.append(
        f"<footer>Generated by cache-trace-replay {_e(__version__)} "
        f"(<code>replay report</code>).</footer>"
    )
    out.append("</main></body></html>")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- Markdown


def _md_cell(v: object) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def _md_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], numeric: Sequence[int] = ()
) -> str:
    sep = ["---:" if i in numeric else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(_md_cell(h) for h in headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def render_markdown(data: ReportData, first: int = 3) -> str:
    s, info = data.summary, data.info
    policy = info.get("policy", "?")
    out = [
        f"## {data.title}",
        "",
        f"Policy `{policy}`, {info.get('coordinator', '?')} coordinator, "
        f"{results_cache(info)} cache, results `{Path(data.results_path).name}`.",
        "",
        _md_table(
            ["lookups", "with a hit", "prompt tokens", "hit tokens", "hit ratio", "flagged"],
            [
                [
                    _num(s["lookups"]),
                    _num(s["lookups_with_hit"]),
                    _num(s["prompt_tokens"]),
                    _num(s["hit_tokens"]),
                    _pct(s["hit_ratio"]),
                    _num(s["flagged_lookups"]),
                ]
            ],
            range(6),
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
            _md_table(
                ["flag", "lookups", "share", "what it means"],
                [
                    [f"`{r['flag']}`", _num(r["lookups"]), _pct(r["share"]), r["meaning"]]
                    for r in data.flag_rows
                ],
                (1, 2),
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
                out.append(f"- `{e.flag}` request `{e.request_id}` (seq {e.seq}){detail}")
                if text:
                    out += [
                        "",
                        f"  <details><summary>replay explain --request {e.request_id} "
                        f"--policy {policy}</summary>",
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
        _md_table(
            ["group", "loaded blocks", "skipped blocks", "tokens loaded"],
            [
                [
                    g["label"],
                    _num(g["loaded_blocks"]),
                    _num(g["skipped_blocks"]),
                    _num(g["tokens_saved"]),
                ]
                for g in data.groups
            ],
            (1, 2, 3),
        ),
        "",
        "<details><summary>Configuration</summary>",
        "",
        "```text",
        *config_lines(data.config, results_cache(data.info)),
        "```",
        "",
        "</details>",
        "",
    ]
    return "\n".join(out)


# ---------------------------------------------------------------- writing


def default_report_path(results: str | os.PathLike[str], fmt: str) -> Path:
    p = Path(results)
    name = p.name.removesuffix(".parquet").removesuffix(".results")
    return p.with_name(f"{name}.report.{fmt}")


def write_report(data: ReportData, out: str | os.PathLike[str], fmt: str = "html") -> OutputTarget:
    """Render and write atomically (no partial file on any error); ``-``
    writes to standard output, ``/dev/null`` nowhere."""
    if fmt not in FORMATS:
        raise ReplayError(f"unknown report format {fmt!r}, expected one of {', '.join(FORMATS)}")
    text = render_html(data) if fmt == "html" else render_markdown(data)
    return write_text(out, text, what="a report")
