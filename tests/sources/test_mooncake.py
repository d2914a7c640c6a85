"""Importers for the Mooncake and Qwen bailian JSONL traces (replay.sources.mooncake)."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from replay.base.errors import ReplayError
from replay.cli.sources import bailian, mooncake
from replay.format.tracedir import open_trace
from replay.rules.coordinator import Coordinator
from replay.sources.mooncake import ingest_bailian, ingest_mooncake
from replay.sources.prefix_reuse import count_reuse
from replay.tools.render import ingest_summary_text
from tests.builders import hand_folded_lookups
from tests.conftest import check_store_options
from tests.contracts.source import DeterministicSourceContract

# Mooncake: one id per 512 tokens; the last, partial block has an id (ceil)
# except in the last row, which omits it (floor).
MOONCAKE_ROWS: list[dict[str, Any]] = [
    {"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 3]},
    {"timestamp": 100, "input_length": 1600, "output_length": 30, "hash_ids": [1, 2, 4, 5]},
    {"timestamp": 200, "input_length": 600, "output_length": 10, "hash_ids": [1, 6]},
    {"timestamp": 300, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
    {"timestamp": 450, "input_length": 1100, "output_length": 7, "hash_ids": [1, 2]},
]
# Reused tokens, row by row, in 16-token blocks, at most (input_length - 1) // 16:
#   row 1: nothing seen yet                                          ->    0
#   row 2: ids 1 and 2 fully covered by row 1 (64 blocks), 4 is new  -> 1024
#   row 3: id 1 (32 blocks), 6 is new                                ->  512
#   row 4: ids 1 and 2 (64 blocks) but at most 1023 // 16 = 63       -> 1008
#   row 5: ids 1 and 2 (64 blocks), then tokens without an id        -> 1024
MOONCAKE_REUSED = 0 + 1024 + 512 + 1008 + 1024
MOONCAKE_INPUT = 1100 + 1600 + 600 + 1024 + 1100

BAILIAN_ROWS: list[dict[str, Any]] = [
    {
        "chat_id": 1,
        "parent_chat_id": -1,
        "timestamp": 0.5,
        "input_length": 40,
        "output_length": 9,
        "type": "text",
        "turn": 1,
        "hash_ids": [10, 11, 12],
    },
    {
        "chat_id": 2,
        "parent_chat_id": 1,
        "timestamp": 1.25,
        "input_length": 70,
        "output_length": 3,
        "type": "text",
        "turn": 2,
        "hash_ids": [10, 11, 13, 14, 15],
    },
    {
        "chat_id": 3,
        "parent_chat_id": -1,
        "timestamp": 2.0,
        "input_length": 32,
        "output_length": 4,
        "type": "search",
        "turn": 1,
        "hash_ids": [10, 11],
    },
]
# Row 1: 0; row 2: ids 10, 11 (13 is new) -> 32; row 3: at most 31 // 16 = 1 block -> 16.
BAILIAN_REUSED = 0 + 32 + 16
BAILIAN_INPUT = 40 + 70 + 32


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _replay_hits(path: Path, policy: str = "vllm-0.33") -> tuple[int, int]:
    """(sum of hits, sum of num_tokens) replaying the trace with the reference
    coordinator over the folded store."""
    reader = open_trace(path)
    coordinator = Coordinator(reader.config, policy)
    hits = tokens = 0
    for r, contains in hand_folded_lookups(reader):
        hits += coordinator.lookup(r["block_hashes"], r["max_length"], contains).hit_tokens
        tokens += r["num_tokens"]
    return hits, tokens


def test_mooncake_reuse_ratio_is_a_direct_count(tmp_path: Path) -> None:
    src = _write(tmp_path / "mooncake.jsonl", MOONCAKE_ROWS)
    out = tmp_path / "t.parquet"
    summary = ingest_mooncake(src, out)
    assert summary["reused_tokens"] == MOONCAKE_REUSED == 3568
    assert summary["input_tokens"] == MOONCAKE_INPUT == 5424
    assert Fraction(summary["reuse_ratio"]) == Fraction(3568 / 5424)
    assert summary["rows"] == summary["lookups"] == 5
    # Replaying as full attention without EAGLE, unbounded, reproduces it.
    assert _replay_hits(out) == (MOONCAKE_REUSED, MOONCAKE_INPUT)
    source = open_trace(out).config.source
    assert source is not None
    assert source["reuse_ratio"] == summary["reuse_ratio"]
    assert source["reused_tokens"] == MOONCAKE_REUSED
    count = count_reuse(src, "mooncake")
    assert (count.reused_tokens, count.input_tokens, count.rows) == (3568, 5424, 5)


def test_mooncake_rows(tmp_path: Path) -> None:
    src = _write(tmp_path / "mooncake.jsonl", MOONCAKE_ROWS)
    out = tmp_path / "t.parquet"
    ingest_mooncake(src, out)
    rows = list(open_trace(out).read_frame().iter_rows(named=True))
    lookups = [r for r in rows if r["kind"] == "lookup"]
    assert [r["request_id"] for r in lookups] == [f"line-{i}" for i in range(1, 6)]
    assert [r["max_length"] for r in lookups] == [1099, 1599, 599, 1023, 1099]
    assert [len(r["block_hashes"]) for r in lookups] == [68, 100, 37, 64, 68]
    assert [r["ts"].timestamp() for r in lookups] == [0.0, 0.1, 0.2, 0.3, 0.45]
    one, two = lookups[0]["block_hashes"], lookups[1]["block_hashes"]
    # A 512-token id becomes 32 chained 16-byte hashes; shared ids, shared hashes.
    assert {len(h) for h in one} == {16}
    assert two[:64] == one[:64] and two[64] != one[64]
    assert len(set(one)) == 68
    # The partial block's id covers its first four 16-token blocks.
    assert lookups[2]["block_hashes"][:32] == one[:32]
    # The last row has no id for its partial block: fresh hashes.
    five = lookups[4]["block_hashes"]
    assert five[:64] == one[:64] and not set(five[64:]) & set(one)
    stores = [r for r in rows if r["kind"] == "store"]
    assert [len(r["block_hashes"]) for r in stores] == [68, 36, 5, 4]
    # Written fixed-size (one width: no length stored or decoded per hash).
    assert pq.ParquetFile(out).schema_arrow.field("block_hashes").type == pa.list_(pa.binary(16))


def test_mooncake_with_a_hybrid_model(tmp_path: Path) -> None:
    src = _write(tmp_path / "mooncake.jsonl", MOONCAKE_ROWS)
    out = tmp_path / "t.parquet"
    summary = ingest_mooncake(
        src, out, model="full+mamba", block_size=64, eagle=True, capacity_blocks=20
    )
    assert summary["reused_tokens"] == 0 + 1024 + 512 + 960 + 1024
    config = open_trace(out).config
    assert [g.kind.value for g in config.groups] == ["full_attention", "mamba"]
    assert config.use_eagle and config.hash_block_size == 64
    assert summary["max_present_keys"] == 20 and summary["removes"] > 0


def test_bailian_reuse_ratio_and_ids(tmp_path: Path) -> None:
    src = _write(tmp_path / "bailian.jsonl", BAILIAN_ROWS)
    out = tmp_path / "t.parquet"
    summary = ingest_bailian(src, out)
    assert (summary["reused_tokens"], summary["input_tokens"]) == (48, 142)
    assert summary["reuse_ratio"] == 48 / 142
    assert _replay_hits(out) == (BAILIAN_REUSED, BAILIAN_INPUT)
    lookups = [
        r for r in open_trace(out).read_frame().iter_rows(named=True) if r["kind"] == "lookup"
    ]
    assert [r["request_id"] for r in lookups] == ["1", "2", "3"]
    # 16-token blocks: the ids themselves, as 8-byte big-endian.
    assert lookups[1]["block_hashes"] == [i.to_bytes(8, "big") for i in (10, 11, 13, 14)]
    assert pq.ParquetFile(out).schema_arrow.field("block_hashes").type == pa.list_(pa.binary(8))
    assert [r["ts"].timestamp() for r in lookups] == [0.5, 1.25, 2.0]


def test_bailian_coarser_blocks(tmp_path: Path) -> None:
    src = _write(tmp_path / "bailian.jsonl", BAILIAN_ROWS)
    out = tmp_path / "t.parquet"
    summary = ingest_bailian(src, out, block_size=32)
    # 32-token blocks are named by the id of their second 16-token block.
    lookups = [
        r for r in open_trace(out).read_frame().iter_rows(named=True) if r["kind"] == "lookup"
    ]
    assert [r["block_hashes"] for r in lookups] == [
        [(11).to_bytes(8, "big")],
        [(11).to_bytes(8, "big"), (14).to_bytes(8, "big")],
        [(11).to_bytes(8, "big")],
    ]
    # Row 2 reuses its first 32-token block; row 3 may reuse at most 31 tokens.
    assert (summary["reused_tokens"], summary["input_tokens"]) == (32, 142)
    assert _replay_hits(out) == (32, 142)


BAD_MOONCAKE = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}'


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            "{not json",
            "not valid JSON (Expecting property name enclosed in double quotes at column 2)",
        ),
        ("[1, 2]", "expected a JSON object, got a list"),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1}',
            "missing field 'hash_ids'",
        ),
        (
            '{"timestamp": "0", "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}',
            "field 'timestamp' must be a number, got a string",
        ),
        (
            '{"timestamp": 0, "input_length": 600.5, "output_length": 1, "hash_ids": [1, 2]}',
            "field 'input_length' must be an integer, got a number",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, "2"]}',
            "field 'hash_ids'[1] must be an integer in [0, 2**64), got a string",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, -2]}',
            "field 'hash_ids'[1] must be an integer in [0, 2**64), got -2",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3]}',
            "field 'hash_ids' has 3 entries, expected 1 or 2 for input_length 600 in "
            "512-token blocks",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [7, 7]}',
            "field 'hash_ids' repeats id 7 (ids are chained over the prefix, so one prompt "
            "cannot hold the same id twice)",
        ),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
            "field 'input_length' must be positive, got 0",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": null, "hash_ids": [1, 2]}',
            "field 'output_length' must be an integer, got null",
        ),
    ],
)
def test_mooncake_bad_lines(tmp_path: Path, line: str, message: str) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text(f"{BAD_MOONCAKE}\n\n{line}\n{BAD_MOONCAKE}\n")
    out = tmp_path / "t.parquet"
    with pytest.raises(ReplayError) as err:
        ingest_mooncake(src, out)
    assert str(err.value) == f"{src}: line 3: {message}"
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [src]


def test_bailian_bad_lines(tmp_path: Path) -> None:
    row = dict(BAILIAN_ROWS[0])
    del row["turn"]
    src = _write(tmp_path / "bad.jsonl", [BAILIAN_ROWS[0], row])
    with pytest.raises(ReplayError) as err:
        ingest_bailian(src, tmp_path / "t.parquet")
    assert str(err.value) == f"{src}: line 2: missing field 'turn'"
    src = _write(tmp_path / "bad.jsonl", [{**BAILIAN_ROWS[0], "type": 3}])
    with pytest.raises(ReplayError) as err:
        ingest_bailian(src, tmp_path / "t.parquet")
    assert str(err.value) == f"{src}: line 1: field 'type' must be a string, got an integer"


def test_bad_block_size_and_missing_file(tmp_path: Path) -> None:
    src = _write(tmp_path / "mooncake.jsonl", MOONCAKE_ROWS)
    with pytest.raises(ReplayError) as err:
        ingest_mooncake(src, tmp_path / "t.parquet", block_size=48)
    assert str(err.value) == (
        "--block-size 48 must divide or be a multiple of the mooncake trace's 512-token blocks"
    )
    with pytest.raises(ReplayError) as err:
        ingest_mooncake(tmp_path / "nope.jsonl", tmp_path / "t.parquet")
    assert str(err.value) == f"{tmp_path / 'nope.jsonl'}: no such file"


def test_mooncake_command(tmp_path: Path) -> None:
    src = _write(tmp_path / "mooncake.jsonl", MOONCAKE_ROWS)
    out = tmp_path / "cli.parquet"
    result = CliRunner().invoke(mooncake, [str(src), "-o", str(out)])
    assert result.exit_code == 0, result.output
    summary = ingest_mooncake(src, tmp_path / "lib.parquet")
    assert result.output == ingest_summary_text({**summary, "path": str(out)}) + "\n"
    assert "Prefix reuse 65.78% (3,568 of 5,424 input tokens" in result.output


def test_bailian_command(tmp_path: Path) -> None:
    src = _write(tmp_path / "bailian.jsonl", BAILIAN_ROWS)
    out = tmp_path / "cli.parquet"
    args = [str(src), "-o", str(out), "--model", "full+mamba", "--eagle", "--capacity-blocks", "9"]
    result = CliRunner().invoke(bailian, args)
    assert result.exit_code == 0, result.output
    assert "Prefix reuse 33.80% (48 of 142 input tokens" in result.output


def test_store_options_are_recorded(tmp_path: Path) -> None:
    src = _write(tmp_path / "bailian.jsonl", BAILIAN_ROWS)
    out = tmp_path / "cli.parquet"
    check_store_options(bailian, [str(src), "-o", str(out), "--model", "full+mamba"], out, 64)
    bad = CliRunner().invoke(
        mooncake, [str(src), "-o", str(tmp_path / "x.parquet"), "--cache", "disk"]
    )
    assert bad.exit_code == 2
    assert bad.stderr == "error: --cache: expected one of mooncake, gpu, got 'disk'\n"
    assert not (tmp_path / "x.parquet").exists()


# ---------------------------------------------------------------- the sources' contract


class TestMooncakeImporter(DeterministicSourceContract):
    def expected_counts(self) -> dict[str, int]:
        return {"lookup": 5, "store": 4}

    def command(self, folder: Path, out: Path) -> list[str]:
        src = _write(folder / "mooncake.jsonl", MOONCAKE_ROWS)
        return ["ingest", "mooncake", str(src), "-o", str(out)]

    def bad_inputs(self, folder: Path, out: Path) -> list[tuple[list[str], str]]:
        cases = []
        for i, (obj, message) in enumerate(
            [
                ({"timestamp": 1e300, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}, "field 'timestamp' must be a finite number >= 0 (at most 253402300799000, the year 9999), got 1e+300"),
                ({"timestamp": 0, "input_length": 2**60, "output_length": 1, "hash_ids": [1, 2]}, "field 'input_length' must be at most 2**48, got 1152921504606846976"),
            ]
        ):  # fmt: skip
            src = _write(folder / f"bad{i}.jsonl", [obj])
            cases.append(
                (["ingest", "mooncake", str(src), "-o", str(out)], f"{src}: line 1: {message}")
            )
        missing = folder / "missing.jsonl"
        cases.append(
            (["ingest", "mooncake", str(missing), "-o", str(out)], f"{missing}: no such file")
        )
        return cases


class TestBailianImporter(DeterministicSourceContract):
    def expected_counts(self) -> dict[str, int]:
        return {"lookup": 3, "store": 4}

    def command(self, folder: Path, out: Path) -> list[str]:
        src = _write(folder / "bailian.jsonl", BAILIAN_ROWS)
        return ["ingest", "bailian", str(src), "-o", str(out), "--model", "full+mamba", "--eagle", "--capacity-blocks", "9"]  # fmt: skip

    def bad_inputs(self, folder: Path, out: Path) -> list[tuple[list[str], str]]:
        notjson = folder / "bad.jsonl"
        notjson.write_text("nope\n")
        surrogate = _write(folder / "surrogate.jsonl", [{**BAILIAN_ROWS[0], "chat_id": "\ud800"}])
        return [
            (["ingest", "bailian", str(notjson), "-o", str(out)], f"{notjson}: line 1: not valid JSON (Expecting value at column 1)"),
            (["ingest", "bailian", str(surrogate), "-o", str(out)], f"{surrogate}: line 1: field 'chat_id' holds a lone surrogate escape (not text)"),
        ]  # fmt: skip
