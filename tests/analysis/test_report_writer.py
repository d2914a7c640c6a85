"""Writing a report (analysis/report/writer.py): the default path, standard
output, and no partial file when writing fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from replay.analysis.report import build_report, default_report_path, write_report
from replay.base.errors import ReplayError
from tests.reports import invoke_report, report_error, results_of


def test_report_default_output_path(trace_43559: Path) -> None:
    results = results_of(trace_43559)
    res = invoke_report([results, "--format", "md"])
    expected = trace_43559.with_name("t43559.report.md")
    assert (res.exit_code, res.output) == (0, f"wrote {expected}\n")
    assert expected.is_file()


def test_default_report_path() -> None:
    assert default_report_path("d/run.results.parquet", "html") == Path("d/run.report.html")
    assert default_report_path("d/run.parquet", "md") == Path("d/run.report.md")


def test_dash_writes_the_page_to_standard_output(trace_43559: Path) -> None:
    res = invoke_report([results_of(trace_43559), "-o", "-", "--format", "md"])
    assert res.exit_code == 0
    assert res.output.splitlines()[0] == "## Replay report: t43559.parquet"


def test_unknown_format(tmp_path: Path, trace_43559: Path) -> None:
    data = build_report(results_of(trace_43559))
    with pytest.raises(
        ReplayError, match=r"^unknown report format 'pdf', expected one of html, md$"
    ):
        write_report(data, tmp_path / "r.pdf", "pdf")
    assert not (tmp_path / "r.pdf").exists()


def test_bad_output_is_directory(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559)
    assert report_error([results, "-o", tmp_path]) == (
        f"error: {tmp_path}: is a directory, expected a file path to write"
    )


def test_no_partial_file_when_writing_fails(
    tmp_path: Path, trace_43559: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = results_of(trace_43559)
    out = tmp_path / "out"
    out.mkdir()
    real_write = Path.write_text

    def half_then_fail(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        real_write(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    assert report_error([results, "-o", out / "r.html"]) == (
        f"error: {out / 'r.html'}: cannot write here (No space left on device)"
    )
    assert list(out.iterdir()) == []
