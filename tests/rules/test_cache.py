"""The two caches (``--cache gpu|mooncake``): the rules that tell vLLM's engine
coordinator from the Mooncake mirror, and every command that replays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from replay.base.errors import ConfigError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.format.writer import write_trace
from replay.rules.coordinator import (
    Coordinator,
    build_spec_groups,
    check_config,
    eagle_group_ids,
    hit_alignment,
)
from tests import builders
from tests.builders import chain, full_mamba, mb, replay_trace, sw
from tests.conftest import run_cli

FULL = GroupKind.FULL_ATTENTION
SWA = GroupKind.SLIDING_WINDOW
MAMBA = GroupKind.MAMBA


def _swa_extra(source: dict[str, Any] | None = None) -> TraceConfig:
    return TraceConfig(
        groups=(
            GroupSpec(kind=FULL, block_size=16),
            GroupSpec(kind=SWA, block_size=16, sliding_window=32, extra_retained_tokens=16),
        ),
        hash_block_size=16,
        scheduler_block_size=16,
        source=source,
    )


def _window_trace(tmp_path: Path, source: dict[str, Any] | None = None) -> Path:
    """Full attention holds four blocks, the window group only blocks 2 and 3:
    the engine's bare 32-token window is served at 64, the mirror's widened
    48-token one is not served anywhere."""
    hs = chain(4, "window")
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": hs},
        {"kind": "store", "group_id": 1, "block_hashes": hs[2:]},
        {"kind": "lookup", "request_id": "w", "block_hashes": hs, "max_length": 64},
    ]
    return write_trace(tmp_path / "window.parquet", _swa_extra(source), rows)


def test_sliding_window_extra_tokens_widen_only_the_mirror(tmp_path: Path) -> None:
    path = _window_trace(tmp_path)
    gpu = replay_trace(path, cache="gpu")
    mooncake = replay_trace(path, cache="mooncake")
    assert gpu.results.select("hit_tokens", "mask_blocks", "loaded_blocks", "cache").rows() == [
        (64, [4, 4], [4, 2], "gpu")
    ]
    assert mooncake.results.select("hit_tokens", "mask_blocks", "cache").rows() == [
        (0, [0, 0], "mooncake")
    ]


def test_flagged_group_drops_only_while_use_eagle_is_on_in_the_engine() -> None:
    config = TraceConfig(
        groups=(GroupSpec(kind=FULL, block_size=16, is_eagle_group=True),),
        hash_block_size=16,
        scheduler_block_size=16,
        use_eagle=False,
    )
    assert eagle_group_ids(config, "mooncake") == {0}
    assert eagle_group_ids(config, "gpu") == set()
    present = [bytes([1, 1, 1, 1])]
    assert Coordinator(config, cache="mooncake").lookup_present(present, 64).hit_tokens == 48
    assert Coordinator(config, cache="gpu").lookup_present(present, 64).hit_tokens == 64


def test_one_spec_group_over_two_kv_groups_gets_the_margin_in_the_engine() -> None:
    """A target full-attention group and a flagged draft group with its spec:
    one spec group. The mirror's single call drops a block from the bound;
    the engine's loop peeks one block past it first and drops back."""
    config = TraceConfig(
        groups=(
            GroupSpec(kind=FULL, block_size=16),
            GroupSpec(kind=FULL, block_size=16, is_eagle_group=True, name="draft"),
        ),
        hash_block_size=16,
        scheduler_block_size=16,
        use_eagle=True,
    )
    assert [sg.group_ids for sg in build_spec_groups(config, "gpu")] == [(0, 1)]
    present = [bytes([1, 1, 1, 1])] * 2
    assert Coordinator(config, cache="mooncake").lookup_present(present, 32).hit_tokens == 16
    assert Coordinator(config, cache="gpu").lookup_present(present, 32).hit_tokens == 32


def test_single_group_is_the_unitary_coordinator_in_the_engine() -> None:
    config = TraceConfig(
        groups=(GroupSpec(kind=FULL, block_size=32),),
        hash_block_size=16,
        scheduler_block_size=32,
    )
    check_config(config, "mooncake")
    with pytest.raises(ConfigError, match="UnitaryKVCacheCoordinator, which needs hash_block_size"):
        check_config(config, "gpu")


def test_partial_hits_are_derived_by_the_engine() -> None:
    """Declared on, but a sliding-window group with a block larger than the
    hash unit cannot probe inside blocks: the engine turns them off."""
    config = builders.config(sw(32, 64), mb(32), hbs=16, partial=True, check=None)
    assert hit_alignment(config, "mooncake") == 16
    assert hit_alignment(config, "gpu") == 32
    # A trace's flag can only turn them off.
    off = TraceConfig(
        groups=(GroupSpec(kind=MAMBA, block_size=32, mamba_cache_mode="align"),) * 2,
        hash_block_size=16,
        scheduler_block_size=32,
    )
    assert hit_alignment(off, "gpu") == 32


def test_default_cache_is_the_traces_own(tmp_path: Path) -> None:
    recorded = _window_trace(tmp_path, source={"tool": "replay record", "cache": "gpu"})
    result = replay_trace(recorded)
    assert (result.cache, result.results["hit_tokens"].to_list()) == ("gpu", [64])
    assert result.metadata()["cache"] == "gpu"
    unnamed = _window_trace(tmp_path)
    assert replay_trace(unnamed).cache == "mooncake"


def test_run_writes_the_cache_in_column_and_metadata(tmp_path: Path) -> None:
    path = _window_trace(tmp_path)
    out = tmp_path / "r.parquet"
    res = run_cli(["run", str(path), "--cache", "gpu", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert [v["cache"] for v in json.loads(res.stdout)["variants"]] == ["gpu"]
    frame = pl.read_parquet(out)
    assert frame["cache"].to_list() == ["gpu"]
    import pyarrow.parquet as pq

    meta = json.loads(pq.read_schema(out).metadata[b"replay.results"])
    assert (meta["cache"], meta["policy"]) == ("gpu", "vllm-0.33")


def test_check_refuses_results_of_another_cache(tmp_path: Path) -> None:
    path = _window_trace(tmp_path)
    out = tmp_path / "r.parquet"
    assert run_cli(["run", str(path), "--cache", "gpu", "-o", str(out), "-q"]).exit_code == 0
    res = run_cli(["check", str(out), "--cache", "mooncake"])
    assert res.exit_code == 2
    assert res.stderr == (
        f"error: {out}: these results were replayed in the gpu cache, not mooncake "
        "(replay the trace with --cache mooncake, or drop --cache)\n"
    )
    assert run_cli(["check", str(out), "--cache", "gpu"]).exit_code == 0


def test_diff_two_caches_names_the_rule(tmp_path: Path) -> None:
    path = _window_trace(tmp_path)
    res = run_cli(["diff", str(path), "--cache", "mooncake", "--cache", "gpu", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [v["cache"] for v in data["variants"]] == ["mooncake", "gpu"]
    assert (data["changed"], data["net"]) == (1, 64)
    (change,) = data["changed_lookups"]
    assert (change["hit_a"], change["hit_b"], change["reason_group"]) == (0, 64, 1)
    assert change["rule"] == (
        "group 1: sliding window 32 widened by extra_retained_tokens 16 in mooncake only"
    )
    text = run_cli(["diff", str(path), "--cache", "mooncake", "--cache", "gpu"]).stdout
    assert "cache rules behind the changes:" in text
    assert "group 1: sliding window 32 widened by extra_retained_tokens 16 in mooncake only" in text


def test_explain_prints_the_flags_under_the_table(trace_43559: Path) -> None:
    res = run_cli(["explain", str(trace_43559), "--request", "req-43559", "--policy", "pre-49502"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].endswith("policy pre-49502 (here vllm-0.26), cache mooncake")
    start = lines.index("flags:")
    assert lines[start : start + 3] == [
        "flags:",
        "  mamba_overrun (corruption): group 1 resumes Mamba state at 64, 16 tokens past the attention KV "
        "loaded for 48 tokens",
        "  eagle_not_dropped (performance): hit 64 reaches group 0's whole match: EAGLE recomputes nothing "
        "past it",
    ]
    clean = run_cli(["explain", str(trace_43559), "--request", "req-43559", "--cache", "gpu"])
    assert "flags: none" in clean.stdout.splitlines()
    assert clean.stdout.splitlines()[0].endswith("policy vllm-0.33, cache gpu")


def test_pytest_plugin_expectation_names_a_cache(tmp_path: Path, pytester: pytest.Pytester) -> None:
    hs = chain(4, "window")
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": hs},
        {"kind": "store", "group_id": 1, "block_hashes": hs[2:]},
        {"kind": "lookup", "request_id": "w", "block_hashes": hs, "max_length": 64},
    ]
    expect = [
        {"policy": "vllm-0.33", "cache": "gpu", "flags": {}, "hits": {"w": 64}},
        {"policy": "vllm-0.33", "cache": "mooncake", "flags": {}, "hits": {"w": 48}},
    ]
    write_trace(pytester.path / "w.parquet", _swa_extra(), rows, expect={"expect": expect})
    result = pytester.runpytest("w.parquet")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*w.parquet under policy vllm-0.33 in the mooncake cache:*",
            "*request w: expected hit 48, replayed 0*",
        ]
    )


def test_43559_is_the_same_in_both_caches(tmp_path: Path) -> None:
    from tests.builders import issue_43559_rows

    path = write_trace(tmp_path / "t.parquet", full_mamba(), issue_43559_rows())
    for cache in ("gpu", "mooncake"):
        assert replay_trace(path, cache=cache).results["hit_tokens"].to_list() == [48]
        pre = replay_trace(path, policy="pre-49502", cache=cache)
        assert pre.results["hit_tokens"].to_list() == [64]


def test_a_trace_the_chosen_cache_cannot_answer_is_one_line(tmp_path: Path) -> None:
    config = TraceConfig(
        groups=(GroupSpec(kind=FULL, block_size=32),), hash_block_size=16, scheduler_block_size=32
    )
    path = write_trace(
        tmp_path / "one.parquet",
        config,
        [{"kind": "lookup", "request_id": "a", "block_hashes": chain(1), "max_length": 16}],
    )
    out = tmp_path / "r.parquet"
    res = run_cli(["run", str(path), "--cache", "gpu", "-o", str(out)])
    assert (res.exit_code, res.stdout) == (2, "")
    assert res.stderr == (
        f"error: {path}: replay.trace metadata: the gpu cache answers a single KV-cache group "
        "with vLLM's UnitaryKVCacheCoordinator, which needs hash_block_size equal to "
        "block_size 32, got 16\n"
    )
    assert not out.exists()
    assert run_cli(["run", str(path), "--cache", "mooncake", "-o", str(out), "-q"]).exit_code == 0


def test_the_report_uses_the_alignment_of_the_cache_that_answered(tmp_path: Path) -> None:
    """One full-attention group, block 32, scheduler block 64: the mirror
    aligns hits to 64, the engine's unitary coordinator to the block, 32."""
    config = TraceConfig(
        groups=(GroupSpec(kind=FULL, block_size=32),), hash_block_size=32, scheduler_block_size=64
    )
    hs = chain(3, "align")
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": hs},
        {"kind": "lookup", "request_id": "a", "block_hashes": hs, "max_length": 95},
    ]
    path = write_trace(tmp_path / "t.parquet", config, rows)
    for cache, hit, alignment in (("gpu", 64, 32), ("mooncake", 64, 64)):
        out, md = tmp_path / f"{cache}.parquet", tmp_path / f"{cache}.md"
        assert run_cli(["run", str(path), "--cache", cache, "-o", str(out), "-q"]).exit_code == 0
        assert pl.read_parquet(out)["hit_tokens"].to_list() == [hit]
        assert run_cli(["report", str(out), "--trace", str(path), "-o", str(md)]).exit_code == 0
        assert (
            "hash_block_size=32 scheduler_block_size=64 use_eagle=false "
            f"enable_partial_hash_hits=false cache={cache} alignment={alignment}"
        ) in md.read_text().splitlines()
