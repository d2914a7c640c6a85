"""Vega-Lite specs (built with Altair) rendered to inline SVG offline by
vl-convert: the one place the report's charts become markup.

The SVG is marked safe on purpose so the templates embed it as is; Vega's
SVG renderer escapes every text and attribute it writes (titles, labels,
``description``), so a group name or request id from a trace stays text.
Each chart's root ``<svg>`` carries ``class="chart"`` and ``data-chart``;
its marks are the ``role="graphics-symbol"`` items of a ``role-mark`` group,
which the page's script counts (marks drawn with ``aria=False`` are not).

Hover text works offline, with no script: each mark item's description
(its ``aria-label``: the chart's ``description`` encoding, which
:func:`tooltip` builds from tooltip fields) is also its ``<title>`` child,
which a browser shows on hover. Marks without a tooltip of their own
(rules, labels, the line under a line's points) are drawn ``aria=False``."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from typing import Any

from markupsafe import Markup, escape

#: One mark item of Vega's SVG: a leaf element with a description. Path
#: marks drawn for a whole series (``line mark``, ``area mark``) are left
#: out: their description is only their first datum's.
_MARK_ITEM = re.compile(
    r'<(path|line|rect|circle)( aria-label="([^"]*)" role="graphics-symbol" '
    r'aria-roledescription="(?![^"]* mark")[^"]*"[^>]*?)/>'
)


def data(values: list[dict[str, Any]]) -> Any:
    """Inline data for an Altair chart (no file, no URL)."""
    import altair as alt

    return alt.Data(values=values)  # type: ignore[no-untyped-call]


def render_svg(spec: dict[str, Any], *, name: str, label: str, element_id: str = "") -> Markup:
    """The spec as one inline ``<svg class="chart" data-chart=NAME>``."""
    import vl_convert

    svg = vl_convert.vegalite_to_svg(json.dumps(spec))
    svg = _MARK_ITEM.sub(_with_title, svg)
    head = (
        f' class="chart marks" data-chart="{escape(name)}" role="img" aria-label="{escape(label)}"'
    )
    svg = svg.replace(' class="marks"', head, 1)
    if element_id:
        svg = svg.replace("<svg ", f'<svg id="{escape(element_id)}" ', 1)
    return Markup(svg)


def _with_title(found: re.Match[str]) -> str:
    """A mark item with its description as a ``<title>`` child (the hover
    text), escaped for a text node."""
    tag, attrs, label = found.group(1), found.group(2), found.group(3)
    return f"<{tag}{attrs}><title>{escape(html.unescape(label))}</title></{tag}>"


def tooltip(chart: Any, fields: Sequence[tuple[str, str, str]]) -> Any:
    """``chart`` whose marks describe themselves as ``title: value; ...``,
    one (title, field, d3 format or "") per field: their ``aria-label`` and
    hover ``<title>``. Vega-Lite's own description of a tooltip encoding
    lists every encoded field unformatted, not the tooltip."""
    parts = []
    for title, field, fmt in fields:
        value = f"datum[{json.dumps(field)}]"
        if fmt:
            value = f"format({value}, {json.dumps(fmt)})"
        parts.append(f"{json.dumps(title + ': ')} + {value}")
    return chart.transform_calculate(tip=" + '; ' + ".join(parts)).encode(description="tip:N")
