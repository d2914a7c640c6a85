"""``replay repair``: the complete row groups of a trace file cut short are
salvaged into a valid trace (issue 32); a file cut at any byte gives back
exactly the row groups that lay wholly before the cut."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from replay.format.tracedir import batch_table, open_trace
from replay.format.writer import TraceWriter
from tests.conftest import run_cli

DEMO = Path(__file__).resolve().parent.parent.parent / "traces" / "demo-full-mamba-eagle.parquet"


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo trace in row groups of 100 rows (16 of them), as a recorder
    flushing every few seconds writes it."""
    out = tmp_path_factory.mktemp("repair") / "whole.parquet"
    reader = open_trace(DEMO)
    with TraceWriter(out, reader.config) as writer:
        for batch in reader.iter_batches(batch_size=100):
            writer.write_table(batch_table(batch))
    return out


def _ends(path: Path) -> list[int]:
    """Where each row group's last byte ends, from the intact footer."""
    meta = pq.ParquetFile(path).metadata
    ends = []
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        ends.append(
            max(
                min(c.data_page_offset, c.dictionary_page_offset or c.data_page_offset)
                + c.total_compressed_size
                for c in (rg.column(j) for j in range(rg.num_columns))
            )
        )
    return ends


@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.93, 0.99])
def test_a_cut_file_gives_back_every_row_group_before_the_cut(
    tmp_path: Path, whole: Path, fraction: float
) -> None:
    data = whole.read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[: int(len(data) * fraction)])
    assert run_cli(["validate", str(cut)]).exit_code == 2  # unreadable as it is
    ends = _ends(whole)
    groups = sum(1 for e in ends if e <= os.path.getsize(cut))
    assert groups >= 1
    meta = pq.ParquetFile(whole).metadata
    rows = sum(meta.row_group(i).num_rows for i in range(groups))
    out = tmp_path / "fixed.parquet"
    result = run_cli(["repair", str(cut), "-o", str(out), "--config", str(whole)])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == (
        f"{cut} -> {out}: kept {rows:,} rows in {groups} complete row "
        f"group{'s' if groups != 1 else ''} ({ends[groups - 1]:,} of {os.path.getsize(cut):,} "
        "bytes; the rest was cut short)\n"
    )
    assert run_cli(["validate", str(out)]).exit_code == 0
    fixed = open_trace(out)
    assert fixed.config == open_trace(whole).config
    assert fixed.read_frame().equals(open_trace(whole).read_frame().head(rows))
    assert cut.read_bytes() == data[: int(len(data) * fraction)]  # the input untouched


def test_what_cannot_be_repaired_is_one_line_and_no_output(tmp_path: Path, whole: Path) -> None:
    data = whole.read_bytes()
    tiny = tmp_path / "tiny.parquet"
    tiny.write_bytes(data[:3000])
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out.parquet"
    cases = [
        (["repair", str(whole), "-o", str(out)],
         f"error: {whole}: its footer is intact, nothing to repair (`replay validate` checks it)"),
        (["repair", str(tiny), "-o", str(out), "--config", str(whole)],
         f"error: {tiny}: no complete row group before the cut (3,000 bytes); nothing to salvage"),
        (["repair", str(cut), "-o", str(out)],
         f"error: {cut}: the footer that held the trace's config is lost; pass --config (a "
         "kv-config JSON or a trace recorded with the same config) or --block-size N"),
        (["repair", str(cut), "-o", str(cut), "--config", str(whole)],
         f"error: -o {cut}: is the input {cut}; refusing to overwrite it (give another output "
         "path)"),
    ]  # fmt: skip
    for args, line in cases:
        result = run_cli(args)
        assert result.exit_code == 2, args
        assert result.stderr == line + "\n"
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.parquet", "tiny.parquet"]


def test_a_wrong_config_keeps_nothing(tmp_path: Path, whole: Path) -> None:
    data = whole.read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[: len(data) // 2])
    result = run_cli(["repair", str(cut), "-o", str(tmp_path / "o.parquet"), "--block-size", "16"])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {cut}: no complete row group could be read (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.parquet"]
