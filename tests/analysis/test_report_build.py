"""``build_report`` (analysis/report/build.py) over the results file and its
trace (analysis/report/inputs.py): which trace is used, each file read
once, and the one-line errors for files that do not fit."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

from replay.analysis.report import build_report
from replay.analysis.report.build import explain_examples
from replay.base.errors import ReplayError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.format.trace import TraceReader
from replay.format.tracedir import open_trace
from replay.format.writer import write_trace
from tests.analysis.test_diff import write_workload
from tests.builders import issue_43559_rows
from tests.reports import MAMBA_ROW, report_error, results_of, unlink_results


def _results_copied(tmp_path: Path, trace: Path) -> Path:
    """The results of ``trace`` copied alone into another directory."""
    dest = tmp_path / "copy"
    dest.mkdir()
    return Path(shutil.copy(results_of(trace), dest / "x.results.parquet"))


def test_report_workload_with_timestamps(tmp_path: Path) -> None:
    trace = write_workload(tmp_path / "work.parquet")
    data = build_report(results_of(trace))
    assert data.x_axis == "time"
    assert len(data.timeline) == 40
    assert sum(p.lookups for p in data.timeline) == 60
    assert [(b.lo, b.lookups) for b in data.histogram] == [
        (0, 4),
        (16, 0),
        (32, 13),
        (48, 10),
        (64, 20),
        (80, 13),
    ]
    assert [(g["loaded_blocks"], g["tokens_saved"]) for g in data.groups] == [
        (145, 2320),
        (56, 896),
    ]
    assert [(r["flag"], r["lookups"]) for r in data.flag_rows] == [
        ("mamba_overrun", 56),
        ("eagle_not_dropped", 56),
    ]
    assert data.summary["flagged_lookups"] == 56
    assert [e.request_id for e in data.examples["mamba_overrun"]] == [
        "req-001",
        "req-002",
        "req-003",
    ]
    # The trace named in the results' metadata, found beside them.
    assert data.trace_path == str(trace)
    assert data.trace_note is None
    assert all(e.explain for exs in data.examples.values() for e in exs)


def test_report_workload_without_timestamps(tmp_path: Path) -> None:
    trace = write_workload(tmp_path / "work.parquet", timestamps=False)
    data = build_report(results_of(trace))
    assert data.x_axis == "seq-no-ts"
    assert len(data.timeline) == 40


def test_explain_tables_of_the_43559_example(trace_43559: Path) -> None:
    data = build_report(results_of(trace_43559))
    (example,) = data.examples["mamba_overrun"]
    assert (example.seq, example.request_id, example.hit_tokens, example.group_id) == (
        2,
        "req-43559",
        64,
        1,
    )
    assert example.explain is not None
    lines = example.explain.splitlines()
    assert lines[0] == (
        "request req-43559 (seq 2): max_length 64, 4 hashes of 16 tokens, "
        "policy pre-49502 (here vllm-0.26), cache mooncake"
    )
    assert "hit: 64 tokens (attention-verified 48)" in lines
    assert lines[-1] == MAMBA_ROW
    # The same lookup under its second flag carries the same table.
    assert data.examples["eagle_not_dropped"][0].explain == example.explain
    assert (data.cache, data.alignment, data.explain_note) == ("mooncake", 16, None)


def test_a_trace_where_the_results_lead_that_changed_is_refused(
    tmp_path: Path, trace_43559: Path
) -> None:
    """The results lead to ``t43559.parquet`` beside them; another trace of
    that name there has another fingerprint: one line, no report."""
    copy = _results_copied(tmp_path, trace_43559)
    other = write_workload(copy.with_name(trace_43559.name), n_requests=3)
    with pytest.raises(ReplayError) as err:
        build_report(copy)
    assert str(err.value).startswith(
        f"{copy}: its trace {other} has changed since these results were made (fingerprint "
    )
    assert str(err.value).endswith(f"replay it again (replay run {other}) or give the trace itself")


def test_an_unlinked_trace_found_by_name_that_is_another_trace_is_a_note(
    tmp_path: Path, trace_43559: Path
) -> None:
    """Results that do not record their trace (made before they led back):
    a trace of that name beside them is checked by its lookups."""
    copy = _results_copied(tmp_path, trace_43559)
    unlink_results(copy)
    other = write_workload(copy.with_name(trace_43559.name), n_requests=3)
    data = build_report(copy)
    assert data.trace_path is None
    assert data.trace_note == (
        f"trace {other} has no lookup 'req-43559' at seq 2: it is not the trace of these "
        "results; pass --trace"
    )
    assert data.examples["mamba_overrun"][0].explain is None


def test_unknown_policy_has_no_explain_tables(trace_43559: Path) -> None:
    data = build_report(results_of(trace_43559), examples=1)
    data.info["policy"] = "vllm-9.99"
    explain_examples(data, open_trace(trace_43559))
    assert data.explain_note is not None
    assert data.explain_note.startswith(
        "policy 'vllm-9.99' of these results is unknown to this version (known: "
    )


def test_results_copied_with_trace_elsewhere_resolves_by_name(
    tmp_path: Path, trace_43559: Path
) -> None:
    copy = _results_copied(tmp_path, trace_43559)
    shutil.copy(trace_43559, copy.with_name(trace_43559.name))
    data = build_report(copy)
    assert data.trace_path == str(copy.with_name("t43559.parquet"))
    assert data.trace_note is None


# ---------------------------------------------------------------- bad input


def test_bad_trace_given_as_results(tmp_path: Path, trace_43559: Path) -> None:
    out = tmp_path / "r.html"
    assert report_error([trace_43559, "-o", out]) == (
        f"error: {trace_43559}: is not a results file (no 'replay.results' metadata), "
        f"expected the output of `replay run` (for a trace, run `replay run {trace_43559}` "
        "first)"
    )
    assert not out.exists()


def test_bad_missing_results(tmp_path: Path) -> None:
    p = tmp_path / "nope.parquet"
    assert report_error([p]) == f"error: {p}: no such file"


def test_bad_explicit_trace_missing(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559)
    out = tmp_path / "r.html"
    missing = tmp_path / "missing.parquet"
    assert (
        report_error([results, "-o", out, "--trace", missing]) == f"error: {missing}: no such file"
    )
    assert not out.exists()


def test_bad_explicit_trace_other_config(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559)
    other = TraceConfig(
        groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),),
        hash_block_size=16,
        scheduler_block_size=16,
    )
    other_trace = tmp_path / "other.parquet"
    write_trace(other_trace, other, [{**issue_43559_rows()[0]}, issue_43559_rows()[2]])
    msg = report_error([results, "-o", tmp_path / "r.html", "--trace", other_trace])
    assert msg.startswith(f"error: {other_trace}: KV-cache config ")
    assert msg.endswith("expected the trace of these results")
    assert not (tmp_path / "r.html").exists()


def test_bad_explicit_trace_other_lookups(tmp_path: Path, trace_43559: Path) -> None:
    results = results_of(trace_43559)
    work = write_workload(tmp_path / "work.parquet", n_requests=3)
    assert report_error([results, "-o", tmp_path / "r.html", "--trace", work]) == (
        f"error: trace {work} has no lookup 'req-43559' at seq 2: it is not the trace of "
        "these results"
    )


def test_report_reads_a_trace_handed_over_open(tmp_path: Path, trace_43559: Path) -> None:
    """The trace is opened once and passed down: an open reader (here of the
    trace's bytes, which no path can reopen) gives the report the path gives."""
    results = results_of(trace_43559)
    by_path = build_report(results, trace=trace_43559)
    by_reader = build_report(results, trace=TraceReader(io.BytesIO(trace_43559.read_bytes())))
    assert by_reader.trace_path == "<stream>"
    assert by_path.trace_path == str(trace_43559)
    (example,) = by_reader.examples["mamba_overrun"]
    assert (example.seq, example.request_id, example.actual, example.expected) == (
        2,
        "req-43559",
        64,
        48,
    )
    assert example.explain == by_path.examples["mamba_overrun"][0].explain
    assert example.explain is not None and MAMBA_ROW in example.explain
