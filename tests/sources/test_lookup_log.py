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
from tests.contracts.source import DeterministicSourceContract
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


# ---------------------------------------------------------------- the sources' contract


class TestLookupMerge(DeterministicSourceContract):
    """``replay ingest merge``: a trace and a lookup log in, one trace out."""

    def _trace(self, folder: Path) -> Path:
        return write_trace(
            folder / "events.parquet",
            one_group(),
            [
                {"seq": 10, "ts": at(T0), "kind": "store", "group_id": 0, "block_hashes": [u64(1), u64(2)]},
                {"seq": 11, "ts": at(T0 + 2), "kind": "remove", "group_id": 0, "block_hashes": [u64(2)]},
            ],
        )  # fmt: skip

    def command(self, folder: Path, out: Path) -> list[str]:
        log = folder / "lookups.jsonl"
        log.write_text(
            json.dumps({"request_id": "a", "ts": T0 + 1, "block_hashes": [1, 2], "num_tokens": 32})
            + "\n"
            + json.dumps(
                {"request_id": "b", "ts": T0 + 3, "block_hashes": [1, 2], "max_length": 31}
            )
            + "\n"
        )
        return ["ingest", "merge", str(self._trace(folder)), str(log), "-o", str(out)]

    def expected_counts(self) -> dict[str, int]:
        return {"store": 1, "lookup": 2, "remove": 1}

    def bad_inputs(self, folder: Path, out: Path) -> list[tuple[list[str], str]]:
        trace = self._trace(folder)
        cases = []
        for i, (line, message) in enumerate(
            [
                (b'{"request_id": "\\udc00", "ts": 1, "block_hashes": [1], "max_length": 3}', "field 'request_id': holds a lone surrogate escape (not text)"),
                (b'{"request_id": "a", "ts": "0001-01-01T00:00:00+01:00", "block_hashes": [1], "max_length": 3}', "field 'ts': '0001-01-01T00:00:00+01:00' is outside the representable time range"),
                (b'{"request_id": "a", "ts": 1, "block_hashes": [""], "max_length": 3}', "field 'block_hashes'[0]: hash is empty (expected a non-empty hex string)"),
                (b'{"request_id": "a", "ts": 1, "block_hashes": [1], "max_length": 3, "num_tokens": 2}', "num_tokens 2 cannot hold max_length 3 (expected num_tokens >= max_length)"),
                (b'{"request_id": "a", "ts": 1, "block_hashes": [1], "max_length": ' + b"9" * 5000 + b"}", "not valid JSON (Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits; use sys.set_int_max_str_digits() to increase the limit)"),
            ]
        ):  # fmt: skip
            log = folder / f"l{i}.jsonl"
            log.write_bytes(line + b"\n")
            cases.append(
                (
                    ["ingest", "merge", str(trace), str(log), "-o", str(out)],
                    f"{log}: line 1: {message}",
                )
            )
        return cases
