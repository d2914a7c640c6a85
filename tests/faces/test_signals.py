"""Real signals sent to real ``python -m replay`` processes while they write.

The test hook ``REPLAY_TEST_PAUSE=stage:marker`` makes the writer stop at
one point of a write (``publish``: the temporary file complete, before the
rename; ``rows``: a trace writer after a row group, its Parquet writer
open) and name its temporary file in ``marker``; everything else is the
production path. A signal there must leave no temporary file, keep a file
that was already at the output path byte for byte, and exit 128 + signum.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import polars as pl
import pyarrow.parquet as pq
import pytest

from replay.format.paths import PAUSE_ENV
from replay.format.tracedir import open_trace
from replay.format.writer import write_trace
from replay.sources.dump import DUMP_MAGIC, DumpWriter
from tests.builders import full_mamba, issue_43559_rows
from tests.conftest import run_cli
from tests.kvpayloads import T0, payload, stored
from tests.sources.test_record_zmq import TIMEOUT, Publisher, Step

ROOT = Path(__file__).resolve().parents[2]


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "replay", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 3 * TIMEOUT
    while not path.exists() or not path.read_text():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before pausing: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the writer never reached the pause")
        time.sleep(0.02)


def finish(proc: subprocess.Popen[str], sig: signal.Signals) -> str:
    """Send ``sig``, wait for the exit (killing a process that hangs); its stderr."""
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
    return err


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    d = tmp_path / "in"
    d.mkdir()
    return write_trace(d / "t.parquet", full_mamba(), issue_43559_rows())


def _dump(folder: Path) -> Path:
    path = folder / "d.kvdump"
    with DumpWriter(path) as w:
        for seq in range(3):
            body = payload(T0 + seq, stored([seq + 1]))
            w.write([b"", seq.to_bytes(8, "big"), body], "live", T0 + seq)
    return path


def _mooncake(folder: Path) -> Path:
    path = folder / "m.jsonl"
    rows = [{"timestamp": i, "input_length": 600, "output_length": 1, "hash_ids": [i, i + 1]} for i in range(3)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _results(trace: Path) -> Path:
    out = trace.with_name("t.results.parquet")
    subprocess.run(
        [sys.executable, "-m", "replay", "run", str(trace), "-o", str(out), "-q"],
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return out


# Each case starts a real process (seconds each): one in `make test`, every
# command, stage and signal in `make test-slow`.
CASES = [
    ("run", "publish", signal.SIGTERM),
    *(
        pytest.param(*case, marks=pytest.mark.slow)
        for case in [
            ("run", "publish", signal.SIGINT),
            ("run", "publish", signal.SIGHUP),
            ("report", "publish", signal.SIGHUP),
            ("state", "publish", signal.SIGTERM),
            ("kv-events", "rows", signal.SIGTERM),
            ("mooncake", "rows", signal.SIGINT),
        ]
    ),
]


@pytest.mark.parametrize(("command", "stage", "sig"), CASES)
def test_a_signal_mid_write_leaves_no_temporary_file_and_keeps_the_old_output(
    tmp_path: Path, trace: Path, command: str, stage: str, sig: signal.Signals
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    target = out / ("r.html" if command == "report" else "r.parquet")
    target.write_bytes(b"the previous output, which must survive")
    before = digest(target)
    inputs = trace.parent
    args = {
        "run": ["run", str(trace), "-o", str(target), "-q"],
        "report": ["report", str(_results(trace) if command == "report" else ""), "-o", str(target)],
        "state": ["state", str(trace), "-o", str(target)],
        "kv-events": ["ingest", "kv-events", str(_dump(inputs)), "-o", str(target), "--block-size", "16"],
        "mooncake": ["ingest", "mooncake", str(_mooncake(inputs)), "-o", str(target)],
    }[command]  # fmt: skip
    inputs_before = {p.name: digest(p) for p in inputs.iterdir()}
    marker = tmp_path / "paused"
    proc = start(args, {PAUSE_ENV: f"{stage}:{marker}"})
    wait_for(marker, proc)
    tmp = Path(marker.read_text())
    # The signal arrives while the write is in progress: its temporary file is there.
    assert tmp.parent == out and tmp.name.startswith(f".{target.name}.") and tmp.exists()
    err = finish(proc, sig)
    assert proc.returncode == 128 + sig, err
    assert err.splitlines()[-1] == f"interrupted by {sig.name}"
    assert sorted(p.name for p in out.iterdir()) == [target.name]
    assert digest(target) == before
    assert {p.name: digest(p) for p in inputs.iterdir()} == inputs_before


@pytest.mark.slow
def test_a_second_signal_during_cleanup_changes_nothing(tmp_path: Path, trace: Path) -> None:
    target = tmp_path / "r.parquet"
    marker = tmp_path / "paused"
    proc = start(["run", str(trace), "-o", str(target), "-q"], {PAUSE_ENV: f"publish:{marker}"})
    wait_for(marker, proc)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=TIMEOUT)
    # Signals pending together are handled lowest number first: that one
    # decides the status; the others arrive during the cleanup and are ignored.
    first = signal.Signals(proc.returncode - 128)
    assert first in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM), err
    assert err.splitlines() == [f"interrupted by {first.name}"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "in") == ["paused"]


def _recorder(pub: Publisher, out: Path, dump: Path) -> subprocess.Popen[str]:
    return start(
        ["record", "--endpoint", pub.endpoint, "-o", str(out), "--block-size", "16",
         "--dump", str(dump), "--duration", str(3 * TIMEOUT)]
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_record_closes_a_valid_trace_on_a_signal_and_exits_128_plus_it(
    tmp_path: Path, sig: signal.Signals
) -> None:
    steps = [Step(seq=i, body=payload(T0 + i, stored([i + 1]))) for i in range(3)]
    out, dump = tmp_path / "t.parquet", tmp_path / "d.kvdump"
    with Publisher(steps, with_replay=False) as pub:
        proc = _recorder(pub, out, dump)
        subscribed = pub.done.wait(TIMEOUT)
        time.sleep(0.5)  # let the last batch arrive
        err = finish(proc, sig)
    assert subscribed, "the recorder never subscribed"
    assert proc.returncode == 128 + sig, err
    assert err.splitlines()[-2:] == [f"recorded 3 KV events in 3 batches, no lookup stream, 0 gaps to {out}", f"interrupted by {sig.name}"]  # fmt: skip
    assert open_trace(out).read_frame().height == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.kvdump", "t.parquet"]


@pytest.mark.slow
def test_a_recorder_killed_with_sigkill_leaves_a_dump_that_reads_back(tmp_path: Path) -> None:
    steps = [Step(seq=i, body=payload(T0 + i, stored([i + 1]))) for i in range(3)]
    out, dump = tmp_path / "t.parquet", tmp_path / "d.kvdump"
    with Publisher(steps, with_replay=False) as pub:
        proc = _recorder(pub, out, dump)
        try:
            assert pub.done.wait(TIMEOUT), "the recorder never subscribed"
            deadline = time.monotonic() + TIMEOUT
            # Records are flushed as they come: wait until all three are on disk.
            while len([*_records(dump)]) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.kill()
            proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == -signal.SIGKILL
    rebuilt = tmp_path / "rebuilt.parquet"
    done = subprocess.run(
        [sys.executable, "-m", "replay", "ingest", "kv-events", str(dump), "-o", str(rebuilt), "--block-size", "16"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert open_trace(rebuilt).read_frame().height == 3


def _records(path: Path) -> list[bytes]:
    if not path.exists():
        return []
    data = path.read_bytes()
    assert data[:8] == DUMP_MAGIC
    out, at = [], 8
    while at + 4 <= len(data):
        n = int.from_bytes(data[at : at + 4], "big")
        if at + 4 + n > len(data):
            break
        out.append(data[at + 4 : at + 4 + n])
        at += 4 + n
    return out


@pytest.mark.slow
def test_a_torn_last_record_is_dropped_saying_how_much(tmp_path: Path) -> None:
    """What a recorder killed in the middle of a write leaves behind."""
    dump = _dump(tmp_path)
    whole = dump.read_bytes()
    last = msgspec.msgpack.encode([T0 + 2, "live", [b"", (2).to_bytes(8, "big"), payload(T0 + 2, stored([3]))]])  # fmt: skip
    assert whole.endswith(last)
    dump.write_bytes(whole[:-5])
    out = tmp_path / "t.parquet"
    done = subprocess.run(
        [sys.executable, "-m", "replay", "ingest", "kv-events", str(dump), "-o", str(out), "--block-size", "16"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    offset = len(whole) - len(last) - 4
    torn = len(last) + 4 - 5
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"{dump}: record 2 at byte {offset}: truncated (the file ends {torn} bytes into it, as "
        f"when the recorder was killed): read 2 complete records, dropped the last {torn} bytes",
        f"wrote {out}: 2 batches, 2 rows",
    ]
    assert open_trace(out).read_frame().height == 2


# ------------------------------------------ several outputs: all or nothing (issue 25)


def _everything(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_signal_before_several_results_files_are_published_leaves_none(
    tmp_path: Path, trace: Path
) -> None:
    sig = signal.SIGHUP
    marker = tmp_path / "paused"
    out = tmp_path / "r.results.parquet"
    args = ["run", str(trace), "--policy", "vllm-0.33", "--policy", "pre-49502", "-o", str(out), "-q"]  # fmt: skip
    proc = start(args, {PAUSE_ENV: f"publish:{marker}"})
    wait_for(marker, proc)
    err = finish(proc, sig)
    assert (proc.returncode, err) == (128 + sig, f"interrupted by {sig.name}\n")
    assert _everything(tmp_path) == ["in", "in/t.parquet", "paused"]


def test_a_signal_to_a_parallel_whatif_leaves_no_trace_and_no_worker_traceback(
    tmp_path: Path, trace: Path
) -> None:
    marker = tmp_path / "paused"
    args = ["whatif", str(trace), "--capacity-blocks", "10,20,30,40", "--jobs", "2", "-q",
            "-o", str(tmp_path / "w.parquet"), "--emit-traces", str(tmp_path / "E")]  # fmt: skip
    # A worker pauses after the first row group of its emitted trace.
    proc = start(args, {PAUSE_ENV: f"rows:{marker}"})
    wait_for(marker, proc)
    err = finish(proc, signal.SIGTERM)
    time.sleep(0.5)  # a worker that outlived its parent would speak now
    assert (proc.returncode, err) == (128 + signal.SIGTERM, "interrupted by SIGTERM\n")
    assert _everything(tmp_path) == ["in", "in/t.parquet", "paused"]


# ------------------------------------ the one rule for partial outputs (issue 32)


def _emitted(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_signal_mid_whatif_publishes_the_finished_runs_with_exactly_their_traces(
    tmp_path: Path, trace: Path
) -> None:
    """One worker: the third run pauses in its emitted trace; the two
    finished runs are the sweep (partial) and their two traces, nothing else."""
    marker = tmp_path / "paused"
    out, emit = tmp_path / "w.parquet", tmp_path / "E"
    args = ["whatif", str(trace), "--capacity-blocks", "10,20,30,40", "--jobs", "1", "-q",
            "-o", str(out), "--emit-traces", str(emit)]  # fmt: skip
    proc = start(args, {PAUSE_ENV: f"rows@3:{marker}"})
    wait_for(marker, proc)
    err = finish(proc, signal.SIGTERM)
    assert (proc.returncode, err) == (
        128 + signal.SIGTERM,
        f"wrote {out} and their traces in {emit}: partial, 2 of 4 runs finished\n"
        "interrupted by SIGTERM\n",
    )
    sweep = pl.read_parquet(out)
    assert sweep["capacity_blocks"].to_list() == [10, 20]
    assert json.loads(pq.read_schema(out).metadata[b"replay.sweep"])["partial"] is True
    assert _emitted(emit) == ["whatif-mooncake-lru-10.parquet", "whatif-mooncake-lru-20.parquet"]
    for name in _emitted(emit):
        assert run_cli(["validate", str(emit / name)]).exit_code == 0
    assert _everything(tmp_path) == sorted(
        ["in", "in/t.parquet", "paused", "w.parquet", "E",
         "E/whatif-mooncake-lru-10.parquet", "E/whatif-mooncake-lru-20.parquet"]
    )  # fmt: skip


@pytest.mark.slow
def test_a_signal_mid_parallel_whatif_keeps_sweep_and_traces_consistent(
    tmp_path: Path, trace: Path
) -> None:
    """Two worker processes, each paused in its second emitted trace: what
    is published is the finished runs and exactly their traces."""
    marker = tmp_path / "paused"
    out, emit = tmp_path / "w.parquet", tmp_path / "E"
    args = ["whatif", str(trace), "--capacity-blocks", "10,20,30,40", "--jobs", "2", "-q",
            "-o", str(out), "--emit-traces", str(emit)]  # fmt: skip
    proc = start(args, {PAUSE_ENV: f"rows@2:{marker}"})
    wait_for(marker, proc)
    time.sleep(0.5)  # the other worker's first run reported too, or not: both are fine
    err = finish(proc, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err
    finished = pl.read_parquet(out)["capacity_blocks"].to_list()
    assert 1 <= len(finished) <= 3
    assert err == (
        f"wrote {out} and their traces in {emit}: partial, {len(finished)} of 4 runs finished\n"
        "interrupted by SIGTERM\n"
    )
    assert _emitted(emit) == sorted(f"whatif-mooncake-lru-{n}.parquet" for n in finished)
    assert not [p for p in tmp_path.rglob(".*")]  # no temporary file of a killed worker


def test_a_signal_mid_split_leaves_no_part(tmp_path: Path, trace: Path) -> None:
    marker = tmp_path / "paused"
    proc = start(
        ["split", str(trace), "-o", str(tmp_path / "parts"), "--files", "3"],
        {PAUSE_ENV: f"rows@2:{marker}"},  # the second part is being written
    )
    wait_for(marker, proc)
    err = finish(proc, signal.SIGINT)
    assert (proc.returncode, err) == (128 + signal.SIGINT, "interrupted by SIGINT\n")
    assert _everything(tmp_path) == ["in", "in/t.parquet", "paused"]
