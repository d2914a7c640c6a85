"""How the report writes a number, a share and a clock time: one spelling
for the cards, the tables, the chart labels and the Markdown."""

from __future__ import annotations

from datetime import UTC, datetime

from replay.tools.render import percent


def num(v: float) -> str:
    """Thousands separators; no decimals on a whole number, at most two otherwise."""
    if float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:,.2f}".rstrip("0").rstrip(".")


def pct(v: float) -> str:
    """A ratio as a percentage, as the command line prints it."""
    return percent(v)


def fmt_time(us: float, span_us: float) -> str:
    """An epoch-µs time in UTC, as precise as a span of ``span_us`` needs."""
    t = datetime.fromtimestamp(us / 1e6, tz=UTC)
    if span_us < 10e6:
        return t.strftime("%H:%M:%S.%f")[:-3]
    if span_us < 86_400e6:
        return t.strftime("%H:%M:%S")
    return t.strftime("%Y-%m-%d %H:%M")
