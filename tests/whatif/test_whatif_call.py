"""The one what-if call, ``whatif(trace, WhatifOptions) -> Sweep``: what the
``replay whatif`` command writes, without the command (issue 35)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from replay.analysis.flags import FLAG_KINDS, sweep_flag_counts
from replay.base.errors import ReplayError
from replay.base.units import parse_capacities
from replay.format.sweepfile import SWEEP_COLUMNS, read_sweep
from replay.whatif.run import WhatifOptions, whatif
from tests.conftest import run_cli

CORPUS = Path(__file__).resolve().parent.parent.parent / "traces"
TRACE = CORPUS / "archetype-full.parquet"


def _without_seconds(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.drop("seconds")


def test_whatif_writes_the_sweep_file_the_command_writes(tmp_path: Path) -> None:
    out = tmp_path / "call.parquet"
    sweep = whatif(
        TRACE,
        WhatifOptions(
            capacities=tuple(parse_capacities("8,64")),
            evictions=("lru", "fifo"),
            cache="gpu",
            output=out,
            count_flags=sweep_flag_counts,
        ),
    )
    cli_out = tmp_path / "cli.parquet"
    result = run_cli(
        [
            "whatif",
            TRACE,
            "--cache",
            "gpu",
            "--capacity",
            "8,64",
            "--eviction",
            "lru,fifo",
            "-o",
            cli_out,
            "-q",
            "--jobs",
            "1",
        ]
    )
    assert result.exit_code == 0, result.output
    frame, meta = read_sweep(out)
    cli_frame, cli_meta = read_sweep(cli_out)
    assert frame.columns == [*SWEEP_COLUMNS, *FLAG_KINDS]
    assert _without_seconds(frame).equals(_without_seconds(cli_frame))
    meta.pop("seconds"), cli_meta.pop("seconds")
    assert meta == cli_meta
    assert sweep.runs == 4 and not sweep.partial
    assert sweep.requests == frame["lookups"][0]
    assert [r["capacity_blocks"] for r in sweep.rows] == [8, 8, 64, 64]
    assert [r["eviction"] for r in sweep.rows] == ["lru", "fifo", "lru", "fifo"]
    assert _without_seconds(sweep.frame()).equals(_without_seconds(frame))


def test_whatif_without_an_output_writes_nothing_and_keeps_the_facts(tmp_path: Path) -> None:
    sweep = whatif(
        TRACE,
        WhatifOptions(capacities=tuple(parse_capacities("50%")), cache="mooncake"),
    )
    assert list(tmp_path.iterdir()) == []
    (row,) = sweep.rows
    assert isinstance(row["facts"], pl.DataFrame)
    assert row["facts"].height == sweep.requests == row["lookups"]
    # The frame has no flag counts: nothing judged them.
    assert sweep.frame().columns == list(SWEEP_COLUMNS)
    assert sweep.metadata["ceiling"]["hit_ratio"] >= row["hit_ratio"]


def test_whatif_refuses_bytes_without_page_sizes() -> None:
    with pytest.raises(ReplayError, match="bytes need the groups' page sizes"):
        whatif(TRACE, WhatifOptions(capacities=tuple(parse_capacities("1GiB"))))
