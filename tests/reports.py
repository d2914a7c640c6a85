"""Shared by the report tests: results of a trace, the ``replay report``
command, and the marks of each chart in a page."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from click.testing import CliRunner, Result

from replay.cli.analysis import report
from replay.format.link import save_results
from tests.builders import replay_trace

#: The Mamba row of the #43559 lookup's explain table.
MAMBA_ROW = (
    "1: mamba block=16 (mamba)             4       1  ...#                          state at 64"
)


def invoke_report(args: Sequence[object]) -> Result:
    return CliRunner().invoke(report, [str(a) for a in args], catch_exceptions=False)


def report_error(args: Sequence[object]) -> str:
    """The one line ``replay report`` prints when it exits 2."""
    res = invoke_report(args)
    assert (res.exit_code, res.output.count("\n")) == (2, 1), res.output
    return res.output.removesuffix("\n")


def results_of(trace: Path, policy: str = "pre-49502", out: Path | None = None) -> Path:
    """Replay ``trace`` and save its results next to it (or at ``out``)."""
    out = out or trace.with_name(trace.name.removesuffix(".parquet") + ".results.parquet")
    save_results(replay_trace(trace, policy=policy), out)
    return out


def marks(page: str) -> dict[str, int]:
    """Marks (points, bars) per chart, by the chart's data-chart name."""
    out = {}
    for m in re.finditer(
        r'<svg [^>]*class="chart marks" data-chart="([a-z]+)".*?</svg>', page, re.S
    ):
        items = r'role="graphics-symbol" aria-roledescription="(?:bar|point)"'
        out[m.group(1)] = len(re.findall(items, m.group(0)))
    return out


def unlink_results(results: Path) -> None:
    """Rewrite ``results`` without the link to their trace (``trace_path``,
    ``trace_abspath``, ``trace_fingerprint``), as a version before results led
    back wrote them."""
    import json

    import pyarrow.parquet as pq

    table = pq.read_table(results)
    meta = dict(table.schema.metadata)
    info = json.loads(meta[b"replay.results"])
    del info["trace_path"], info["trace_abspath"], info["trace_fingerprint"]
    meta[b"replay.results"] = json.dumps(info).encode()
    pq.write_table(table.replace_schema_metadata(meta), results)
