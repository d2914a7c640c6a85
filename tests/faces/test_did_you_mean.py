"""Issue 36 item 2: every name a user types that is not known is answered
with the close names (``did you mean``), not with the whole list; an unknown
request id with the trace's nearest ids and the command that lists them."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from replay.base.errors import ReplayError
from replay.base.text import close_names, edit_distance, nearest
from replay.cli import cli
from replay.rules.coordinator import POLICIES, get_policy
from tests.conftest import run_cli


def run_replay(args: list[str]) -> Result:
    """The command line as a user types it (``replay ...``, not click's test name)."""
    return CliRunner().invoke(cli, args, prog_name="replay", catch_exceptions=False)


DEMO = Path(__file__).parents[2] / "traces" / "demo-full-mamba-eagle.parquet"


def test_edit_distance_counts_inserts_deletes_and_substitutions() -> None:
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("vllm-033", "vllm-0.33") == 1
    assert edit_distance("", "abc") == 3
    # Past the bound it stops early, saying only "more than most".
    assert edit_distance("aaaaaaaa", "bbbbbbbb", most=2) == 3


def test_close_names_are_the_nearest_only() -> None:
    assert close_names("vllm-033", POLICIES) == ["vllm-0.33"]
    assert close_names("pre49502", POLICIES) == ["pre-49502"]
    # A prefix of a name when nothing is a few edits away.
    assert close_names("eagle", ["mamba_overrun", "eagle_not_dropped"]) == ["eagle_not_dropped"]
    assert close_names("zzz", ["mamba_overrun", "eagle_not_dropped"]) == []


def test_nearest_ties_keep_the_order_given() -> None:
    assert nearest("s18-t9", ["s18-t1", "s1-t1", "s22-t1", "s18-t10"]) == [
        "s18-t1",
        "s1-t1",
        "s18-t10",
    ]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["run", str(DEMO), "--policy", "vllm-033"],
            "error: replay run: invalid value for '--policy': no policy 'vllm-033', "
            "did you mean 'vllm-0.33'? (try 'replay run --help')",
        ),
        (
            ["diff", str(DEMO), "--policy", "vllm-0.33", "--policy", "pre49502"],
            "error: replay diff: invalid value for '--policy': no policy 'pre49502', "
            "did you mean 'pre-49502'? (try 'replay diff --help')",
        ),
        (
            ["explain", str(DEMO), "--request", "s18-t1", "--cache", "gp"],
            "error: replay explain: invalid value for '--cache': no cache 'gp', "
            "did you mean 'gpu'? (try 'replay explain --help')",
        ),
        (
            ["synth", "--model", "ful", "-o", "x.parquet"],
            "error: replay synth: invalid value for '--model': no model 'ful', "
            "did you mean 'full'? (try 'replay synth --help')",
        ),
        (
            ["synth", "--model", "full", "--cache", "gp", "-o", "x.parquet"],
            "error: --cache: no cache 'gp', did you mean 'gpu'?",
        ),
        (
            ["check", str(DEMO), "--fail-on", "mamba_overun"],
            "error: --fail-on: unknown flag or severity 'mamba_overun', "
            "did you mean 'mamba_overrun'?",
        ),
        (
            ["check", str(DEMO), "--ignore", "eagle"],
            "error: --ignore: unknown flag or severity 'eagle', did you mean 'eagle_not_dropped'?",
        ),
        (
            ["explain", str(DEMO), "--request", "s18-t9"],
            f"error: {DEMO}: no lookup with request_id 's18-t9'; nearest: 's18-t1', 's18-t2', "
            f"'s1-t1' (replay info {DEMO} --requests lists them all)",
        ),
    ],
)
def test_a_typo_gets_the_close_name(
    args: list[str], line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = run_replay(args)
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", line + "\n")


def test_a_far_name_still_lists_them_all() -> None:
    result = run_replay(["run", str(DEMO), "--cache", "disk"])
    assert result.stderr == (
        "error: replay run: invalid value for '--cache': 'disk' is not one of 'mooncake', "
        "'gpu' (try 'replay run --help')\n"
    )


def test_a_library_name_gets_the_close_name() -> None:
    with pytest.raises(ReplayError) as caught:
        get_policy("pre-4950")
    assert str(caught.value) == "unknown policy 'pre-4950', did you mean 'pre-49502'?"


def test_info_requests_lists_every_lookup_seq_and_request_id() -> None:
    result = run_cli(["info", str(DEMO), "--requests"])
    lines = result.stdout.splitlines()
    assert result.exit_code == 0
    assert len(lines) == 404  # the demo's lookups
    assert lines[:2] == ["0\ts0-t1", "3\ts1-t1"]
    assert "54\ts18-t1" in lines
