"""Every command answers as the vLLM release that recorded the trace (issue
23): one rule (``choose_policies``: --policy, --vllm, a results file's own
policy, the trace's ``source.vllm_version``, the default) and one note on
standard error, pinned here for a trace recorded by vLLM 0.26.0, whose
Mooncake mirror still has the #43559 overrun (fixed in 0.27.0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.base.errors import ReplayError
from replay.format.results import read_results
from replay.format.writer import write_trace
from replay.pytest_plugin import read_expectations
from replay.rules.coordinator import DEFAULT_POLICY, choose_policies, get_policy
from tests.builders import full_mamba, issue_43559_rows
from tests.conftest import run_cli

NOTE = (
    "policy vllm-0.26: the trace's vLLM 0.26.0 (source.vllm_version, vLLM 0.26.0); "
    "--policy or --vllm overrides"
)


def _write(path: Path, version: str | None, **kwargs: object) -> Path:
    source = {"cache": "mooncake"} | ({"vllm_version": version} if version else {})
    return write_trace(path, full_mamba(source=source), issue_43559_rows(), **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return _write(tmp_path / "t026.parquet", "0.26.0")


def _results(trace: Path, out: Path, *args: str) -> Path:
    result = run_cli(["run", trace, "-o", out, "-q", *args])
    assert result.exit_code == 0, result.output
    return out


# --- the rule --------------------------------------------------------------------


def test_the_rule_in_its_order() -> None:
    source = {"vllm_version": "0.26.0"}
    assert choose_policies(source=source).policies == ("vllm-0.26",)
    assert choose_policies(source=source).notes == (NOTE,)
    assert choose_policies(source={}).policies == (DEFAULT_POLICY,)
    assert choose_policies(source={}).notes == ()
    # A results file's own policy wins over the trace's release, silently.
    assert choose_policies(source=source, results_policy="vllm-0.33").policies == ("vllm-0.33",)
    assert choose_policies(source=source, results_policy="vllm-0.33").notes == ()
    # --vllm and --policy win over both.
    chosen = choose_policies(vllm=["0.27.1"], source=source, results_policy="vllm-0.33")
    assert chosen.policies == ("vllm-0.27",)
    assert chosen.notes == ("policy vllm-0.27: vLLM 0.27.1 (vLLM 0.27.0 - 0.27.1)",)
    chosen = choose_policies(["pre-49502"], source=source)
    assert chosen.policies == ("pre-49502",)
    assert chosen.notes == (get_policy("pre-49502").alias_note,)
    with pytest.raises(ReplayError, match=r"^`vllm` and `policy` both choose the policy"):
        choose_policies(["vllm-0.33"], vllm=["0.26.0"])
    with pytest.raises(ReplayError, match=r"^the trace's source.vllm_version: vLLM 0.12.0 is "):
        choose_policies(source={"vllm_version": "0.12.0"})


# --- each command ------------------------------------------------------------------


def test_run(tmp_path: Path, trace: Path) -> None:
    result = run_cli(["run", trace, "-o", tmp_path / "r.parquet", "--json"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [NOTE]
    assert json.loads(result.stdout)["variants"][0]["policy"] == "vllm-0.26"


def test_explain(tmp_path: Path, trace: Path) -> None:
    result = run_cli(["explain", trace, "--request", "req-43559"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [NOTE]
    assert result.stdout.splitlines()[0] == (
        "request req-43559 (seq 2): max_length 64, 4 hashes of 16 tokens, policy vllm-0.26, "
        "cache mooncake"
    )
    assert "hit: 64 tokens (attention-verified 48)" in result.stdout
    newer = run_cli(["explain", trace, "--request", "req-43559", "--vllm", "0.27.1"])
    assert newer.stderr.splitlines() == ["policy vllm-0.27: vLLM 0.27.1 (vLLM 0.27.0 - 0.27.1)"]
    assert "policy vllm-0.27, cache mooncake" in newer.stdout.splitlines()[0]
    # Results lead to their trace under their own policy: no note.
    own = run_cli(
        ["explain", _results(trace, tmp_path / "r.parquet", "--policy", "vllm-0.33"),
         "--request", "req-43559"]
    )  # fmt: skip
    assert (own.exit_code, own.stderr) == (0, "")
    assert "policy vllm-0.33, cache mooncake" in own.stdout.splitlines()[0]


def test_check(tmp_path: Path, trace: Path) -> None:
    flagged = run_cli(["check", trace, "--examples", "0"])
    assert (flagged.exit_code, flagged.stderr.splitlines()) == (1, [NOTE])
    assert flagged.stdout.splitlines()[0] == (
        f"{trace}: 1 flagged lookup under vllm-0.26: mamba_overrun 1 (corruption), "
        "eagle_not_dropped 1 (performance)"
    )
    fixed = run_cli(["check", trace, "--vllm", "0.27.1"])
    assert (fixed.exit_code, fixed.stdout.splitlines()[0]) == (
        0,
        f"{trace}: clean under vllm-0.27 (no flags)",
    )
    # A results file is checked under its own policy, not the trace's release.
    results = _results(trace, tmp_path / "r.parquet", "--policy", "vllm-0.33")
    own = run_cli(["check", results])
    assert (own.exit_code, own.stderr) == (0, "")
    assert own.stdout == f"{results}: clean under vllm-0.33 (no flags)\n"
    other = run_cli(["check", results, "--vllm", "0.26.0"])
    assert (other.exit_code, other.stderr) == (
        2,
        f"error: {results}: these results were made under policy vllm-0.33, not --policy "
        "vllm-0.26 (check the trace to replay it under vllm-0.26, or drop --policy)\n",
    )


def test_diff(tmp_path: Path, trace: Path) -> None:
    caches = run_cli(["diff", trace, "--cache", "mooncake", "--cache", "gpu", "--json"])
    assert caches.exit_code == 0, caches.output
    assert caches.stderr.splitlines() == [NOTE]
    data = json.loads(caches.stdout)
    assert [(v["policy"], v["cache"]) for v in data["variants"]] == [
        ("vllm-0.26", "mooncake"),
        ("vllm-0.26", "gpu"),
    ]
    assert (data["changed"], data["net"]) == (1, -16)  # the 0.26 engine has the gate
    releases = run_cli(["diff", trace, "--vllm", "0.26.0", "--vllm", "0.27.1", "--json"])
    assert releases.stderr.splitlines() == [
        "policy vllm-0.26: vLLM 0.26.0 (vLLM 0.26.0)",
        "policy vllm-0.27: vLLM 0.27.1 (vLLM 0.27.0 - 0.27.1)",
    ]
    data = json.loads(releases.stdout)
    assert [v["policy"] for v in data["variants"]] == ["vllm-0.26", "vllm-0.27"]
    assert (data["changed"], data["net"]) == (1, -16)
    # One results file: its own policy on both sides.
    results = _results(trace, tmp_path / "r.parquet", "--policy", "vllm-0.33")
    own = run_cli(["diff", results, "--cache", "mooncake", "--cache", "gpu", "--json"])
    assert own.stderr == ""
    assert [v["policy"] for v in json.loads(own.stdout)["variants"]] == ["vllm-0.33"] * 2


def test_minimize(tmp_path: Path, trace: Path) -> None:
    out = tmp_path / "small.parquet"
    small = run_cli(["minimize", trace, "--request", "req-43559", "-o", out])
    assert small.exit_code == 0, small.output
    assert small.stderr.splitlines() == [NOTE]
    # Shrunk under vllm-0.26 (the trace's own mooncake cache), and pinned
    # under it beside the default and the aliases, in both caches (the 0.26
    # engine has the gate: clean there).
    overrun = {"eagle_not_dropped": 1, "mamba_overrun": 1}
    assert [(e["policy"], e["cache"], e["flags"]) for e in read_expectations(out) or []] == [
        ("vllm-0.33", "mooncake", {}),
        ("vllm-0.34", "mooncake", {}),
        ("pre-49502", "mooncake", overrun),
        ("vllm-0.26", "mooncake", overrun),
        ("vllm-0.33", "gpu", {}),
        ("vllm-0.34", "gpu", {}),
        ("pre-49502", "gpu", overrun),
        ("pre-32802", "gpu", {}),
        ("vllm-0.26", "gpu", {}),
    ]
    results = _results(trace, tmp_path / "r.parquet", "--policy", "vllm-0.33")
    clean = run_cli(["minimize", results, "--request", "req-43559", "-o", out])
    assert (clean.exit_code, clean.stderr) == (
        2,
        f"error: {trace}: request 'req-43559' raises no flag under vllm-0.33: nothing to "
        "minimize\n",
    )


def test_report(tmp_path: Path, trace: Path) -> None:
    results = _results(trace, tmp_path / "r.parquet")
    report = run_cli(["report", results, "-o", tmp_path / "r.md"])
    assert report.exit_code == 0, report.output
    text = (tmp_path / "r.md").read_text()
    assert read_results(results)[1]["policy"] == "vllm-0.26"
    assert (
        f"replay explain {trace} --request req-43559 --seq 2 --policy vllm-0.26 --cache mooncake"
        in text
    )


def test_bisect(trace: Path) -> None:
    result = run_cli(["bisect", trace, "--cache", "mooncake"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "policy vllm-0.26: the trace's vLLM 0.26.0 (source.vllm_version, vLLM 0.26.0); "
        "its column is marked (trace)"
    ]
    assert (
        "| lookups | seq | request | vllm-0.22 | vllm-0.23 | vllm-0.24 | vllm-0.26 (trace) | "
        "vllm-0.27 | "
        "vllm-0.28 | vllm-0.29 | vllm-0.30 | vllm-0.32 | vllm-0.33 | vllm-0.34 |"
    ) in result.stdout.splitlines()
    data = json.loads(run_cli(["bisect", trace, "--json"]).stdout)
    assert (data["trace_vllm_version"], data["trace_release"]) == ("0.26.0", "vllm-0.26")


def _with_expectation(tmp_path: Path) -> Path:
    """The 0.26.0 trace with an expectation that names no policy: the
    trace's release answers it (the mirror's overrun, 64)."""
    entry = {
        "cache": "mooncake",
        "flags": {"mamba_overrun": 1, "eagle_not_dropped": 1},
        "hits": {"req-43559": 64},
    }
    return _write(tmp_path / "t026.parquet", "0.26.0", expect={"expect": [entry]})


def test_replay_test(tmp_path: Path) -> None:
    path = _with_expectation(tmp_path)
    result = run_cli(["test", path, "--json"])
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(result.stdout)["expectations"]
    assert (entry["policy"], entry["cache"], entry["status"]) == ("vllm-0.26", "mooncake", "passed")


def test_pytest_plugin(pytester: pytest.Pytester, tmp_path: Path) -> None:
    path = _with_expectation(tmp_path)
    (pytester.path / path.name).write_bytes(path.read_bytes())
    result = pytester.runpytest("-q", "-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["PASSED t026.parquet::t026[[]vllm-0.26-mooncake[]]"])


@pytest.mark.parametrize("command", ["run", "explain"])
def test_a_recorded_release_no_policy_models_names_the_trace(tmp_path: Path, command: str) -> None:
    """A trace recorded by a vLLM older than every policy: one line naming the
    trace, exit 2, nothing written; --policy gets past it."""
    old = _write(tmp_path / "t012.parquet", "0.12.0")
    out = tmp_path / "r.parquet"
    args = ["-o", str(out), "-q"] if command == "run" else ["--request", "a"]
    result = run_cli([command, str(old), *args])
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {old}: the trace's source.vllm_version: vLLM 0.12.0 is older than the "
        "oldest modelled release 0.16.0: no policy models it; choose one with --policy\n",
    )
    assert not out.exists()
    assert run_cli(["run", str(old), "-o", str(out), "-q", "--policy", "vllm-0.33"]).exit_code == 0


def test_whatif(tmp_path: Path, trace: Path) -> None:
    """The what-if simulates the release that recorded the trace (its hits and
    its stores), says so, and records it; --policy overrides."""
    from replay.format.sweepfile import read_sweep

    out = tmp_path / "s.parquet"
    result = run_cli(["whatif", trace, "--capacity", "64", "-o", out, "-q"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [NOTE]
    frame, _meta = read_sweep(out)
    assert frame["policy"].to_list() == ["vllm-0.26"]
    out.unlink()
    result = run_cli(
        ["whatif", trace, "--capacity", "64", "-o", out, "-q", "--policy", "vllm-0.33"]
    )
    assert (result.exit_code, result.stderr) == (0, "")
    assert read_sweep(out)[0]["policy"].to_list() == ["vllm-0.33"]
