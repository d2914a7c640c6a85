"""Issue 31 and issue 30 item 4 against the real vLLM: a minimized
regression trace guards both caches (the #43559 gates removed from vLLM, one
cache at a time, each fails it), and the drift check agrees with an
unmodified vLLM and catches a mutated one, writing a trace that fails on it.

The mutants are applied to the installed vLLM at import time in the
subprocess that runs ``replay`` (``python -m mutants.replay``); vLLM's files
are never edited."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.vllm_modules import replay_under_mutant

pytest.importorskip("vllm", reason="vLLM not importable: run make test-vllm")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
ARCHETYPE = ROOT / "traces" / "archetype-full-mamba.parquet"


def test_a_minimized_trace_fails_under_each_gate_removal_in_its_cache(tmp_path: Path) -> None:
    """The issue's case: request s116-t1 of the full + Mamba archetype,
    shrunk under pre-49502, pins vllm-0.33 in both caches at the original
    lookup's hit; with the engine's gate removed vLLM fails it in the gpu
    cache, with the mirror's (#49502) in the mooncake cache; unmodified,
    it passes."""
    from replay.analysis.expectations import cause_shape, read_expectations

    small = tmp_path / "small.parquet"
    made = replay_under_mutant(
        "minimize", str(ARCHETYPE), "--request", "s116-t1", "--policy", "pre-49502",
        "--flag", "mamba_overrun", "-o", str(small), cwd=tmp_path,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    pinned = {
        (e["policy"], e["cache"]): e["hits"]["s116-t1"] for e in read_expectations(small) or []
    }
    assert pinned == {
        ("vllm-0.33", "gpu"): 0,
        ("vllm-0.33", "mooncake"): 0,
        ("pre-49502", "gpu"): 656,
        ("pre-49502", "mooncake"): 656,
        ("pre-32802", "gpu"): 0,
        ("vllm-0.34", "gpu"): 0,
        ("vllm-0.34", "mooncake"): 0,
    }
    clean = replay_under_mutant("test", "--coordinator", "vllm", str(small), cwd=tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert clean.stdout.splitlines()[-1].startswith("3 passed, 0 failed, 4 skipped")
    # The failure names the vLLM function whose answer differs (issue 31):
    # the Mamba finder asked one block past the verified 640 tokens.
    cause = (
        "vLLM's fixed point called MambaManager.find_longest_cache_hit(max_length=656, "
        "drop_eagle_block=True) (spec group 1), which returned 656; vllm-0.33's calls its "
        "mamba finder (spec group 1) with max_length=640, drop=True, which returns 0"
    )
    # The engine's gate removed fails vllm-0.33 and vllm-0.34 (0.33.0's engine
    # rules) in the gpu cache; the mirror's only vllm-0.33 in the mooncake cache.
    for mutant, cache, summary in (
        ("engine-no-mamba-gate", "gpu", "1 passed, 2 failed, 4 skipped"),
        ("mirror-no-mamba-gate", "mooncake", "2 passed, 1 failed, 4 skipped"),
    ):
        got = replay_under_mutant(
            "test", "--coordinator", "vllm", str(small), cwd=tmp_path, mutant=mutant
        )
        assert got.returncode == 1, (mutant, got.stderr)
        assert got.stdout.splitlines()[:4] == [
            f"1 lookup in 1 trace differ under policy vllm-0.33 in the {cache} cache: "
            + str(cause_shape(cause)),
            f"FAILED small.parquet under policy vllm-0.33 in the {cache} cache:",
            f"  cause: {cause}",
            "  flags: expected none, replayed {'eagle_not_dropped': 1, 'mamba_overrun': 1}",
        ], mutant
        assert "  request s116-t1: expected hit 0, replayed 656" in got.stdout
        assert got.stdout.splitlines()[-1].startswith(summary), mutant


DRIFT = re.compile(
    r"drift check: 40 random configurations \(seed 7\), ([\d,]+) lookups through vLLM "
    r"(\S+) and policy vllm-0\.33: ([\d,]+) agreed \([\d.]+%; gpu [\d,]+/[\d,]+, "
    r"mooncake [\d,]+/[\d,]+\) in [\d.]+ s"
)


def test_the_drift_check_agrees_with_an_unmodified_vllm(tmp_path: Path) -> None:
    got = replay_under_mutant(
        "test", "--coordinator", "vllm", "--random", "40", "--seed", "7", cwd=tmp_path
    )
    assert got.returncode == 0, got.stdout + got.stderr
    (line,) = got.stdout.splitlines()
    match = DRIFT.fullmatch(line)
    assert match is not None, line
    lookups, agreed = (int(match.group(i).replace(",", "")) for i in (1, 3))
    assert lookups == agreed > 200
    assert list(tmp_path.iterdir()) == []  # nothing written when nothing differs
    as_json = replay_under_mutant(
        "test", "--coordinator", "vllm", "--random", "40", "--seed", "7", "--json", cwd=tmp_path
    )
    data = json.loads(as_json.stdout)
    assert (data["version"], data["command"], data["trace"], data["first"]) == (
        1,
        "test",
        None,
        None,
    )
    assert (data["scenarios"], data["lookups"], data["agreed"]) == (40, lookups, agreed)
    assert sum(n for n, _ in data["per_cache"].values()) == lookups


def test_the_drift_check_catches_a_mutated_finder_and_writes_a_failing_trace(
    tmp_path: Path,
) -> None:
    """The full-attention finder searching one block further: the drift
    check exits 1, names the first differing lookup with both answers and
    writes the smallest differing trace; that trace fails on the mutated
    vLLM and passes on the unmodified one."""
    out = tmp_path / "drift.parquet"
    mutant = "full-peeks-one-more-block"
    got = replay_under_mutant(
        "test", "--coordinator", "vllm", "--random", "40", "--seed", "7", "-o", str(out),
        cwd=tmp_path, mutant=mutant,
    )  # fmt: skip
    assert got.returncode == 1, got.stdout + got.stderr
    lines = got.stdout.splitlines()
    match = DRIFT.fullmatch(lines[0])
    assert match is not None, lines[0]
    assert int(match.group(3).replace(",", "")) < int(match.group(1).replace(",", ""))
    assert re.fullmatch(
        r"[\d,]+ configuration x cache pairs differ; the first: configuration \d+, request "
        r"s\d+-l\d+, (gpu|mooncake) cache:",
        lines[1],
    ), lines[1]
    assert lines[2].startswith("  policy vllm-0.33: hit ")
    assert lines[3].startswith(f"  vLLM {match.group(2)}: hit ")
    assert lines[2].split(": ", 1)[1] != lines[3].split(": ", 1)[1]
    assert lines[4].startswith("wrote the smallest differing trace (")
    assert f"events) to {out}: " in lines[4]
    assert lines[5] == f"  replay test --coordinator vllm {out}"
    failing = replay_under_mutant(
        "test", "--coordinator", "vllm", str(out), cwd=tmp_path, mutant=mutant
    )
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert "FAILED drift.parquet under policy vllm-0.33" in failing.stdout
    passing = replay_under_mutant("test", "--coordinator", "vllm", str(out), cwd=tmp_path)
    assert passing.returncode == 0, passing.stdout + passing.stderr
