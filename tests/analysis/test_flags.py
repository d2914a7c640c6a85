"""Flags: minimal cases for each kind, #43559 under every policy, the false
alarm the store-based definition raised, and the checker against a
plain-Python restatement of the definitions on random traces."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from replay.analysis.flags import (
    FLAG_KINDS,
    Layout,
    add_flags,
    flag_counts,
    flag_exprs,
    recompute_flags,
    result_flags,
)
from replay.base.errors import ConfigError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.format.schema import FACT_COLUMNS
from replay.format.writer import write_trace
from replay.rules.coordinator import Coordinator, policy_rules
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
    seeds,
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
    # pre-32802 (vllm-0.16, engine only) drops once more per pass, but a
    # simple hybrid stops after one.
    assert _flags(tmp_path, full_mamba(), issue_43559_rows(), "pre-32802", "gpu").height == 0


def test_check_cli_exit_codes_and_json(trace_43559: Path) -> None:
    ok = run_cli(["check", str(trace_43559)])
    assert (ok.exit_code, ok.stdout) == (0, f"{trace_43559}: clean under vllm-0.33 (no flags)\n")
    bad = run_cli(["check", str(trace_43559), "--policy", "pre-49502", "--json"])
    assert bad.exit_code == 1
    import json

    data = json.loads(bad.stdout)
    (variant,) = data["variants"]
    assert variant["flags"] == [
        {"flag": "mamba_overrun", "severity": "corruption", "lookups": 1, "fails": True},
        {"flag": "eagle_not_dropped", "severity": "performance", "lookups": 1, "fails": False},
    ]
    assert variant["flagged"][0] | {"detail": ""} == {
        "seq": 2,
        "request_id": "req-43559",
        "flag": "mamba_overrun",
        "group_id": 1,
        "hit_tokens": 64,
        "max_length": 64,
        "actual": 64,
        "expected": 48,
        "detail": "",
        "severity": "corruption",
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
        == f"{out}: 1 flagged lookup under pre-49502: mamba_overrun 1 (corruption), eagle_not_dropped 1 (performance)"
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
    No release had partial hits and Mamba's margin together (both changed in
    #46384 and #49502); vLLM 0.33.0 with the gate removed (the mutants'
    emulation) does. Full attention verifies 8 tokens (its drop of one unit),
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
    pre = replay_trace(path, policy="vllm-0.33-no-mamba-gate")
    assert pre.results.select("hit_tokens", "mask_blocks", "group_hit_tokens").rows() == [
        (16, [2, 1], [16, 8])
    ]
    assert result_flags(pre).select("flag", "group_id", "actual").rows() == [
        ("eagle_not_dropped", 1, 16)
    ]
    fixed = replay_trace(path)
    assert fixed.results["hit_tokens"].to_list() == [8]
    assert result_flags(fixed).height == 0


def test_swa_mamba_overrun_past_the_retried_hit(tmp_path: Path) -> None:
    config = builders.config(sw(16, 32), mb(16), eagle=True, check=None)
    hs = chain(6)
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": hs},
        {"kind": "store", "group_id": 1, "block_hashes": hs},
        {"kind": "lookup", "request_id": "r", "block_hashes": hs[:5], "max_length": 79},
    ]
    assert _flags(tmp_path, config, rows).height == 0
    # The releases with the overrun (pre-49502) capped the peek at
    # max_length: nothing to flag here. vLLM 0.33.0 without the Mamba gate
    # (the mutants' emulation): the store worker's lookup of the 80-token
    # prompt hits it whole, so it looks again at 64, where Mamba peeks to
    # 80: the hit is 64 and Mamba resumes at 80, past it and past the 64
    # tokens the window's KV covers.
    assert replay_trace(
        write_trace(tmp_path / "t.parquet", config, rows), policy="pre-49502"
    ).results.select("hit_tokens", "group_hit_tokens").rows() == [(64, [64, 64])]
    assert _flags(tmp_path, config, rows, "pre-49502").height == 0
    pre = _flags(tmp_path, config, rows, "vllm-0.33-no-mamba-gate")
    assert pre.select("flag", "group_id", "actual", "expected").rows() == [
        ("mamba_overrun", 1, 80, 64),
        ("mamba_state_mismatch", 1, 80, 64),
    ]
    assert pre["detail"][0] == "group 1 resumes Mamba state at 80, 16 tokens past the hit 64"


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
    assert replay_trace(path, policy="pre-32802", cache="gpu").results["hit_tokens"].to_list() == [
        0
    ]
    assert result_flags(replay_trace(path, policy="pre-32802", cache="gpu")).height == 0
    with pytest.raises(ConfigError, match=r"pre-32802 .* has no Mooncake store mirror"):
        replay_trace(path, policy="pre-32802", cache="mooncake")


@pytest.mark.parametrize("seed", seeds(60))
@pytest.mark.parametrize(
    ("cache", "policy"),
    [
        *(
            (c, p)
            for c in ("mooncake", "gpu")
            for p in ("vllm-0.33", "pre-49502", "vllm-0.33-no-mamba-gate")
        ),
        ("gpu", "pre-32802"),
    ],
)
def test_flags_agree_with_plain_python_on_random_traces(
    tmp_path: Path, seed: int, policy: str, cache: str
) -> None:
    rng = random.Random(1000 + seed)
    config = random_config(rng)
    rows = random_rows(rng, config, 16)
    path = write_trace(tmp_path / "r.parquet", config, rows)
    try:
        Coordinator(config, policy, cache)
    except ConfigError as exc:  # a configuration these releases refuse: said as such
        with pytest.raises(ConfigError, match=re.escape(str(exc))):
            replay_trace(path, policy=policy, cache=cache)
        return
    result = replay_trace(path, policy=policy, cache=cache, unit_present=True)
    flags = result_flags(result)
    got = {(s, f, g) for s, f, g in flags.select("seq", "flag", "group_id").rows()}
    # Judged by the rules of the policy that answered (its alignment, its
    # partial hits), as the replay's facts are.
    rules = policy_rules(policy, cache)
    assert got == plain_flags(rows, result.results, config, rules)
    assert set(flags["flag"].unique()) <= set(FLAG_KINDS)
    if policy == "vllm-0.33":
        # vLLM 0.33 never overruns: the #49502 fix holds on any store state.
        assert "mamba_overrun" not in flags["flag"].to_list()
    # What the replay wrote is what the checker computes from the results.
    assert recompute_flags(result.results, config, rules).equals(flags)


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


# --- the registry and the facts (issue 21) -----------------------------------


def test_every_flag_is_one_registry_entry_with_a_severity() -> None:
    from replay.analysis.flags import FLAGS

    assert (
        tuple(FLAGS)
        == FLAG_KINDS
        == (
            "mamba_overrun",
            "mamba_state_mismatch",
            "hit_beyond_max_length",
            "hit_misaligned",
            "missing_block",
            "eagle_not_dropped",
            "observed_mismatch",
        )
    )
    assert {k.name: k.severity for k in FLAGS.values()} == {
        "mamba_overrun": "corruption",
        "mamba_state_mismatch": "inconsistent",
        "hit_beyond_max_length": "inconsistent",
        "hit_misaligned": "inconsistent",
        "missing_block": "corruption",
        "eagle_not_dropped": "performance",
        "observed_mismatch": "observed",
    }


def test_the_43559_lookup_carries_its_facts(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.parquet", full_mamba(), issue_43559_rows())
    row = replay_trace(path, policy="pre-49502").results.row(0, named=True)
    assert {k: row[k] for k in FACT_COLUMNS} == {
        "hit_alignment": 16,
        "group_state_tokens": [None, 64],
        "attention_tokens": 48,
        "first_absent_block": [None, None],
        "eagle_unit_present": [False, None],
    }
    assert row["flags"] == ["mamba_overrun", "eagle_not_dropped"]


def test_a_flag_is_one_expression_and_the_expression_matches_its_details(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new registry entry is all a new flag takes; and on random traces
    each flag's expression holds exactly where it has details."""
    from replay.analysis.flags import FLAGS, FlagKind, Layout, add_flags, flag_exprs
    from replay.engine.run import ReplayOptions, replay

    rng = random.Random(77)
    for i in range(12):
        config = random_config(rng)
        path = write_trace(tmp_path / f"r{i}.parquet", config, random_rows(rng, config, 20))
        (result,) = replay(path, ReplayOptions(policies=("pre-49502",)))
        layout = Layout.of(config)
        frame = result.results.with_columns(flag_exprs(layout)[1])
        for name, kind in FLAGS.items():
            got = frame.select(kind.expression(layout).alias("x"))["x"].to_list()
            has = frame["flag_details"].list.eval(pl.element().struct.field("flag") == name)
            assert got == has.list.any().to_list()

    def no_hit(layout: Layout) -> list[tuple[pl.Expr, pl.Expr]]:
        h = pl.col("hit_tokens")
        text = pl.format("hit {} of {}", h, pl.col("max_length"))
        detail = pl.struct(
            pl.lit("no_hit").alias("flag"),
            pl.lit(None, pl.Int32).alias("group_id"),
            h.alias("actual"),
            pl.lit(None, pl.Int64).alias("expected"),
            text.alias("detail"),
        )
        return [((h == 0) & (pl.col("max_length") > 0), detail)]

    monkeypatch.setitem(FLAGS, "no_hit", FlagKind("no_hit", "performance", "no hit", no_hit))
    path = write_trace(tmp_path / "t.parquet", full_mamba(), issue_43559_rows())
    (result,) = replay(path)
    flagged = add_flags(
        result.results.with_columns(pl.lit(0, pl.Int64).alias("hit_tokens")), result.config
    )
    flags, details = flagged.select("flags", "flag_details").row(0)
    assert flags == ["mamba_overrun", "mamba_state_mismatch", "no_hit"]
    assert details[-1] == {
        "flag": "no_hit",
        "group_id": None,
        "actual": 0,
        "expected": None,
        "detail": "hit 0 of 64",
    }


def test_results_files_with_and_without_facts(tmp_path: Path) -> None:
    """A file with facts has its flags recomputed from them (a flags column
    edited by hand does not count); a file from before the facts keeps the
    flags it was written with."""
    import pyarrow.parquet as pq

    from replay.analysis.check import check_path
    from replay.format.link import save_results

    path = write_trace(tmp_path / "t.parquet", full_mamba(), issue_43559_rows())
    out = save_results(replay_trace(path, policy="pre-49502"), tmp_path / "t.results.parquet")
    table = pq.read_table(out)
    empty = pl.Series([[]], dtype=pl.List(pl.String)).to_arrow()
    i = table.schema.get_field_index("flags")
    tampered = table.set_column(i, table.schema.field(i), empty.cast(table.schema.field(i).type))
    pq.write_table(tampered, tmp_path / "edited.results.parquet")
    flags, _ = check_path(tmp_path / "edited.results.parquet", policy=None)
    assert flags["flag"].to_list() == ["mamba_overrun", "eagle_not_dropped"]
    # Before the facts: the file's own flag_details, numbers and all.
    old = table.drop_columns(list(FACT_COLUMNS))
    pq.write_table(old, tmp_path / "old.results.parquet")
    flags, _ = check_path(tmp_path / "old.results.parquet", policy=None)
    assert flags.select("flag", "group_id", "actual", "expected").rows() == [
        ("mamba_overrun", 1, 64, 48),
        ("eagle_not_dropped", 0, 64, None),
    ]
    # The facts come together.
    pq.write_table(table.drop_columns(["attention_tokens"]), tmp_path / "part.results.parquet")
    bad = run_cli(["check", str(tmp_path / "part.results.parquet")])
    assert bad.exit_code == 2
    assert "missing column 'attention_tokens' (the facts columns" in bad.stderr


def test_details_of_the_flagged_lookups_alone_are_the_whole_frames_33(tmp_path: Path) -> None:
    # add_flags works the details out for the flagged lookups only (their
    # plan is most of a small batch's cost in replay watch): the same frame.
    hs = chain(4, "two")
    miss = {"kind": "lookup", "request_id": "miss", "block_hashes": hs, "max_length": 63}
    rows = [miss, *issue_43559_rows(), {**miss, "request_id": "miss-2"}]
    path = write_trace(tmp_path / "t.parquet", full_mamba(), rows)
    result = replay_trace(path, policy="pre-49502")
    judged = add_flags(result.results, result.config)
    whole = (
        result.results.lazy()
        .with_columns(*flag_exprs(Layout.of(result.config)))
        .collect()
        .select(judged.columns)
    )
    assert judged.equals(whole)
    assert [[d["flag"] for d in ds] for ds in judged["flag_details"]] == [
        [], ["mamba_overrun", "eagle_not_dropped"], []
    ]  # fmt: skip
    none = add_flags(result.results.filter(pl.col("request_id") != "req-43559"), result.config)
    assert none["flag_details"].to_list() == [[], []]
    assert none["flag_details"].dtype == judged["flag_details"].dtype
