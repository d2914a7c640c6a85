"""Vega-Lite specs (built with Altair) rendered to inline SVG offline by
vl-convert: the one place the report's charts become markup.

The SVG is marked safe on purpose so the templates embed it as is; Vega's
SVG renderer escapes every text and attribute it writes (titles, labels,
``description``), so a group name or request id from a trace stays text.
Each chart's root ``<svg>`` carries ``class="chart"`` and ``data-chart``;
its marks are the ``role="graphics-symbol"`` items of a ``role-mark`` group,
which the page's script counts (marks drawn with ``aria=False`` are not)."""

from __future__ import annotations

import json
from typing import Any

from markupsafe import Markup, escape


def data(values: list[dict[str, Any]]) -> Any:
    """Inline data for an Altair chart (no file, no URL)."""
    import altair as alt

    return alt.Data(values=values)  # type: ignore[no-untyped-call]


def render_svg(spec: dict[str, Any], *, name: str, label: str, element_id: str = "") -> Markup:
    """The spec as one inline ``<svg class="chart" data-chart=NAME>``."""
    import vl_convert

    svg = vl_convert.vegalite_to_svg(json.dumps(spec))
    head = (
        f' class="chart marks" data-chart="{escape(name)}" role="img" aria-label="{escape(label)}"'
    )
    svg = svg.replace(' class="marks"', head, 1)
    if element_id:
        svg = svg.replace("<svg ", f'<svg id="{escape(element_id)}" ', 1)
    return Markup(svg)
