"""The recorder's stream bookkeeping under late batches, silence and bad
endpoints (issue 10): a late batch goes in its place instead of being
taken for a publisher restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from replay.sources.record import EmptyRecording
from replay.sources.record import record as record_stream
from replay.sources.stream import StreamProcessor
from tests.conftest import run_cli
from tests.kvpayloads import T0, keyed, one_group, payload, stored, u64


def processor(rows: list[dict[str, Any]], messages: list[str], **kw: Any) -> StreamProcessor:
    return StreamProcessor(one_group(), rows.extend, report=messages.append, **kw)


def feed(proc: StreamProcessor, seq: int, recv_ts: float, origin: str = "live") -> None:
    body = payload(T0 + seq, stored([seq + 1]))
    proc.feed([b"", seq.to_bytes(8, "big"), body], origin=origin, recv_ts=recv_ts)


def test_a_late_batch_inside_the_window_goes_in_its_place() -> None:
    rows: list[dict[str, Any]] = []
    messages: list[str] = []
    proc = processor(rows, messages, reorder_seconds=2.0)
    for seq, at in ((0, 0.0), (2, 0.1), (3, 0.2), (1, 0.5), (4, 0.6)):
        feed(proc, seq, T0 + at)
    proc.finish()
    assert [r["block_hashes"] for r in rows] == [[u64(n)] for n in (1, 2, 3, 4, 5)]
    assert [r["seq"] for r in rows] == [0, 1, 2, 3, 4]
    assert (proc.gaps, proc.restarts, proc.late, messages) == ([], [], 0, [])


def test_a_batch_later_than_the_window_fills_its_gap_and_is_no_restart() -> None:
    rows: list[dict[str, Any]] = []
    messages: list[str] = []
    proc = processor(rows, messages, reorder_seconds=2.0)
    feed(proc, 0, T0)
    feed(proc, 2, T0 + 0.1)
    feed(proc, 3, T0 + 3.0)  # the hold ran out: seq 1 is reported missing
    feed(proc, 1, T0 + 3.5)  # ... and then comes
    proc.finish()
    assert keyed(rows) == [
        (0, "store", 0, [u64(1)], "GPU"),
        (1, "store", 0, [u64(3)], "GPU"),
        (2, "store", 0, [u64(4)], "GPU"),
        (3, "store", 0, [u64(2)], "GPU"),
    ]
    assert (proc.gaps, proc.restarts, proc.late, proc.expected) == ([], [], 1, 4)
    assert messages == [
        "gap: seq 1 missing (1 batch): missing from the stream",
        "late batch: seq 1 came after seq 3 was written; taken where it arrived",
    ]
    assert proc.source()["late_batches"] == 1


def test_a_seq_going_back_over_batches_taken_is_still_a_restart() -> None:
    rows: list[dict[str, Any]] = []
    messages: list[str] = []
    proc = processor(rows, messages, reorder_seconds=2.0)
    for seq in (0, 1, 2):
        feed(proc, seq, T0 + seq / 10)
    proc.feed([b"", (0).to_bytes(8, "big"), payload(T0 + 9, stored([42]))], origin="live", recv_ts=T0 + 1)  # fmt: skip
    assert proc.restarts == [{"epoch": 1, "previous_last_seq": 2}]
    assert [r["kind"] for r in rows] == ["store", "store", "store", "clear", "store"]


def test_silence_before_any_event_ends_the_recording_at_the_connect_timeout(
    tmp_path: Path,
) -> None:
    """Nothing ever received is not an idle engine to wait for: past
    ``connect_timeout`` it is an error and nothing is written (the silence
    note is for a stream that went quiet after it began)."""
    messages: list[str] = []
    out = tmp_path / "t.parquet"
    with pytest.raises(EmptyRecording) as err:
        record_stream(
            endpoint="tcp://127.0.0.1:9",  # nobody publishes there
            output=out,
            config=one_group(),
            topic="kv@",
            duration=5.0,
            silence_seconds=0.3,
            connect_timeout=1.0,
            report=messages.append,
        )
    assert str(err.value) == (
        "--endpoint tcp://127.0.0.1:9: no KV event within 1 s (connected: vLLM's publisher must "
        "bind there); check that vLLM runs with kv_events_config (enable_kv_cache_events, "
        "publisher zmq) on that host and port, and the topic 'kv@'; no trace written"
    )
    assert messages == []
    assert not out.exists()


def test_a_bad_endpoint_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "t.parquet"
    for endpoint, message in [
        ("nonsense", "--endpoint nonsense: cannot connect (Invalid argument)"),
        ("tcp://127.0.0.1:notaport", "--endpoint tcp://127.0.0.1:notaport: cannot connect (Invalid argument)"),
        ("tcp://\udcff:1", "--endpoint 'tcp://\\udcff:1': not valid text (undecodable bytes)"),
    ]:  # fmt: skip
        result = run_cli(["record", "--endpoint", endpoint, "-o", str(out), "--block-size", "16"])
        assert (result.exit_code, result.stderr) == (2, f"error: {message}\n"), endpoint
    assert list(tmp_path.iterdir()) == []
