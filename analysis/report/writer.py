"""Writing a report: where it goes by default, and the atomic write (no
partial file on any error); ``-`` is standard output, ``/dev/null`` nowhere."""

from __future__ import annotations

import os
from pathlib import Path

from replay.analysis.report.data import ReportData
from replay.analysis.report.html import render_html, render_sweep_html
from replay.analysis.report.markdown import render_markdown, render_sweep_markdown
from replay.base.errors import ReplayError
from replay.format.paths import OutputTarget, check_outputs, write_text
from replay.format.sweepfile import read_sweep

FORMATS = ("html", "md")


def default_report_path(results: str | os.PathLike[str], fmt: str) -> Path:
    p = Path(results)
    name = p.name.removesuffix(".parquet").removesuffix(".results")
    return p.with_name(f"{name}.report.{fmt}")


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ReplayError(f"unknown report format {fmt!r}, expected one of {', '.join(FORMATS)}")


def write_report(data: ReportData, out: str | os.PathLike[str], fmt: str = "html") -> OutputTarget:
    """Render ``data`` as ``html`` or ``md`` and write it atomically."""
    _check_format(fmt)
    text = render_html(data) if fmt == "html" else render_markdown(data)
    return write_text(out, text, what="a report")


def write_sweep_report(
    sweep: str | os.PathLike[str], out: str | os.PathLike[str], fmt: str = "html"
) -> OutputTarget:
    """Render a sweep file as ``html`` or ``md`` and write it atomically."""
    frame, meta = read_sweep(sweep)
    if frame.height == 0:
        raise ReplayError(f"{sweep}: the sweep has no runs")
    _check_format(fmt)
    check_outputs({"-o": out}, [sweep], text=True)
    text = render_sweep_html(frame, meta) if fmt == "html" else render_sweep_markdown(frame, meta)
    return write_text(out, text, what="report")
