"""Lookahead block hashes (vLLM's ``num_hash_lookahead_tokens``) in the trace
sources: ``synth`` and ``ingest`` write the field, a prompt carries the hashes
of its units less the lookahead, a unit whose lookahead tokens differ has a
different key, and a source refuses a lookahead the release never had. What
the stores are under lookahead is checked against vLLM's own
``KVCacheManager`` in ``tests/vllm/test_store_rules_vllm.py``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.format.tracedir import open_trace
from replay.format.writer import write_trace
from replay.sources.archetypes import archetype_config
from tests.conftest import run_cli


def _lookups(path: Path) -> pl.DataFrame:
    rows = open_trace(path).read_frame()
    return rows.filter(pl.col("kind") == "lookup")


def test_synth_writes_the_lookahead_and_each_prompt_carries_fewer_hashes(
    tmp_path: Path,
) -> None:
    out = tmp_path / "t.parquet"
    result = run_cli(
        [
            "synth", "--model", "full+swa+mamba", "--eagle", "--lookahead-tokens", "3",
            "--cache", "gpu", "--vllm", "0.34.0", "--requests", "300", "-o", out,
        ]
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "EAGLE on (3 lookahead hash tokens)" in result.stdout
    assert open_trace(out).config.num_hash_lookahead_tokens == 3
    lookups = _lookups(out)
    assert lookups.height == 300
    carried = lookups["block_hashes"].list.len().to_list()
    assert carried == [(n - 3) // 16 for n in lookups["num_tokens"].to_list()]
    info = run_cli(["info", out])
    assert "use_eagle=true enable_partial_hash_hits=false num_hash_lookahead_tokens=3 " in (
        info.stdout
    )
    check = run_cli(["check", out])
    assert check.exit_code == 0, check.stdout + check.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--lookahead-tokens", "2"],
            "error: num_hash_lookahead_tokens 2: vLLM hashes lookahead tokens only for "
            "EAGLE's block drop: turn EAGLE on\n",
        ),
        (
            ["--lookahead-tokens", "2", "--eagle", "--cache", "gpu", "--inject-overrun", "1"],
            "error: --inject-overrun needs EAGLE's block drop, which lookahead hashes turn off "
            "(#43559 is its margin): use --lookahead-tokens 0\n",
        ),
        (
            ["--lookahead-tokens", "2", "--eagle", "--vllm", "0.32.0"],
            "error: num_hash_lookahead_tokens 2: vLLM 0.32.0 has no lookahead block hashes "
            "(they came in 0.33.0): use 0, or a release from 0.33.0\n",
        ),
        (
            ["--lookahead-tokens", "2", "--eagle", "--vllm", "0.33.0", "--cache", "mooncake"],
            "error: vLLM 0.33.0 gives the Mooncake store plain block hashes "
            "(num_hash_lookahead_tokens 0 under a KV connector), not 2: use 0, or a "
            "release from 0.34.0\n",
        ),
    ],
)
def test_a_lookahead_the_release_never_had_is_refused(
    args: list[str], message: str, tmp_path: Path
) -> None:
    out = tmp_path / "t.parquet"
    result = run_cli(["synth", "--model", "full+mamba", "--requests", "10", "-o", out, *args])
    assert result.exit_code == 2
    assert result.stderr == message
    assert not out.exists() and list(tmp_path.iterdir()) == []


def _mooncake_rows(tmp: Path) -> Path:
    # Two prompts of two 512-token blocks sharing the first block only.
    rows: list[dict[str, Any]] = [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 10, "input_length": 1024, "output_length": 1, "hash_ids": [1, 9]},
    ]
    path = tmp / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(("lookahead", "carried", "shared"), [(0, 64, 32), (3, 63, 31)])
def test_ingest_keys_a_unit_by_the_tokens_its_lookahead_reads(
    lookahead: int, carried: int, shared: int, tmp_path: Path
) -> None:
    """The last 16-token unit of the shared 512-token block reads its
    lookahead tokens from the next block, which differs: with lookahead the
    two prompts share one unit less, and each carries the units of its
    tokens less the lookahead."""
    out = tmp_path / "t.parquet"
    args: list[str | Path] = ["ingest", "mooncake", _mooncake_rows(tmp_path), "-o", out]
    args += ["--block-size", "16"]
    args += ["--eagle", "--lookahead-tokens", str(lookahead), "--vllm", "0.34.0"]
    result = run_cli(args)
    assert result.exit_code == 0, result.stderr
    assert open_trace(out).config.num_hash_lookahead_tokens == lookahead
    first, second = _lookups(out)["block_hashes"].to_list()
    assert (len(first), len(second)) == (carried, carried)
    common = next(
        (i for i, (x, y) in enumerate(zip(first, second, strict=True)) if x != y), carried
    )
    assert common == shared


def _config(lookahead: int) -> TraceConfig:
    return replace(archetype_config("full", use_eagle=True), num_hash_lookahead_tokens=lookahead)


@pytest.mark.parametrize(("lookahead", "longest"), [(0, 47), (1, 47), (3, 49)])
def test_a_lookup_may_ask_past_its_hashes_by_the_lookahead(
    lookahead: int, longest: int, tmp_path: Path
) -> None:
    """Two hashes: the scheduler's prompt of max_length + 1 tokens has at
    most 3 * 16 - 1 + lookahead tokens, less the first lookahead token."""
    config = _config(lookahead)
    assert config.max_length_bound(2) == longest + 1
    hashes = [bytes([i]) * 8 for i in (1, 2)]

    def lookup(max_length: int) -> dict[str, Any]:
        return {
            "kind": "lookup",
            "request_id": "r",
            "block_hashes": hashes,
            "max_length": max_length,
        }

    good = write_trace(tmp_path / "good.parquet", config, [lookup(longest)])
    assert run_cli(["validate", good]).exit_code == 0
    bad = tmp_path / "bad.parquet"
    plus = f" + {lookahead - 1} lookahead tokens" if lookahead > 1 else ""
    with pytest.raises(ReplayError) as info:
        write_trace(bad, config, [lookup(longest + 1)])
    assert not bad.exists()
    assert str(info.value).endswith(
        f"lookup max_length {longest + 1} exceeds what its 2 block_hashes cover (expected "
        f"below (len(block_hashes) + 1) * hash_block_size 16{plus})"
    )
