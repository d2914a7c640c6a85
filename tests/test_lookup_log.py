"""The lookup log merged into a trace by time (``replay.sources.lookup_log``)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from replay.base.errors import ReplayError, TraceError
from replay.format.tracedir import open_trace
from replay.format.writer import write_trace
from replay.sources.lookup_log import LookupMerger, read_lookup_log
from tests.kvpayloads import T0, at, one_group, run_ingest, u64


def test_lookups_merge_by_time_before_events_of_the_same_time(tmp_path: Path) -> None:
    trace = tmp_path / "events.parquet"
    write_trace(
        trace,
        one_group(),
        [
            {"seq": 10, "ts": at(T0), "kind": "store", "group_id": 0, "block_hashes": [u64(1)]},
            {
                "seq": 11,
                "ts": at(T0 + 2),
                "kind": "remove",
                "group_id": 0,
                "block_hashes": [u64(1)],
            },
        ],
    )
    log = tmp_path / "lookups.jsonl"
    log.write_text(
        "\n".join(
            json.dumps(o)
            for o in [
                {"request_id": "late", "ts": T0 + 5, "block_hashes": ["00" * 7 + "01"], "max_length": 15},
                {"request_id": "tie", "ts": T0 + 2, "block_hashes": [1, 2], "num_tokens": 32},
                {"request_id": "first", "ts": "2027-01-15T09:00:01+01:00", "block_hashes": [1], "max_length": 0, "observed_hit_tokens": 0},
            ]
        )
        + "\n\n"
    )  # fmt: skip
    out = tmp_path / "merged.parquet"
    result = run_ingest(["merge", str(trace), str(log), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stderr.strip() == f"wrote {out}: 2 events, 3 lookups merged"
    merged = open_trace(out)
    rows = merged.read_frame().to_dicts()
    assert [
        (r["seq"], r["kind"], r["request_id"], r["block_hashes"], r["max_length"], r["num_tokens"])
        for r in rows
    ] == [
        (0, "store", None, [u64(1)], None, None),
        (1, "lookup", "first", [u64(1)], 0, None),
        (2, "lookup", "tie", [u64(1), u64(2)], 31, 32),
        (3, "remove", None, [u64(1)], None, None),
        (4, "lookup", "late", [u64(1)], 15, None),
    ]
    assert rows[1]["ts"] == datetime(2027, 1, 15, 8, 0, 1, tzinfo=UTC)
    assert rows[1]["observed_hit_tokens"] == 0
    assert (merged.config.source or {})["lookups"]["count"] == 3


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1]", "line 2: expected a JSON object, got array"),
        ('{"ts": 1, "block_hashes": []}', "line 2: missing field 'request_id'"),
        ('{"request_id": "r", "ts": "soon", "block_hashes": [], "max_length": 0}', "line 2: field 'ts': 'soon' is not an ISO 8601 time"),
        ('{"request_id": "r", "ts": 1, "block_hashes": [1.5], "max_length": 0}', "line 2: field 'block_hashes'[0]: expected an unsigned 64-bit integer or a hex string, got float"),
        ('{"request_id": "r", "ts": 1, "block_hashes": ["xyz"], "max_length": 0}', "line 2: field 'block_hashes'[0]: 'xyz' is not a hex string"),
        ('{"request_id": "r", "ts": 1, "block_hashes": [1]}', "line 2: missing field 'max_length' (or 'num_tokens', giving num_tokens - 1)"),
        ('{"request_id": "r", "ts": 1, "block_hashes": [1], "max_length": 32}', "line 2: max_length 32 exceeds what its 1 block_hashes cover (expected below (len(block_hashes) + 1) * hash_block_size = 32)"),
        ("{oops", "line 2: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ],
)  # fmt: skip
def test_lookup_log_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    log = tmp_path / "l.jsonl"
    log.write_text('{"request_id": "ok", "ts": 1, "block_hashes": [], "max_length": 0}\n' + line)
    with pytest.raises(ReplayError) as info:
        read_lookup_log(log, one_group())
    assert str(info.value) == f"{log}: {message}"


def test_merge_needs_ts_on_every_event() -> None:
    merger = LookupMerger([])
    with pytest.raises(TraceError) as info:
        merger.feed([{"seq": 4, "ts": None, "kind": "clear"}], where="t.parquet")
    assert str(info.value) == (
        "t.parquet: seq 4: no ts (lookups are merged by time, so every event needs one)"
    )
