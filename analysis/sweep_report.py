"""The report of a what-if sweep (``replay whatif``): hit ratio against
capacity, one line per eviction policy, as the same self-contained SVG as
the replay report, and the table as HTML or Markdown."""

from __future__ import annotations

import math
import os
from typing import Any

import polars as pl

from analysis.flags import FLAG_KINDS
from analysis.report import (
    _CSS,
    _GREY,
    _H,
    _W,
    _axes,
    _e,
    _md_table,
    _num,
    _pct,
    _svg_open,
    nice_ticks,
)
from replay.errors import ReplayError
from replay.paths import OutputTarget, check_outputs, write_text
from replay.whatif import read_sweep

#: One colour per eviction policy, lru (vLLM's own order) first.
POLICY_COLOURS = {"lru": "#2563eb", "fifo": "#d97706", "lfu": "#059669", "belady": "#7c3aed"}


def _label_blocks(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:g}M"
    if v >= 1e4:
        return f"{v / 1e3:g}k"
    return _num(v)


def sweep_svg(frame: pl.DataFrame) -> str:
    """Hit ratio against capacity (log scale when it spans 10x or more)."""
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
            f'<text x="{lx + 28}" y="16" class="tick">{_e(eviction)}</text>'
        )
        if len(pts) > 1:
            path = " ".join(f"{px(c):.1f},{py(r):.1f}" for c, r in pts)
            parts.append(
                f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>'
            )
        for c, r in pts:
            parts.append(
                f'<circle class="mark" cx="{px(c):.1f}" cy="{py(r):.1f}" r="4" fill="{colour}" '
                f'stroke="#fff" stroke-width="1.5"><title>{_e(eviction)}, {c:,} blocks: '
                f"{100 * r:.2f}%</title></circle>"
            )
    parts.append("</svg>")
    return "".join(parts)


def _table_rows(frame: pl.DataFrame) -> tuple[list[str], list[list[object]]]:
    flags = [k for k in FLAG_KINDS if k in frame.columns and frame[k].sum() > 0]
    headers = [
        "capacity (blocks)",
        "eviction",
        "hit ratio",
        "hit tokens",
        "evicted blocks",
        "not admitted",
        *flags,
    ]
    rows: list[list[object]] = []
    for r in frame.sort("capacity_blocks", maintain_order=True).iter_rows(named=True):
        rows.append(
            [
                f"{r['capacity_blocks']:,}",
                r["eviction"],
                _pct(r["hit_ratio"]),
                f"{r['hit_tokens']:,}",
                f"{r['evicted_blocks']:,}",
                f"{r['not_admitted']:,}",
                *(f"{r[k]:,}" for k in flags),
            ]
        )
    return headers, rows


def _context(meta: dict[str, Any], frame: pl.DataFrame) -> str:
    lookups = frame["lookups"][0] if frame.height else 0
    return (
        f"trace {meta.get('trace', '?')}: {lookups:,} lookups, {meta.get('cache', '?')} cache, "
        f"policy {meta.get('policy', '?')}, retention interval "
        f"{meta.get('retention_interval')}, max_num_batched_tokens "
        f"{meta.get('max_num_batched_tokens')}; one request at a time; "
        f"{frame.height} runs in {meta.get('seconds', 0):.1f} s"
    )


def render_sweep_markdown(frame: pl.DataFrame, meta: dict[str, Any]) -> str:
    headers, rows = _table_rows(frame)
    numeric = [0, 2, 3, 4, 5, *range(6, len(headers))]
    return (
        "## What-if sweep\n\n"
        + _context(meta, frame)
        + ".\n\n"
        + _md_table(headers, rows, numeric)
        + "\n"
    )


def render_sweep_html(frame: pl.DataFrame, meta: dict[str, Any]) -> str:
    headers, rows = _table_rows(frame)
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return "".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            "<title>What-if sweep</title>",
            f"<style>{_CSS}</style>",
            "</head><body><main>",
            "<h1>What-if sweep</h1>",
            f'<p class="sub">{_e(_context(meta, frame))}</p>',
            '<section id="sweep"><h2>Hit ratio against capacity</h2>',
            sweep_svg(frame),
            "</section>",
            '<section id="table"><h2>Runs</h2>',
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>",
            "</section></main></body></html>",
        ]
    )


def write_sweep_report(
    sweep: str | os.PathLike[str], out: str | os.PathLike[str], fmt: str = "html"
) -> OutputTarget:
    """Render a sweep file as ``html`` or ``md`` and write it atomically."""
    frame, meta = read_sweep(sweep)
    if frame.height == 0:
        raise ReplayError(f"{sweep}: the sweep has no runs")
    if fmt not in ("html", "md"):
        raise ReplayError(f"unknown report format {fmt!r}, expected html or md")
    check_outputs({"-o": out}, [sweep], text=True)
    text = render_sweep_html(frame, meta) if fmt == "html" else render_sweep_markdown(frame, meta)
    return write_text(out, text, what="report")
