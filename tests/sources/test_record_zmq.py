"""``replay record`` against real ZMQ sockets on 127.0.0.1.

A publisher thread plays vLLM's part: an XPUB socket (a PUB that also
tells us when the subscriber is in, so nothing is lost to the slow-joiner
race) sending ``[topic, seq, payload]``, and a ROUTER answering replay
requests from a buffer, exactly as ``ZmqEventPublisher`` does. Every wait is
bounded; the recorder stops on ``max_batches`` with ``duration`` as a
safety net.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from click.testing import CliRunner, Result

from replay.cli.sources import ingest, record
from replay.format.tracedir import open_trace
from replay.sources.record import EmptyRecording
from replay.sources.record import record as record_stream
from replay.sources.zmq_client import END_SEQ
from tests.contracts.source import SourceContract
from tests.kvpayloads import (
    T0,
    at,
    cleared,
    keyed,
    one_group,
    payload,
    removed,
    stored,
    two_groups,
    u64,
)

TIMEOUT = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on (bound, then freed)."""
    with zmq.Context() as probe:
        sock = probe.socket(zmq.PUB)
        port = int(sock.bind_to_random_port("tcp://127.0.0.1"))
        sock.close(linger=0)
    return port


@dataclass
class Step:
    """One thing the publisher does, in order."""

    seq: int | None = None  # None: raw frames (malformed) or a restart
    body: bytes = b""
    live: bool = True  # sent on the PUB socket
    buffered: bool = True  # kept for replay
    raw: list[bytes] | None = None
    restart: bool = False
    topic: bytes = b""
    # Wait until the recorder asked the replay endpoint for this seq (so the
    # publisher cannot run ahead and drop what the recorder still needs).
    wait_request: int | None = None


@dataclass
class Publisher:
    steps: list[Step]
    topic: bytes = b""
    with_replay: bool = True
    answer_replay: bool = True
    ctx: Any = field(default_factory=zmq.Context)
    done: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[BaseException] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = None
        self.replay_endpoint: str | None = None
        if self.with_replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.buffer: list[tuple[int, bytes, bytes]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _service(self, wait_ms: int) -> None:
        poller = zmq.Poller()
        if self.router is not None:
            poller.register(self.router, zmq.POLLIN)
        for sock, _ in poller.poll(wait_ms) if self.router is not None else []:
            msg = sock.recv_multipart()
            if not self.answer_replay or len(msg) != 3:
                continue
            ident, _, start = msg
            start_seq = int.from_bytes(start, "big")
            self.requests.append(start_seq)
            for seq, topic, body in self.buffer:
                if seq >= start_seq:
                    sock.send_multipart([ident, b"", topic, seq.to_bytes(8, "big"), body])
            sock.send_multipart([ident, b"", b"", END_SEQ, b""])
        if self.router is None and wait_ms:
            time.sleep(wait_ms / 1000)

    def _wait_for_subscriber(self) -> None:
        deadline = time.monotonic() + TIMEOUT
        subscribed = False
        while time.monotonic() < deadline:
            self._service(0)
            if self.pub.poll(20) and self.pub.recv()[:1] == b"\x01":
                subscribed = True
            # With a replay endpoint the recorder first asks for the history:
            # answering before publishing keeps the test deterministic.
            if subscribed and (self.router is None or not self.answer_replay or self.requests):
                return
        raise TimeoutError("no subscriber")

    def _wait_for_request(self, start: int) -> None:
        deadline = time.monotonic() + TIMEOUT
        while start not in self.requests:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no replay request for seq {start}")
            self._service(20)

    def _run(self) -> None:
        try:
            self._wait_for_subscriber()
            for step in self.steps:
                if step.wait_request is not None:
                    self._wait_for_request(step.wait_request)
                if step.restart:
                    self.buffer = []
                    continue
                if step.raw is not None:
                    self.pub.send_multipart(step.raw)
                    continue
                assert step.seq is not None
                topic = step.topic or self.topic
                if step.buffered:
                    self.buffer.append((step.seq, topic, step.body))
                if step.live:
                    self.pub.send_multipart([topic, step.seq.to_bytes(8, "big"), step.body])
                self._service(5)
            self.done.set()
            deadline = time.monotonic() + 3 * TIMEOUT
            while not self.stop.is_set() and time.monotonic() < deadline:
                self._service(20)
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)
            self.done.set()

    def __enter__(self) -> Publisher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT)
        self.ctx.destroy(linger=0)
        assert not self.thread.is_alive()
        assert not self.errors, self.errors


# The scenario: both encodings, copies, a gap the replay fills, a gap it
# cannot, a malformed payload, a malformed frame, a clear, a restart.
SCENARIO = [
    Step(seq=0, body=payload(T0, stored([1, 2], group=0), stored([1, 2], group=1))),
    Step(seq=1, body=payload(T0 + 1, stored([3], parent=2, group=0, legacy=True))),
    Step(seq=2, body=payload(T0 + 2, stored([1], group=0))),  # a second copy of 1
    Step(seq=3, body=payload(T0 + 3, removed([1], legacy=True)), live=False),  # replay fills
    Step(seq=4, body=payload(T0 + 4, removed([1, 3]))),
    Step(seq=5, body=payload(T0 + 5, stored([9])), live=False, buffered=False),  # lost
    Step(seq=6, body=payload(T0 + 6, stored([b"\xaa" * 32], group=1, medium="CPU"))),
    Step(seq=7, body=b"\xc1"),
    Step(raw=[b"", b"\x00\x01"]),
    Step(seq=8, body=payload(T0 + 8, cleared(legacy=True))),
    Step(seq=9, body=payload(T0 + 9, stored([4]))),
    Step(restart=True, wait_request=5),  # after the recorder saw the gap at 5
    Step(seq=0, body=payload(T0 + 20, stored([5])), live=False),  # replay fills
    Step(seq=1, body=payload(T0 + 21, stored([6], parent=5, legacy=True))),
    Step(seq=2, body=payload(T0 + 22, removed([5]))),
]
SCENARIO_BATCHES = 12  # every seq but the lost one

EXPECTED_ROWS = [
    (0, "store", 0, [u64(1), u64(2)], "GPU"),
    (1, "store", 1, [u64(1), u64(2)], "GPU"),
    (2, "store", 0, [u64(3)], "GPU"),
    (3, "store", 0, [u64(1)], "GPU"),
    (4, "remove", 0, [u64(1), u64(3)], "GPU"),  # seq 3 removed one of two copies of 1
    (5, "store", 1, [b"\xaa" * 32], "CPU"),
    (6, "clear", None, None, None),
    (7, "store", 0, [u64(4)], "GPU"),
    (8, "clear", None, None, None),  # the restart: a new engine, an empty cache
    (9, "store", 0, [u64(5)], "GPU"),
    (10, "store", 0, [u64(6)], "GPU"),
    (11, "remove", 0, [u64(5)], "GPU"),
]
EXPECTED_TS = [
    at(T0 + t) for t in (0, 0, 1, 2, 4, 6, 8, 9, 20, 20, 21, 22)
]  # clear at its epoch's start


def test_record_fills_gaps_survives_restart_and_skips_malformed(tmp_path: Path) -> None:
    messages: list[str] = []
    out = tmp_path / "rec.parquet"
    dump = tmp_path / "rec.kvdump"
    with Publisher(SCENARIO) as pub:
        summary = record_stream(
            endpoint=pub.endpoint,
            replay_endpoint=pub.replay_endpoint,
            output=out,
            config=two_groups(),
            max_batches=SCENARIO_BATCHES,
            duration=TIMEOUT,
            dump=dump,
            report=messages.append,
            flush_rows=4,  # several row groups
        )
        assert pub.done.wait(TIMEOUT)
    assert summary.stop_reason == "max-batches", (summary, messages, pub.requests)
    assert (summary.batches, summary.rows, summary.skipped) == (12, 12, 2)

    trace = open_trace(out)
    rows = trace.read_frame().to_dicts()
    assert keyed(rows) == EXPECTED_ROWS
    assert [r["ts"] for r in rows] == EXPECTED_TS
    source = dict(trace.config.source or {})
    assert source["tool"] == "replay record"
    assert source["stop_reason"] == "max-batches"
    assert source["gaps"] == [
        {"epoch": 0, "first": 5, "last": 5, "count": 1, "reason": "not in the publisher's replay buffer"}
    ]  # fmt: skip
    assert source["restarts"] == [{"epoch": 1, "previous_last_seq": 9}]
    assert source["epochs"] == [
        {"epoch": 0, "first_seq": 0, "last_seq": 9},
        {"epoch": 1, "first_seq": 0, "last_seq": 2},
    ]
    assert [(s["seq"], s["error"]) for s in source["skipped"]] == [
        (7, "seq 7: payload is not msgpack (MessagePack data is malformed: invalid opcode '\\xc1' (byte 0))"),
        (None, "message has 2 frames, expected 3 (topic, seq, payload)"),
    ]  # fmt: skip
    assert source["missing_batches"] == 1
    assert source["filled_from_replay"] >= 2  # seq 3 and the new epoch's seq 0
    assert "gap: seq 5 missing (1 batch): not in the publisher's replay buffer" in messages
    assert (
        "publisher restart: seq went back from 9 to 1; starting epoch 1 with a clear "
        "(a new engine has an empty cache)"
    ) in messages
    # The history first, then each gap, then the new epoch's start.
    assert pub.requests == [0, 3, 5, 0]

    # The dump rebuilds the same trace.
    again = tmp_path / "again.parquet"
    cfg = tmp_path / "kv.json"
    cfg.write_text(two_groups().dumps())
    result = CliRunner().invoke(
        ingest, ["kv-events", str(dump), "-o", str(again), "--config", str(cfg)]
    )
    assert result.exit_code == 0, result.output
    rebuilt = open_trace(again)
    assert keyed(rebuilt.read_frame().to_dicts()) == EXPECTED_ROWS
    assert [r["ts"] for r in rebuilt.read_frame().to_dicts()] == EXPECTED_TS
    rsource = dict(rebuilt.config.source or {})
    assert [(g["epoch"], g["first"], g["last"]) for g in rsource["gaps"]] == [(0, 5, 5)]
    assert rsource["restarts"] == source["restarts"]
    assert rsource["skipped_total"] == 2


def test_record_cli_with_topic_filter_and_no_replay_endpoint(tmp_path: Path) -> None:
    steps = [
        Step(seq=0, body=payload(T0, stored([1])), topic=b"kv"),
        Step(seq=0, body=payload(T0, stored([99])), topic=b"other"),  # filtered by SUB
        Step(seq=2, body=payload(T0 + 2, removed([1])), topic=b"kv"),  # seq 1 lost
    ]
    out = tmp_path / "t.parquet"
    with Publisher(steps, with_replay=False) as pub:
        result = CliRunner().invoke(
            record,
            [
                "--endpoint", pub.endpoint, "--topic", "kv", "-o", str(out), "--block-size", "16",
                "--max-batches", "2", "--duration", str(TIMEOUT),
            ],
        )  # fmt: skip
        assert pub.done.wait(TIMEOUT)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        f"recording {pub.endpoint} (connecting: vLLM's publisher binds there) -> {out} "
        "(Ctrl-C to stop)",
        "gap: seq 1 missing (1 batch): no --replay-endpoint to ask",
        f"recorded 2 KV events in 2 batches, no lookup stream, 1 gap (1 batch missing) to {out}",
    ]
    trace = open_trace(out)
    assert keyed(trace.read_frame().to_dicts()) == [
        (0, "store", 0, [u64(1)], "GPU"),
        (1, "remove", 0, [u64(1)], "GPU"),
    ]
    assert (trace.config.source or {})["topic"] == "kv"


def test_record_reports_a_replay_endpoint_that_does_not_answer(tmp_path: Path) -> None:
    steps = [
        Step(seq=0, body=payload(T0, stored([1]))),
        Step(seq=3, body=payload(T0 + 3, stored([2]))),
    ]
    out = tmp_path / "t.parquet"
    messages: list[str] = []
    with Publisher(steps, answer_replay=False) as pub:
        summary = record_stream(
            endpoint=pub.endpoint,
            replay_endpoint=pub.replay_endpoint,
            output=out,
            config=one_group(),
            max_batches=2,
            duration=TIMEOUT,
            replay_timeout=0.2,
            report=messages.append,
        )
    assert summary.batches == 2
    assert messages == [
        f"replay endpoint {pub.replay_endpoint} did not answer within 0.2 s (asked from seq 0)",
        f"replay endpoint {pub.replay_endpoint} did not answer within 0.2 s (asked from seq 1)",
        "gap: seq 1-2 missing (2 batches): the replay endpoint did not answer",
    ]
    assert keyed(open_trace(out).read_frame().to_dicts()) == [
        (0, "store", 0, [u64(1)], "GPU"),
        (1, "store", 0, [u64(2)], "GPU"),
    ]


def test_an_empty_recording_is_never_written(tmp_path: Path) -> None:
    """A publisher that is there but sends nothing, until --duration: before
    issue 26 this wrote an empty trace and exited 0."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUB)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        out = tmp_path / "t.parquet"
        start = time.monotonic()
        with pytest.raises(EmptyRecording) as err:
            record_stream(
                endpoint=f"tcp://127.0.0.1:{port}", output=out, config=one_group(), duration=0.3
            )
        assert 0.3 <= time.monotonic() - start < TIMEOUT
    finally:
        ctx.destroy(linger=0)
    assert re.fullmatch(
        rf"--endpoint tcp://127\.0\.0\.1:{port}: no KV event in 0\.\d s \(stopped: duration\) "
        r"\(connected: vLLM's publisher must bind there\); check that vLLM runs with "
        r"kv_events_config \(enable_kv_cache_events, publisher zmq\) on that host and port; "
        r"no trace written",
        str(err.value),
    ), str(err.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bind", [False, True])
def test_no_kv_event_within_the_connect_timeout_is_exit_2_and_no_file(
    tmp_path: Path, bind: bool
) -> None:
    """Nothing on a real socket on 127.0.0.1 (no publisher, or one that binds
    or connects elsewhere): one line naming the endpoint, whether the
    recorder bound or connected, and what to check; exit 2; no trace."""
    port = free_port()
    out = tmp_path / "t.parquet"
    endpoint = f"tcp://127.0.0.1:{port}"
    start = time.monotonic()
    result = CliRunner().invoke(
        record,
        ["--endpoint", endpoint, "--bind" if bind else "--connect", "-o", str(out),
         "--block-size", "16", "--connect-timeout", "0.5", "--topic", "kv"],
    )  # fmt: skip
    assert 0.5 <= time.monotonic() - start < TIMEOUT
    how = (
        "bound there: vLLM's publisher must connect to it); check that vLLM's kv_events_config "
        "endpoint names this host and port"
        if bind
        else "connected: vLLM's publisher must bind there); check that vLLM runs with "
        "kv_events_config (enable_kv_cache_events, publisher zmq) on that host and port"
    )
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr.splitlines()[-1] == (
        f"error: --endpoint {endpoint}: no KV event within 0.5 s ({how}, and the topic 'kv'; "
        "no trace written"
    )
    assert list(tmp_path.iterdir()) == []


def test_record_bad_endpoint_is_a_one_line_error(tmp_path: Path) -> None:
    out = tmp_path / "t.parquet"
    result = CliRunner().invoke(
        record, ["--endpoint", "nope://x", "-o", str(out), "--block-size", "16", "--duration", "1"]
    )
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (
        "error: --endpoint nope://x: cannot connect (Protocol not supported)"
    )
    assert list(tmp_path.iterdir()) == []


def test_record_wrong_config_keeps_the_dump_but_no_trace(tmp_path: Path) -> None:
    steps = [Step(seq=0, body=payload(T0, stored([1], group=1)))]
    out = tmp_path / "t.parquet"
    dump = tmp_path / "d.kvdump"
    with Publisher(steps) as pub:
        result = CliRunner().invoke(
            record,
            [
                "--endpoint", pub.endpoint, "--replay-endpoint", str(pub.replay_endpoint),
                "-o", str(out), "--block-size", "16", "--dump", str(dump),
                "--max-batches", "1", "--duration", str(TIMEOUT),
            ],
        )  # fmt: skip
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (
        "error: seq 0: BlockStored names group_idx 1, but the config has 1 KV-cache group "
        f"(0..0); the raw frames are in {dump}: `replay ingest kv-events {dump} --config ...`"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.kvdump"]


@pytest.mark.slow
def test_sigterm_closes_a_valid_trace(tmp_path: Path) -> None:
    steps = [Step(seq=i, body=payload(T0 + i, stored([i]))) for i in range(3)]
    out = tmp_path / "t.parquet"
    with Publisher(steps, with_replay=False) as pub:
        proc = subprocess.Popen(
            [
                sys.executable, "-c", "from replay.cli.sources import record; record()",
                "--endpoint", pub.endpoint, "-o", str(out), "--block-size", "16",
                "--duration", str(3 * TIMEOUT),
            ],
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )  # fmt: skip
        try:
            assert pub.done.wait(TIMEOUT), "the recorder never subscribed"
            time.sleep(0.5)  # let the last batch arrive
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(TIMEOUT)
    # A valid trace, and the status says a signal ended the recording: 128 + 15.
    assert proc.returncode == 143, err
    assert err.splitlines()[-2:] == [
        f"recorded 3 KV events in 3 batches, no lookup stream, 0 gaps to {out}",
        "interrupted by SIGTERM",
    ]
    trace = open_trace(out)
    assert [r[3] for r in keyed(trace.read_frame().to_dicts())] == [[u64(0)], [u64(1)], [u64(2)]]
    assert (trace.config.source or {})["stop_reason"] == "signal"


def test_scenario_payloads_use_both_encodings() -> None:
    events = [msgspec.msgpack.decode(s.body)[1] for s in SCENARIO if s.seq in (0, 1)][:2]
    assert isinstance(events[0][0], dict) and events[0][0]["type"] == "BlockStored"
    assert isinstance(events[1][0], list) and events[1][0][0] == "BlockStored"


# ---------------------------------------------------------------- the sources' contract

RECORDED = [
    (0, payload(T0, stored([1, 2]))),
    (1, payload(T0 + 1, stored([3], parent=2))),
    (2, payload(T0 + 2, removed([3]))),
]


class TestRecorder(SourceContract):
    """``replay record``: a live publisher on a real ZMQ socket, three batches."""

    def command(self, folder: Path, out: Path) -> list[str]:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        return [
            "record", "--endpoint", f"tcp://127.0.0.1:{port}", "-o", str(out),
            "--block-size", "16", "--max-batches", str(len(RECORDED)), "--duration", str(TIMEOUT),
        ]  # fmt: skip

    def run(self, args: Sequence[str | os.PathLike[str]]) -> Result:
        pub = getattr(self, "_pub", None)
        if pub is None:
            return super().run(args)
        stop = threading.Event()

        def publish() -> None:
            # Once the recorder subscribed (XPUB hears it), the three batches.
            while not stop.is_set():
                if pub.poll(20) and pub.recv()[:1] == b"\x01":
                    for seq, body in RECORDED:
                        pub.send_multipart([b"", seq.to_bytes(8, "big"), body])
                    return

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        try:
            return super().run(args)
        finally:
            stop.set()
            thread.join(TIMEOUT)
            self._ctx.destroy(linger=0)
            del self._pub

    def expected_counts(self) -> dict[str, int]:
        return {"store": 2, "remove": 1}

    def bad_inputs(self, folder: Path, out: Path) -> list[tuple[list[str], str]]:
        missing = folder / "kv.json"
        badjson = folder / "bad.json"
        badjson.write_text("{nope")
        endpoint = ["record", "--endpoint", "tcp://127.0.0.1:1", "-o", str(out)]
        return [
            (endpoint, "no KV-cache config: pass --config kv-config.json (the replay.trace metadata object) or --block-size N (one full-attention group)"),
            ([*endpoint, "--config", str(missing)], f"{missing}: no such file"),
            ([*endpoint, "--config", str(badjson)], f"{badjson}: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        ]  # fmt: skip


def test_silence_after_the_stream_began_is_said_once(tmp_path: Path) -> None:
    out = tmp_path / "t.parquet"
    messages: list[str] = []
    with Publisher([Step(seq=0, body=payload(T0, stored([1])))], with_replay=False) as pub:
        summary = record_stream(
            endpoint=pub.endpoint,
            output=out,
            config=one_group(),
            duration=1.5,
            silence_seconds=0.5,
            report=messages.append,
        )
    assert summary.kv_events == 1
    assert messages == [
        f"nothing received on {pub.endpoint} (topic '') for 0.5 s: is the engine publishing "
        "KV events there (kv_events_config), and is the topic right? Still recording."
    ]
    assert open_trace(out).num_rows == 1
