"""Flags: minimal cases for each kind, #43559 under every policy, the false
alarm the store-based definition raised, and the checker against a
plain-Python restatement of the definitions on random traces."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from analysis.flags import FLAG_KINDS, flag_counts, recompute_flags, result_flags
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.format.writer import write_trace
from tests import builders
from tests.builders import (
    MAMBA,
    SWA,
    chain,
    full_mamba,
    issue_43559_rows,
    mb,
    random_config,
    random_rows,
    replay_trace,
    sw,
)
from tests.conftest import run_cli
from tests.flagdefs import plain_flags

FULL = GroupKind.FULL_ATTENTION


def _flags(
    tmp_path: Path,
    config: TraceConfig,
    rows: list[dict[str, Any]],
    policy: str = "vllm-0.33",
    cache: str | None = None,
) -> pl.DataFrame:
    path = write_trace(tmp_path / "t.parquet", config, rows)
    return result_flags(replay_trace(path, policy=policy, cache=cache))


def test_mamba_overrun_43559_flagged_under_pre_49502_only(tmp_path: Path) -> None:
    for cache in ("mooncake", "gpu"):
        assert _flags(tmp_path, full_mamba(), issue_43559_rows(), cache=cache).height == 0
        bad = _flags(tmp_path, full_mamba(), issue_43559_rows(), "pre-49502", cache)
        assert bad.select("flag", "group_id", "actual", "expected").rows() == [
            ("mamba_overrun", 1, 64, 48),
            ("eagle_not_dropped", 0, 64, None),
        ]
        assert bad["detail"][0] == (
            "group 1 resumes Mamba state at 64, 16 tokens past the attention KV loaded for "
            "48 tokens"
        )
    # pre-32802 drops once more per pass, but a simple hybrid stops after one.
    assert _flags(tmp_path, full_mamba(), issue_43559_rows(), "pre-32802").height == 0


def test_check_cli_exit_codes_and_json(trace_43559: Path) -> None:
    ok = run_cli(["check", str(trace_43559)])
    assert (ok.exit_code, ok.stdout) == (0, f"{trace_43559}: clean under vllm-0.33 (no flags)\n")
    bad = run_cli(["check", str(trace_43559), "--policy", "pre-49502", "--json"])
    assert bad.exit_code == 1
    import json

    data = json.loads(bad.stdout)
    assert data["counts"] == {"eagle_not_dropped": 1, "mamba_overrun": 1}
    assert data["flags"][0] | {"detail": ""} == {
        "seq": 2,
        "request_id": "req-43559",
        "flag": "mamba_overrun",
        "group_id": 1,
        "hit_tokens": 64,
        "max_length": 64,
        "actual": 64,
        "expected": 48,
        "detail": "",
    }


def test_check_results_file(tmp_path: Path, trace_43559: Path) -> None:
    out = tmp_path / "r.parquet"
    assert (
        run_cli(["run", str(trace_43559), "--policy", "pre-49502", "-o", str(out), "-q"]).exit_code
        == 0
    )
    res = run_cli(["check", str(out)])
    assert res.exit_code == 1
    assert (
        res.stdout.splitlines()[0]
        == f"{out}: 1 flagged lookup(s) under pre-49502 (eagle_not_dropped 1, mamba_overrun 1)"
    )
    frame = pl.read_parquet(out)
    assert frame["flags"].to_list() == [["mamba_overrun", "eagle_not_dropped"]]
    assert [d["flag"] for d in frame["flag_details"][0]] == ["mamba_overrun", "eagle_not_dropped"]


def _result_frame(tmp_path: Path) -> tuple[pl.DataFrame, TraceConfig]:
    path = write_trace(tmp_path / "t.parquet", full_mamba(), issue_43559_rows())
    result = replay_trace(path, unit_present=True)
    return result.results, result.config


# A correct coordinator never raises these: feed the checks a wrong answer,
# as a broken coordinator (or a broken vLLM) would give.
WRONG_ANSWERS: dict[str, tuple[dict[str, Any], tuple[int, int]]] = {
    "hit_beyond_max_length": ({"hit_tokens": 80, "mask_blocks": [5, 5]}, (80, 64)),
    "hit_misaligned": ({"hit_tokens": 40}, (40, 32)),
    "mamba_state_mismatch": ({"hit_tokens": 32, "mask_blocks": [2, 3]}, (48, 32)),
    "observed_mismatch": ({"observed_hit_tokens": 64}, (48, 64)),
}


@pytest.mark.parametrize("flag", sorted(WRONG_ANSWERS))
def test_wrong_answers_are_flagged(tmp_path: Path, flag: str) -> None:
    results, config = _result_frame(tmp_path)
    change, (actual, expected) = WRONG_ANSWERS[flag]
    wrong = results.with_columns(
        [pl.lit(v, dtype=results.schema[k]).alias(k) for k, v in change.items()]
    )
    flags = recompute_flags(wrong, config)
    row = flags.filter(pl.col("flag") == flag)
    assert row.select("actual", "expected").rows() == [(actual, expected)]
    assert recompute_flags(results, config).height == 0


def test_missing_block_when_the_hit_relies_on_an_absent_block(tmp_path: Path) -> None:
    hs = chain(4)
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": [hs[0], hs[2], hs[3]]},
        {"kind": "store", "group_id": 1, "block_hashes": hs},
        {"kind": "lookup", "request_id": "gap", "block_hashes": hs, "max_length": 63},
    ]
    path = write_trace(tmp_path / "t.parquet", full_mamba(eagle=False), rows)
    result = replay_trace(path, unit_present=True)
    assert result.results["hit_tokens"].to_list() == [16]
    # A coordinator that skipped the hole in full attention:
    wrong = result.results.with_columns(
        pl.lit(48, pl.Int64).alias("hit_tokens"),
        pl.lit([3, 3], dtype=pl.List(pl.Int32)).alias("mask_blocks"),
        pl.lit([3, 1], dtype=pl.List(pl.Int32)).alias("loaded_blocks"),
    )
    flags = recompute_flags(wrong, result.config)
    assert flags.filter(pl.col("flag") == "missing_block").select("group_id", "actual").rows() == [
        (0, 1)
    ]
    # One that loaded too little full attention for its hit:
    short = result.results.with_columns(
        pl.lit(48, pl.Int64).alias("hit_tokens"),
        pl.lit([1, 3], dtype=pl.List(pl.Int32)).alias("mask_blocks"),
        pl.lit([1, 1], dtype=pl.List(pl.Int32)).alias("loaded_blocks"),
    )
    flags = recompute_flags(short, result.config)
    assert flags.select("flag", "group_id", "actual", "expected").rows() == [
        ("mamba_overrun", 1, 48, 16)
    ]
    # Without a Mamba group to report it, the short mask is a missing block.
    only_full = TraceConfig(
        groups=(GroupSpec(kind=FULL, block_size=16),), hash_block_size=16, scheduler_block_size=16
    )
    short_full = short.with_columns(
        pl.lit([1], dtype=pl.List(pl.Int32)).alias("mask_blocks"),
        pl.lit([1], dtype=pl.List(pl.Int32)).alias("loaded_blocks"),
        pl.lit([16], dtype=pl.List(pl.Int64)).alias("group_hit_tokens"),
        pl.col("unit_present").list.head(1),
    )
    flags = recompute_flags(short_full, only_full)
    assert flags.select("flag", "group_id", "actual").rows() == [("missing_block", 0, 1)]
    assert flags["detail"][0] == (
        "group 0 (full_attention) block 1 (tokens 16..32) is not in the group's load mask "
        "but the hit of 48 relies on it"
    )


def test_eagle_not_dropped_when_nothing_is_recomputed(tmp_path: Path) -> None:
    results, config = _result_frame(tmp_path)
    wrong = results.with_columns(
        pl.lit(64, pl.Int64).alias("hit_tokens"),
        pl.lit([4, 4], dtype=pl.List(pl.Int32)).alias("mask_blocks"),
    )
    flags = recompute_flags(wrong, config)
    # Full attention loads all four blocks and Mamba resumes at 64: the
    # state is consistent, only the EAGLE drop was skipped.
    assert flag_counts(flags) == {"eagle_not_dropped": 1}


def test_consistent_hit_that_skipped_the_drop_is_not_an_overrun(tmp_path: Path) -> None:
    """Mamba (block 8) + full attention (block 16), partial hits, EAGLE.
    Under pre-49502 full attention verifies 8 tokens (its drop of one unit),
    Mamba peeks to 16, and the hit is 16: full attention loads its block 0
    (tokens 0..16), Mamba resumes at 16. The store-based definition called
    this an overrun (state 16 past the verified 8); the resumed state is
    consistent with the loaded KV, so only the skipped drop is flagged."""
    config = TraceConfig(
        groups=(
            GroupSpec(kind=MAMBA, block_size=8, mamba_cache_mode="align"),
            GroupSpec(kind=FULL, block_size=16),
        ),
        hash_block_size=8,
        scheduler_block_size=32,
        use_eagle=True,
        enable_partial_hash_hits=True,
    )
    hs = chain(2, "junction")
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": hs},
        {"kind": "store", "group_id": 1, "block_hashes": hs},
        {"kind": "lookup", "request_id": "r", "block_hashes": hs, "max_length": 23},
    ]
    path = write_trace(tmp_path / "t.parquet", config, rows)
    pre = replay_trace(path, policy="pre-49502")
    assert pre.results.select("hit_tokens", "mask_blocks", "group_hit_tokens").rows() == [
        (16, [2, 1], [16, 8])
    ]
    assert result_flags(pre).select("flag", "group_id", "actual").rows() == [
        ("eagle_not_dropped", 1, 16)
    ]
    fixed = replay_trace(path)
    assert fixed.results["hit_tokens"].to_list() == [8]
    assert result_flags(fixed).height == 0


def test_swa_mamba_overrun_under_pre_49502(tmp_path: Path) -> None:
    config = builders.config(sw(16, 32), mb(16), eagle=True, check=None)
    hs = chain(6)
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": hs},
        {"kind": "store", "group_id": 1, "block_hashes": hs},
        {"kind": "lookup", "request_id": "r", "block_hashes": hs[:5], "max_length": 79},
    ]
    assert _flags(tmp_path, config, rows).height == 0
    pre = _flags(tmp_path, config, rows, "pre-49502")
    # Before #49502 the hit is the unaligned bound 79 and Mamba resumes at
    # 80, past both the hit and the 64 tokens the window's KV covers.
    assert pre.select("flag", "group_id", "actual", "expected").rows() == [
        ("mamba_overrun", 1, 80, 64),
        ("mamba_state_mismatch", 1, 80, 79),
        ("hit_misaligned", None, 79, 64),
    ]
    assert pre["detail"][0] == (
        "group 1 resumes Mamba state at 80, 16 tokens past the attention KV loaded for 64 tokens"
    )


def test_pre_32802_spirals_the_hit_down(tmp_path: Path) -> None:
    """Full attention + sliding window + Mamba, EAGLE on, eight blocks stored
    in every group: vLLM 0.33 verifies the sliding window once per candidate
    (112 tokens). Before #32802 its finder dropped a block on every pass and
    each pass shrank the candidate again, down to nothing."""
    config = TraceConfig(
        groups=(
            GroupSpec(kind=FULL, block_size=16),
            GroupSpec(kind=SWA, block_size=16, sliding_window=17),
            GroupSpec(kind=MAMBA, block_size=16, mamba_cache_mode="align"),
        ),
        hash_block_size=16,
        scheduler_block_size=16,
        use_eagle=True,
    )
    hs = chain(8, "spiral")
    rows = [
        *({"kind": "store", "group_id": g, "block_hashes": hs} for g in range(3)),
        {"kind": "lookup", "request_id": "r", "block_hashes": hs, "max_length": 128},
    ]
    path = write_trace(tmp_path / "t.parquet", config, rows)
    assert replay_trace(path).results["hit_tokens"].to_list() == [112]
    assert replay_trace(path, policy="pre-32802").results["hit_tokens"].to_list() == [0]
    for cache in ("mooncake", "gpu"):
        assert result_flags(replay_trace(path, policy="pre-32802", cache=cache)).height == 0


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("policy", ["vllm-0.33", "pre-49502", "pre-32802"])
@pytest.mark.parametrize("cache", ["mooncake", "gpu"])
def test_flags_agree_with_plain_python_on_random_traces(
    tmp_path: Path, seed: int, policy: str, cache: str
) -> None:
    rng = random.Random(1000 + seed)
    config = random_config(rng)
    rows = random_rows(rng, config, 16)
    path = write_trace(tmp_path / "r.parquet", config, rows)
    result = replay_trace(path, policy=policy, cache=cache, unit_present=True)
    flags = result_flags(result)
    got = {(s, f, g) for s, f, g in flags.select("seq", "flag", "group_id").rows()}
    assert got == plain_flags(rows, result.results, config, cache)
    assert set(flags["flag"].unique()) <= set(FLAG_KINDS)
    if policy == "vllm-0.33":
        # vLLM 0.33 never overruns: the #49502 fix holds on any store state.
        assert "mamba_overrun" not in flags["flag"].to_list()
    # What the replay wrote is what the checker computes from the results.
    assert recompute_flags(result.results, config, cache).equals(flags)


def test_flag_column_lists_each_lookups_flags(tmp_path: Path) -> None:
    hs = chain(4, "two")
    rows = [
        *issue_43559_rows(),
        {"kind": "lookup", "request_id": "miss", "block_hashes": hs, "max_length": 63},
    ]
    path = write_trace(tmp_path / "t.parquet", full_mamba(), rows)
    result = replay_trace(path, policy="pre-49502")
    assert result.results.select("request_id", "flags").rows() == [
        ("req-43559", ["mamba_overrun", "eagle_not_dropped"]),
        ("miss", []),
    ]
