"""Every bad input a user can give: one line naming the file and the row
(seq) or column, exit status 2, no traceback, no output file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.trace import TRACE_META_KEY, events_table
from tests.conftest import chain, full_mamba, issue_43559_rows, run_cli

GOOD_META: dict[str, Any] = full_mamba().to_json()


def _write(path: Path, table: pa.Table, meta: bytes | None) -> Path:
    schema = table.schema.with_metadata({TRACE_META_KEY: meta} if meta is not None else {})
    pq.write_table(table.cast(schema), str(path))
    return path


def _table(rows: list[dict[str, Any]] | None = None) -> pa.Table:
    return events_table(
        rows if rows is not None else issue_43559_rows(), full_mamba()
    ).replace_schema_metadata(None)


def _with_meta(tmp: Path, **changes: Any) -> Path:
    meta = dict(GOOD_META)
    meta.update(changes)
    meta = {k: v for k, v in meta.items() if v is not ...}
    return _write(tmp / "t.parquet", _table(), json.dumps(meta).encode())


def _with_group(tmp: Path, group: dict[str, Any], **changes: Any) -> Path:
    return _with_meta(tmp, kv_cache_groups=[group], **changes)


def _rows(tmp: Path, rows: list[dict[str, Any]]) -> Path:
    return _write(tmp / "t.parquet", _table(rows), json.dumps(GOOD_META).encode())


def _csv(tmp: Path) -> Path:
    p = tmp / "t.parquet"
    p.write_text("seq,kind\n0,store\n")
    return p


def _truncated(tmp: Path) -> Path:
    good = _write(tmp / "good.parquet", _table(), json.dumps(GOOD_META).encode())
    data = good.read_bytes()
    p = tmp / "t.parquet"
    p.write_bytes(data[: len(data) // 2])
    return p


def _empty(tmp: Path) -> Path:
    p = tmp / "t.parquet"
    p.write_bytes(b"")
    return p


def _drop_column(tmp: Path, name: str) -> Path:
    t = _table()
    return _write(tmp / "t.parquet", t.drop_columns([name]), json.dumps(GOOD_META).encode())


def _retype_column(tmp: Path, name: str, values: pa.Array) -> Path:
    t = _table()
    i = t.schema.get_field_index(name)
    t = t.set_column(i, name, values)
    return _write(tmp / "t.parquet", t, json.dumps(GOOD_META).encode())


HS = chain(2)
CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "missing_path": (lambda tmp: tmp / "t.parquet", "{p}: no such file"),
    "empty_file": (_empty, "{p}: empty file, expected a Parquet file"),
    "csv_not_parquet": (_csv, "{p}: not a Parquet file (no PAR1 magic at the start)"),
    "truncated_parquet": (_truncated, "{p}: truncated Parquet file (no PAR1 magic at the end)"),
    "no_metadata": (
        lambda tmp: _write(tmp / "t.parquet", _table(), None),
        "{p}: missing 'replay.trace' metadata (not a replay trace v1)",
    ),
    "metadata_not_json": (
        lambda tmp: _write(tmp / "t.parquet", _table(), b"{not json"),
        "{p}: 'replay.trace' metadata is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
    ),
    "metadata_missing_field": (
        lambda tmp: _with_meta(tmp, hash_block_size=...),
        "{p}: replay.trace metadata: missing field 'hash_block_size'",
    ),
    "metadata_wrong_type": (
        lambda tmp: _with_meta(tmp, use_eagle="yes"),
        "{p}: replay.trace metadata: use_eagle must be a boolean, got 'yes'",
    ),
    "metadata_wrong_version": (
        lambda tmp: _with_meta(tmp, version=2),
        "{p}: replay.trace metadata: field 'version': expected 1, got 2",
    ),
    "unknown_group_kind": (
        lambda tmp: _with_group(tmp, {"kind": "linear_attention", "block_size": 16}),
        "{p}: replay.trace metadata: kv_cache_groups[0]: unknown kind 'linear_attention', "
        "expected one of full_attention, sliding_window, chunked_local_attention, mamba",
    ),
    "zero_block_size": (
        lambda tmp: _with_group(tmp, {"kind": "full_attention", "block_size": 0}),
        "{p}: replay.trace metadata: kv_cache_groups[0]: block_size must be a positive integer, got 0",
    ),
    "negative_block_size": (
        lambda tmp: _with_group(tmp, {"kind": "full_attention", "block_size": -16}),
        "{p}: replay.trace metadata: kv_cache_groups[0]: block_size must be a positive integer, got -16",
    ),
    "block_not_multiple_of_hash_block": (
        lambda tmp: _with_group(
            tmp, {"kind": "full_attention", "block_size": 24}, scheduler_block_size=48
        ),
        "{p}: replay.trace metadata: kv_cache_groups[0]: block_size 24 must be a multiple of hash_block_size 16",
    ),
    "scheduler_not_multiple_of_block": (
        lambda tmp: _with_group(tmp, {"kind": "full_attention", "block_size": 32}),
        "{p}: replay.trace metadata: kv_cache_groups[0]: scheduler_block_size 16 must be a multiple of block_size 32",
    ),
    "sliding_window_without_window": (
        lambda tmp: _with_group(tmp, {"kind": "sliding_window", "block_size": 16}),
        "{p}: replay.trace metadata: kv_cache_groups[0]: sliding_window group needs a positive integer sliding_window, got None",
    ),
    "chunked_with_eagle": (
        lambda tmp: _with_group(
            tmp, {"kind": "chunked_local_attention", "block_size": 16, "attention_chunk_size": 64}
        ),
        "{p}: replay.trace metadata: kv_cache_groups[0]: chunked_local_attention does not combine with EAGLE (vLLM rejects this hybrid)",
    ),
    "no_groups": (
        lambda tmp: _with_meta(tmp, kv_cache_groups=[]),
        "{p}: replay.trace metadata: kv_cache_groups: at least one KV-cache group is required",
    ),
    "missing_column": (
        lambda tmp: _drop_column(tmp, "max_length"),
        "{p}: missing column 'max_length' (expected int64)",
    ),
    "wrongly_typed_column": (
        lambda tmp: _retype_column(tmp, "seq", pa.array(["0", "1", "2"])),
        "{p}: column 'seq' has type string, expected int64",
    ),
    "seq_not_increasing": (
        lambda tmp: _rows(
            tmp,
            [
                {"seq": 5, "kind": "store", "group_id": 0, "block_hashes": HS},
                {"seq": 5, "kind": "store", "group_id": 1, "block_hashes": HS},
            ],
        ),
        "{p}: seq 5: seq not strictly increasing (comes after seq 5)",
    ),
    "seq_decreasing": (
        lambda tmp: _rows(
            tmp,
            [
                {"seq": 7, "kind": "store", "group_id": 0, "block_hashes": HS},
                {"seq": 3, "kind": "store", "group_id": 1, "block_hashes": HS},
            ],
        ),
        "{p}: seq 3: seq not strictly increasing (comes after seq 7)",
    ),
    "unknown_event_kind": (
        lambda tmp: _rows(tmp, [{"kind": "evict", "group_id": 0, "block_hashes": HS}]),
        "{p}: seq 0: unknown event kind 'evict', expected one of store, remove, clear, lookup",
    ),
    "lookup_without_max_length": (
        lambda tmp: _rows(tmp, [{"kind": "lookup", "request_id": "a", "block_hashes": HS}]),
        "{p}: seq 0: lookup has no max_length",
    ),
    "lookup_without_request_id": (
        lambda tmp: _rows(tmp, [{"kind": "lookup", "max_length": 16, "block_hashes": HS}]),
        "{p}: seq 0: lookup has no request_id",
    ),
    "negative_max_length": (
        lambda tmp: _rows(
            tmp, [{"kind": "lookup", "request_id": "a", "max_length": -1, "block_hashes": HS}]
        ),
        "{p}: seq 0: lookup has a negative max_length -1",
    ),
    "max_length_beyond_hashes": (
        lambda tmp: _rows(
            tmp, [{"kind": "lookup", "request_id": "a", "max_length": 48, "block_hashes": HS}]
        ),
        "{p}: seq 0: lookup max_length 48 exceeds what its 2 block_hashes cover "
        "(expected below (len(block_hashes) + 1) * hash_block_size 16)",
    ),
    "store_without_group_id": (
        lambda tmp: _rows(tmp, [{"kind": "store", "block_hashes": HS}]),
        "{p}: seq 0: store has no group_id (store and remove name the group whose keys change)",
    ),
    "group_id_names_no_group": (
        lambda tmp: _rows(tmp, [{"kind": "remove", "group_id": 2, "block_hashes": HS}]),
        "{p}: seq 0: group_id 2 names no group (the trace has 2: 0..1)",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["validate", "run", "state"])
def test_bad_input_is_one_line_exit_2_no_output(tmp_path: Path, case: str, command: str) -> None:
    build, message = CASES[case]
    path = build(tmp_path)
    out = tmp_path / "out.parquet"
    args = {
        "validate": ["validate", str(path)],
        "run": ["run", str(path), "-o", str(out), "--quiet"],
        "state": ["state", str(path), "-o", str(out)],
    }[command]
    result = run_cli(args)
    assert result.exit_code == 2
    assert result.stdout == "" or command == "state"
    assert result.stderr == "error: " + message.format(p=path) + "\n"
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_unknown_request_in_explain(trace_43559: Path) -> None:
    result = run_cli(["explain", str(trace_43559), "--request", "nope"])
    assert result.exit_code == 2
    assert result.stderr == f"error: {trace_43559}: no lookup with request_id 'nope'\n"


def test_state_group_out_of_range(trace_43559: Path) -> None:
    result = run_cli(["state", str(trace_43559), "--group", "5"])
    assert result.exit_code == 2
    assert result.stderr == "error: --group 5: the trace has groups 0..1\n"


@pytest.mark.parametrize("command", ["run", "state", "synth"])
def test_output_path_is_a_directory(tmp_path: Path, trace_43559: Path, command: str) -> None:
    target = tmp_path / "out"
    target.mkdir()
    args = {
        "run": ["run", str(trace_43559), "-o", str(target), "-q"],
        "state": ["state", str(trace_43559), "-o", str(target)],
        "synth": ["synth", "-o", str(target), "--model", "full", "--requests", "5"],
    }[command]
    result = run_cli(args)
    assert result.exit_code == 2
    assert result.stderr == f"error: {target}: is a directory, expected a file path to write\n"
    assert list(target.iterdir()) == []


def test_output_in_an_unwritable_place(trace_43559: Path) -> None:
    result = run_cli(["run", str(trace_43559), "-o", "/proc/nope/r.parquet", "-q"])
    assert result.exit_code == 2
    assert (
        result.stderr
        == "error: /proc/nope/r.parquet: no such directory /proc/nope (it is not created)\n"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["state", "{t}", "--show", "-1"],
        ["run", "{t}", "--examples", "-1", "-q"],
        ["check", "{t}", "--examples", "-2"],
    ],
)
def test_negative_counts_are_refused(trace_43559: Path, args: list[str]) -> None:
    result = run_cli([a.format(t=trace_43559) for a in args])
    assert result.exit_code == 2
    assert "is not in the range x>=0" in result.stderr
