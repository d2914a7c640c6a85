"""Results lead back to their trace: the path relative to the results file
and the trace's fingerprint in the metadata; explain, minimize (and report,
diff: their own tests) follow a results file there and refuse a changed
trace with one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq

from replay.format.link import fingerprint
from replay.format.writer import write_trace
from tests.builders import full_mamba, issue_43559_rows
from tests.conftest import run_cli
from tests.reports import unlink_results


def _layout(tmp_path: Path) -> tuple[Path, Path]:
    """traces/t.parquet and out/t.results.parquet, replayed under pre-49502."""
    (tmp_path / "traces").mkdir()
    (tmp_path / "out").mkdir()
    trace = write_trace(tmp_path / "traces" / "t.parquet", full_mamba(), issue_43559_rows())
    results = tmp_path / "out" / "t.results.parquet"
    assert run_cli(["run", trace, "--policy", "pre-49502", "-o", results, "-q"]).exit_code == 0
    return trace, results


def test_results_record_the_trace_relative_to_themselves(tmp_path: Path) -> None:
    trace, results = _layout(tmp_path)
    info = json.loads(pq.read_schema(results).metadata[b"replay.results"])
    assert (info["trace"], info["trace_path"]) == ("t.parquet", "../traces/t.parquet")
    assert info["trace_abspath"] == str(trace.resolve())
    assert info["trace_fingerprint"] == fingerprint(trace)
    assert info["trace_fingerprint"].startswith("sha256:") and len(info["trace_fingerprint"]) == 71
    # The fingerprint follows the events, not the file's name or place.
    copy = Path(shutil.copy(trace, tmp_path / "copy.parquet"))
    assert fingerprint(copy) == fingerprint(trace)
    write_trace(copy, full_mamba(), issue_43559_rows()[:2])
    assert fingerprint(copy) != fingerprint(trace)


def test_explain_and_minimize_follow_results_to_their_trace(tmp_path: Path) -> None:
    trace, results = _layout(tmp_path)
    # The folder moves as a whole: the link is relative.
    moved = tmp_path.parent / f"{tmp_path.name}-moved"
    shutil.copytree(tmp_path, moved)
    results = moved / "out" / "t.results.parquet"
    trace = moved / "traces" / "t.parquet"
    by_results = run_cli(["explain", results, "--request", "req-43559"])
    by_trace = run_cli(["explain", trace, "--request", "req-43559", "--policy", "pre-49502"])
    assert by_results.exit_code == 0
    # Under the results' own policy (pre-49502), not the default.
    assert by_results.stdout == by_trace.stdout
    assert by_results.stdout.splitlines()[0] == (
        "request req-43559 (seq 2): max_length 64, 4 hashes of 16 tokens, "
        "policy pre-49502 (here vllm-0.26), cache mooncake"
    )
    small = moved / "small.parquet"
    shrunk = run_cli(["minimize", results, "--request", "req-43559", "-o", small])
    assert shrunk.stdout.splitlines()[:1] == [f"{trace}: 3 events -> {small}: 3 events"]


def test_a_changed_trace_is_refused_in_one_line(tmp_path: Path) -> None:
    trace, results = _layout(tmp_path)
    write_trace(trace, full_mamba(), issue_43559_rows()[:2] + issue_43559_rows()[2:])
    assert fingerprint(trace) == json.loads(pq.read_schema(results).metadata[b"replay.results"])["trace_fingerprint"]  # fmt: skip
    write_trace(trace, full_mamba(), [*issue_43559_rows(), issue_43559_rows()[0]])
    result = run_cli(["explain", results, "--request", "req-43559"])
    assert (result.exit_code, result.stdout) == (2, "")
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        f"error: {results}: its trace {trace} has changed since these results were made "
        "(fingerprint sha256:"
    )
    assert line.endswith(f"replay it again (replay run {trace}) or give the trace itself")


def test_results_without_a_link_say_what_to_give(tmp_path: Path) -> None:
    trace, results = _layout(tmp_path)
    unlink_results(results)
    result = run_cli(["explain", results, "--request", "req-43559"])
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {results}: these results do not record where their trace is (made before "
        "results led back to traces); give the trace (t.parquet)\n",
    )
    trace.unlink()
    gone = run_cli(["explain", _layout_again(tmp_path, results), "--request", "req-43559"])
    assert gone.exit_code == 2
    assert gone.stderr.startswith(f"error: {results}: its trace ")
    assert "is not there (the results record it as '../traces/t.parquet'" in gone.stderr


def _layout_again(tmp_path: Path, results: Path) -> Path:
    """Results written again (with their link), then their trace removed."""
    trace = write_trace(tmp_path / "traces" / "t.parquet", full_mamba(), issue_43559_rows())
    assert run_cli(["run", trace, "--policy", "pre-49502", "-o", results, "-q"]).exit_code == 0
    trace.unlink()
    return results


def test_results_copied_alone_elsewhere_follow_the_absolute_path(tmp_path: Path) -> None:
    _, results = _layout(tmp_path)
    deeper = tmp_path / "a" / "b"
    deeper.mkdir(parents=True)
    copy = Path(shutil.copy(results, deeper / "t.results.parquet"))
    result = run_cli(["explain", copy, "--request", "req-43559"])
    assert result.exit_code == 0, result.stderr
    assert "policy pre-49502" in result.stdout.splitlines()[0]
