"""Severities and the flags that fail a check: every flag's severity, the
one selection function (``--fail-on`` / ``--ignore``), ``replay check``'s
verdict and the pytest plugin's same choices."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.analysis.flags import FLAG_KINDS, FLAGS, SEVERITIES, by_severity, severity, worst_first
from replay.analysis.selection import failing, select_flags, selection_text
from replay.base.errors import ReplayError
from replay.format.writer import write_trace
from replay.tools.render import counts_text
from tests.builders import full_mamba, issue_43559_rows
from tests.conftest import run_cli

TRACES = Path(__file__).resolve().parents[2] / "traces"


def test_every_flag_has_a_severity() -> None:
    assert {name: severity(name) for name in FLAG_KINDS} == {
        "mamba_overrun": "corruption",
        "mamba_state_mismatch": "inconsistent",
        "hit_beyond_max_length": "inconsistent",
        "hit_misaligned": "inconsistent",
        "missing_block": "corruption",
        "eagle_not_dropped": "performance",
        "observed_mismatch": "observed",
    }
    assert all(k.severity in SEVERITIES and k.meaning for k in FLAGS.values())
    assert by_severity(["observed_mismatch", "zz_new", "eagle_not_dropped", "missing_block"]) == [
        "missing_block",
        "eagle_not_dropped",
        "observed_mismatch",
        "zz_new",
    ]
    assert counts_text(worst_first({"eagle_not_dropped": 18, "mamba_overrun": 2})) == (
        "mamba_overrun 2 (corruption), eagle_not_dropped 18 (performance)"
    )


def test_select_flags_as_ruff_select_and_ignore() -> None:
    assert select_flags() == {"mamba_overrun", "missing_block"}
    assert select_flags("performance,observed") == {"eagle_not_dropped", "observed_mismatch"}
    assert select_flags(["corruption", "hit_misaligned"], ["missing_block"]) == {
        "mamba_overrun",
        "hit_misaligned",
    }
    assert select_flags("all", "inconsistent,observed_mismatch") == {
        "mamba_overrun",
        "missing_block",
        "eagle_not_dropped",
    }
    assert select_flags(None, "corruption") == frozenset()
    assert failing({"mamba_overrun": 1, "eagle_not_dropped": 3}, select_flags()) == {
        "mamba_overrun": 1
    }
    assert selection_text(("performance",), ("eagle_not_dropped",)) == (
        "--fail-on performance --ignore eagle_not_dropped"
    )
    with pytest.raises(ReplayError) as err:
        select_flags("corruptoin")
    assert str(err.value) == (
        "--fail-on: unknown flag or severity 'corruptoin', did you mean 'corruption'?"
    )
    with pytest.raises(ReplayError) as err:
        select_flags("nosuchflag")
    assert str(err.value) == (
        "--fail-on: unknown flag or severity 'nosuchflag', expected a comma-separated list of "
        "all, corruption, inconsistent, performance, observed, mamba_overrun, "
        "mamba_state_mismatch, hit_beyond_max_length, hit_misaligned, missing_block, "
        "eagle_not_dropped, observed_mismatch"
    )


def test_check_fails_on_corruption_only_by_default() -> None:
    """The issue's case: 18 eagle_not_dropped and no overrun used to exit 1."""
    trace = TRACES / "archetype-swa-mamba.parquet"
    result = run_cli(["check", trace, "--policy", "pre-49502", "--examples", "1"])
    assert (result.exit_code, result.stdout.splitlines()) == (
        0,
        [
            f"{trace}: 18 flagged lookups under pre-49502: eagle_not_dropped 18 (performance)",
            "  eagle_not_dropped: request s100-t1 seq 427: hit 192 reaches group 0's whole "
            "match: EAGLE recomputes nothing past it",
            "pass (--fail-on corruption): no flag it selects",
        ],
    )
    perf = run_cli(["check", trace, "--policy", "pre-49502", "--examples", "0", "--fail-on", "performance"])  # fmt: skip
    assert (perf.exit_code, perf.stdout.splitlines()[-1]) == (
        1,
        "fail (--fail-on performance): 18 lookups with eagle_not_dropped 18 (performance)",
    )
    ignored = run_cli(["check", trace, "--policy", "pre-49502", "--examples", "0", "--fail-on", "all", "--ignore", "eagle_not_dropped"])  # fmt: skip
    assert (ignored.exit_code, ignored.stdout.splitlines()[-1]) == (
        0,
        "pass (--fail-on all --ignore eagle_not_dropped): no flag it selects",
    )
    bad = run_cli(["check", trace, "--ignore", "eagle"])
    assert (bad.exit_code, bad.stdout) == (2, "")
    assert bad.stderr == (
        "error: --ignore: unknown flag or severity 'eagle', did you mean 'eagle_not_dropped'?\n"
    )


def test_explain_lists_flags_worst_first_with_severity() -> None:
    trace = TRACES / "issue-43559.parquet"
    result = run_cli(["explain", trace, "--request", "req-43559", "--policy", "pre-49502"])
    assert result.stdout.splitlines()[-4:-1] == [
        "flags:",
        "  mamba_overrun (corruption): group 1 resumes Mamba state at 64, 16 tokens past the "
        "attention KV loaded for 48 tokens",
        "  eagle_not_dropped (performance): hit 64 reaches group 0's whole match: EAGLE "
        "recomputes nothing past it",
    ]


def test_pytest_plugin_takes_the_same_choices(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry without ``flags`` fails on what --replay-fail-on selects
    (corruption by default); --replay-ignore leaves a flag out of an exact
    ``flags`` expectation on both sides."""
    monkeypatch.delenv("CI", raising=False)
    rows = issue_43559_rows()
    write_trace(
        pytester.path / "open.parquet",
        full_mamba(),
        rows,
        expect={"expect": [{"policy": "pre-49502"}]},
    )
    write_trace(
        pytester.path / "pinned.parquet",
        full_mamba(),
        rows,
        expect={"expect": [{"policy": "pre-49502", "flags": {"mamba_overrun": 1}}]},
    )
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "open.parquet")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*open.parquet under policy pre-49502 in the mooncake cache:",
            "  flags: mamba_overrun 1 (corruption) (--fail-on corruption)",
        ]
    )
    ok = pytester.runpytest_subprocess(
        "-q", "-p", "no:cacheprovider", "--replay-fail-on", "inconsistent"
    )
    # pinned.parquet expects no eagle_not_dropped, which fires: it fails.
    ok.assert_outcomes(passed=1, failed=1)
    ok.stdout.fnmatch_lines(
        [
            "  flags: expected {'mamba_overrun': 1}, replayed {'eagle_not_dropped': 1, 'mamba_overrun': 1}"
        ]
    )
    quiet = pytester.runpytest_subprocess(
        "-q", "-p", "no:cacheprovider", "--replay-ignore", "performance"
    )
    quiet.assert_outcomes(passed=1, failed=1)  # open.parquet still fails on the overrun
    pytester.makeini("[pytest]\nreplay_ignore = eagle_not_dropped,mamba_overrun\n")
    clean = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    # Both flags ignored: open.parquet has nothing to fail on, pinned.parquet
    # compares no flag at all.
    clean.assert_outcomes(passed=2)
