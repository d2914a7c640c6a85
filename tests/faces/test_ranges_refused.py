"""Issue 36 item 3: a position or a range outside the trace, the modelled
releases or the sweep is refused in one line naming the valid range (exit
status 2, no output), never answered silently with something else."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli

DEMO = Path(__file__).parents[2] / "traces" / "demo-full-mamba-eagle.parquet"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["state", str(DEMO), "--at", "99999"],
            f"{DEMO}: seq 99999 is outside the trace, whose seqs are 0..1574",
        ),
        (
            ["state", str(DEMO), "--at", "-1"],
            f"{DEMO}: seq -1 is outside the trace, whose seqs are 0..1574",
        ),
        (
            ["explain", str(DEMO), "--request", "s18-t1", "--seq", "99999"],
            f"{DEMO}: no lookup with request_id 's18-t1' at seq 99999 (its lookups: seq 54)",
        ),
        (
            ["bisect", str(DEMO), "--from", "0.10.0"],
            "--from 0.10.0 is outside the modelled vLLM releases, 0.16.0 to 0.34.0",
        ),
        (
            ["whatif", str(DEMO), "--points", "40", "--min", "1", "--max", "10", "-o", "w.parquet"],
            "--points 40: from --min 1 to --max 10 there are only 10 sizes in blocks; "
            "give --points 2 to 10",
        ),
    ],
)
def test_out_of_range_is_one_line_naming_the_range(
    args: list[str], line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = run_cli(args)
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"error: {line}\n")
    assert list(tmp_path.iterdir()) == []


def test_the_ends_of_the_trace_are_positions() -> None:
    first = run_cli(["state", str(DEMO), "--at", "0", "--show", "0"])
    last = run_cli(["state", str(DEMO), "--at", "1574", "--show", "0"])
    assert (first.exit_code, last.exit_code) == (0, 0)
    assert first.stdout.splitlines()[0] == f"state before seq 0: {DEMO}"
    assert last.stdout.splitlines()[0] == f"state before seq 1574: {DEMO}"
