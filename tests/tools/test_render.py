"""replay.tools.render: the words of every summary a command prints."""

from __future__ import annotations

from pathlib import Path

from replay.sources.stream import RecordSummary
from replay.tools.render import record_summary_text


def test_a_clean_recording_is_its_batches_and_rows() -> None:
    summary = RecordSummary(path=Path("t.parquet"), batches=1, rows=3, kv_events=3)
    assert record_summary_text(summary) == "1 batch, 3 rows"


def test_a_recording_names_every_way_the_stream_fell_short() -> None:
    summary = RecordSummary(
        path=Path("t.parquet"),
        batches=40,
        rows=120,
        kv_events=130,
        gaps=[{"count": 3}, {"count": 4}],
        restarts=[{"epoch": 1}],
        skipped=2,
        filled=5,
        lookups=17,
    )
    assert record_summary_text(summary) == (
        "40 batches, 120 rows, 17 lookups placed, 5 filled from the replay endpoint, "
        "7 missing in 2 gaps, 1 publisher restart, 2 malformed skipped"
    )
    one_gap = RecordSummary(
        path=Path("t.parquet"),
        batches=2,
        rows=2,
        kv_events=2,
        gaps=[{"count": 1}],
        restarts=[{}, {}],
    )
    assert (
        record_summary_text(one_gap)
        == "2 batches, 2 rows, 1 missing in 1 gap, 2 publisher restarts"
    )
