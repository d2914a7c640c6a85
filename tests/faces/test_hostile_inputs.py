"""Issue 25's remaining hostile inputs, each fed as found: one line, exit
status 2 (or a correct run where the input is valid), nothing left behind."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.format.writer import events_table, write_trace
from tests.builders import full_mamba
from tests.conftest import run_cli

ROWS: list[dict[str, Any]] = [
    {"kind": "store", "group_id": 0, "block_hashes": [b"a" * 16]},
    {"kind": "store", "group_id": 1, "block_hashes": [b"a" * 16]},
    {"kind": "lookup", "request_id": "r", "block_hashes": [b"a" * 16], "max_length": 15},
]


def _with_ts(path: Path, typ: pa.DataType, values: list[int]) -> Path:
    table = events_table(ROWS[: len(values)], full_mamba())
    ts = pa.array(values, pa.int64()).cast(typ)
    table = table.set_column(table.schema.get_field_index("ts"), pa.field("ts", typ), ts)
    pq.write_table(table, str(path))
    return path


LAST_US = 253_402_300_799 * 1_000_000 + 999_999  # 9999-12-31T23:59:59.999999


@pytest.mark.parametrize("zone", ["+05:30", "-08:00", "America/New_York"])
def test_a_ts_in_another_zone_is_read_as_the_instant_it_stores_and_said(
    tmp_path: Path, zone: str
) -> None:
    """Issue 32: the format says UTC; a fixed offset or a real zone name is
    read as the UTC instants Arrow stores, and each command says so."""
    trace = _with_ts(tmp_path / "t.parquet", pa.timestamp("us", tz=zone), [0, 1, 2])
    results = tmp_path / "r.parquet"
    note = (
        f"{trace}: column 'ts' is in time zone {zone}; read as the UTC instants it stores "
        "(the format's timestamp[us, UTC])"
    )
    for args in (
        ["validate", str(trace)],
        ["info", str(trace), "--json"],
        ["run", str(trace), "-o", str(results), "-q"],
    ):
        result = run_cli(args)
        assert result.exit_code == 0, (args, result.output)
        assert result.stderr.splitlines()[-1] == note, args
    import polars as pl

    assert pl.read_parquet(results)["ts"].dt.epoch("us").to_list() == [2]


@pytest.mark.parametrize(
    ("zone", "why"),
    [
        ("Mars/Olympus", "has time zone 'Mars/Olympus', which is not a time zone"),
        (None, "has no time zone (a wall-clock time of unknown zone)"),
    ],
)
def test_a_ts_of_no_known_zone_is_refused(tmp_path: Path, zone: str | None, why: str) -> None:
    trace = _with_ts(tmp_path / "t.parquet", pa.timestamp("us", tz=zone), [0, 1, 2])
    for args in (["validate", str(trace)], ["run", str(trace), "-o", str(tmp_path / "r.parquet")]):
        result = run_cli(args)
        assert result.exit_code == 2, args
        assert result.stderr == f"error: {trace}: column 'ts' {why}, expected timestamp[us, UTC]\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]


def test_the_last_second_of_9999_is_a_valid_ts(tmp_path: Path) -> None:
    trace = _with_ts(
        tmp_path / "t.parquet", pa.timestamp("us", tz="UTC"), [LAST_US - 2, LAST_US - 1, LAST_US]
    )
    results = tmp_path / "r.parquet"
    for args in (
        ["validate", str(trace)],
        ["run", str(trace), "-o", str(results), "-q"],
        ["report", str(results), "-o", str(tmp_path / "r.html")],
    ):
        result = run_cli(args)
        assert result.exit_code == 0, (args, result.output)
    beyond = _with_ts(tmp_path / "b.parquet", pa.timestamp("ns", tz="UTC"), [0, 1])
    assert run_cli(["validate", str(beyond)]).exit_code == 0


def test_a_report_of_x_values_beyond_2_53(tmp_path: Path) -> None:
    big = 1 << 60
    rows = [{**row, "seq": big + i} for i, row in enumerate(ROWS)]
    trace = write_trace(tmp_path / "t.parquet", full_mamba(), rows)
    results = tmp_path / "r.parquet"
    assert run_cli(["run", str(trace), "-o", str(results), "-q"]).exit_code == 0
    result = run_cli(["report", str(results), "-o", str(tmp_path / "r.html")])
    assert (result.exit_code, result.stdout) == (0, f"wrote {tmp_path / 'r.html'}\n")


def test_prompts_all_shorter_than_one_block(tmp_path: Path) -> None:
    src = tmp_path / "m.jsonl"
    src.write_text(
        json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}) + "\n"
    )
    out = tmp_path / "m.parquet"
    result = run_cli(["ingest", "mooncake", str(src), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "1 event (1 lookup, 0 stores" in result.stdout
    assert run_cli(["run", str(out), "-o", str(tmp_path / "r.parquet"), "-q"]).exit_code == 0


def test_check_refuses_flags_without_their_details(tmp_path: Path, trace_43559: Path) -> None:
    results = tmp_path / "r.parquet"
    assert run_cli(["run", str(trace_43559), "-o", str(results), "-q"]).exit_code == 0
    # A file from before the facts: its stored flags are all `check` has (a
    # file with the facts has its flags recomputed from them).
    from replay.format.schema import FACT_COLUMNS

    table = pq.read_table(str(results))
    table = table.drop_columns([c for c in FACT_COLUMNS if c in table.column_names])
    i = table.schema.get_field_index("flags")
    flags = pa.array([["mamba_overrun"]] * table.num_rows, table.schema.field("flags").type)
    lying = tmp_path / "lying.parquet"
    pq.write_table(table.set_column(i, table.schema.field("flags"), flags), str(lying))
    result = run_cli(["check", str(lying)])
    seq = table.column("seq")[0].as_py()
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {lying}: seq {seq}: flags and flag_details disagree (each flag listed needs "
        "its flag_details entry, and each entry a listed flag)\n",
    )


def test_run_of_the_working_directory(tmp_path: Path, trace_43559: Path) -> None:
    here = tmp_path / "here"
    here.mkdir()
    os.link(trace_43559, here / "t.parquet")
    old = Path.cwd()
    os.chdir(here)
    try:
        result = run_cli(["run", ".", "-q"])
    finally:
        os.chdir(old)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "here.results.parquet").is_file()


DRIVER = """
import json, sys
from click.testing import CliRunner
from replay.cli import cli
out = []
for args in json.loads(sys.argv[1]):
    r = CliRunner().invoke(cli, args)
    out.append([r.exit_code, r.stderr])
print(json.dumps(out))
"""


def test_a_full_disk_is_an_error_naming_the_file_and_leaves_nothing(
    tmp_path: Path, trace_43559: Path
) -> None:
    """Each command writes into a 32 KiB tmpfs (mounted in a user and mount
    namespace): the error names the file the user asked for, never a hidden
    temporary one, and the disk is left empty."""
    import shutil
    import subprocess
    import sys

    from replay.format.writer import write_trace

    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    # A trace larger than the disk.
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": [os.urandom(32) for _ in range(64)]}
        for _ in range(64)
    ]
    trace = write_trace(tmp_path / "t.parquet", full_mamba(), rows)
    disk = tmp_path / "disk"
    disk.mkdir()
    commands = [
        ["split", str(trace), "-o", f"{disk}/parts", "--files", "3"],
        ["cat", str(trace), "-o", f"{disk}/c.parquet"],
        ["synth", "-o", f"{disk}/s.parquet", "--model", "full", "--requests", "200"],
        [
            "whatif",
            str(trace_43559),
            "--capacity-blocks",
            "1,2",
            "-q",
            "--jobs",
            "1",
            "-o",
            f"{disk}/w.parquet",
        ],
    ]
    script = (
        f"mount -t tmpfs -o size=32k tmpfs {disk} && "
        f"{sys.executable} -c '{DRIVER}' '{json.dumps(commands)}' && ls -A {disk}"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=env
    )
    if "unshare:" in run.stderr or "mount:" in run.stderr:
        pytest.skip(f"no tmpfs mount here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    results = json.loads(lines[0])
    full = "cannot write here (No space left on device)"
    assert results[:3] == [
        [2, f"error: {disk}/parts/part-000000.parquet: {full}\n"],
        [2, f"error: {disk}/c.parquet: {full}\n"],
        [2, f"error: {disk}/s.parquet: {full}\n"],
    ]
    # The sweep file is small: it fits, and is written whole.
    assert results[3][0] in (0, 2)
    assert lines[1:] in ([], ["w.parquet"])


def test_control_characters_in_request_ids_never_reach_the_terminal(tmp_path: Path) -> None:
    from tests.builders import issue_43559_rows

    evil = "req\x1b[2J\x1b]0;pwned\x07\r"
    rows = [
        {**row, "request_id": evil} if row.get("request_id") == "req-43559" else row
        for row in issue_43559_rows()
    ]
    trace = write_trace(tmp_path / "t.parquet", full_mamba(), rows)
    shown = "req\\x1b[2J\\x1b]0;pwned\\x07\\r"
    outputs = []
    for args in (
        ["check", str(trace), "--policy", "pre-49502"],
        ["explain", str(trace), "--request", evil, "--policy", "pre-49502"],
        ["diff", str(trace), "--policy", "vllm-0.33", "--policy", "pre-49502"],
        ["run", str(trace), "--policy", "pre-49502", "-o", str(tmp_path / "r.parquet")],
        ["explain", str(trace), "--request", evil + "x"],
    ):
        result = run_cli(args)
        outputs.append(result.output)
        assert "\x1b" not in result.output and "\x07" not in result.output, args
        assert "\r" not in result.output, args
    assert all(shown in out for out in outputs[:4]), outputs
    assert shown + "x" in outputs[4]


def test_a_kv_dump_whose_block_size_differs_from_the_config_is_refused(tmp_path: Path) -> None:
    from replay.sources.dump import DumpWriter
    from tests.kvpayloads import T0, payload, stored

    dump = tmp_path / "d.kvdump"
    with DumpWriter(dump) as w:  # events of 16-token blocks
        w.write([b"", (0).to_bytes(8, "big"), payload(T0, stored([1, 2]))], "live", T0)
    out = tmp_path / "t.parquet"
    result = run_cli(["ingest", "kv-events", str(dump), "-o", str(out), "--block-size", "32"])
    assert result.exit_code == 2
    assert result.stderr.endswith(
        "group_idx 0: the publisher says block_size 16, but the config's group 0 has "
        "block_size 32\n"
    ), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.kvdump"]
    assert (
        run_cli(["ingest", "kv-events", str(dump), "-o", str(out), "--block-size", "16"]).exit_code
        == 0
    )
