"""The pytest plugin as a user meets it: every regression trace item fails
when the coordinator is broken, and a failure says what moved and explains it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from replay.format.writer import write_trace
from replay.pytest_plugin import read_expectations
from tests.builders import answerable, chain, full_mamba, vllm_metadata

ROOT = Path(__file__).resolve().parents[2]
TRACES = sorted(Path(__file__).parent.parent.parent.joinpath("traces").glob("*.parquet"))

NEVER_HITS = """
from replay.rules.coordinator import hybrid

def _never(self, present, max_length, *, explain=False):
    groups = tuple(
        hybrid.GroupOutcome(
            group_id=gid, kind=g.kind, mask_blocks=0, loaded_blocks=0, hit_tokens=0,
            state_tokens=0 if g.kind is hybrid.GroupKind.MAMBA else None,
        )
        for gid, g in enumerate(self.config.groups)
    )
    return hybrid.LookupOutcome(hit_tokens=0, groups=groups)

hybrid.Coordinator.lookup_present = _never

# The replay answers compiled (replay.rules.compiled): the Python reference,
# patched above, answers only where the compiled path is not supported.
from replay.engine import answers
answers.compiled_supported = lambda coordinator: "the test's coordinator never hits"
"""


def _entries() -> list[tuple[str, dict[str, Any]]]:
    """Every expectation of the corpus, with its trace's name."""
    return [(t.name, e) for t in TRACES for e in read_expectations(t) or []]


@pytest.mark.slow
def test_a_coordinator_that_never_hits_fails_every_item(pytester: pytest.Pytester) -> None:
    """Every item fails but those whose true answer is no hit at all in any
    group (before #32802, a sliding-window + Mamba EAGLE model spiralled every
    hit to zero), which no expectation can tell from a coordinator that
    never hits."""
    for trace in TRACES:
        shutil.copy(trace, pytester.path / trace.name)
    pytester.makeconftest(NEVER_HITS)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-rA")
    nothing = [
        (name, e["policy"], e["cache"])
        for name, e in _entries()
        if e["hit_tokens"] == 0 and not any(e["group_hit_tokens"])
    ]
    # Beside that one, only scenarios kept because a mutant gives a hit
    # where the truth is none (traces/build.py RANDOM).
    assert {n for n in nothing if not n[0].startswith("mutant-")} == {
        ("archetype-swa-mamba.parquet", "pre-32802", "gpu"),  # no mirror before 0.22
        # Through the store worker (0.27.0 on) each lookup is aligned down to
        # the 64-token hit alignment first, so the EAGLE drop of the one
        # spec group leaves less than 64 tokens: no hit (the gpu hits 128).
        ("random-0033.parquet", "vllm-0.33", "mooncake"),
        ("random-0033.parquet", "vllm-0.34", "mooncake"),
    }
    result.assert_outcomes(failed=len(_entries()) - len(nothing), passed=len(nothing))
    result.stdout.fnmatch_lines(
        [
            "PASSED archetype-swa-mamba.parquet::archetype-swa-mamba[pre-32802-gpu]",
        ]
    )


@pytest.mark.slow
def test_the_regression_corpus_passes(pytester: pytest.Pytester) -> None:
    for trace in TRACES:
        shutil.copy(trace, pytester.path / trace.name)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=len(_entries()))
    # Every trace pins each of its policies in both caches, wherever its
    # configuration is valid for both.
    from replay.base.errors import ConfigError
    from replay.format.tracedir import open_trace
    from replay.rules.coordinator import check_config

    both = 0
    for trace in TRACES:
        entries = read_expectations(trace) or []
        policies = {e["policy"] for e in entries}
        assert "vllm-0.33" in policies, trace.name
        config = open_trace(trace).config
        valid = []
        for cache in ("gpu", "mooncake"):
            try:
                check_config(config, cache)
                valid.append(cache)
            except ConfigError:
                pass
        both += len(valid) == 2
        # ... where the policy's releases answer it (pre-32802 had no mirror;
        # a release may refuse the configuration).
        assert sorted((e["policy"], e["cache"]) for e in entries) == sorted(
            (p, c) for p in policies for c in valid if answerable(config, p, c)
        ), trace.name
    assert both >= len(TRACES) - 5
    # The aliases are pinned wherever their releases answer: most traces.
    pinned = [{e["policy"] for e in read_expectations(t) or []} for t in TRACES]
    assert sum("pre-49502" in p for p in pinned) >= len(TRACES) - 10
    assert sum("pre-32802" in p for p in pinned) >= len(TRACES) // 2


def test_failure_output_names_what_moved_and_explains_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trace whose expectation no longer holds: the item says which totals
    and which requests moved (at most ten, then how many more) and prints the
    explain table of the first ones, with the command to run it again."""
    hs = chain(4, "plugin")
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": hs},
        {"kind": "store", "group_id": 1, "block_hashes": hs},
        *(
            {"kind": "lookup", "request_id": f"r{i}", "block_hashes": hs, "max_length": 64}
            for i in range(12)
        ),
    ]
    expect = [
        {
            "policy": "vllm-0.33",
            "flags": {"mamba_overrun": 1},
            "hit_tokens": 12 * 64,
            "hits": {f"r{i}": 64 for i in range(12)},
        }
    ]
    write_trace(pytester.path / "broken.parquet", full_mamba(), rows, expect={"expect": expect})
    # Under CI=true pytest repeats the whole failure in its short summary.
    monkeypatch.delenv("CI", raising=False)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider", "broken.parquet")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*broken.parquet under policy vllm-0.33 in the mooncake cache:",
            "  flags: expected {'mamba_overrun': 1}, replayed none",
            "  hit tokens: expected 768 in all, replayed 576",
            "  request r0: expected hit 64, replayed 48",
            "  request r7: expected hit 64, replayed 48",
            "  ... and 2 more requests with another hit",
            # Runnable as printed, from anywhere: the trace's absolute path.
            f"replay explain {pytester.path / 'broken.parquet'} --request r0 --policy vllm-0.33:",
            "*full_attention*",
        ]
    )
    text = result.stdout.str()
    assert "request r8: expected" not in text
    assert text.count(f"replay explain {pytester.path / 'broken.parquet'} --request") == 3


def test_nothing_checked_is_not_a_pass(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`pytest --replay-coordinator vllm` where the installed vLLM is checked
    as a policy the traces do not pin (here vLLM 0.29.0, as its metadata
    says): every item is skipped, and the session fails with the line that
    says why (it passed green before, checking nothing)."""
    shutil.copy(
        Path(__file__).parent.parent.parent / "traces" / "issue-43559.parquet", pytester.path
    )
    meta = vllm_metadata(tmp_path / "meta", "0.29.0")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(meta), str(ROOT)]))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--replay-coordinator", "vllm")
    entries = read_expectations(pytester.path / "issue-43559.parquet") or []
    result.assert_outcomes(skipped=len(entries))
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "replay: no expectation was checked (* skipped, see the reasons above): "
            "nothing checked is not a pass"
        ]
    )
    # The reference coordinator checks every one: the session passes.
    checked = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert checked.ret == pytest.ExitCode.OK


def test_replay_corpus_runs_the_shipped_corpus_from_any_directory(
    pytester: pytest.Pytester,
) -> None:
    """Issue 31: ``pytest --replay-corpus`` in a directory holding nothing
    collects the corpus inside the package, one item per trace x policy x
    cache, each id naming all three; with a path it collects both."""
    from replay.analysis.expectations import corpus_dir

    collected = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--replay-corpus", "--collect-only", "-q"
    )
    ids = [line for line in collected.outlines if "::" in line]
    assert len(ids) == len(_entries())
    assert "issue-43559.parquet::issue-43559[vllm-0.33-gpu]" in ids
    assert "issue-43559.parquet::issue-43559[pre-49502-mooncake]" in ids
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--replay-corpus", "-q", "-k", "issue-43559"
    )
    result.assert_outcomes(
        passed=len(read_expectations(corpus_dir() / "issue-43559.parquet") or [])
    )
    # Without the option, an empty directory has nothing to collect.
    assert pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q").ret == 5
    # --pyargs names the same shipped directory.
    pyargs = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pyargs", "replay.corpus", "--collect-only", "-q"
    )
    assert len([line for line in pyargs.outlines if "::" in line]) == len(_entries())
