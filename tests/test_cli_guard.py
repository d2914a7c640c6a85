"""`replay test` as a user meets it (the reference coordinator; the vLLM
route is tests/test_guard_vllm.py): the shipped corpus passes, a broken
expectation fails with what moved and the explain table of the first
lookup that differs, bad input is one line and exit 2."""

from __future__ import annotations

import shutil
from pathlib import Path

from replay.analysis.expectations import corpus_dir, read_expectations
from replay.format.writer import write_trace
from replay.rules.coordinator import POLICIES
from tests.builders import chain, full_mamba, issue_43559_rows
from tests.conftest import run_cli

TRACES = Path(__file__).resolve().parents[1] / "traces"


def test_no_path_runs_the_shipped_corpus() -> None:
    shipped = sorted(corpus_dir().glob("*.parquet"))
    assert [p.name for p in shipped] == sorted(p.name for p in TRACES.glob("*.parquet"))
    entries = sum(len(read_expectations(p) or []) for p in shipped)
    result = run_cli(["test"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1].startswith(
        f"{entries} passed, 0 failed, 0 skipped: {entries} expectations of {len(shipped)} "
        "traces through the reference coordinator in "
    )
    progress = result.stderr.splitlines()
    assert len(progress) == len(shipped)
    assert progress[0].startswith(f"[1/{len(shipped)}] {shipped[0].name}: vllm-0.33/")


def test_cache_option_checks_only_that_cache(tmp_path: Path) -> None:
    shutil.copy(TRACES / "issue-43559.parquet", tmp_path)
    result = run_cli(["test", str(tmp_path), "--cache", "gpu"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("3 passed, 0 failed, 0 skipped: 3 expectations of 1 traces")
    assert result.stderr == (
        "[1/1] issue-43559.parquet: vllm-0.33/gpu ok, pre-32802/gpu ok, pre-49502/gpu ok"
        + result.stderr.split("pre-49502/gpu ok")[1]
    )


def test_a_failing_expectation_says_what_moved_and_explains_the_first_lookup(
    tmp_path: Path,
) -> None:
    hs = chain(4, "guard")
    rows = [
        *issue_43559_rows("first"),
        {"kind": "store", "group_id": 0, "block_hashes": hs},
        {"kind": "store", "group_id": 1, "block_hashes": hs},
        {"kind": "lookup", "request_id": "second", "block_hashes": hs, "max_length": 64},
    ]
    expect = [
        {"policy": "vllm-0.33", "cache": "gpu", "hits": {"first": 48, "second": 64}},
        {"policy": "vllm-0.33", "cache": "mooncake", "hits": {"first": 48, "second": 48}},
    ]
    path = write_trace(tmp_path / "t.parquet", full_mamba(), rows, expect={"expect": expect})
    result = run_cli(["test", str(path)])
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert lines[:4] == [
        "FAILED t.parquet under policy vllm-0.33 in the gpu cache:",
        "  request second: expected hit 64, replayed 48",
        "",
        "replay explain t.parquet --request second --policy vllm-0.33 --cache gpu:",
    ]
    assert "hit: 48 tokens (attention-verified 48)" in result.stdout
    assert lines[-1].startswith("1 passed, 1 failed, 0 skipped: 2 expectations of 1 traces")
    assert result.stderr.startswith("[1/1] t.parquet: vllm-0.33/gpu FAILED, vllm-0.33/mooncake ok")


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    plain = write_trace(tmp_path / "plain.parquet", full_mamba(), issue_43559_rows())
    unknown = write_trace(
        tmp_path / "unknown.parquet",
        full_mamba(),
        issue_43559_rows(),
        expect={"expect": [{"policy": "vllm-9.9", "flags": {}}]},
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        str(
            tmp_path / "missing.parquet"
        ): f"error: {tmp_path / 'missing.parquet'}: no such file or directory",
        str(
            plain
        ): f"error: {plain}: not a trace with expectations (no replay.expect metadata entry)",
        str(
            unknown
        ): f"error: {unknown}: replay.expect names policy 'vllm-9.9'; known: {', '.join(POLICIES)}",
        str(empty): f"error: {empty}: no trace with a replay.expect entry in this directory",
    }
    for arg, message in cases.items():
        result = run_cli(["test", arg])
        assert result.exit_code == 2, (arg, result.output)
        assert result.stderr.splitlines()[-1] == message
        assert result.stdout == ""
