"""click's own usage errors (an unknown option, a missing argument or
option value, a bad choice, an extra argument, no such command) are one
line on stderr naming the command and the problem, with where the options
are listed, and exit status 2; nothing else is printed (issue 25)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from replay.cli import cli

ROOT = Path(__file__).resolve().parents[2]

CASES = [
    (["run", "--bogus", "t.parquet"], "replay run: no such option '--bogus' (try 'replay run --help')"),
    (["run", "t.parquet", "--exampels", "3"], "replay run: no such option '--exampels'. Did you mean '--examples'? (try 'replay run --help')"),
    (["run"], "replay run: missing argument 'TRACE' (try 'replay run --help')"),
    (["synth", "-o", "s.parquet"], "replay synth: missing option '--model'. Choose from: full, full+mamba, full+swa, full+chunked, swa+mamba, full+swa+mamba (try 'replay synth --help')"),
    (["synth", "--model", "full", "--seed"], "replay synth: option '--seed' requires an argument (try 'replay synth --help')"),
    (["whatif", "t.parquet", "--cache", "disk"], "replay whatif: invalid value for '--cache': 'disk' is not one of 'mooncake', 'gpu' (try 'replay whatif --help')"),
    (["validate", "a.parquet", "b.parquet"], "replay validate: got unexpected extra argument (b.parquet) (try 'replay validate --help')"),
    (["replay"], "replay: no such command 'replay'. (Did you mean one of: 'explain', 'repair'?) (try 'replay --help')"),
    (["ingest", "jsonl"], "replay ingest: no such command 'jsonl' (try 'replay ingest --help')"),
    (["ingest", "mooncake", "m.jsonl", "--model", "gpt"], "replay ingest mooncake: invalid value for '--model': 'gpt' is not one of 'full', 'full+mamba', 'full+swa', 'full+chunked', 'swa+mamba', 'full+swa+mamba' (try 'replay ingest mooncake --help')"),
    (["--max-row-hashes"], "replay: option '--max-row-hashes' requires an argument (try 'replay --help')"),
    (["--verbose", "run", "t.parquet"], "replay: no such option '--verbose'. Did you mean '--version'? (try 'replay --help')"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "line"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_usage_error_is_one_line_naming_the_command(
    tmp_path: Path, args: list[str], line: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, args, prog_name="replay")
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"error: {line}\n")
    assert list(tmp_path.iterdir()) == []


def test_the_console_script_says_the_same_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "replay", "diff", "--policy", "vllm-9"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr.startswith(
        "error: replay diff: invalid value for '--policy': 'vllm-9' is not one of 'vllm-0.16', "
    )
    assert run.stderr.endswith(" (try 'replay diff --help')\n")
    assert run.stderr.count("\n") == 1
