"""`replay test` as a user meets it (the reference coordinator; the vLLM
route is tests/vllm/test_guard_vllm.py): the shipped corpus passes, a broken
expectation fails with what moved and the explain table of the first
lookup that differs, bad input is one line and exit 2."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from replay.analysis.expectations import corpus_dir, read_expectations
from replay.format.writer import write_trace
from replay.rules.coordinator import POLICIES
from tests.builders import chain, full_mamba, issue_43559_rows, vllm_metadata
from tests.conftest import run_cli

TRACES = Path(__file__).resolve().parents[2] / "traces"


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
    assert result.stdout.startswith("4 passed, 0 failed, 0 skipped: 4 expectations of 1 trace")
    assert result.stderr == (
        "[1/1] issue-43559.parquet: vllm-0.33/gpu ok, pre-32802/gpu ok, pre-49502/gpu ok, "
        "vllm-0.34/gpu ok" + result.stderr.split("vllm-0.34/gpu ok")[1]
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
    assert lines[:5] == [
        "1 lookup in 1 trace differ under policy vllm-0.33 in the gpu cache",
        "FAILED t.parquet under policy vllm-0.33 in the gpu cache:",
        "  request second: expected hit 64, replayed 48",
        "",
        f"replay explain {path} --request second --policy vllm-0.33 --cache gpu:",
    ]
    assert "hit: 48 tokens (attention-verified 48)" in result.stdout
    assert lines[-1].startswith("1 passed, 1 failed, 0 skipped: 2 expectations of 1 trace")
    assert result.stderr.startswith("[1/1] t.parquet: vllm-0.33/gpu FAILED, vllm-0.33/mooncake ok")


def _failing(path: Path, requests: int, extra_stores: int = 0) -> Path:
    """A full + Mamba trace whose ``requests`` lookups are each pinned one
    block too high in the gpu cache (``extra_stores`` unrelated events make
    it bigger)."""
    hs = chain(4, path.stem)
    rows: list[dict[str, object]] = [
        {"kind": "store", "group_id": 0, "block_hashes": chain(2, f"{path.stem}-{i}")}
        for i in range(extra_stores)
    ]
    rows += [
        {"kind": "store", "group_id": 0, "block_hashes": hs},
        {"kind": "store", "group_id": 1, "block_hashes": hs},
        *(
            {"kind": "lookup", "request_id": f"r{i}", "block_hashes": hs, "max_length": 64}
            for i in range(requests)
        ),
    ]
    expect = [
        {"policy": "vllm-0.33", "cache": "gpu", "hits": {f"r{i}": 64 for i in range(requests)}}
    ]
    return write_trace(path, full_mamba(), rows, expect={"expect": expect})


def test_failures_are_grouped_smallest_trace_first_with_commands_that_run(
    tmp_path: Path, monkeypatch: object
) -> None:
    """Issue 31: the failures of one policy and cache are one group, headed
    by how many lookups in how many traces; the smallest trace is shown in
    full whatever its name, the others one line each; every printed command
    runs as printed from another directory."""
    import os
    import shlex

    big = _failing(tmp_path / "a-big.parquet", 3, extra_stores=40)
    small = _failing(tmp_path / "z-small.parquet", 2)
    result = run_cli(["test", str(tmp_path)])
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert lines[:4] == [
        "5 lookups in 2 traces differ under policy vllm-0.33 in the gpu cache",
        "FAILED z-small.parquet under policy vllm-0.33 in the gpu cache:",
        "  request r0: expected hit 64, replayed 48",
        "  request r1: expected hit 64, replayed 48",
    ]
    rest = lines[lines.index("the other 1 of this group, smallest first:") :]
    command = f"replay explain {big} --request r0 --policy vllm-0.33 --cache gpu"
    assert rest[:3] == [
        "the other 1 of this group, smallest first:",
        "  a-big.parquet (45 events, 3 lookups): request r0: expected hit 64, replayed 48",
        f"    {command}",
    ]
    assert result.stdout.count("FAILED ") == 1
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cwd = os.getcwd()
    os.chdir(elsewhere)
    try:
        explained = run_cli(shlex.split(command)[1:])
        shown = [ln for ln in lines if ln.startswith(f"replay explain {small}")]
        again = run_cli(shlex.split(shown[0].split(":")[0])[1:])
    finally:
        os.chdir(cwd)
    assert explained.exit_code == 0, explained.output
    assert "hit: 48 tokens (attention-verified 48)" in explained.stdout
    assert again.exit_code == 0, again.output


def test_junit_xml_has_one_test_case_per_trace_policy_and_cache(tmp_path: Path) -> None:
    import xml.etree.ElementTree as ET

    traces = tmp_path / "traces"
    traces.mkdir()
    shutil.copy(TRACES / "issue-43559.parquet", traces)
    _failing(traces / "t.parquet", 1)
    report = tmp_path / "junit.xml"
    result = run_cli(["test", str(traces), "--junit-xml", str(report)])
    assert result.exit_code == 1, result.output
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None
    cases = suite.findall("testcase")
    entries = len(read_expectations(traces / "issue-43559.parquet") or []) + 1
    assert (len(cases), suite.get("tests"), suite.get("failures")) == (entries, str(entries), "1")
    assert {c.get("name") for c in cases} >= {
        "issue-43559[vllm-0.33-gpu]",
        "issue-43559[vllm-0.33-mooncake]",
        "issue-43559[pre-49502-gpu]",
        "t[vllm-0.33-gpu]",
    }
    (failed,) = [c for c in cases if c.find("failure") is not None]
    failure = failed.find("failure")
    assert failure is not None
    assert (failed.get("classname"), failed.get("name")) == ("t", "t[vllm-0.33-gpu]")
    assert failure.get("message") == "request r0: expected hit 64, replayed 48"
    assert (failure.text or "").startswith(
        "FAILED t.parquet under policy vllm-0.33 in the gpu cache:\n"
        "  request r0: expected hit 64, replayed 48\n"
    )
    # Refused before any work: a name that says another format.
    bad = run_cli(["test", str(traces), "--junit-xml", str(tmp_path / "junit.txt")])
    assert bad.exit_code == 2
    assert bad.stderr.startswith(
        f"error: --junit-xml {tmp_path / 'junit.txt'}: .txt is not an extension"
    )


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


def test_nothing_checked_fails_in_one_line_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under --coordinator vllm, an installed vLLM checked as a policy the
    trace does not pin (vLLM 0.29.0 as its metadata says; or a development
    build with --policy / REPLAY_POLICY naming one) checks nothing: exit 2,
    one line, never a pass. No vLLM code runs: every expectation is skipped
    before a replay."""
    monkeypatch.syspath_prepend(str(vllm_metadata(tmp_path / "meta", "0.29.0")))
    monkeypatch.delenv("REPLAY_POLICY", raising=False)
    issue = str(TRACES / "issue-43559.parquet")
    result = run_cli(["test", "--coordinator", "vllm", issue])
    assert result.exit_code == 2
    assert result.stdout.startswith("0 passed, 0 failed, ")
    assert result.stderr.splitlines()[-1] == (
        "error: no expectation was checked: policy vllm-0.33 is not checked in the mooncake "
        "cache: the installed "
        "vLLM 0.29.0 is checked as policy vllm-0.29"
    )


def test_policy_chooses_what_an_unmodelled_vllm_is_checked_as(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(vllm_metadata(tmp_path / "meta", "0.1.dev1+gabc1234")))
    monkeypatch.delenv("REPLAY_POLICY", raising=False)
    issue = str(TRACES / "issue-43559.parquet")
    chosen = run_cli(["test", "--coordinator", "vllm", "--policy", "vllm-0.29", issue])
    assert chosen.exit_code == 2
    assert chosen.stderr.splitlines()[-1] == (
        "error: no expectation was checked: policy vllm-0.33 is not checked in the mooncake "
        "cache: the installed "
        "vLLM 0.1.dev1+gabc1234 is checked as policy vllm-0.29"
    )
    monkeypatch.setenv("REPLAY_POLICY", "vllm-9.9")
    unknown = run_cli(["test", "--coordinator", "vllm", issue])
    assert (unknown.exit_code, unknown.stdout) == (2, "")
    assert unknown.stderr.splitlines() == [
        # every mistyped name is answered with the close ones (did you mean)
        "error: --coordinator vllm: REPLAY_POLICY=vllm-9.9: unknown policy 'vllm-9.9', "
        "did you mean 'vllm-0.29'?"
    ]
    reference = run_cli(["test", "--policy", "vllm-0.29", issue])
    assert reference.exit_code == 2
    assert reference.stderr == (
        "error: --policy chooses the policy the installed vLLM is checked as: give "
        "--coordinator vllm\n"
    )


def test_the_drift_check_refuses_what_it_cannot_do_in_one_line(tmp_path: Path) -> None:
    """``--random`` compares the installed vLLM (its run is
    tests/vllm/test_adopt_vllm.py); what it does not take is one line, exit 2,
    before any work."""
    cases = {
        (
            "--random",
            "5",
        ): "error: --random: the drift check compares the installed vLLM, give --coordinator vllm",
        (
            "--coordinator",
            "vllm",
            "--random",
            "0",
        ): "error: --random 0: expected at least 1 configuration",
        (
            "--coordinator",
            "vllm",
            "--random",
            "5",
            str(TRACES),
        ): "error: --random: PATH is not taken (the drift check answers both caches)",
        (
            "-o",
            str(tmp_path / "d.parquet"),
        ): "error: -o: only with --random (the drift check writes a trace)",
    }
    for args, message in cases.items():
        result = run_cli(["test", *args])
        assert (result.exit_code, result.stdout, result.stderr) == (2, "", message + "\n"), args
    assert list(tmp_path.iterdir()) == []
