"""The store side per release (``replay.rules.coordinator.stores``): what a
prefill leaves behind in each release range, where it departs from 0.33.0,
and ``synth``/importers/``whatif`` producing a named release's stores."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from replay.base.errors import ConfigError
from replay.base.spec import TraceConfig
from replay.format.sweepfile import read_sweep
from replay.format.tracedir import open_trace
from replay.rules.coordinator import RELEASES, policy_for_version
from replay.rules.coordinator.stores import RELEASE_STORES, STORES_033, policy_stores
from replay.rules.store_rules import StoreRules, StoreSettings
from replay.sources.archetypes import archetype_config
from tests.conftest import run_cli


def _stores(
    model: str,
    policy: str,
    cache: str,
    *,
    n: int,
    hit: int,
    retention: int | None,
    eagle: bool = False,
    junction: int = 0,
) -> list[list[int]]:
    config = archetype_config(model, 16, None, eagle, sliding_window=32)
    rules = StoreRules(
        config, StoreSettings(retention_interval=retention, cache=cache, policy=policy)
    )
    got = rules.stores(num_tokens=n, hit_tokens=hit, junction_tokens=junction)
    return [[int(b) for b in blocks] for blocks in got]


def test_every_release_policy_has_its_stores_and_an_alias_its_releases() -> None:
    assert set(RELEASE_STORES) == {p.name for p in RELEASES}
    assert policy_stores("vllm-0.33") == STORES_033
    # An alias stores as the release it stands for, per cache.
    assert policy_stores("pre-49502", "gpu") == RELEASE_STORES["vllm-0.24"]
    assert policy_stores("pre-49502", "mooncake") == RELEASE_STORES["vllm-0.26"]
    assert policy_stores("pre-32802", "gpu") == RELEASE_STORES["vllm-0.16"]
    # 0.34.0 stores as 0.33.0 (what is modelled of the stores did not change);
    # identical to 0.33.0 nowhere else: each older range departs in a field.
    assert policy_stores("vllm-0.34") == STORES_033
    assert all(policy_stores(p.name) != STORES_033 for p in RELEASES[:-2])


@pytest.mark.parametrize(
    ("policy", "default"),
    [
        ("vllm-0.16", None),
        ("vllm-0.23", None),
        ("vllm-0.24", None),
        ("vllm-0.28", None),
        ("vllm-0.29", 0),
    ],
)
def test_the_default_retention_is_dense_until_the_config_field_of_029(
    policy: str, default: int | None
) -> None:
    assert policy_stores(policy).default_retention == default


def test_the_mooncake_store_saves_mamba_by_its_mask_before_the_handoffs_of_029() -> None:
    # 100 tokens from a 32-token hit, dense: 0.29.0 on, the store gets only
    # the states the engine caches (the prefill's one chunk ends at the
    # checkpoint, 96: block 5); before, every state block past the hit.
    after = _stores("full+mamba", "vllm-0.29", "mooncake", n=100, hit=32, retention=None)
    before = _stores("full+mamba", "vllm-0.28", "mooncake", n=100, hit=32, retention=None)
    assert after == [[2, 3, 4, 5], [5]]
    assert before == [[2, 3, 4, 5], [2, 3, 4, 5]]


def test_mamba_stops_at_the_checkpoint_below_n_minus_1_from_032() -> None:
    # A 64-token block-aligned prompt, retention 0: 0.32.0 on, the prefill
    # stops at 48 (a resend's hit is capped at 63) and keeps that state;
    # before, its one chunk ends at 64, whose state the mask drops (the
    # replay boundary 63 wants 48's): nothing a resend could resume from.
    assert _stores("full+mamba", "vllm-0.32", "gpu", n=64, hit=0, retention=0)[1] == [2]
    assert _stores("full+mamba", "vllm-0.30", "gpu", n=64, hit=0, retention=0)[1] == []
    # Dense, both releases keep the state at 64; 0.32.0 also the one at 48.
    assert _stores("full+mamba", "vllm-0.32", "gpu", n=64, hit=0, retention=None)[1] == [2, 3]
    assert _stores("full+mamba", "vllm-0.30", "gpu", n=64, hit=0, retention=None)[1] == [3]


def test_the_kept_checkpoint_state_is_the_tail_hash_unit_from_032() -> None:
    # Full attention + sliding window (flagged, EAGLE off) + Mamba, 16-token
    # blocks, retention 0, 80 tokens a step: the flagged replay boundaries sit
    # one block below the checkpoint (272 for 299 tokens, 96 for 124), and
    # the scheduler stops at the checkpoint (288, 112). The engine keys the
    # state at the prompt's last reusable *hash unit*: with 16-token units
    # that is the stop, kept; with 8-token units it is mid-block (296, 120)
    # and the stop's state is dropped, junction or not.
    def mamba(hbs: int, n: int, junction: int = 0) -> list[int]:
        config = archetype_config(
            "full+swa+mamba", 16, hbs, False, sliding_window=128, extra_retained_tokens=8
        )
        groups = list(config.groups)
        groups[1] = replace(groups[1], is_eagle_group=True)
        settings = StoreSettings(
            retention_interval=0, max_num_batched_tokens=80, cache="gpu", policy="vllm-0.32"
        )
        rules = StoreRules(replace(config, groups=tuple(groups)), settings)
        got = rules.stores(num_tokens=n, hit_tokens=0, junction_tokens=junction)
        return [int(b) for b in got[2]]

    assert mamba(16, 299) == [17]
    assert mamba(16, 124) == [6]
    assert mamba(8, 299) == []
    assert mamba(8, 124) == []
    # The two requests of vLLM 0.32.0's writer differential: only the
    # junction's state (64: block 3; 16: block 0) and a boundary that is a
    # chunk end (96: block 5).
    assert mamba(8, 299, junction=64) == [3]
    assert mamba(8, 124, junction=16) == [0, 5]
    # A tail unit on a block edge is kept: 100 tokens, 8-token units, 96.
    assert mamba(8, 100) == [4, 5]


@pytest.mark.parametrize("policy", ["vllm-0.32", "vllm-0.33"])
def test_with_eagle_the_tail_hash_unit_is_a_block_above_the_checkpoint(policy: str) -> None:
    # EAGLE, 8-token units, 16 tokens a step, retention 0, 40 tokens: the
    # scheduler's checkpoint is 16 (block 0, also the replay boundary), the
    # tail unit 32 (40 floored to a unit, one unit lower); the step ending at
    # 32 keys that state too (vLLM 0.32.0 and 0.33.0 store blocks 0 and 1).
    config = archetype_config("full+swa+mamba", 16, 8, True, sliding_window=128)
    settings = StoreSettings(
        retention_interval=0, max_num_batched_tokens=16, cache="gpu", policy=policy
    )
    got = StoreRules(config, settings).stores(num_tokens=40, hit_tokens=0)
    assert [int(b) for b in got[2]] == [0, 1]


def test_sliding_window_keeps_the_eagle_replay_boundaries_from_030() -> None:
    # Retention 0, EAGLE, 64 tokens: 0.30.0 on, the tails one block below the
    # resend's (48) and the extension's (64) aligned hits; before, the one
    # tail at num_prompt_tokens - 1 (63, aligned 48), shifted for EAGLE.
    new = _stores("full+swa", "vllm-0.30", "gpu", n=64, hit=0, retention=0, eagle=True)
    old = _stores("full+swa", "vllm-0.29", "gpu", n=64, hit=0, retention=0, eagle=True)
    assert new[1] == [0, 1, 2, 3]
    assert old[1] == [1, 2, 3]


def test_the_junction_is_kept_from_026_and_its_eagle_block_from_033() -> None:
    # Window 32 in 16-token blocks with EAGLE: a hit needs a 3-block tail,
    # shifted one block up. 200 tokens, retention 0, junction at 96.
    args: dict[str, Any] = {"n": 200, "hit": 0, "retention": 0, "eagle": True, "junction": 96}
    # Before 0.26.0: only the tail at the replay boundary 199 (aligned 192).
    assert _stores("full+swa", "vllm-0.23", "gpu", **args)[1] == [10, 11]
    # 0.26.0: and the junction's tail.
    assert _stores("full+swa", "vllm-0.26", "gpu", **args)[1] == [4, 5, 6, 10, 11]
    # 0.30.0: the EAGLE replay boundaries (176) instead of 192.
    assert _stores("full+swa", "vllm-0.32", "gpu", **args)[1] == [4, 5, 6, 9, 10, 11]
    # 0.33.0: and the tail one block below the junction (80).
    assert _stores("full+swa", "vllm-0.33", "gpu", **args)[1] == [3, 4, 5, 6, 9, 10, 11]


def test_before_023_eagle_caches_no_block_past_the_aligned_end() -> None:
    config = archetype_config("full+swa", 16, None, True, sliding_window=32)
    old = StoreRules(config, StoreSettings(retention_interval=None, policy="vllm-0.22"))
    new = StoreRules(config, StoreSettings(retention_interval=None, policy="vllm-0.23"))
    assert old.cacheable_tokens(old.groups[0], 40) == 32
    assert new.cacheable_tokens(new.groups[0], 40) == 40


def test_a_retention_a_release_could_not_be_given_is_refused() -> None:
    config = archetype_config("full+swa", 16, None, False, sliding_window=32)
    with pytest.raises(ConfigError, match=r"vLLM 0.16.0 - 0.19.1 has no prefix_cache_retention"):
        StoreRules(config, StoreSettings(retention_interval=0, cache="gpu", policy="vllm-0.16"))
    full = archetype_config("full", 16, None, False)
    with pytest.raises(ConfigError, match=r"refuses VLLM_PREFIX_CACHE_RETENTION_INTERVAL"):
        StoreRules(full, StoreSettings(retention_interval=0, policy="vllm-0.26"))
    with pytest.raises(ConfigError, match=r"has no Mooncake store mirror"):
        StoreSettings(retention_interval=None, cache="mooncake", policy="vllm-0.20")


def _stored_keys(frame: Any) -> int:
    stores = frame.filter(frame["kind"] == "store")
    return int(stores["block_hashes"].list.len().sum())


def test_synth_produces_a_named_releases_stores_and_run_answers_as_it(tmp_path: Path) -> None:
    out = tmp_path / "t.parquet"
    args: list[str | Path] = [
        "synth",
        "-o",
        out,
        "--model",
        "full+mamba",
        "--requests",
        "60",
        "--seed",
        "3",
    ]
    result = run_cli([*args, "--vllm", "0.26.0"])
    assert result.exit_code == 0, result.output
    source = open_trace(out).config.source or {}
    assert source["vllm_version"] == "0.26.0"
    assert source["policy"] == "vllm-0.26"
    assert source["retention_interval"] is None  # 0.26.0's default: dense
    # The same seed under 0.33.0 stores fewer Mamba states (hand-offs only).
    other = tmp_path / "u.parquet"
    assert run_cli([*args[:2], other, *args[3:]]).exit_code == 0
    mine = open_trace(out).read_frame()
    theirs = open_trace(other).read_frame()
    assert _stored_keys(mine) > _stored_keys(theirs)
    run = run_cli(["run", out, "-o", tmp_path / "r.parquet", "--json"])
    assert run.exit_code == 0, run.output
    assert run.stderr.splitlines() == [
        "policy vllm-0.26: the trace's vLLM 0.26.0 (source.vllm_version, vLLM 0.26.0); "
        "--policy or --vllm overrides"
    ]
    assert json.loads(run.stdout)["variants"][0]["policy"] == "vllm-0.26"


def test_synth_refuses_a_cache_or_retention_the_release_lacked(tmp_path: Path) -> None:
    out = tmp_path / "t.parquet"
    base: list[str | Path] = ["synth", "-o", out, "--model", "full+mamba", "--requests", "5"]
    result = run_cli([*base, "--vllm", "0.19.1"])
    assert result.exit_code == 2
    assert "has no Mooncake store mirror: it came with #42828 in vLLM 0.22.0" in result.output
    assert not out.exists()
    both = run_cli([*base, "--vllm", "0.26.0", "--policy", "vllm-0.26"])
    assert both.exit_code == 2
    assert "--vllm and --policy both choose the policy: give one" in both.output


def test_synth_by_policy_records_it_and_run_follows(tmp_path: Path) -> None:
    out = tmp_path / "t.parquet"
    args: list[str | Path] = [
        "synth",
        "-o",
        out,
        "--model",
        "full+swa",
        "--requests",
        "20",
        "--policy",
        "vllm-0.27",
    ]
    assert run_cli(args).exit_code == 0
    source = open_trace(out).config.source or {}
    assert (source["policy"], source.get("vllm_version")) == ("vllm-0.27", None)
    run = run_cli(["run", out, "-o", tmp_path / "r.parquet", "--json"])
    assert run.stderr.splitlines() == [
        "policy vllm-0.27: the trace's stores are vLLM 0.27.0 - 0.27.1's (source.policy); "
        "--policy or --vllm overrides"
    ]


def test_the_mooncake_importer_produces_a_named_releases_stores(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 2000, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
    ]
    src = tmp_path / "m.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    keys = {}
    for version in ("0.28.0", "0.33.0"):
        out = tmp_path / f"{version}.parquet"
        result = run_cli(
            ["ingest", "mooncake", src, "-o", out, "--model", "full+mamba", "--vllm", version]
        )
        assert result.exit_code == 0, result.output
        assert (open_trace(out).config.source or {})["vllm_version"] == version
        keys[version] = _stored_keys(open_trace(out).read_frame())
    # Full attention stores 1500 // 16 = 93 blocks, then 2000 // 16 - 93 = 32
    # past the second row's hit. 0.28.0's store saves every Mamba state block
    # past the hit too (dense retention, its default); 0.33.0 gets the one
    # state each prefill hands off.
    assert keys == {"0.28.0": 2 * (93 + 32), "0.33.0": 93 + 32 + 2}


def test_whatif_simulates_a_named_releases_stores(tmp_path: Path) -> None:
    out = tmp_path / "t.parquet"
    synth: list[str | Path] = ["synth", "-o", out, "--model", "full+mamba", "--requests", "40"]
    assert run_cli(synth).exit_code == 0
    evicted = {}
    for version in ("0.26.0", "0.33.0"):
        sweep = tmp_path / f"{version}.sweep.parquet"
        args: list[str | Path] = [
            "whatif",
            out,
            "--capacity-blocks",
            "3000",
            "-o",
            sweep,
            "-q",
            "--jobs",
            "1",
        ]
        result = run_cli([*args, "--vllm", version])
        assert result.exit_code == 0, result.output
        frame, meta = read_sweep(sweep)
        assert (meta["policy"], meta["vllm_version"]) == (policy_for_version(version).name, version)
        assert meta["retention_interval"] == (None if version == "0.26.0" else 0)
        evicted[version] = frame["evicted_blocks"][0]
    # 0.26.0's Mooncake store also saves every Mamba state past the hit: it
    # fills the same store sooner.
    assert evicted["0.26.0"] > evicted["0.33.0"]


def test_the_gpu_pool_model_refuses_a_release_with_another_free_order() -> None:
    from replay.rules.blockpool import GpuCache

    config = archetype_config("full", 16, None, False)
    settings = StoreSettings(retention_interval=None, cache="gpu", policy="vllm-0.22")
    with pytest.raises(ConfigError, match=r"covers vLLM 0.24 and later \(policy vllm-0.22 frees"):
        GpuCache(config, 100, policy="vllm-0.22", store_settings=settings)
    assert policy_stores("vllm-0.26").free_order == "unhashed-front"


def test_before_022_the_engine_caches_every_full_block_unaligned() -> None:
    # full+swa+mamba, 16-token attention blocks under 32-token Mamba blocks (a
    # 32-token scheduler block), window 17 (a hit reads one block), 90 tokens,
    # dense: 0.22.0 on, attention caches up to 64 and the window keeps each
    # segment's last block; before, every full block (to 80), window too.
    config = archetype_config(
        "full+swa+mamba", 16, 8, False, sliding_window=17, mamba_block_size=32
    )
    got = {}
    for policy in ("vllm-0.20", "vllm-0.22"):
        settings = StoreSettings(retention_interval=None, cache="gpu", policy=policy)
        stores = StoreRules(config, settings).stores(num_tokens=90, hit_tokens=0)
        got[policy] = [[int(b) for b in s] for s in stores]
    assert got == {
        "vllm-0.20": [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [1]],
        "vllm-0.22": [[0, 1, 2, 3], [1, 3], [1]],
    }


def test_before_024_a_flagged_attention_group_empties_the_mooncake_store_template() -> None:
    """Sliding window (32-token blocks, flagged for EAGLE) + Mamba (64), dense:
    before 0.24.0 the store's mask is one 64-token segment's lookup with every
    block present, in which the window's EAGLE drop leaves no hit, so the
    store writes nothing (seen on 0.23.0's wheel); a flagged Mamba group does
    not shorten it, and from 0.24.0 the mask is the managers' reachable blocks."""

    def config(flag_window: bool) -> TraceConfig:
        return TraceConfig.from_json(
            {
                "version": 1,
                "kv_cache_groups": [
                    {"kind": "sliding_window", "block_size": 32, "sliding_window": 100,
                     "is_eagle_group": flag_window, "name": "sliding_window"},
                    {"kind": "mamba", "block_size": 64, "mamba_cache_mode": "align",
                     "is_eagle_group": not flag_window, "name": "mamba"},
                ],
                "hash_block_size": 16,
                "scheduler_block_size": 64,
                "use_eagle": False,
            }
        )  # fmt: skip

    def stores(flag_window: bool, policy: str) -> list[list[int]]:
        settings = StoreSettings(retention_interval=None, cache="mooncake", policy=policy)
        got = StoreRules(config(flag_window), settings).stores(num_tokens=300, hit_tokens=64)
        return [[int(b) for b in blocks] for blocks in got]

    assert stores(True, "vllm-0.23") == [[], []]
    assert stores(True, "vllm-0.22") == [[], []]
    assert stores(True, "vllm-0.24") == [[2, 3, 4, 5, 6, 7], [1, 2, 3]]
    assert stores(False, "vllm-0.23") == [[2, 3, 4, 5, 6, 7], [1, 2, 3]]
