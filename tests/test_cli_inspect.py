"""replay validate / info / state: what a user reads about a trace."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import polars as pl

from replay.format.writer import write_trace
from tests.builders import chain, full_mamba
from tests.conftest import run_cli

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _trace(tmp_path: Path) -> Path:
    a, b = chain(3, "a"), chain(2, "b")
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": a, "ts": T0},
        {"kind": "store", "group_id": 0, "block_hashes": a[:2], "ts": T0},  # stored again
        {"kind": "store", "group_id": 1, "block_hashes": a[2:], "ts": T0},  # same hash, other group
        {
            "kind": "lookup",
            "request_id": "r1",
            "block_hashes": a,
            "max_length": 47,
            "num_tokens": 48,
        },
        {"kind": "remove", "group_id": 0, "block_hashes": a[2:]},
        {"kind": "store", "group_id": 0, "block_hashes": b},
        {"kind": "lookup", "request_id": "r2", "block_hashes": b, "max_length": 31},
        {"kind": "clear", "group_id": 1, "ts": datetime(2026, 11, 30, 12, 1, 30, tzinfo=UTC)},
    ]
    return write_trace(tmp_path / "t.parquet", full_mamba(), rows)


def test_validate_prints_ok_and_the_counts(tmp_path: Path) -> None:
    path = _trace(tmp_path)
    result = run_cli(["validate", str(path)])
    assert result.exit_code == 0
    assert result.stdout == (
        f"ok: {path}: 8 events (store 4, remove 1, clear 1, lookup 2), 2 KV-cache groups\n"
    )


def test_info_counts_distinct_keys_time_span_and_tokens(tmp_path: Path) -> None:
    path = _trace(tmp_path)
    data = json.loads(run_cli(["info", str(path), "--json"]).stdout)
    assert data["events_by_kind"] == {"store": 4, "remove": 1, "clear": 1, "lookup": 2}
    assert data["distinct_keys_per_group"] == [5, 1]
    assert data["hash_entries"] == 3 + 2 + 1 + 3 + 1 + 2 + 2
    assert data["time_span"]["seconds"] == 90.0
    assert (data["lookups"], data["lookup_prompt_tokens"], data["lookup_max_length_tokens"]) == (
        2,
        48 + 32,
        78,
    )
    text = run_cli(["info", str(path)]).stdout
    assert "distinct keys stored, group 0: full_attention block=16 (attn): 5" in text
    assert "time: 2026-11-30T12:00:00+00:00 .. 2026-11-30T12:01:30+00:00 (90.0 s)" in text


def test_state_at_a_seq_and_written_as_parquet(tmp_path: Path) -> None:
    path = _trace(tmp_path)
    a, b = chain(3, "a"), chain(2, "b")
    out = tmp_path / "keys.parquet"
    result = run_cli(["state", str(path), "--at", "6", "-o", str(out)])
    assert result.exit_code == 0
    assert "group 0: full_attention block=16 (attn): 4 keys" in result.stdout
    keys = pl.read_parquet(out)
    assert sorted(keys.rows()) == sorted([(0, h) for h in a[:2] + b] + [(1, a[2])])
    # After the clear of group 1 and with --group.
    end = run_cli(["state", str(path), "--group", "1"])
    assert "group 1: mamba block=16 (mamba): 0 keys" in end.stdout
