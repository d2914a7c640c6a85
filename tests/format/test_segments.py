"""A trace written as closed segments (issue 32): each segment replays alone
with the answers the whole log gives, the directory reads as the log that
was written, a missing segment costs only its own lookups, and an error
keeps the closed segments and nothing else."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from replay.base.errors import ReplayError, TraceError
from replay.format.segments import SEGMENT_META_KEY, SegmentedTraceWriter
from replay.format.tracedir import batch_table, open_trace
from tests.builders import replay_trace

DEMO = Path(__file__).resolve().parent.parent.parent / "traces" / "demo-full-mamba-eagle.parquet"
ANSWER = ["request_id", "max_length", "hit_tokens", "mask_blocks", "loaded_blocks"]


def _write(out: Path, segment_events: int | None = None, **kw: object) -> SegmentedTraceWriter:
    reader = open_trace(DEMO)
    with SegmentedTraceWriter(out, reader.config, segment_events=segment_events, **kw) as w:  # type: ignore[arg-type]
        for batch in reader.iter_batches(batch_size=100):
            w.write_table(batch_table(batch))
    return w


def _answers(trace: Path) -> pl.DataFrame:
    frame: pl.DataFrame = replay_trace(trace).results.select(ANSWER)
    return frame


def _facts(segment: Path) -> dict[str, object]:
    meta = pq.ParquetFile(segment).metadata.metadata
    return dict(json.loads(meta[SEGMENT_META_KEY]))


@pytest.fixture
def segmented(tmp_path: Path) -> Path:
    out = tmp_path / "rec"
    w = _write(out, segment_events=400)
    assert [p.name for p in w.segments] == [f"segment-{i:06d}.parquet" for i in range(4)]
    assert w.rows_written == 1575
    return out


def test_the_directory_reads_as_the_log_that_was_written(segmented: Path) -> None:
    whole = open_trace(DEMO)
    reader = open_trace(segmented)
    assert reader.num_rows == 1575  # the snapshots are skipped
    assert sorted(p.name for p in segmented.iterdir()) == [
        f"segment-{i:06d}.parquet" for i in range(4)
    ]
    # Same rows in the same order; seq shifted past each snapshot.
    cols = [c for c in whole.read_frame().columns if c != "seq"]
    assert reader.read_frame().select(cols).equals(whole.read_frame().select(cols))
    assert _answers(segmented).equals(_answers(DEMO))


def test_each_segment_replays_alone_with_the_whole_logs_answers(segmented: Path) -> None:
    whole = _answers(DEMO)
    facts = [_facts(segmented / f"segment-{i:06d}.parquet") for i in range(4)]
    assert [f["events"] for f in facts] == [400, 400, 400, 375]
    assert facts[0]["snapshot_rows"] == 0 and facts[0]["previous_last_seq"] is None
    for before, after in itertools.pairwise(facts):
        assert after["previous_last_seq"] == before["last_seq"]
        assert int(after["snapshot_rows"]) >= 1  # type: ignore[call-overload]
    done = 0
    for i in range(4):
        alone = _answers(segmented / f"segment-{i:06d}.parquet")
        assert alone.equals(whole.slice(done, alone.height)), f"segment {i}"
        done += alone.height
    assert done == whole.height == 404


def test_a_missing_segment_costs_only_its_own_lookups(segmented: Path) -> None:
    whole = _answers(DEMO)
    first = _answers(segmented / "segment-000000.parquet").height
    lost = _answers(segmented / "segment-000001.parquet").height
    (segmented / "segment-000001.parquet").unlink()
    left = _answers(segmented)
    # Segment 2's snapshot is kept (its predecessor is gone): the state resumes.
    assert left.equals(pl.concat([whole.head(first), whole.slice(first + lost)]))


def test_time_bound_closes_segments_by_the_clock(tmp_path: Path) -> None:
    now = [0.0]
    reader = open_trace(DEMO)
    out = tmp_path / "rec"
    with SegmentedTraceWriter(out, reader.config, segment_seconds=10, clock=lambda: now[0]) as w:
        for batch in reader.iter_batches(batch_size=500):
            w.write_table(batch_table(batch))
            now[0] += 6  # two batches per segment
        assert w.tick() is True  # idle, and old enough: closed without a row
        assert w.tick() is False  # nothing open
    assert [_facts(p)["events"] for p in w.segments] == [1000, 575]
    assert _answers(out).equals(_answers(DEMO))


def test_an_error_keeps_the_closed_segments_only(tmp_path: Path) -> None:
    reader = open_trace(DEMO)
    out = tmp_path / "rec"
    table = batch_table(next(reader.iter_batches(batch_size=300)))
    with (
        pytest.raises(TraceError, match="seq not strictly increasing"),
        SegmentedTraceWriter(out, reader.config, segment_events=200) as w,
    ):
        w.write_table(table)  # one closed, one open with 100 rows
        w.write_table(table)  # seq goes back: refused
    assert sorted(p.name for p in out.iterdir()) == ["segment-000000.parquet"]
    assert open_trace(out).num_rows == 200


def test_an_error_before_any_segment_leaves_nothing(tmp_path: Path) -> None:
    reader = open_trace(DEMO)
    out = tmp_path / "rec"
    table = batch_table(next(reader.iter_batches(batch_size=10)))
    with pytest.raises(TraceError), SegmentedTraceWriter(out, reader.config) as w:
        w.write_table(table)
        w.write_table(table)
    assert list(tmp_path.iterdir()) == []


def test_no_rows_is_one_empty_segment(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    with SegmentedTraceWriter(out, open_trace(DEMO).config):
        pass
    assert open_trace(out).num_rows == 0


def test_the_directory_must_be_new_or_empty(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ReplayError, match="directory is not empty"):
        SegmentedTraceWriter(tmp_path / "full", open_trace(DEMO).config)
    with pytest.raises(ReplayError, match="expected at least 1"):
        SegmentedTraceWriter(tmp_path / "new", open_trace(DEMO).config, segment_events=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]
