"""replay.base.limits: what a file declares is checked against the limits before
it is decoded (the Parquet footer), else as each row or line is read; a
refusal is one line naming the limit and the option that raises it, exit
status 2, nothing written (issue 25)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from replay.format.hashwords import hash_words
from replay.format.schema import TRACE_META_KEY
from replay.format.writer import events_table, trace_schema
from tests.builders import full_mamba
from tests.conftest import run_cli


def _bomb(path: Path, copies: int) -> Path:
    """One store row of ``copies`` copies of one 9-byte hash, dictionary
    encoded: a few KB on disk, the footer declaring every copy."""
    config = full_mamba()
    schema = trace_schema(config)
    values = pa.DictionaryArray.from_arrays(
        pa.array(np.zeros(copies, dtype=np.int32)), pa.array([b"x" * 9])
    )
    columns = {f.name: pa.nulls(1, f.type) for f in schema}
    columns["seq"] = pa.array([0], pa.int64())
    columns["kind"] = pa.array(["store"]).dictionary_encode().cast(schema.field("kind").type)
    columns["group_id"] = pa.array([0], pa.int32())
    columns["block_hashes"] = pa.ListArray.from_arrays(pa.array([0, copies], pa.int32()), values)
    table = pa.table(columns)
    writer = pq.ParquetWriter(str(path), table.schema, compression="zstd", store_schema=False)
    writer.write_table(table)
    writer.add_key_value_metadata({TRACE_META_KEY: config.dumps().encode()})
    writer.close()
    return path


def refused(args: list[str], message: str, folder: Path) -> None:
    before = sorted(p.name for p in folder.iterdir())
    result = run_cli(args)
    assert (result.exit_code, result.stderr) == (2, f"error: {message}\n")
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_row_declaring_too_many_hashes_is_refused_from_the_footer(tmp_path: Path) -> None:
    bomb = _bomb(tmp_path / "bomb.parquet", 100_000)
    assert bomb.stat().st_size < 4000
    out = str(tmp_path / "r.parquet")
    refused(
        ["--max-row-hashes", "1000", "run", str(bomb), "-o", out, "-q"],
        f"{bomb}: row group 0 declares 100,000 hashes in 1 row, at least 100,000 hashes in "
        "one row, above the limit of 1,000 (`replay --max-row-hashes N ...` raises it)",
        tmp_path,
    )
    refused(
        ["--max-group-hashes", "10k", "validate", str(bomb)],
        f"{bomb}: row group 0 declares 100,000 hashes in one row group, above the limit of "
        "10,000 (`replay --max-group-hashes N ...` raises it)",
        tmp_path,
    )
    # Under the limits the same file is a valid trace.
    assert run_cli(["validate", str(bomb)]).exit_code == 0


def test_one_wide_hash_is_refused_and_mixed_widths_never_pad_to_the_widest(
    tmp_path: Path,
) -> None:
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": [i.to_bytes(9, "big") for i in range(2000)]},
        {"kind": "store", "group_id": 0, "block_hashes": [b"w" * 4096]},
    ]  # fmt: skip
    path = tmp_path / "wide.parquet"
    pq.write_table(events_table(rows, full_mamba()), str(path))
    refused(
        ["run", str(path), "-o", str(tmp_path / "r.parquet"), "-q"],
        f"{path}: seq 1: block_hashes[0] holds 4,096 bytes in one hash, above the limit of 128 "
        "(`replay --max-hash-bytes N ...` raises it)",
        tmp_path,
    )
    result = run_cli(["--max-hash-bytes", "4096", "validate", str(path)])
    assert result.exit_code == 0, result.output
    # The words of the batch: each hash padded to its own words (2 for 9
    # bytes), not all 2,001 to the widest's 512.
    hashes = pq.read_table(str(path)).column("block_hashes").combine_chunks()
    words = hash_words(hashes)
    assert words.words.nbytes == (2000 * 2 + 512) * 8
    assert words.nbytes.tolist() == [9] * 2000 + [4096]
    assert words.max_bytes == 4096


def test_jsonl_lines_are_bounded(tmp_path: Path) -> None:
    line = {"timestamp": 0, "input_length": 512 * 40, "output_length": 1, "hash_ids": list(range(40))}  # fmt: skip
    src = tmp_path / "m.jsonl"
    src.write_text(json.dumps(line) + "\n")
    out = str(tmp_path / "o.parquet")
    refused(
        ["--max-row-hashes", "100", "ingest", "mooncake", str(src), "-o", out],
        f"{src}: line 1: input_length 20480 makes 1,280 hashes in one row, above the limit of "
        "100 (`replay --max-row-hashes N ...` raises it)",
        tmp_path,
    )
    refused(
        ["--max-row-hashes", "10", "ingest", "mooncake", str(src), "-o", out],
        f"{src}: line 1: field 'hash_ids' holds 40 hashes in one row, above the limit of 10 "
        "(`replay --max-row-hashes N ...` raises it)",
        tmp_path,
    )
    refused(
        ["--max-line-bytes", "64", "ingest", "mooncake", str(src), "-o", out],
        f"{src}: line 1 holds more than 64 bytes in one line, above the limit of 64 "
        "(`replay --max-line-bytes N ...` raises it)",
        tmp_path,
    )


def test_a_lookup_log_line_of_too_many_hashes(tmp_path: Path, inputs: dict[str, Path]) -> None:
    log = tmp_path / "l.jsonl"
    log.write_text(json.dumps({"request_id": "x", "ts": 1.0, "block_hashes": list(range(1, 50)), "max_length": 15}) + "\n")  # fmt: skip
    refused(
        [
            "--max-row-hashes",
            "20",
            "ingest",
            "merge",
            str(inputs["trace"]),
            str(log),
            "-o",
            str(tmp_path / "o.parquet"),
        ],
        f"{log}: line 1: field 'block_hashes' holds 49 hashes in one row, above the limit of 20 "
        "(`replay --max-row-hashes N ...` raises it)",
        tmp_path,
    )


def test_whatif_refuses_a_lookup_whose_num_tokens_its_hashes_do_not_cover(
    tmp_path: Path,
) -> None:
    from replay.format.writer import write_trace

    rows = [{"kind": "lookup", "request_id": "r", "block_hashes": [b"a" * 16], "max_length": 15, "num_tokens": 1 << 48}]  # fmt: skip
    trace = write_trace(tmp_path / "t.parquet", full_mamba(), rows)
    refused(
        ["whatif", str(trace), "--capacity-blocks", "10", "-o", str(tmp_path / "w.parquet")],
        f"{trace}: seq 0: num_tokens {1 << 48} exceeds what its 1 block_hashes cover (the "
        "what-if needs num_tokens <= (len(block_hashes) + 1) * hash_block_size 16)",
        tmp_path,
    )


def test_many_groups_merge_into_spec_groups_by_key() -> None:
    from replay.base.spec import TraceConfig
    from replay.rules.coordinator.hybrid import build_spec_groups

    raw = full_mamba().to_json()
    first = raw["kv_cache_groups"][0]
    windows = [{**first, "kind": "sliding_window", "sliding_window": 16 * (1 + i % 50)} for i in range(5000)]  # fmt: skip
    config = TraceConfig.from_json({**raw, "kv_cache_groups": [first, *windows]})
    groups = build_spec_groups(config)
    assert len(groups) == 51
    assert groups[1].group_ids == tuple(range(1, 5001, 50))
