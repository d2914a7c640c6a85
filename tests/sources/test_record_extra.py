"""pyzmq and msgspec are the ``record`` extra: without them the commands that
need them say what to install in one line, and everything else runs.

The commands run in a fresh interpreter where importing ``zmq`` or
``msgspec`` fails as it does when they are not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from replay.sources.dump import DumpWriter
from tests.kvpayloads import T0, frames, payload, stored

DEMO = Path(__file__).parent.parent.parent / "traces" / "demo-full-mamba-eagle.parquet"

# Runs the console script's entry point with the two packages unimportable.
WITHOUT_EXTRA = """
import sys

class Uninstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("zmq", "msgspec"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Uninstalled())
sys.argv[0] = "replay"
from replay.entry import main
main()
"""
INSTALL = "pip install 'cache-trace-replay[record]'"


def replay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRA, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_record_and_ingest_kv_events_say_what_to_install(tmp_path: Path) -> None:
    dump = tmp_path / "d.kvdump"
    with DumpWriter(dump) as writer:
        writer.write(frames(0, payload(T0, stored([1]))), "live", T0)
    out = tmp_path / "t.parquet"
    cases = [
        (
            ["record", "--endpoint", "tcp://127.0.0.1:1", "--block-size", "16", "-o", str(out)],
            f"error: replay record needs pyzmq and msgspec, which are not installed: {INSTALL}",
        ),
        (
            ["ingest", "kv-events", str(dump), "--block-size", "16", "-o", str(out)],
            f"error: replay ingest kv-events needs msgspec, which is not installed: {INSTALL}",
        ),
    ]
    for args, message in cases:
        result = replay(*args)
        assert (result.returncode, result.stderr.splitlines(), result.stdout) == (2, [message], "")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["d.kvdump"]


@pytest.mark.slow
def test_help_run_synth_mooncake_and_merge_run_without_the_extra(tmp_path: Path) -> None:
    mooncake = tmp_path / "m.jsonl"
    row = {"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3]}
    mooncake.write_text(json.dumps(row) + "\n")
    log = tmp_path / "l.jsonl"
    log.write_text(json.dumps({"request_id": "r", "ts": 1, "block_hashes": [1], "max_length": 15}))
    synth, imported = tmp_path / "s.parquet", tmp_path / "m.parquet"
    for args in (
        ["--help"],
        ["run", str(DEMO), "-o", str(tmp_path / "r.parquet"), "-q"],
        ["synth", "--model", "full+mamba", "--requests", "20", "-o", str(synth)],
        ["ingest", "mooncake", str(mooncake), "-o", str(imported)],
        ["ingest", "merge", str(imported), str(log), "-o", str(tmp_path / "merged.parquet")],
    ):
        result = replay(*args)
        assert result.returncode == 0, (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert {"r.parquet", "s.parquet", "m.parquet", "merged.parquet"} <= {
        p.name for p in tmp_path.iterdir()
    }
