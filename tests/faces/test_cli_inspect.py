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
    assert (data["lookups"], data["prompt_tokens"], data["max_length_tokens"]) == (
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


def test_a_relative_trace_shows_elapsed_time_not_1970(tmp_path: Path) -> None:
    """The public Mooncake trace's clock starts at zero: info and the report
    say +00:58:57, never a date in 1970."""
    from replay.analysis.report import build_report, render_html

    hs = chain(3, "rel")
    zero = datetime(1970, 1, 1, tzinfo=UTC)
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": hs, "ts": zero},
        {"kind": "store", "group_id": 1, "block_hashes": hs, "ts": zero},
        {"kind": "lookup", "request_id": "r", "block_hashes": hs, "max_length": 47, "ts": zero},
        {
            "kind": "lookup",
            "request_id": "s",
            "block_hashes": hs,
            "max_length": 47,
            "ts": datetime(1970, 1, 1, 0, 58, 56, 999000, tzinfo=UTC),
        },
    ]
    path = write_trace(tmp_path / "rel.parquet", full_mamba(), rows)
    text = run_cli(["info", str(path)]).stdout.splitlines()
    assert (
        "time: +00:00:00 .. +00:58:57 elapsed (3,537.0 s; the trace's clock starts at zero)" in text
    )
    data = json.loads(run_cli(["info", str(path), "--json"]).stdout)
    assert data["time_span"]["relative"] is True
    results = tmp_path / "rel.results.parquet"
    assert run_cli(["run", str(path), "-o", str(results), "-q"]).exit_code == 0
    page = render_html(build_report(results))
    assert "1970" not in page
    assert ">elapsed time since the trace's start (h:mm:ss)</text>" in page
    assert ">+00:50:00</text>" in page
    assert "+00:58:57: 1 lookup," in page
