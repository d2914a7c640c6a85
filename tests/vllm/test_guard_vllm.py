"""The corpus guards vLLM itself: `replay test --coordinator vllm` and the
pytest route check the installed vLLM's answers, and fail when vLLM's
lookup is broken. The negative control of vLLM's own #48361: with the
#49502 gate removed from the installed vLLM (a mutant applied at import
time, vLLM's files untouched), issue-43559 fails with 64 against 48;
unmutated it passes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.builders import vllm_metadata
from tests.vllm_modules import replay_under_mutant

pytest.importorskip("vllm", reason="vLLM not importable: run make test-vllm")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "traces"
ISSUE = TRACES / "issue-43559.parquet"


def test_the_49502_gate_removed_fails_issue_43559_with_64_against_48() -> None:
    got = _replay("test", "--coordinator", "vllm", str(ISSUE), mutant="mirror-no-mamba-gate")
    assert got.returncode == 1, got.stderr
    out = got.stdout
    # The cause names vLLM's function: the mirror's fixed point asked the
    # Mamba finder one block (16 tokens) past what attention verified.
    cause = (
        "vLLM's fixed point called MambaManager.find_longest_cache_hit(max_length=64, "
        "drop_eagle_block=True) (spec group 1), which returned 64; vllm-0.33's calls its "
        "mamba finder (spec group 1) with max_length=48, drop=True, which returns 48"
    )
    shape = cause.replace("=64", "=…").replace("=48", "=…").replace("group 1", "group …")
    shape = shape.replace("returned 64", "returned …").replace("returns 48", "returns …")
    assert out.startswith(
        f"1 lookup in 1 trace differ under policy vllm-0.33 in the mooncake cache: {shape}\n"
        "FAILED issue-43559.parquet under policy vllm-0.33 in the mooncake cache:\n"
        f"  cause: {cause}\n"
        "  flags: expected none, replayed {'eagle_not_dropped': 1, 'mamba_overrun': 1}\n"
        "  hit tokens: expected 48 in all, replayed 64\n"
        "  group hit tokens: expected [48, 48] per group, replayed [48, 64]\n"
        "  request req-43559: expected hit 48, replayed 64\n"
    ), out
    # The reference's fixed point (Mamba bound 48, no margin), then vLLM's answer.
    assert (
        f"replay explain {ISSUE} --request req-43559 --policy vllm-0.33 "
        "--cache mooncake (what policy vllm-0.33 computes, step by step):"
    ) in out
    assert "   1  1 [1]                mamba              48       0       48" in out
    vllm_part = out.split("--coordinator vllm (what the installed vLLM answered):")[1]
    assert "hit: 64 tokens (attention-verified 48)" in vllm_part
    # vLLM's own finder calls, as its fixed point made them.
    assert "   1  1 [1]                mamba              64     +16       64" in vllm_part
    assert "state at 64" in vllm_part
    # Only the mirror was mutated: the engine's cache still holds.
    assert "FAILED issue-43559.parquet under policy vllm-0.33 in the gpu cache" not in out
    assert "vllm-0.33/mooncake FAILED, vllm-0.33/gpu ok" in got.stderr
    # vllm-0.34's engine expectation too (its engine rules are 0.33.0's).
    assert out.splitlines()[-1].startswith(
        "2 passed, 1 failed, 4 skipped: 7 expectations of 1 trace"
    )


def test_the_engine_gate_removed_fails_the_gpu_cache() -> None:
    got = _replay("test", "--coordinator", "vllm", str(ISSUE), mutant="engine-no-mamba-gate")
    assert got.returncode == 1, got.stderr
    assert "FAILED issue-43559.parquet under policy vllm-0.33 in the gpu cache:" in got.stdout
    assert "  request req-43559: expected hit 48, replayed 64" in got.stdout
    assert "FAILED issue-43559.parquet under policy vllm-0.33 in the mooncake cache" not in (
        got.stdout
    )


def test_unmutated_the_shipped_corpus_passes_and_other_policies_are_skipped() -> None:
    """No PATH: the corpus inside the installed package. Every expectation of
    vllm-0.33 is checked in both caches; the others are skipped, naming the
    policy and the installed version."""
    from replay.adapters.vllm.backend import installed_vllm_version
    from replay.analysis.expectations import corpus_dir, read_expectations
    from replay.rules.coordinator import same_rules

    got = _replay("test", "--coordinator", "vllm")
    assert got.returncode == 0, got.stdout + got.stderr
    traces = sorted(corpus_dir().glob("*.parquet"))
    entries = [e for t in traces for e in read_expectations(t) or []]
    # vllm-0.33's, and vllm-0.34's in the engine (the same rules there).
    ours = [e for e in entries if same_rules(e["policy"], "vllm-0.33", e["cache"])]
    assert {(e["policy"], e["cache"]) for e in ours} == {
        ("vllm-0.33", "gpu"),
        ("vllm-0.33", "mooncake"),
        ("vllm-0.34", "gpu"),
    }
    version = installed_vllm_version()
    last = got.stdout.splitlines()[-1]
    assert last.startswith(
        f"{len(ours)} passed, 0 failed, {len(entries) - len(ours)} skipped: "
        f"{len(entries)} expectations of {len(traces)} traces through the vllm coordinator"
    ), last
    assert (
        f"policy pre-49502 is not checked in the gpu and mooncake caches: the installed "
        f"vLLM {version} is checked as policy vllm-0.33"
    ) in last
    # A progress line per trace (vLLM's own logger may add a warning line).
    assert len([x for x in got.stderr.splitlines() if x.startswith("[")]) == len(traces)


def test_a_mutant_that_does_not_apply_is_refused(tmp_path: Path) -> None:
    got = _replay("test", "--coordinator", "vllm", str(ISSUE), mutant="no-such-mutant")
    assert got.returncode == 2
    assert got.stderr.startswith("error: no mutant named 'no-such-mutant' in ")


def test_the_pytest_route_checks_vllm_and_skips_other_policies(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pytest --replay-coordinator vllm` (and REPLAY_COORDINATOR=vllm):
    the vllm-0.33 items pass against vLLM, the others skip with the reason;
    with the gate removed, the mooncake item of issue-43559 fails."""
    from replay.adapters.vllm.backend import installed_vllm_version

    shutil.copy(ISSUE, pytester.path / ISSUE.name)
    version = installed_vllm_version()
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rs", "--replay-coordinator", "vllm"
    )
    result.assert_outcomes(passed=3, skipped=4)
    result.stdout.fnmatch_lines(
        [
            f"SKIPPED * policy pre-49502 is not checked in the * cache: the installed vLLM "
            f"{version} is checked as policy vllm-0.33"
        ]
    )
    monkeypatch.setenv("REPLAY_COORDINATOR", "vllm")
    monkeypatch.setenv("REPLAY_MUTANT", "mirror-no-mamba-gate")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("CI", raising=False)
    pytester.makeconftest("from mutants.loader import install_from_env\n\ninstall_from_env()\n")
    mutated = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    mutated.assert_outcomes(passed=2, failed=1, skipped=4)
    mutated.stdout.fnmatch_lines(
        [
            "issue-43559.parquet under policy vllm-0.33 in the mooncake cache:",
            "  request req-43559: expected hit 48, replayed 64",
        ]
    )


# --- the installed vLLM, whatever it is: a moved API is one line, exit 2 ------

MOVED = """
import sys
from mutants.loader import Mutant, install
{setup}
from replay.entry import main
sys.argv = ["replay", "test", "--coordinator", "vllm", "--cache", {cache!r}, {trace!r}]
main()
"""

RENAMED = """install(Mutant("moved", "vllm.v1.core.kv_cache_coordinator",
    "def get_kv_cache_coordinator(", "def build_kv_cache_coordinator(", "renamed"))"""

NEW_PARAMETER = """install(Mutant("param", "vllm.v1.core.kv_cache_coordinator",
    "    allow_partial_hash_hits: bool = True,\\n) -> KVCacheCoordinator:",
    "    allow_partial_hash_hits: bool = True,\\n    *,\\n    page_layout: str,\\n) -> KVCacheCoordinator:",
    "a required parameter"))"""

GONE_MODULE = """
import importlib.abc
class Gone(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Gone())
"""


def _moved(setup: str, cache: str) -> subprocess.CompletedProcess[str]:
    script = MOVED.format(setup=setup, cache=cache, trace=str(ISSUE))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )


def test_a_moved_internal_api_is_one_line_naming_it() -> None:
    from replay.adapters.vllm.backend import installed_vllm_version

    version = installed_vllm_version()
    cases = [
        (
            RENAMED,
            "gpu",
            f"error: --coordinator vllm: the installed vLLM {version} has no "
            "`vllm.v1.core.kv_cache_coordinator.get_kv_cache_coordinator` "
            "(its internal API moved; this backend needs it)",
        ),
        (
            NEW_PARAMETER,
            "gpu",
            f"error: --coordinator vllm: the installed vLLM {version}'s "
            "`vllm.v1.core.kv_cache_coordinator.get_kv_cache_coordinator` requires a "
            "parameter `page_layout` this backend does not know (its internal API moved)",
        ),
        (
            GONE_MODULE,
            "mooncake",
            f"error: --coordinator vllm: the installed vLLM {version} has no module "
            "`vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator` "
            "(its internal API moved; this backend needs "
            "`vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator`)",
        ),
    ]
    for setup, cache, message in cases:
        got = _moved(setup, cache)
        assert got.returncode == 2, got.stderr
        assert got.stdout == ""
        errors = [line for line in got.stderr.splitlines() if not line.startswith("[")]
        assert errors == [message], got.stderr
        assert "Traceback" not in got.stderr


def test_the_installed_version_picks_the_policy() -> None:
    from replay.adapters.vllm.backend import policy_for_vllm

    assert policy_for_vllm("0.33.0") == "vllm-0.33"
    assert policy_for_vllm("0.34.1.dev12+g1234abcd") == "vllm-0.34"  # an editable main
    assert policy_for_vllm("0.1.dev1+g1234abcd") == "vllm-0.34"  # a shallow clone
    assert policy_for_vllm("1.0.0") == "vllm-0.34"
    # Older releases get their release policy (issue 23); before 0.16, none.
    assert policy_for_vllm("0.32.2") == "vllm-0.32"
    assert policy_for_vllm("0.26.0") == "vllm-0.26"
    assert policy_for_vllm("0.15.1") is None


# --- a vLLM no policy models yet: a development build -----------------------


def _as_version(
    tmp_path: Path, version: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`replay test` in this vLLM's Python, whose metadata reports ``version``
    (a metadata-only dist-info first on the path: vLLM's code is the installed
    release's, its reported version is the development build's)."""
    meta = vllm_metadata(tmp_path / "meta", version)
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(meta), str(ROOT)]), **(env or {})}
    full.pop("REPLAY_MUTANT", None)
    if env is None:
        full.pop("REPLAY_POLICY", None)
    return subprocess.run(
        [sys.executable, "-m", "replay", "test", "--coordinator", "vllm", *args],
        capture_output=True,
        text=True,
        env=full,
        cwd=ROOT,
        timeout=600,
    )


def test_a_development_build_is_checked_as_the_newest_policy(tmp_path: Path) -> None:
    """A vLLM installed from a shallow clone reports 0.1.dev1+g<commit>: no
    refusal, the newest policy's expectations are checked against it, and one
    line says which version, which policy and how to choose another."""
    from replay.rules.coordinator import RELEASES

    newest = RELEASES[-1]
    got = _as_version(tmp_path, "0.1.dev1+gabc1234", str(ISSUE))
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stderr.splitlines()[-1] == (
        f"vLLM 0.1.dev1+gabc1234 is a development build with no release tag: assuming policy "
        f"{newest.name} (vLLM {newest.releases}, the newest modelled); choose another with "
        "--policy or REPLAY_POLICY"
    )
    summary = got.stdout.splitlines()[-1]
    assert f"is checked as policy {newest.name}" in summary
    assert not summary.startswith("0 passed"), summary
    assert ", 0 failed," in summary, summary


def test_a_development_build_checked_as_nothing_fails(tmp_path: Path) -> None:
    got = _as_version(tmp_path, "0.1.dev1+gabc1234", str(ISSUE), env={"REPLAY_POLICY": "vllm-0.29"})
    assert got.returncode == 2, got.stderr
    assert got.stdout.startswith("0 passed, 0 failed, "), got.stdout
    assert got.stderr.splitlines()[-1] == (
        "error: no expectation was checked: policy vllm-0.33 is not checked in the mooncake "
        "cache: the installed "
        "vLLM 0.1.dev1+gabc1234 is checked as policy vllm-0.29"
    )


def _replay(*args: str, mutant: str | None = None) -> subprocess.CompletedProcess[str]:
    return replay_under_mutant(*args, cwd=ROOT, mutant=mutant, timeout=600)
