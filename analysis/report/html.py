"""The report as one self-contained HTML page, rendered by Jinja2 with
autoescaping on (templates in ``templates/``): every value from the results,
the trace or its configuration is escaped by the template; the only markup
passed through is the charts' SVG (``charts``, rendered by Vega, which
escapes every text it writes).

Python decides what is shown and formats the numbers; the templates only
lay it out. A short inline script stamps each chart with its number of
marks once the page has laid out (``data-marks``, ``data-rendered`` on
``<body>``), which the browser test reads back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import polars as pl

from replay import __version__
from replay.analysis.flags import SEVERITIES
from replay.analysis.report import charts
from replay.analysis.report.data import Example, ReportData
from replay.analysis.report.fmt import num, pct
from replay.analysis.report.sweep import sweep_chart_svg, sweep_context, sweep_table
from replay.tools.render import config_lines

_BINNED_BY = {
    "time": "lookup timestamps (ts)",
    "seq": "seq (some lookups have no timestamp)",
    "seq-no-ts": "seq (the lookups have no timestamps)",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Table:
    """Cells as the page shows them; ``numeric`` columns right-aligned."""

    headers: tuple[str, ...] | None
    rows: list[list[str]]
    numeric: frozenset[int] = frozenset()


def table(
    headers: Sequence[str] | None, rows: Sequence[Sequence[object]], numeric: Sequence[int] = ()
) -> Table:
    """Ints of ``numeric`` columns get thousands separators, except a ``seq``
    column's: people copy those."""

    def cell(i: int, c: object) -> str:
        if (
            i in numeric
            and isinstance(c, int)
            and not isinstance(c, bool)
            and (headers is None or headers[i] != "seq")
        ):
            return f"{c:,}"
        return str(c)

    return Table(
        headers=tuple(headers) if headers is not None else None,
        rows=[[cell(i, c) for i, c in enumerate(r)] for r in rows],
        numeric=frozenset(numeric),
    )


@cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("replay.analysis.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["num"] = num
    env.filters["pct"] = pct
    return env


def _explains(
    exs: Sequence[Example], explained: set[int], command: Callable[[Example], str]
) -> list[dict[str, Any]]:
    """The explain tables under one flag: a lookup already explained under an
    earlier flag links back to it; only the flag's first table starts open."""
    out: list[dict[str, Any]] = []
    for e in exs:
        if not e.explain:
            continue
        above = e.seq in explained
        explained.add(e.seq)
        out.append(
            {
                "seq": e.seq,
                "request_id": e.request_id,
                "text": e.explain,
                "command": command(e),
                "above": above,
                "open": e is exs[0],
            }
        )
    return out


def _flags(data: ReportData) -> list[dict[str, Any]]:
    explained: set[int] = set()
    out = []
    for r in data.flag_rows:
        exs = data.examples.get(r["flag"], [])
        rows = [
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
            {
                **r,
                "meter": max(2, round(60 * r["share"])),
                "shown": len(exs),
                "examples": table(
                    ["request", "seq", "max_length", "hit", "group", "detail"], rows, (1, 2, 3)
                ),
                "explains": _explains(exs, explained, data.explain_command),
            }
        )
    return out


def _cards(s: dict[str, Any]) -> list[dict[str, Any]]:
    cards = [
        ("lookups", num(s["lookups"]), False),
        ("with a hit", num(s["lookups_with_hit"]), False),
        ("prompt tokens", num(s["prompt_tokens"]), False),
        ("hit tokens", num(s["hit_tokens"]), False),
        ("hit ratio", pct(s["hit_ratio"]), False),
    ]
    # One card per severity, worst first: corruption red, performance amber.
    for sev, n in s["by_severity"].items():
        if n or sev == "corruption":
            cards.append((sev, num(n), n > 0))
    if s["observed"]:
        cards.append(
            ("observed ≠ replay", f"{s['observed_mismatches']:,} / {s['observed']:,}", False)
        )
    return [
        {"key": k, "value": v, "bad": bad, "severity": k if k in SEVERITIES else None}
        for k, v, bad in cards
    ]


def _described(name: str, description: object) -> str:
    return f"{name}: {description}".rstrip(": ")


def render_html(data: ReportData) -> str:
    s, info = data.summary, data.info
    policy = info.get("policy", "?")
    coordinator = info.get("coordinator", "?")
    meta_rows = [
        ["results", data.results_path],
        ["trace", data.trace_path or f"not found ({data.trace_note})"],
        ["policy", _described(policy, info.get("policy_description", ""))],
        ["coordinator", coordinator],
        ["cache", _described(data.cache, info.get("cache_description", ""))],
        ["keys", info.get("keys", "-")],
    ]
    group_rows = [
        [g["label"], g["loaded_blocks"], g["skipped_blocks"], g["tokens_saved"]]
        for g in data.groups
    ]
    return (
        environment()
        .get_template("report.html.j2")
        .render(
            title=data.title,
            policy=policy,
            coordinator=coordinator,
            cache=data.cache,
            results_name=Path(data.results_path).name,
            cards=_cards(s),
            trace_note=data.trace_note,
            flags=_flags(data),
            flag_details=bool(data.extra.get("flag_details")),
            explain_note=data.explain_note,
            charts={
                "timeline": charts.timeline_svg(data.timeline, data.x_axis, s["hit_ratio"]),
                "histogram": charts.histogram_svg(data.histogram),
                "groups": charts.groups_svg(data.groups),
            },
            points=len(data.timeline),
            binned_by=_BINNED_BY[data.x_axis],
            median_hit=s["median_hit"],
            mean_hit=round(s["mean_hit"], 1),
            bar_width=data.histogram[-1].width if len(data.histogram) > 1 else data.alignment,
            alignment=data.alignment,
            group_table=table(
                ["group", "loaded blocks", "skipped blocks", "tokens loaded"],
                group_rows,
                (1, 2, 3),
            ),
            meta_table=table(None, meta_rows),
            config_text="\n".join(config_lines(data.config, data.cache)),
            version=__version__,
        )
    )


def render_sweep_html(frame: pl.DataFrame, meta: dict[str, Any]) -> str:
    headers, rows = sweep_table(frame)
    return (
        environment()
        .get_template("sweep.html.j2")
        .render(
            title="What-if sweep",
            context=sweep_context(meta, frame),
            chart=sweep_chart_svg(frame, meta),
            runs=table(headers, rows),
        )
    )
