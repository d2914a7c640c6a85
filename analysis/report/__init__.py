"""A results file as one self-contained report: HTML (inline SVG charts, no
network) for a reviewer, or Markdown to paste into a pull request; and the
report of a what-if sweep.

One job per module:

- ``data``: the figures, from a results frame alone (no I/O);
- ``inputs``: the results file and its trace, each opened once and checked
  against each other;
- ``build``: ``build_report``, the figures plus the examples' explain tables;
- ``fmt``: how numbers, shares and clock times are spelled;
- ``charts``: the SVG charts;
- ``html``: the page, rendered by Jinja2 with autoescaping (``templates/``);
- ``markdown``: the Markdown;
- ``sweep``: the rows and context line of a sweep report;
- ``writer``: default paths and atomic writing.
"""

from replay.analysis.report.build import build_report
from replay.analysis.report.data import Bin, Example, Point, ReportData
from replay.analysis.report.html import render_html, render_sweep_html
from replay.analysis.report.markdown import render_markdown, render_sweep_markdown
from replay.analysis.report.writer import (
    FORMATS,
    default_report_path,
    write_report,
    write_sweep_report,
)

__all__ = [
    "FORMATS",
    "Bin",
    "Example",
    "Point",
    "ReportData",
    "build_report",
    "default_report_path",
    "render_html",
    "render_markdown",
    "render_sweep_html",
    "render_sweep_markdown",
    "write_report",
    "write_sweep_report",
]
