"""``replay info``'s figures from a trace handed over as a path or an open reader."""

from __future__ import annotations

import io
from pathlib import Path

from replay.analysis.summary import trace_info
from replay.format.trace import TraceReader
from replay.format.writer import write_trace
from tests.builders import full_mamba, issue_43559_rows


def test_trace_info_of_an_open_reader_is_that_of_the_path(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.parquet", full_mamba(), issue_43559_rows())
    by_path = trace_info(path)
    by_reader = trace_info(TraceReader(io.BytesIO(path.read_bytes())))
    assert (by_path["path"], by_reader["path"]) == (str(path), "<stream>")
    assert {**by_reader, "path": str(path)} == by_path
    assert by_reader["events_by_kind"] == {"store": 2, "remove": 0, "clear": 0, "lookup": 1}
    assert (by_reader["hash_entries"], by_reader["distinct_keys_per_group"]) == (12, [4, 4])
    assert (by_reader["lookups"], by_reader["lookup_max_length_tokens"]) == (1, 64)
