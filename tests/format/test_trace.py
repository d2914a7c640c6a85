"""The trace reader and writers beyond a path: file objects (``io.BytesIO``,
an open file), an Arrow table in memory, a reader passed down instead of a
path, and the results writer that refuses results without their flags."""

from __future__ import annotations

import io
import os
import random
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.analysis.flags import result_flags
from replay.base.errors import ReplayError, TraceError
from replay.format.link import save_results
from replay.format.results import read_results, write_results
from replay.format.trace import TableReader, TraceReader
from replay.format.tracedir import open_trace
from replay.format.writer import TraceWriter, events_table, trace_schema, write_trace
from tests.builders import full_mamba, issue_43559_rows, random_config, random_rows, replay_trace


@pytest.mark.parametrize("seed", range(12))
def test_a_trace_round_trips_through_bytesio_and_replays_as_the_file(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(700 + seed)
    config = random_config(rng)
    rows = random_rows(rng, config)
    path = write_trace(tmp_path / "r.parquet", config, rows)
    buffer = io.BytesIO()
    assert write_trace(buffer, config, rows) == Path("<stream>")
    # The same writer either way: the same bytes.
    assert buffer.getvalue() == path.read_bytes()
    reader = TraceReader(io.BytesIO(buffer.getvalue()))
    assert (reader.path, reader.name, reader.num_rows) == (None, "<stream>", len(rows))
    assert reader.config == config
    for policy in ("vllm-0.33", "pre-49502"):
        want = replay_trace(path, policy=policy, unit_present=True).results
        got = replay_trace(reader, policy=policy, unit_present=True).results
        assert got.equals(want)


def test_trace_writer_to_a_stream_writes_only_a_complete_file() -> None:
    config = full_mamba()
    rows = issue_43559_rows()
    buffer = io.BytesIO()
    with TraceWriter(buffer, config) as writer:
        for i, row in enumerate(rows):
            writer.write_rows([{**row, "seq": i}])
    assert writer.rows_written == 3
    reader = TraceReader(io.BytesIO(buffer.getvalue()))
    assert reader.read_frame(["seq", "kind"]).rows() == [(0, "store"), (1, "store"), (2, "lookup")]
    assert replay_trace(reader, policy="pre-49502").results["hit_tokens"].to_list() == [64]

    failed = io.BytesIO()
    with (
        pytest.raises(TraceError, match=r"^<stream>: seq 0: seq not strictly increasing"),
        TraceWriter(failed, config) as writer,
    ):
        writer.write_rows([{**rows[0], "seq": 0}])
        writer.write_rows([{**rows[1], "seq": 0}])
    assert failed.getvalue() == b""


def test_stream_errors_name_the_stream(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"^<stream>: empty file, expected a Parquet file$"):
        TraceReader(io.BytesIO())
    with pytest.raises(TraceError, match=r"^<stream>: not a Parquet file \(no PAR1 magic"):
        TraceReader(io.BytesIO(b"seq,kind\n0,store\n"))
    buffer = io.BytesIO()
    write_trace(buffer, full_mamba(), issue_43559_rows())
    with pytest.raises(TraceError, match=r"^<stream>: truncated Parquet file"):
        TraceReader(io.BytesIO(buffer.getvalue()[:-1]))
    # A row the format refuses, in a file written by another tool.
    table = events_table(issue_43559_rows(), full_mamba())
    lengths = table.column("max_length").to_pylist()
    lengths[2] = None
    bad = io.BytesIO()
    pq.write_table(table.set_column(6, "max_length", pa.array(lengths, pa.int64())), bad)
    with pytest.raises(TraceError, match=r"^<stream>: seq 2: lookup has no max_length$"):
        replay_trace(TraceReader(io.BytesIO(bad.getvalue())))


def test_an_open_file_is_named_by_its_path(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    path.write_bytes(b"PAR1 but nothing else")
    with open(path, "rb") as fh, pytest.raises(TraceError, match=f"^{path}: truncated Parquet"):
        TraceReader(fh)
    good = write_trace(tmp_path / "good.parquet", full_mamba(), issue_43559_rows())
    with open(good, "rb") as fh:
        reader = TraceReader(fh)
        assert reader.name == str(good)
        assert result_flags(replay_trace(reader, policy="pre-49502"))["flag"].to_list() == [
            "mamba_overrun",
            "eagle_not_dropped",
        ]


def test_a_pipe_is_refused_as_not_seekable() -> None:
    r, w = os.pipe()
    os.write(w, b"PAR1")
    os.close(w)
    with open(r, "rb") as fh, pytest.raises(TraceError, match=r"^<stream>: cannot read it as a"):
        TraceReader(fh)


def test_open_trace_passes_an_open_reader_through(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.parquet", full_mamba(), issue_43559_rows())
    reader = open_trace(path)
    assert open_trace(reader) is reader
    # One reader serves several passes: each reads the file from its start.
    first = replay_trace(reader, policy="pre-49502").results
    assert replay_trace(reader, policy="pre-49502").results.equals(first)
    assert reader.read_frame(["seq"])["seq"].to_list() == [0, 1, 2]


def test_a_table_reader_reads_rows_as_a_file_would(tmp_path: Path) -> None:
    rng = random.Random(5)
    config = random_config(rng)
    rows = random_rows(rng, config)
    path = write_trace(tmp_path / "r.parquet", config, rows)
    memory = TableReader(events_table(rows, config), config, name="<rows>")
    assert (memory.num_rows, memory.name, memory.path) == (len(rows), "<rows>", None)
    assert replay_trace(memory, unit_present=True).results.equals(
        replay_trace(path, unit_present=True).results
    )
    assert memory.read_frame().equals(open_trace(path).read_frame())
    backwards = [{**r, "seq": len(rows) - i} for i, r in enumerate(rows)]
    with pytest.raises(TraceError, match=r"^<rows>: seq \d+: seq not strictly increasing"):
        replay_trace(TableReader(events_table(backwards, config), config, name="<rows>"))
    with pytest.raises(TraceError, match=r"^<rows>: missing column 'seq' in the rows to write$"):
        TableReader(pa.table({"kind": ["store"]}), config, name="<rows>")


def test_the_results_writer_refuses_results_without_their_flags(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.parquet", full_mamba(), issue_43559_rows())
    result = replay_trace(trace, policy="pre-49502")
    table = result.results.to_arrow()
    out = tmp_path / "t.results.parquet"
    for name in ("flags", "flag_details"):
        with pytest.raises(ReplayError, match=f"results without their '{name}' column"):
            write_results(out, table.drop_columns([name]), result.metadata())
        assert not out.exists()
    unflagged = table.set_column(
        table.schema.get_field_index("flags"),
        "flags",
        pa.array([None], table.schema.field("flags").type),
    )
    with pytest.raises(ReplayError, match="results with a null 'flags'"):
        write_results(out, unflagged, result.metadata())
    assert not out.exists()
    # Through the library the flags are always there, with their numbers.
    frame, _ = read_results(save_results(result, out))
    assert frame["flags"].to_list() == [["mamba_overrun", "eagle_not_dropped"]]
    details = frame["flag_details"].to_list()[0]
    assert [(d["flag"], d["group_id"], d["actual"], d["expected"]) for d in details] == [
        ("mamba_overrun", 1, 64, 48),
        ("eagle_not_dropped", 0, 64, None),
    ]


def test_trace_schema_is_what_the_stream_writer_writes() -> None:
    buffer = io.BytesIO()
    write_trace(buffer, full_mamba(), issue_43559_rows())
    schema = pq.read_schema(io.BytesIO(buffer.getvalue()))
    assert schema.remove_metadata().equals(trace_schema(full_mamba()).remove_metadata())
    frame = TraceReader(io.BytesIO(buffer.getvalue())).read_frame(["kind", "request_id"])
    assert frame.filter(pl.col("kind") == "lookup")["request_id"].to_list() == ["req-43559"]
