"""How the report writes a number, a share and a clock time: one spelling
for the cards, the tables, the chart labels and the Markdown."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from replay.tools.render import elapsed, percent

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def num(v: float) -> str:
    """Thousands separators; no decimals on a whole number, at most two otherwise."""
    if float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:,.2f}".rstrip("0").rstrip(".")


def pct(v: float) -> str:
    """A ratio as a percentage, as the command line prints it."""
    return percent(v)


#: Timestamps before this (epoch µs) belong to a trace whose clock starts at
#: zero (the public Mooncake and bailian traces): elapsed time, not dates.
RELATIVE_BEFORE_US = 365 * 86_400e6


def is_relative(us: float) -> bool:
    return us < RELATIVE_BEFORE_US


def utc_datetime(us: float) -> datetime:
    """An epoch-µs time as a UTC datetime, exactly: a float of seconds rounds
    the last second of 9999 into the year 10000."""
    lo = (datetime.min.replace(tzinfo=UTC) - _EPOCH) // timedelta(microseconds=1)
    hi = (datetime.max.replace(tzinfo=UTC) - _EPOCH) // timedelta(microseconds=1)
    # A chart's tick may round past the last representable time: clamped.
    return _EPOCH + timedelta(microseconds=min(max(int(us), lo), hi))


def fmt_time(us: float, span_us: float) -> str:
    """An epoch-µs time in UTC, as precise as a span of ``span_us`` needs;
    in a relative trace, the elapsed time (``+00:58:57``)."""
    if is_relative(us):
        return elapsed(us / 1e6, millis=span_us < 10e6)
    t = utc_datetime(us)
    if span_us < 10e6:
        return t.strftime("%H:%M:%S.%f")[:-3]
    if span_us < 86_400e6:
        return t.strftime("%H:%M:%S")
    return t.strftime("%Y-%m-%d %H:%M")
