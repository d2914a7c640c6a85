"""Faults of a long recording (issue 32): a ``replay record`` subprocess fed
over real ZMQ sockets (a publisher playing vLLM's, the vLLM plugin's own
lookup sink) is killed with SIGKILL; every closed segment must be readable
and ``replay run DIR`` must replay them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import zmq

from replay.adapters.vllm import plugin as vllm_plugin
from replay.base.errors import ReplayError
from replay.base.units import parse_segment
from replay.format.tracedir import open_trace
from tests.conftest import run_cli
from tests.kvpayloads import T0, one_group, payload, stored, u64
from tests.sources.test_record_zmq import free_port

TIMEOUT = 20.0
ROOT = Path(__file__).resolve().parents[2]
KEY = 1000  # batch i stores the key KEY + i


def _lookup(i: int) -> dict[str, Any]:
    """Batch i's lookup, placed before its store: it asks for the key batch
    i - 1 stored, then one never stored (a 16-token hit, 0 for the first)."""
    return {
        "type": "lookup",
        "instance": "e1",
        "n": i,
        "ts": T0 + i,
        "step": i,
        "batch": i,
        "position": 0,
        "request_id": f"r{i}",
        "block_hashes": [u64(KEY + i - 1).hex(), u64(5).hex()],
        "num_tokens": 33,
        "num_prompt_tokens": 33,
        "max_length": 32,
        "observed_hit_tokens": 16 if i else 0,
        "admitted": True,
    }


class Engine:
    """vLLM's two publishers: KV events on an XPUB (batch i at ``rate`` per
    second from the recorder's subscription on), lookups on the plugin's
    sink; both keep going until stopped."""

    def __init__(self, rate: float = 40.0) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.lookups = f"tcp://127.0.0.1:{free_port()}"
        self.sink = vllm_plugin.open_sink(self.lookups)
        config = {**one_group().to_json(), "source": {"cache": "gpu"}}
        self.sink.engine(
            {"type": "engine", "instance": "e1", "ts": T0, "config": config, "engine": {}}
        )
        self.rate = rate
        self.sent = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():  # the recorder's subscription
            if self.pub.poll(20) and self.pub.recv()[:1] == b"\x01":
                break
        time.sleep(0.5)  # the lookup subscription is up too
        i = 0
        while not self.stop.is_set():
            self.sink.send([_lookup(i)], watermark=i + 1, instance="e1")
            self.pub.send_multipart([b"", i.to_bytes(8, "big"), payload(T0 + i, stored([KEY + i]))])
            self.sent = i = i + 1
            time.sleep(1 / self.rate)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT)
        self.sink.close()
        self.ctx.destroy(linger=0)


def _recorder(engine: Engine, out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable, "-c", "from replay.entry import main; main()", "record",
            "--endpoint", engine.endpoint, "--lookups", engine.lookups, "-o", str(out),
            "--duration", str(3 * TIMEOUT), *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def _closed(out: Path) -> list[str]:
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if not p.name.startswith("."))


def _wait_sent(engine: Engine, n: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while engine.sent < n:
        assert time.monotonic() < deadline, f"the engine sent {engine.sent} of {n} batches"
        time.sleep(0.02)


def _wait_segments(proc: subprocess.Popen[str], out: Path, n: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while len(_closed(out)) < n:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"only {_closed(out)} after {TIMEOUT} s"
        time.sleep(0.05)


def test_kill_9_keeps_every_closed_segment_and_run_replays_them(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    engine = Engine()
    try:
        proc = _recorder(engine, out, "--segment", "0.5s")
        try:
            _wait_segments(proc, out, 3)
            proc.kill()  # SIGKILL: no handler, no footer, no cleanup
            proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=TIMEOUT)
    finally:
        engine.close()
    assert proc.returncode == -signal.SIGKILL
    closed = _closed(out)
    assert closed == [f"segment-{i:06d}.parquet" for i in range(len(closed))]
    # What else is left: at most the open segment's hidden temporary file.
    hidden = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
    assert len(hidden) <= 1 and all(h.startswith(".segment-") for h in hidden), hidden
    for name in closed:  # each closed segment is a valid trace alone
        result = run_cli(["validate", str(out / name)])
        assert result.exit_code == 0, result.stderr
    # The directory is the recorded log: lookup i then store KEY + i, a
    # prefix of what was sent, with nothing missing inside it.
    rows = open_trace(out).read_frame()
    kinds = rows["kind"].to_list()
    n = len(kinds) // 2
    assert n >= 3 and n <= engine.sent
    assert kinds == ["lookup", "store"] * n
    stores = rows.filter(pl.col("kind") == "store")["block_hashes"].to_list()
    assert stores == [[u64(KEY + i)] for i in range(n)]
    # And `replay run DIR` replays them: each lookup hits the key the batch
    # before it stored, as vLLM said (observed_hit_tokens).
    res = tmp_path / "results.parquet"
    result = run_cli(["run", str(out), "-o", str(res)])
    assert result.exit_code == 0, result.stderr
    got = pl.read_parquet(res)
    assert got["request_id"].to_list() == [f"r{i}" for i in range(n)]
    assert got["hit_tokens"].to_list() == [0] + [16] * (n - 1)
    assert got["hit_tokens"].to_list() == got["observed_hit_tokens"].to_list()
    # The open segment's temporary file: `replay repair` takes the config
    # from the closed segments beside it and salvages its complete row
    # groups (a snapshot, then the events after the last closed segment).
    for name in hidden:
        fixed = tmp_path / "open.parquet"
        result = run_cli(["repair", str(out / name), "-o", str(fixed)])
        if result.exit_code == 2:  # killed before its first row group was out
            assert "no complete row group before the cut" in result.stderr
            continue
        assert result.exit_code == 0, result.stderr
        salvaged = open_trace(fixed).read_frame()
        assert salvaged["seq"][0] > rows["seq"][-1]
        assert salvaged["kind"][0] == "clear"  # the open segment's snapshot comes first
        keys = salvaged.filter(pl.col("kind") == "store")["block_hashes"].explode().to_list()
        assert keys == [u64(KEY + i) for i in range(len(keys))]  # then the log goes on


@pytest.mark.slow
def test_sigterm_closes_the_open_segment(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    engine = Engine()
    try:
        proc = _recorder(engine, out, "--segment", "100events")
        try:
            _wait_segments(proc, out, 1)
            # The open segment must hold rows before the signal: under load the
            # first segment can close with nothing sent after it yet (CI saw
            # exactly 100 rows), so let the engine send a second's batches more.
            _wait_sent(engine, engine.sent + 40)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=TIMEOUT)
    finally:
        engine.close()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines()[-1] == "interrupted by SIGTERM"
    assert all(not p.name.startswith(".") for p in out.iterdir())
    trace = open_trace(out)
    # Each batch is a lookup then its store; they come on two sockets, so the
    # signal may land between the two: the last row may lack its partner.
    kinds = trace.read_frame(["kind"])["kind"].to_list()
    assert len(kinds) > 100
    assert kinds[:-1] == (["lookup", "store"] * len(kinds))[: len(kinds) - 1]
    # Each segment says what it is; the last one how the recording ended.
    *before, last = sorted(out.iterdir())
    assert [(open_trace(p).config.source or {})["stop_reason"] for p in before] == [None] * len(
        before
    )
    assert (open_trace(last).config.source or {})["stop_reason"] == "signal"


def test_segment_takes_a_duration_or_a_count_of_events() -> None:
    assert parse_segment("90") == (90.0, None)
    assert parse_segment("10m") == (600.0, None)
    assert parse_segment("50k events") == (None, 50_000)
    assert parse_segment("100events") == (None, 100)
    # A count suffix that is no unit of time is a count of events (the
    # watch's 100k), and M millions; m stays minutes, a bare number seconds.
    assert parse_segment("100k") == (None, 100_000)
    assert parse_segment("1M") == (None, 1_000_000)
    assert parse_segment("1m") == (60.0, None)
    assert parse_segment("5000") == (5000.0, None)
    for bad in ("0events", "soon", "1mi", "-5"):
        with pytest.raises(ReplayError) as info:
            parse_segment(bad)
        assert str(info.value) == (
            f"--segment '{bad}': expected a duration (60, 30s, 10m, 1h) or a number of events "
            "(10000events, 50k events, 100k)"
        )


def test_segment_with_a_file_output_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "t.parquet"
    result = run_cli(
        ["record", "--endpoint", "tcp://127.0.0.1:1", "-o", str(out), "--block-size", "16",
         "--segment", "10s"]
    )  # fmt: skip
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: --segment: -o {out} is one file; name a directory (e.g. -o {tmp_path / 't'}) "
        "to record segments\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_kill_9_of_a_one_file_recording_is_salvaged_by_repair(tmp_path: Path) -> None:
    """A recording to one .parquet file (as every recording was before
    segments): SIGKILL leaves only its hidden temporary file, which no
    reader opens; `replay repair` gives back its complete row groups."""
    out = tmp_path / "t.parquet"
    engine = Engine()
    code = (
        "import sys; from replay.sources.record import record; "
        "from replay.sources.kv_config import load_config; "
        "record(endpoint=sys.argv[1], output=sys.argv[2], config=load_config(None, 16), "
        "duration=60, flush_seconds=0.2)"
    )
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, engine.endpoint, str(out)],
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            deadline = time.monotonic() + TIMEOUT
            while engine.sent < 60:  # 1.5 s of batches: several flushes
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            proc.kill()
            proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=TIMEOUT)
    finally:
        engine.close()
    (tmp,) = tmp_path.iterdir()  # only the hidden temporary file is left
    assert tmp.name.startswith(".t.parquet.") and tmp.name.endswith(".tmp")
    result = run_cli(["validate", str(tmp)])
    assert result.exit_code == 2
    assert result.stderr == f"error: {tmp}: truncated Parquet file (no PAR1 magic at the end)\n"
    fixed = tmp_path / "fixed.parquet"
    result = run_cli(["repair", str(tmp), "-o", str(fixed), "--block-size", "16"])
    assert result.exit_code == 0, result.stderr
    rows = open_trace(fixed).read_frame()
    n = rows.height
    assert result.stdout.startswith(f"{tmp} -> {fixed}: kept {n:,} rows in ")
    assert 10 <= n <= engine.sent
    assert rows["kind"].to_list() == ["store"] * n
    assert rows["block_hashes"].to_list() == [[u64(KEY + i)] for i in range(n)]


#: The recorder, saying its peak RSS as it exits: VmHWM, the high-water mark
#: of its own memory (``ru_maxrss`` keeps the forking parent's across exec).
PEAK = (
    "import atexit, re, sys; "
    "atexit.register(lambda: sys.stderr.write('peak rss %s KiB\\n' % re.search("
    "r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))); "
    "from replay.entry import main; main()"
)


def _oversized_recording(tmp_path: Path, big: int, limit: str) -> tuple[int, list[str], Path]:
    """A recorder (connecting, as to vLLM's binding publisher) hears batch 0,
    then a ``big``-byte message as seq 1, then batches 2 and 3 once it is
    subscribed again. Returns its exit code, its stderr lines and the trace."""
    ctx: zmq.Context[Any] = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    # Every subscription is heard: the new socket may subscribe before the
    # old connection's end is noticed (a duplicate a plain XPUB keeps quiet).
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    out = tmp_path / "rec"
    proc = subprocess.Popen(
        [
            sys.executable, "-c", PEAK, "--max-record-bytes", limit, "record",
            "--endpoint", endpoint, "-o", str(out), "--block-size", "16", "--duration", "6",
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert pub.poll(int(TIMEOUT * 1000)) and pub.recv() == b"\x01"
        pub.send_multipart([b"", u64(0), payload(T0, stored([KEY]))])
        pub.send_multipart([b"", u64(1), b"\x00" * big])
        # The recorder lost the connection and connects again: it subscribes anew.
        while True:
            if not pub.poll(int(TIMEOUT * 1000)):
                proc.kill()
                raise AssertionError(f"the recorder never came back: {proc.communicate()}")
            if pub.recv() == b"\x01":
                break
        for seq in (2, 3):
            pub.send_multipart([b"", u64(seq), payload(T0 + seq, stored([KEY + seq]))])
        _, err = proc.communicate(timeout=3 * TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=TIMEOUT)
        ctx.destroy(linger=0)
    return proc.returncode, err.splitlines(), out


def _peak(lines: list[str]) -> int:
    return int(lines[-1].removeprefix("peak rss ").removesuffix(" KiB")) * 1024


def test_an_oversized_message_costs_no_memory_and_recording_goes_on(tmp_path: Path) -> None:
    # The same recording with a message just above the limit first: its peak
    # is the recorder's own (numpy, polars, Arrow, numba: about 250 MB here,
    # more where the kernel backs memory with huge pages), which an absolute
    # bound cannot tell from a buffered message (CI stop 39: 343 MB).
    (tmp_path / "small").mkdir()
    (tmp_path / "big").mkdir()
    code, lines, _ = _oversized_recording(tmp_path / "small", 2 << 20, "1Mi")
    assert code == 0, lines
    baseline = _peak(lines)
    big = 256 << 20
    code, lines, out = _oversized_recording(tmp_path / "big", big, "1Mi")
    assert code == 0, lines
    peak = _peak(lines)
    endpoint = lines[0].split()[1]
    assert lines[1:-1] == [
        f"--endpoint {endpoint}: connection dropped (1 so far): a message above "
        "--max-record-bytes (1,048,576 bytes), or the peer closed it; connecting again; "
        "still recording",
        "gap: seq 1 missing (1 batch): no --replay-endpoint to ask",
        f"recorded 3 KV events in 3 batches, no lookup stream, 1 gap (1 batch missing), "
        f"1 dropped connection to {out} (1 segment)",
    ]
    rows = open_trace(out).read_frame()
    assert rows["block_hashes"].to_list() == [[u64(KEY)], [u64(KEY + 2)], [u64(KEY + 3)]]
    assert (open_trace(out).config.source or {})["dropped_connections"] == 1
    # The 256 MiB message never entered the recorder's memory: its peak is
    # the 2 MiB one's, give or take what a run's timing moves it.
    assert peak - baseline < big // 8, f"peak RSS {peak >> 20} MiB, {baseline >> 20} MiB with 2 MiB"


def test_an_oversized_lookup_message_drops_one_connection_not_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plugin's lookup stream: a message above --max-record-bytes costs
    its connection, which is made again; the next lookups still arrive."""
    from replay.sources.zmq_client import LookupSubscriber

    monkeypatch.setenv("REPLAY_MAX_RECORD_BYTES", str(64 << 10))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sink = vllm_plugin.open_sink(endpoint)
    ctx: zmq.Context[Any] = zmq.Context()
    said: list[str] = []
    try:
        lsub = LookupSubscriber(ctx, endpoint, said.append)
        assert lsub.sock.getsockopt(zmq.MAXMSGSIZE) == 64 << 10
        config = {**one_group().to_json(), "source": {"cache": "gpu"}}
        sink.engine({"type": "engine", "instance": "e1", "ts": T0, "config": config, "engine": {}})
        assert lsub.wait_engine(lambda: False) is not None
        big = {**_lookup(1), "request_id": "x" * (1 << 20)}
        sink.send([big], watermark=1, instance="e1")
        got: list[Any] = []
        deadline = time.monotonic() + TIMEOUT
        while not got and time.monotonic() < deadline:
            sink.send([_lookup(2)], watermark=3, instance="e1")  # until one arrives
            time.sleep(0.2)
            lsub.check_drops()
            got = [item for kind, item in lsub.receive(one_group()) if kind == "lookup"]
    finally:
        sink.close()
        ctx.destroy(linger=0)
    assert got and all(g.n == 2 for g in got)
    assert said[0] == (
        f"--lookups {endpoint}: connection dropped (1 so far): a message above "
        "--max-record-bytes (65,536 bytes), or the peer closed it; connecting again; "
        "still recording"
    )
    assert lsub.source()["dropped_connections"] == 1
