"""The plugin-log reader and the KV-event dump reader are bounded like the
JSONL importers (replay.base.limits): a line's bytes, a record's bytes
(checked against its length prefix before it is read), an event's hashes
and a hash's bytes. Each refusal is one line naming the limit and the
option that raises it, exit status 2, no output; each hostile input is fed
as it is to the command in its own process, whose peak memory is measured
(issue 25)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from replay.sources.dump import DUMP_MAGIC
from tests.kvpayloads import event, frames, payload, stored, write_dump

ROOT = Path(__file__).resolve().parents[2]

#: Runs `python -m replay ARGS` as its child and prints the child's exit
#: status, stderr and peak RSS in MiB (RUSAGE_CHILDREN's ru_maxrss, KiB on
#: Linux). Two levels: a process's ru_maxrss starts at its parent's peak
#: (Linux keeps it across exec), and this driver's is small.
DRIVER = """
import json, resource, subprocess, sys
r = subprocess.run([sys.executable, "-m", "replay", *json.loads(sys.argv[1])],
                   capture_output=True, text=True)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(json.dumps([r.returncode, r.stderr, peak]))
"""


def refused_within(args: list[str], line: str, folder: Path, peak_mib: int) -> float:
    before = sorted(p.name for p in folder.iterdir())
    run = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(args)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    code, stderr, peak = json.loads(run.stdout)
    assert (code, stderr) == (2, f"error: {line}\n")
    assert sorted(p.name for p in folder.iterdir()) == before
    assert peak < peak_mib, f"peak RSS {peak:.0f} MiB"
    print(f"peak RSS {peak:.0f} MiB")
    return float(peak)


def _empty_dump(path: Path) -> Path:
    path.write_bytes(DUMP_MAGIC)
    return path


def test_a_plugin_log_of_one_64_mib_line_is_refused_once_the_limit_is_read(
    tmp_path: Path,
) -> None:
    dump = _empty_dump(tmp_path / "d.dump")
    log = tmp_path / "plugin.jsonl"
    with open(log, "wb") as fh:  # {"type": "lookup", "block_hashes": ["00", "00", ... 64 MiB
        fh.write(b'{"type": "lookup", "block_hashes": [')
        fh.write(b'"00",' * ((64 << 20) // 5 + 2))
        fh.write(b'"00"]}\n')
    assert log.stat().st_size > 64 << 20
    refused_within(
        ["ingest", "kv-events", str(dump), "--lookups", str(log), "--block-size", "16", "-o", str(tmp_path / "t.parquet")],
        f"{log}: line 1 holds more than 67,108,864 bytes in one line, above the limit of "
        "67,108,864 (`replay --max-line-bytes N ...` raises it)",
        tmp_path,
        peak_mib=450,
    )  # fmt: skip


def test_a_plugin_log_line_over_a_raised_limit_names_the_raised_limit(tmp_path: Path) -> None:
    dump = _empty_dump(tmp_path / "d.dump")
    log = tmp_path / "plugin.jsonl"
    engine = {"type": "engine", "config": None}
    log.write_text(
        json.dumps(engine) + "\n" + json.dumps({"type": "lookup", "pad": "x" * 200}) + "\n"
    )
    refused_within(
        ["--max-line-bytes", "100", "ingest", "kv-events", str(dump), "--lookups", str(log), "--block-size", "16", "-o", str(tmp_path / "t.parquet")],
        f"{log}: line 2 holds more than 100 bytes in one line, above the limit of 100 "
        "(`replay --max-line-bytes N ...` raises it)",
        tmp_path,
        peak_mib=400,
    )  # fmt: skip


def test_a_dump_record_whose_length_prefix_claims_2_gib_is_refused_before_it_is_read(
    tmp_path: Path,
) -> None:
    """A sparse file: the prefix declares 2**31 bytes and the file holds
    them (holes); the record was read whole before (2 GiB)."""
    dump = tmp_path / "d.dump"
    with open(dump, "wb") as fh:
        fh.write(DUMP_MAGIC + struct.pack(">I", 1 << 31))
        fh.truncate(len(DUMP_MAGIC) + 4 + (1 << 31))
    refused_within(
        ["ingest", "kv-events", str(dump), "--block-size", "16", "-o", str(tmp_path / "t.parquet")],
        f"{dump}: record 0 at byte 8: its length prefix declares 2,147,483,648 bytes in one "
        "record, above the limit of 67,108,864 (`replay --max-record-bytes N ...` raises it)",
        tmp_path,
        peak_mib=400,
    )


def test_an_event_of_more_hashes_than_a_row_takes_is_refused(tmp_path: Path) -> None:
    """4,194,305 hashes in one BlockStored (integers: one msgpack byte
    each), one over the default limit."""
    hashes = event("BlockStored", block_hashes=list(range(1, (1 << 22) + 2)), block_size=16)
    body = payload(1.8e9, hashes)
    dump = write_dump(tmp_path / "d.dump", [(frames(0, body), "live")])
    refused_within(
        ["ingest", "kv-events", str(dump), "--block-size", "16", "-o", str(tmp_path / "t.parquet")],
        f"{dump} record 0 (seq 0): BlockStored block_hashes holds 4,194,305 hashes in one "
        "row, above the limit of 4,194,304 (`replay --max-row-hashes N ...` raises it)",
        tmp_path,
        peak_mib=1200,
    )


@pytest.mark.parametrize("width", [129, 1 << 16])
def test_an_event_whose_hash_is_wider_than_the_limit_is_refused(tmp_path: Path, width: int) -> None:
    """The trace it would write is one no reader accepts by default."""
    body = payload(1.8e9, stored([b"a" * 32, b"w" * width]))
    dump = write_dump(tmp_path / "d.dump", [(frames(0, body), "live")])
    refused_within(
        ["ingest", "kv-events", str(dump), "--block-size", "16", "-o", str(tmp_path / "t.parquet")],
        f"{dump} record 0 (seq 0): BlockStored block_hashes holds a hash of {width:,} bytes "
        "in one hash, above the limit of 128 (`replay --max-hash-bytes N ...` raises it)",
        tmp_path,
        peak_mib=400,
    )
