"""`replay run --coordinator vllm` and the reference give identical results,
in both caches, under the policy of the installed vLLM release (the backend
answers only as that release: vLLM's code is not patched, so the emulations
have no oracle); the flags computed from vLLM's own answers equal a plain
restatement of their definitions."""

from __future__ import annotations

import random
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from replay.analysis.flags import result_flags
from replay.format.results import read_results
from replay.format.writer import write_trace
from tests.builders import random_config, random_rows, replay_trace
from tests.conftest import run_cli
from tests.flagdefs import plain_flags

pytest.importorskip("vllm", reason="vLLM not importable: run make test-vllm")
pytestmark = pytest.mark.vllm

TRACES = sorted(Path(__file__).parent.parent.parent.joinpath("traces").glob("*.parquet"))


def _installed() -> str:
    from replay.adapters.vllm.backend import installed_vllm_version
    from replay.rules.coordinator import policy_for_version

    return policy_for_version(installed_vllm_version()).name


INSTALLED = _installed()
POLICIES = [INSTALLED]
CACHES = ["gpu", "mooncake"]


def _same_results(path: Path, policy: str, tmp_path: Path, cache: str = "mooncake") -> None:
    ref, out = tmp_path / "ref.parquet", tmp_path / "vllm.parquet"
    for coordinator, target in (("reference", ref), ("vllm", out)):
        args = [
            "run",
            str(path),
            "--coordinator",
            coordinator,
            "--policy",
            policy,
            "--cache",
            cache,
            "-o",
            str(target),
            "-q",
        ]
        result = run_cli(args)
        assert result.exit_code == 0, result.output
    a, meta_a = read_results(ref)
    b, meta_b = read_results(out)
    assert (meta_a["coordinator"], meta_b["coordinator"]) == ("reference", "vllm")
    assert (meta_a["cache"], meta_b["cache"]) == (cache, cache)
    assert (a["coordinator"].unique().to_list(), b["coordinator"].unique().to_list()) == (
        ["reference"],
        ["vllm"],
    )
    assert_frame_equal(a.drop("coordinator"), b.drop("coordinator"))


@pytest.mark.parametrize("trace", TRACES, ids=[t.stem for t in TRACES])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cache", CACHES)
def test_regression_traces_identical_through_vllm(
    trace: Path, policy: str, cache: str, tmp_path: Path
) -> None:
    from replay.base.errors import ConfigError
    from replay.format.tracedir import open_trace
    from replay.rules.coordinator import check_config

    try:
        check_config(open_trace(trace).config, cache)
    except ConfigError as exc:  # a trace whose configuration only the other cache takes
        pytest.skip(f"{trace.name}: not a {cache} configuration ({exc})")
    _same_results(trace, policy, tmp_path, cache)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cache", CACHES)
def test_random_traces_identical_through_vllm(
    seed: int, policy: str, cache: str, tmp_path: Path
) -> None:
    rng = random.Random(7000 + seed)
    config = random_config(rng)
    path = write_trace(
        tmp_path / "r.parquet", config, random_rows(rng, config, 20, request_shaped=True)
    )
    _same_results(path, policy, tmp_path, cache)
    assert pl.read_parquet(tmp_path / "vllm.parquet").height == 20


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cache", CACHES)
def test_flags_of_vllms_answers_match_their_definition(
    seed: int, policy: str, cache: str, tmp_path: Path
) -> None:
    """The answers come from vLLM's own coordinator; the flags the replay
    computed for them must be what the definitions say, checked by a plain
    fold of the rows and vLLM's masks."""
    rng = random.Random(9000 + seed)
    config = random_config(rng)
    rows = random_rows(rng, config, 16, request_shaped=True)
    path = write_trace(tmp_path / "r.parquet", config, rows)
    result = replay_trace(path, policy=policy, coordinator="vllm", cache=cache)
    got = {(s, f, g) for s, f, g in result_flags(result).select("seq", "flag", "group_id").rows()}
    assert got == plain_flags(rows, result.results, config, cache)


@pytest.mark.parametrize("seed", range(10))
def test_vllm_and_the_reference_answer_from_one_fold(seed: int, tmp_path: Path) -> None:
    """Both coordinators in one pass (as `replay diff --coordinator reference
    --coordinator vllm` runs them): vLLM asks by hash, answered from the
    same presence bytes, and agrees with the reference on every column but
    the coordinator's name; explain answers by hash too."""
    from replay.analysis.flags import flag_results, lookup_flags
    from replay.engine.replay import explain_lookups
    from replay.engine.run import ReplayOptions, Variant, replay
    from replay.format.tracedir import open_trace

    rng = random.Random(9500 + seed)
    config = random_config(rng)
    path = write_trace(
        tmp_path / "r.parquet", config, random_rows(rng, config, 16, request_shaped=True)
    )
    reader = open_trace(path)
    variants = tuple(
        Variant(policy=p, cache=c, coordinator=k)
        for p in POLICIES
        for c in CACHES
        for k in ("reference", "vllm")
    )
    got = flag_results(replay(reader, ReplayOptions(variants=variants, unit_present=True)))
    for ref, theirs in zip(got[::2], got[1::2], strict=True):
        assert (ref.coordinator, theirs.coordinator) == ("reference", "vllm")
        want = replay_trace(path, policy=ref.policy, cache=ref.cache, unit_present=True)
        assert ref.results.equals(want.results)
        assert theirs.results.drop("coordinator").equals(ref.results.drop("coordinator"))
    _, explained = explain_lookups(reader, lambda e: True, INSTALLED, "vllm", cache="gpu")
    gpu = got[1].results
    assert (got[1].policy, got[1].cache, got[1].coordinator) == (INSTALLED, "gpu", "vllm")
    assert [o.hit_tokens for _, o, _ in explained] == gpu["hit_tokens"].to_list()
    flags = [
        [f.flag for f in lookup_flags(config, "gpu", o, facts, e.max_length, e.observed_hit_tokens)]
        for e, o, facts in explained
    ]
    assert flags == gpu["flags"].to_list()
