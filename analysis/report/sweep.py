"""What the report of a what-if sweep (``replay whatif``) shows besides its
chart: one table row per run and the line that says what was swept."""

from __future__ import annotations

from typing import Any

import polars as pl
from markupsafe import Markup

from replay.analysis.flags import FLAG_KINDS
from replay.analysis.report.fmt import pct
from replay.analysis.report.vega import data as inline_data
from replay.analysis.report.vega import render_svg, tooltip


def sweep_table(frame: pl.DataFrame) -> tuple[list[str], list[list[str]]]:
    """Headers and rows by capacity; a flag column only for a flag that occurs."""
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
    rows: list[list[str]] = []
    for r in frame.sort("capacity_blocks", maintain_order=True).iter_rows(named=True):
        rows.append(
            [
                f"{r['capacity_blocks']:,}",
                r["eviction"],
                pct(r["hit_ratio"]),
                f"{r['hit_tokens']:,}",
                f"{r['evicted_blocks']:,}",
                f"{r['not_admitted']:,}",
                *(f"{r[k]:,}" for k in flags),
            ]
        )
    return headers, rows


def sweep_context(meta: dict[str, Any], frame: pl.DataFrame) -> str:
    lookups = frame["lookups"][0] if frame.height else 0
    return (
        f"trace {meta.get('trace', '?')}: {lookups:,} lookups, {meta.get('cache', '?')} cache, "
        f"policy {meta.get('policy', '?')}, retention interval "
        f"{meta.get('retention_interval')}, max_num_batched_tokens "
        f"{meta.get('max_num_batched_tokens')}; one request at a time; "
        f"{frame.height} runs in {meta.get('seconds', 0):.1f} s"
    )


# ---------------------------------------------------------------- the chart

#: One colour per eviction, lru (vLLM's own order) first.
EVICTION_COLOURS = {"lru": "#1f77b4", "fifo": "#ff7f0e", "lfu": "#2ca02c", "belady": "#9467bd"}


def _axis(meta: dict[str, Any]) -> tuple[str, str, float]:
    """The x field, its title and the factor from blocks: the unit the
    capacities were given in."""
    unit = meta.get("capacity_unit") or "blocks"
    if unit == "bytes" and meta.get("block_bytes"):
        return "capacity_gib", "capacity (GiB, log scale)", meta["block_bytes"] / 2**30
    if unit == "percent" and meta.get("working_set_blocks"):
        return (
            "capacity_pct",
            "capacity (% of the working set, log scale)",
            (100 / meta["working_set_blocks"]),
        )
    return "capacity_blocks", "capacity (blocks, log scale)", 1.0


def _own_capacity(meta: dict[str, Any]) -> int | None:
    """The capacity the trace was recorded with (its ``source``), if it says."""
    source = (meta.get("trace_config") or {}).get("source") or {}
    value = source.get("capacity_blocks")
    return int(value) if isinstance(value, int) and value > 0 else None


def sweep_chart_spec(frame: pl.DataFrame, meta: dict[str, Any]) -> dict[str, Any]:
    """The Vega-Lite spec of the sweep chart: hit ratio against capacity on a
    log axis in the capacities' own unit, one line per eviction, the
    unbounded ceiling as a dashed rule, a marker at the trace's own capacity,
    and below it the per-request hit-ratio percentiles (p50, p90, p99)."""
    import altair as alt

    field, title, factor = _axis(meta)
    rows = frame.sort("capacity_blocks")

    def x_of(r: dict[str, Any]) -> float:
        if field == "capacity_gib" and r.get("capacity_bytes"):
            return float(r["capacity_bytes"]) / 2**30
        return float(r["capacity_blocks"]) * factor

    data = [
        {
            "x": x_of(r),
            "eviction": r["eviction"],
            "hit_ratio": r["hit_ratio"],
            "hit_tokens": r["hit_tokens"],
            "evicted": r["evicted_blocks"],
            "capacity_blocks": r["capacity_blocks"],
            **{p: r.get(p) for p in ("hit_ratio_p50", "hit_ratio_p90", "hit_ratio_p99")},
        }
        for r in rows.iter_rows(named=True)
    ]
    evictions = list(dict.fromkeys(r["eviction"] for r in data))
    colour = alt.Color(
        "eviction:N",
        scale=alt.Scale(
            domain=evictions, range=[EVICTION_COLOURS.get(e, "#7f7f7f") for e in evictions]
        ),
        legend=alt.Legend(title="eviction", orient="bottom"),
    )
    x = alt.X("x:Q", scale=alt.Scale(type="log"), title=title)
    base = alt.Chart(inline_data(data))
    ratio = alt.Y("hit_ratio:Q", title="hit ratio", axis=alt.Axis(format="%"))
    run = [
        ("eviction", "eviction", ""),
        ("blocks", "capacity_blocks", ","),
        ("hit ratio", "hit_ratio", ".2%"),
        ("hit tokens", "hit_tokens", ","),
        ("evicted blocks", "evicted", ","),
    ]
    layers: list[Any] = [
        base.mark_line(aria=False).encode(x=x, y=ratio, color=colour),
        tooltip(base.mark_point(filled=True, opacity=1), run).encode(x=x, y=ratio, color=colour),
    ]
    ceiling = meta.get("ceiling")
    if ceiling:
        rule = alt.Chart(inline_data([{"y": ceiling["hit_ratio"], "label": "unbounded ceiling"}]))
        layers.append(rule.mark_rule(strokeDash=[6, 4], color="#444", aria=False).encode(y="y:Q"))
        layers.append(
            rule.mark_text(align="left", dx=4, dy=-6, color="#444", aria=False).encode(
                y="y:Q", text="label:N", x=alt.value(4)
            )
        )
    own = _own_capacity(meta)
    if own is not None:
        mark = alt.Chart(inline_data([{"x": own * factor, "label": "trace's capacity"}]))
        layers.append(mark.mark_rule(color="#d62728", aria=False).encode(x="x:Q"))
        layers.append(
            mark.mark_text(align="left", dx=4, y=8, color="#d62728", aria=False).encode(
                x="x:Q", text="label:N"
            )
        )
    top = alt.layer(*layers).properties(
        width=640, height=300, title="Hit ratio against cache capacity"
    )
    folded = (
        base.transform_fold(
            ["hit_ratio_p50", "hit_ratio_p90", "hit_ratio_p99"], as_=["percentile", "value"]
        )
        .transform_calculate(percentile="replace(datum.percentile, 'hit_ratio_', '')")
        .encode(
            x=x,
            y=alt.Y("value:Q", title="per-request hit ratio", axis=alt.Axis(format="%")),
            color=colour,
        )
    )
    share = [
        ("eviction", "eviction", ""),
        ("percentile", "percentile", ""),
        ("hit ratio", "value", ".2%"),
    ]
    percentiles = alt.layer(
        folded.mark_line(aria=False).encode(
            strokeDash=alt.StrokeDash("percentile:N", legend=alt.Legend(orient="bottom"))
        ),
        tooltip(folded.mark_point(filled=True, opacity=1), share),
    ).properties(width=640, height=200, title="Per-request hit ratio: p50, p90, p99")
    chart = alt.vconcat(top, percentiles).resolve_scale(color="shared")
    spec: dict[str, Any] = chart.to_dict()
    return spec


def sweep_chart_svg(frame: pl.DataFrame, meta: dict[str, Any]) -> Markup:
    """The sweep chart as inline SVG, rendered offline by vl-convert."""
    return render_svg(
        sweep_chart_spec(frame, meta),
        name="sweep",
        label="Hit ratio against cache capacity",
        element_id="sweep-chart",
    )
