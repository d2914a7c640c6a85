"""`replay watch` over real ZMQ sockets: a publisher playing vLLM's (KV
events, its replay endpoint) and the vLLM plugin's own lookup sink; no vLLM
needed. ``tests/vllm/test_watch_vllm.py`` runs vLLM's real scheduler."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from replay.adapters.vllm import plugin as vllm_plugin
from replay.analysis.flags import add_flags
from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.cli import cli
from replay.engine.run import replay
from replay.format.tracedir import open_trace
from replay.sources.live import EngineEndpoints
from replay.watch import Metrics, Watch, WatchOptions, WatchSummary
from replay.watch._service import GC_THRESHOLDS
from tests.kvpayloads import T0, one_group, payload, removed, stored, u64
from tests.kvpayloads import plugin_lookup as lookup
from tests.sources.test_record_zmq import Publisher, Step, free_port

TIMEOUT = 20.0


def engine_record(
    config: TraceConfig, instance: str = "e1", version: str = "0.33.0"
) -> dict[str, Any]:
    cfg = {**config.to_json(), "source": {"cache": "gpu", "vllm_version": version}}
    return {
        "type": "engine",
        "instance": instance,
        "ts": T0,
        "config": cfg,
        "engine": {"vllm_version": version},
    }


class Running:
    """A watch in a thread, stopped like SIGTERM stops it (the stop event)."""

    def __init__(self, options: WatchOptions) -> None:
        self.stop = threading.Event()
        self.lines: list[str] = []
        self.box: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(options,), daemon=True)

    def _run(self, options: WatchOptions) -> None:
        try:
            service = Watch(
                options, stop=self.stop, report=self.lines.append, status=self.lines.append
            )
            self.box["service"] = service
            self.box["summary"] = service.run()
        except BaseException as exc:  # surfaced by the test
            self.box["error"] = exc

    def __enter__(self) -> Running:
        self.thread.start()
        return self

    def finish(self) -> WatchSummary:
        self.stop.set()
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive()
        if "error" in self.box:
            raise self.box["error"]
        summary = self.box["summary"]
        assert isinstance(summary, WatchSummary)
        return summary

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT)


def wait_for(check: Any, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("replay_watch_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_every_lookup_is_judged_live_with_metrics_and_flag_lines(tmp_path: Path) -> None:
    """One engine: two blocks stored, a lookup served right (32 tokens) and
    one served 16 tokens past what the store holds (an observed mismatch);
    a block removed; the flagged lookup is one JSON line as it happens."""
    lookups_endpoint = f"tcp://127.0.0.1:{free_port()}"
    metrics_port = free_port()
    sink = vllm_plugin.open_sink(lookups_endpoint)
    steps = [
        Step(seq=0, body=payload(T0, stored([1]), stored([2], parent=1))),
        Step(seq=1, body=payload(T0 + 1, removed([2]))),
    ]
    flags_out = tmp_path / "flags.jsonl"
    try:
        sink.engine(engine_record(one_group()))
        with Publisher(steps, with_replay=False) as pub:
            opts = WatchOptions(
                engines=(EngineEndpoints(name="rank0", kv=pub.endpoint, lookups=lookups_endpoint),),
                flags_out=flags_out,
                metrics=f"127.0.0.1:{metrics_port}",
                status_every=0.2,
                output=tmp_path / "rolling",
                segment_seconds=None,
                segment_events=3,
            )
            thresholds = gc.get_threshold()
            with Running(opts) as running:
                assert pub.done.wait(TIMEOUT)
                time.sleep(0.5)  # the lookup subscription is up
                sink.send([lookup(0, 1, 0, [1, 2], 32)], watermark=1, instance="e1")
                sink.send([lookup(1, 1, 1, [1, 2, 3], 48)], watermark=2, instance="e1")
                wait_for(lambda: flags_out.exists() and flags_out.read_text(), "a flag line")
                # The flagged lookup is out while the watch still runs.
                assert running.thread.is_alive()
                # Collected seldom while it runs, as the caller had it after.
                assert gc.get_threshold() == GC_THRESHOLDS
                assert gc.get_freeze_count() > 0
                wait_for(
                    lambda: (
                        scrape(metrics_port).get('replay_watch_lookups_total{engine="rank0"}') == 2
                    ),
                    "the metrics",
                )
                metrics = scrape(metrics_port)
                summary = running.finish()
    finally:
        sink.close()
    assert (gc.get_threshold(), gc.get_freeze_count()) == (thresholds, 0)
    rank0 = summary.engines["rank0"]
    assert rank0["lookups"] == 2
    assert rank0["hit_tokens"] == 32 + 16  # the second: block 2 was removed
    assert rank0["observed_hit_tokens"] == 80
    assert rank0["prompt_tokens"] == 33 + 49
    assert rank0["observed_mismatch"] == 1
    assert rank0["observed_over"] == 1
    assert rank0["flags"] == [{"flag": "observed_mismatch", "severity": "observed", "lookups": 1}]
    assert rank0["events"] == {"store": 2, "remove": 1, "lookup": 2}
    assert rank0["policy"] == "vllm-0.33"
    assert rank0["vllm_version"] == "0.33.0"
    assert summary.stop_reason == "signal"
    (line,) = flags_out.read_text().splitlines()
    record = json.loads(line)
    assert {k: record[k] for k in ("engine", "request_id", "seq", "flags", "hit_tokens",
                                   "observed_hit_tokens", "severities", "policy")} == {
        "engine": "rank0", "request_id": "r1", "seq": 4, "flags": ["observed_mismatch"],
        "hit_tokens": 16, "observed_hit_tokens": 48, "severities": ["observed"],
        "policy": "vllm-0.33",
    }  # fmt: skip
    # The rolling trace: segments of 3 rows (the second begins with the
    # store at its start), read back as one trace by the offline replay,
    # whose counts are the watch's.
    trace_dir = tmp_path / "rolling" / "rank0"
    assert sorted(p.name for p in trace_dir.iterdir()) == [
        "segment-000000.parquet",
        "segment-000001.parquet",
    ]
    offline = offline_counts(trace_dir)
    assert offline == {
        "lookups": 2, "hit_tokens": 48, "observed_mismatch": 1, "flags": {"observed_mismatch": 1}
    }  # fmt: skip
    assert record["segment"] == str(trace_dir / "segment-000001.parquet")
    # Segment 1 begins with a clear and a store row of the keys held then, so the
    # lookup (seq 4 of the stream) is seq 6 there and in the directory.
    assert record["trace_seq"] == 6
    assert record["explain"] == (
        f"replay explain {trace_dir / 'segment-000001.parquet'} --request r1 --seq 6 "
        "--policy vllm-0.33"
    )
    explained = CliRunner().invoke(cli, record["explain"].split()[1:])
    assert explained.exit_code == 0, explained.output
    assert "observed_mismatch" in explained.output
    assert metrics['replay_watch_lookups_total{engine="rank0"}'] == 2
    assert metrics['replay_watch_hit_tokens_total{engine="rank0"}'] == 48
    assert metrics['replay_watch_prompt_tokens_total{engine="rank0"}'] == 82
    assert metrics['replay_watch_observed_mismatch_total{engine="rank0"}'] == 1
    assert (
        metrics[
            'replay_watch_flags_total{engine="rank0",flag="observed_mismatch",severity="observed"}'
        ]
        == 1
    )
    assert metrics['replay_watch_events_total{engine="rank0",kind="store"}'] == 2
    assert metrics['replay_watch_events_total{engine="rank0",kind="lookup"}'] == 2
    assert metrics['replay_watch_event_gaps_total{engine="rank0"}'] == 0
    assert metrics['replay_watch_lag_seconds_count{engine="rank0"}'] == 2
    assert metrics['replay_watch_store_keys{engine="rank0"}'] == 1
    assert (
        metrics['replay_watch_info{engine="rank0",policy="vllm-0.33",vllm_version="0.33.0"}'] == 1
    )


def offline_counts(trace: Path) -> dict[str, Any]:
    """What `replay run` of the rolling trace counts."""
    (result,) = replay(trace)
    judged = add_flags(result.results, result.config)
    flags: dict[str, int] = {}
    for names in judged["flags"].to_list():
        for name in names:
            flags[name] = flags.get(name, 0) + 1
    return {
        "lookups": judged.height,
        "hit_tokens": int(judged["hit_tokens"].sum()),
        "observed_mismatch": int((~judged["observed_match"]).fill_null(False).sum()),
        "flags": flags,
    }


def test_engine_option_is_parsed_and_bad_ones_are_one_line() -> None:
    spec = EngineEndpoints.parse("kv=tcp://h:5557,lookups=tcp://h:5560,replay=tcp://h:5558", 3)
    assert spec == EngineEndpoints(
        name="engine3", kv="tcp://h:5557", lookups="tcp://h:5560", replay="tcp://h:5558"
    )
    with pytest.raises(ReplayError) as exc:
        EngineEndpoints.parse("kv=tcp://h:5557", 0)
    assert str(exc.value) == "--engine 'kv=tcp://h:5557': lookups= is required"
    with pytest.raises(ReplayError) as exc:
        EngineEndpoints.parse("kv=tcp://h:1,lookups=tcp://h:2,port=3", 0)
    assert str(exc.value) == (
        "--engine 'kv=tcp://h:1,lookups=tcp://h:2,port=3': expected comma-separated kv=, "
        "lookups=, and optionally replay=, name=, topic= (got 'port=3')"
    )


def test_a_restart_resets_the_store_and_gaps_are_counted_or_filled(tmp_path: Path) -> None:
    """Two engines with separate stores. ``a`` has no replay endpoint: its
    lost batch is a gap (counted, and in its trace's source), then its
    engine restarts (seq 0 again, a new plugin instance) and its store is
    empty: the lookup that hit 32 tokens before hits none after. ``b``'s
    lost batch is filled from its replay endpoint."""
    sinks = {name: f"tcp://127.0.0.1:{free_port()}" for name in "ab"}
    a_steps = [
        Step(seq=0, body=payload(T0, stored([1]), stored([2], parent=1))),
        Step(seq=1, body=payload(T0 + 1, stored([3], parent=2)), live=False, buffered=False),
        Step(seq=2, body=payload(T0 + 2, stored([4]))),
        Step(restart=True),
        Step(seq=0, body=payload(T0 + 10, stored([5]))),
    ]
    b_steps = [
        Step(seq=0, body=payload(T0, stored([1]), stored([2], parent=1))),
        Step(seq=1, body=payload(T0 + 1, removed([2])), live=False),  # the replay fills it
        Step(seq=2, body=payload(T0 + 2, stored([4]))),
    ]
    a_sink, b_sink = (vllm_plugin.open_sink(sinks[n]) for n in "ab")
    try:
        a_sink.engine(engine_record(one_group(), instance="a1"))
        b_sink.engine(engine_record(one_group(), instance="b1"))
        a_pub, b_pub = Publisher(a_steps, with_replay=False), Publisher(b_steps)
        opts = WatchOptions(
            engines=(
                EngineEndpoints(name="a", kv=a_pub.endpoint, lookups=sinks["a"]),
                EngineEndpoints(
                    name="b", kv=b_pub.endpoint, lookups=sinks["b"], replay=b_pub.replay_endpoint
                ),
            ),
            output=tmp_path / "rolling",
            status_every=0.2,
        )
        with Running(opts) as running:
            # Both lookup subscriptions are up once each engine's facts came
            # (the plugin sends them again to every new subscriber; a lookup
            # sent before its subscriber joined would be lost, and on a
            # loaded machine the watch warms up slower than any fixed sleep).
            wait_for(
                lambda: sum(e.feed.placer is not None for e in running_engines(running)) == 2,
                "both engines' facts",
            )
            # The first engine's lookup comes before its restart, as it does.
            a_sink.send([lookup(0, 1, 0, [1, 2], 32, instance="a1")], watermark=3, instance="a1")
            with a_pub, b_pub:
                assert a_pub.done.wait(TIMEOUT) and b_pub.done.wait(TIMEOUT)
                a_sink.engine(engine_record(one_group(), instance="a2"))
                a_sink.send([lookup(0, 0, 1, [1, 2], 0, instance="a2")], watermark=1, instance="a2")
                b_sink.send(
                    [lookup(0, 2, 0, [1, 2], 16, instance="b1")], watermark=3, instance="b1"
                )
                wait_for(
                    lambda: sum(e.counts.lookups for e in running_engines(running)) == 3,
                    "three verdicts",
                )
                summary = running.finish()
    finally:
        a_sink.close()
        b_sink.close()
    a, b = summary.engines["a"], summary.engines["b"]
    assert (a["lookups"], a["hit_tokens"], a["observed_mismatch"]) == (2, 32, 0)
    assert (a["gaps"], a["missing_batches"], a["restarts"]) == (1, 1, 1)
    assert a["events"] == {"store": 4, "clear": 1, "lookup": 2}
    assert (b["lookups"], b["hit_tokens"], b["observed_mismatch"]) == (1, 16, 0)
    assert (b["gaps"], b["restarts"]) == (0, 0)
    assert b["events"] == {"store": 3, "remove": 1, "lookup": 1}
    # The gap is marked in a's trace, and the offline replay agrees.
    source = open_trace(tmp_path / "rolling" / "a").config.source or {}
    assert [(g["epoch"], g["first"], g["last"]) for g in source["gaps"]] == [(0, 1, 1)]
    assert offline_counts(tmp_path / "rolling" / "a") == {
        "lookups": 2, "hit_tokens": 32, "observed_mismatch": 0, "flags": {}
    }  # fmt: skip


def test_an_oversized_kv_message_is_counted_and_the_watch_keeps_judging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hostile publisher: a KV message above --max-record-bytes costs the
    connection (refused from its size header), which the watch says once,
    counts, and makes again; the batches after it are judged, the lost one
    is a gap."""
    import zmq

    monkeypatch.setenv("REPLAY_MAX_RECORD_BYTES", str(64 << 10))
    lookups_endpoint = f"tcp://127.0.0.1:{free_port()}"
    metrics_port = free_port()
    sink = vllm_plugin.open_sink(lookups_endpoint)
    ctx: zmq.Context[Any] = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    # Every subscription is heard, the new socket's too.
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    kv = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"

    def subscribed() -> None:
        while True:
            assert pub.poll(int(TIMEOUT * 1000)), "the watch never subscribed"
            if pub.recv() == b"\x01":
                return

    try:
        sink.engine(engine_record(one_group()))
        opts = WatchOptions(
            engines=(EngineEndpoints(name="rank0", kv=kv, lookups=lookups_endpoint),),
            metrics=f"127.0.0.1:{metrics_port}",
            status_every=0.2,
        )
        with Running(opts) as running:
            subscribed()
            pub.send_multipart([b"", u64(0), payload(T0, stored([1]), stored([2], parent=1))])
            pub.send_multipart([b"", u64(1), b"\x00" * (1 << 20)])
            subscribed()  # the watch connected again
            pub.send_multipart([b"", u64(2), payload(T0 + 2, stored([3], parent=2))])
            time.sleep(0.5)  # the lookup subscription is up
            sink.send([lookup(0, 2, 1, [1, 2, 3], 48)], watermark=3, instance="e1")
            wait_for(
                lambda: scrape(metrics_port).get('replay_watch_lookups_total{engine="rank0"}') == 1,
                "the verdict",
            )
            wait_for(
                lambda: (
                    scrape(metrics_port).get(
                        'replay_watch_dropped_connections_total{engine="rank0"}'
                    )
                    == 1
                ),
                "the drop counted",
            )
            summary = running.finish()
    finally:
        sink.close()
        ctx.destroy(linger=0)
    rank0 = summary.engines["rank0"]
    assert (rank0["lookups"], rank0["hit_tokens"], rank0["observed_mismatch"]) == (1, 48, 0)
    assert (rank0["dropped_connections"], rank0["gaps"], rank0["missing_batches"]) == (1, 1, 1)
    assert rank0["events"] == {"store": 3, "lookup": 1}
    said = [line for line in running.lines if "connection dropped" in line]
    assert said == [
        f"rank0: kv {kv}: connection dropped (1 so far): a message above --max-record-bytes "
        "(65,536 bytes), or the peer closed it; connecting again; still watching"
    ]


def test_engines_of_one_layout_are_flagged_together_and_counted_apart() -> None:
    """A turn's answers of every engine with one group layout get one
    results frame per policy among them and their flags in one call (the
    costs are per call); each engine counts its own verdicts, as when
    flagged alone: ``a`` served 16 tokens past its store (an observed
    mismatch), ``b``, whose store holds the third block, did not; ``c``,
    judged under another release's policy (its own frame), as ``a``."""
    from datetime import UTC, datetime

    from replay.engine.live import LiveFold
    from replay.sources.live import EngineFeed
    from replay.watch._service import Answered, EngineWatch

    config = one_group()
    ts = datetime.fromtimestamp(T0, tz=UTC)
    service = Watch(
        WatchOptions(engines=(EngineEndpoints(name="x", kv="tcp://127.0.0.1:1", lookups="tcp://127.0.0.1:2"),)),
        report=lambda _: None,
    )  # fmt: skip
    engines = []
    try:
        for name, stored_keys, policy in (
            ("a", [1, 2], "vllm-0.33"),
            ("c", [1, 2], "vllm-0.32"),
            ("b", [1, 2, 3], "vllm-0.33"),
        ):
            spec = EngineEndpoints(
                name=name,
                kv=f"tcp://127.0.0.1:{free_port()}",
                lookups=f"tcp://127.0.0.1:{free_port()}",
            )
            ew = EngineWatch(EngineFeed(service.ctx, spec, report=lambda _: None))
            engines.append(ew)
            ew.feed.config = config
            ew.fold = LiveFold(config, policy, cache="gpu")
            answers = ew.fold.answer(
                [
                    {"seq": 0, "ts": ts, "kind": "store", "group_id": 0,
                     "block_hashes": [u64(k) for k in stored_keys]},
                    {"seq": 1, "ts": ts, "kind": "lookup", "block_hashes": [u64(k) for k in (1, 2, 3)],
                     "request_id": f"{name}-r", "max_length": 48, "num_tokens": 49,
                     "observed_hit_tokens": 48},
                ]
            )  # fmt: skip
            service._answered.append(Answered(ew, answers, [time.time()], {}))
        service._judge_answered()
    finally:
        for ew in engines:
            ew.feed.close()
        service.ctx.destroy(linger=0)
    a, c, b = (ew.counts for ew in engines)
    # Each engine's lag, of its own lookup (the engine's ``ts``, T0, is ahead
    # of this clock: from its arrival, moments ago).
    for counts in (a, b, c):
        assert len(counts.lags) == 1 and 0 <= counts.lags.values()[0] < TIMEOUT
    for counts in (a, c):
        assert (counts.lookups, counts.hit_tokens, counts.observed_mismatch) == (1, 32, 1)
        assert counts.observed_over == 1
        assert dict(counts.flags) == {("observed_mismatch", "observed"): 1}
    assert (b.lookups, b.hit_tokens, b.observed_mismatch, b.flagged_lookups) == (1, 48, 0, 0)
    assert dict(b.flags) == {}
    assert service._answered == []


def running_engines(running: Running) -> list[Any]:
    service = running.box.get("service")
    return [] if service is None else list(service.engines)


def test_sigterm_closes_the_open_segment_and_exits_0(tmp_path: Path) -> None:
    """`replay watch` as a process: SIGTERM while a segment is open closes
    it (a complete trace, no temporary file left) and exits 0 with the
    counts."""
    lookups_endpoint = f"tcp://127.0.0.1:{free_port()}"
    metrics_port = free_port()
    sink = vllm_plugin.open_sink(lookups_endpoint)
    steps = [Step(seq=0, body=payload(T0, stored([1]), stored([2], parent=1)))]
    out = tmp_path / "rolling"
    pub = Publisher(steps, with_replay=False)
    try:
        sink.engine(engine_record(one_group()))
        proc = subprocess.Popen(
            [sys.executable, "-m", "replay", "watch", "--engine",
             f"kv={pub.endpoint},lookups={lookups_endpoint},name=e",
             "-o", str(out), "--segment", "1h", "--metrics", f"127.0.0.1:{metrics_port}",
             "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            # The process is up (and subscribed) before the publisher runs.
            wait_for(lambda: proc.poll() is not None or metrics_up(metrics_port), "metrics", 60)
            with pub:
                assert pub.done.wait(TIMEOUT)
                time.sleep(0.5)
                sink.send([lookup(0, 0, 2, [1, 2], 32)], watermark=1, instance="e1")
                wait_for(
                    lambda: scrape(metrics_port).get('replay_watch_lookups_total{engine="e"}') == 1,
                    "the verdict",
                )
                proc.send_signal(signal.SIGTERM)
                stdout, stderr = proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        sink.close()
    assert proc.returncode == 0, stderr
    result = json.loads(stdout)
    assert result["stop_reason"] == "signal"
    assert result["engines"]["e"]["lookups"] == 1
    assert sorted(os.listdir(out / "e")) == ["segment-000000.parquet"]
    assert offline_counts(out / "e") == {
        "lookups": 1, "hit_tokens": 32, "observed_mismatch": 0, "flags": {}
    }  # fmt: skip


def metrics_up(port: int) -> bool:
    try:
        scrape(port)
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "kv=tcp://127.0.0.1:1"], "--engine 'kv=tcp://127.0.0.1:1': lookups= is required"),
        (["--engine", "kv=tcp://127.0.0.1:1,lookups=tcp://127.0.0.1:2", "--segment", "soon"],
         "--segment 'soon': expected a duration (60, 30s, 10m, 1h) or a number of events (10000events, 50k events, 100k)"),
        (["--engine", "kv=tcp://127.0.0.1:1,lookups=tcp://127.0.0.1:2", "--metrics", "nowhere"],
         "--metrics 'nowhere': expected HOST:PORT (a port 0-65535)"),
        (["--engine", "kv=tcp://127.0.0.1:1,lookups=tcp://127.0.0.1:2,name=x",
          "--engine", "kv=tcp://127.0.0.1:3,lookups=tcp://127.0.0.1:4,name=x"],
         "--engine name=x: two engines have that name"),
        # --policy is the shared option bundle (replay.cli.options.policy_options).
        (["--engine", "kv=tcp://127.0.0.1:1,lookups=tcp://127.0.0.1:2", "--policy", "vllm-0.3"],
         "replay watch: invalid value for '--policy': no policy 'vllm-0.3', did you mean "
         "'vllm-0.23' or 'vllm-0.30' or 'vllm-0.32' or 'vllm-0.33' or 'vllm-0.34'? "
         "(try 'replay watch --help')"),
        (["--engine", "kv=tcp://127.0.0.1:1,lookups=tcp://127.0.0.1:2", "--policy", "vllm-0.33",
          "--vllm", "0.26.0"], "--vllm and --policy both choose the policy: give one"),
    ],
)  # fmt: skip
def test_bad_options_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["watch", *args], prog_name="replay")
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {message}\n"


def test_metrics_without_prometheus_client_say_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ReplayError) as exc:
        Metrics("127.0.0.1:0")
    assert str(exc.value) == (
        "--metrics needs prometheus_client, which is not installed: "
        "pip install 'cache-trace-replay[watch]'"
    )


def test_the_status_line_reads_each_engines_latest_lags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The status line's lag percentiles are of each engine's latest lags,
    at most STATUS_LAGS in all (every window copied was most of a second a
    line at 1,000 engines): two engines, two lags each; ``a``'s older 9 s
    ones do not count."""
    from typing import cast

    from replay.watch import _service
    from replay.watch._service import EngineWatch

    monkeypatch.setattr(_service, "STATUS_LAGS", 4)
    service = Watch(
        WatchOptions(engines=(EngineEndpoints(name="x", kv="tcp://127.0.0.1:1", lookups="tcp://127.0.0.1:2"),)),
        report=lambda _: None,
    )  # fmt: skip
    try:
        for lags in ([9.0, 9.0, 0.010, 0.020], [0.030, 0.040]):
            ew = EngineWatch(cast(Any, None))
            ew.counts.lags.extend(lags)
            service.engines.append(ew)
        line = service._status_line({}, 1.0)
    finally:
        service.ctx.destroy(linger=0)
    assert "lag p50 30 ms p99 40 ms" in line, line


def test_a_fleet_of_silent_engines_starts_and_stops_at_once() -> None:
    """200 engines (ZMQ's default of 1,023 sockets a context held about
    150): the watch starts, and stops without waiting for each engine's
    sockets to be quiet in turn (200 ms each, 40 s here)."""
    from replay.watch import watch

    engines = tuple(
        EngineEndpoints(name=f"e{i}", kv=f"tcp://127.0.0.1:{free_port()}",
                        lookups=f"tcp://127.0.0.1:{free_port()}")
        for i in range(200)
    )  # fmt: skip
    started = time.monotonic()
    summary = watch(WatchOptions(engines=engines, duration=0.5), report=lambda _: None)
    assert time.monotonic() - started < TIMEOUT
    assert summary.stop_reason == "duration"
    assert sorted(summary.engines) == sorted(e.name for e in engines)
    assert all(e["lookups"] == 0 and e["gaps"] == 0 for e in summary.engines.values())


def test_engines_beyond_the_open_files_hard_limit_are_one_line() -> None:
    """100 engines take about 1,056 open files: under a hard limit of 512
    the watch says so in one line, exit 2, before it opens a socket."""
    engines = [
        a
        for i in range(100)
        for a in (
            "--engine",
            f"kv=tcp://127.0.0.1:{40000 + 2 * i},lookups=tcp://127.0.0.1:{40001 + 2 * i}",
        )
    ]

    def low_limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512))

    done = subprocess.run(
        [sys.executable, "-m", "replay", "watch", *engines, "--duration", "1"],
        capture_output=True, text=True, timeout=60, preexec_fn=low_limit,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "error: 100 --engine need about 1,056 open files, above this process's hard limit "
        "of 512 (`ulimit -Hn`): raise it, or split the engines over several watches\n"
    )
