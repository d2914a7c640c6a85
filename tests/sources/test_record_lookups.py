"""Lookups from the vLLM plugin: exact placement, the plugin's file, the live stream.

The records here are written in the plugin's documented format
(``replay/adapters/vllm/plugin.py``); ``tests/sources/test_record_scheduler.py`` produces
them with vLLM's real scheduler. The live test sends them through the
plugin's own ZMQ sink (no vLLM needed for it).
"""

from __future__ import annotations

import json
import threading
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from replay.adapters.vllm import plugin as vllm_plugin
from replay.adapters.vllm import wire
from replay.cli.sources import ingest, record
from replay.format.tracedir import open_trace
from replay.sources.record import ingest_dumps
from replay.sources.zmq_client import binds
from tests.kvpayloads import (
    T0,
    frames,
    one_group,
    payload,
    plugin_lookup,
    removed,
    stored,
    two_groups,
    u64,
    write_dump,
)
from tests.sources.test_record_zmq import Publisher, Step, free_port

TIMEOUT = 10.0


def engine_record(instance: str = "e1") -> dict[str, Any]:
    config = {**two_groups().to_json(), "source": {"cache": "gpu"}}
    return {"type": "engine", "instance": instance, "ts": T0, "config": config, "engine": {}}


def lookup(
    n: int, batch: int, position: int, hit: int, *, admitted: bool = True, instance: str = "e1"
) -> dict[str, Any]:
    """The recorder's tests' lookup: a 33-token prompt of two hashed blocks."""
    return plugin_lookup(n, batch, position, [1, 2], hit, admitted=admitted, instance=instance)


def write_jsonl(path: Path, records: list[dict[str, Any]], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def dump_three_batches(tmp_path: Path) -> Path:
    return write_dump(
        tmp_path / "d.kvdump",
        [
            (frames(0, payload(T0, stored([1]), stored([2], parent=1))), "live"),
            (frames(1, payload(T0 + 1, removed([2]), removed([1]))), "live"),
            # seq 2: a step whose batch was lost (a gap), seq 3 follows
            (frames(3, payload(T0 + 3, stored([1]))), "live"),
        ],
    )


def order(path: Path) -> list[tuple[Any, ...]]:
    rows = open_trace(path).read_frame().to_dicts()
    return [
        (r["seq"], r["kind"], r["request_id"] or r["block_hashes"], r["observed_hit_tokens"])
        for r in rows
    ]


def test_each_lookup_goes_before_the_event_at_its_position(tmp_path: Path) -> None:
    lookups = write_jsonl(
        tmp_path / "l.jsonl",
        [
            engine_record(),
            lookup(0, 0, 0, 0),  # before anything
            lookup(1, 0, 1, 16),  # after the first store of batch 0
            lookup(2, 0, 2, 32, admitted=False),  # after both
            lookup(3, 1, 1, 0),  # between the two removes of batch 1
            lookup(4, 2, 0, 0),  # batch 2 never came: before batch 3
            lookup(5, 4, 0, 16),  # after the last batch: at the end
        ],
    )
    summary = ingest_dumps([dump_three_batches(tmp_path)], tmp_path / "t.parquet", None,
                           lookups=lookups, report=lambda m: None)  # fmt: skip
    assert summary.lookups == 6
    assert order(tmp_path / "t.parquet") == [
        (0, "lookup", "r0", 0),
        (1, "store", [u64(1)], None),
        (2, "lookup", "r1", 16),
        (3, "store", [u64(2)], None),
        (4, "lookup", "r2", 32),
        (5, "remove", [u64(2)], None),
        (6, "lookup", "r3", 0),
        (7, "remove", [u64(1)], None),
        (8, "lookup", "r4", 0),
        (9, "store", [u64(1)], None),
        (10, "lookup", "r5", 16),
    ]
    trace = open_trace(tmp_path / "t.parquet")
    source = dict(trace.config.source or {})
    # The engine record is the config; the cache is vLLM's engine cache.
    assert trace.config == two_groups()
    assert source["cache"] == "gpu"
    assert source["lookups"]["not_admitted_seqs"] == [4]
    assert source["lookups"]["admitted"] == 5
    assert source["lookups"]["placed_by"].startswith("KV-event batch and position")


def test_cli_ingest_with_the_plugin_file_needs_no_config(tmp_path: Path) -> None:
    lookups = write_jsonl(tmp_path / "l.jsonl", [engine_record(), lookup(0, 0, 1, 16)])
    out = tmp_path / "t.parquet"
    result = CliRunner().invoke(
        ingest, ["kv-events", str(dump_three_batches(tmp_path)), "--lookups", str(lookups),
                 "-o", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[-1] == (
        f"wrote {out}: 3 batches, 6 rows, 1 lookup placed, 1 missing in 1 gap"
    )
    assert [r[1] for r in order(out)][:3] == ["store", "lookup", "store"]


@pytest.mark.parametrize(
    ("records", "tail", "message"),
    [
        ([lookup(0, 0, 0, 0)], "", "no engine record (the plugin writes one when the scheduler "
         "starts); pass --config"),
        ([engine_record(), {**lookup(0, 0, 0, 0), "position": -1}], "",
         "line 2: field 'position': expected an integer >= 0, got -1"),
        ([engine_record(), {**lookup(0, 0, 0, 0), "admitted": "yes"}], "",
         "line 2: field 'admitted': expected a boolean, got str"),
        ([engine_record(), {**lookup(0, 0, 0, 0), "max_length": 99}], "",
         "line 2: num_tokens 33 cannot hold max_length 99 (expected num_tokens >= max_length)"),
        ([engine_record(), {**lookup(0, 0, 0, 0), "max_length": 99, "num_tokens": 100}], "",
         "line 2: max_length 99 exceeds what its 2 block_hashes cover (expected below "
         "(len(block_hashes) + 1) * hash_block_size = 48)"),
        ([engine_record(), {"type": "other"}], "",
         "line 2: expected a plugin record (a JSON object with 'type' engine or lookup)"),
        ([{**engine_record(), "config": {**two_groups().to_json(), "kv_cache_groups": []}}], "",
         "line 1: engine record: kv_cache_groups: at least one KV-cache group is required"),
    ],
)  # fmt: skip
def test_a_bad_plugin_file_is_one_line_and_no_trace(
    tmp_path: Path, records: list[dict[str, Any]], tail: str, message: str
) -> None:
    lookups = write_jsonl(tmp_path / "l.jsonl", records, tail)
    out = tmp_path / "t.parquet"
    result = CliRunner().invoke(
        ingest, ["kv-events", str(dump_three_batches(tmp_path)), "--lookups", str(lookups),
                 "-o", str(out)],
    )  # fmt: skip
    assert result.exit_code == 2
    assert result.stderr == f"error: {lookups}: {message}\n"
    assert not out.exists()


def test_a_line_cut_short_at_the_end_is_a_killed_engine_not_an_error(tmp_path: Path) -> None:
    lookups = write_jsonl(
        tmp_path / "l.jsonl", [engine_record(), lookup(0, 0, 0, 0)], tail='{"type": "lookup", "in'
    )
    summary = ingest_dumps([dump_three_batches(tmp_path)], tmp_path / "t.parquet", None,
                           lookups=lookups, report=lambda m: None)  # fmt: skip
    assert summary.lookups == 1
    bad = write_jsonl(tmp_path / "bad.jsonl", [engine_record()], tail='{"type": "lo\n{}\n')
    with pytest.raises(Exception, match="line 2: not valid JSON"):
        ingest_dumps([dump_three_batches(tmp_path)], tmp_path / "u.parquet", None, lookups=bad)


def test_a_lookup_log_is_still_merged_by_time(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text(
        json.dumps({"request_id": "a", "ts": T0 + 0.5, "block_hashes": [1], "max_length": 15})
        + "\n"
    )
    summary = ingest_dumps([dump_three_batches(tmp_path)], tmp_path / "t.parquet", two_groups(),
                           lookups=log, report=lambda m: None)  # fmt: skip
    assert summary.lookups is None
    assert [r[1] for r in order(tmp_path / "t.parquet")] == [
        "store", "store", "lookup", "remove", "remove", "store",
    ]  # fmt: skip
    source = open_trace(tmp_path / "t.parquet").config.source or {}
    assert source["lookups"]["merged_by"].startswith("ts")
    assert source["cache"] == "gpu"


def test_bind_or_connect_follows_vllms_rule_from_the_other_end() -> None:
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557")
    assert not binds("tcp://vllm-host:5557") and not binds("tcp://127.0.0.1:5557")
    assert not binds("ipc:///tmp/kv")  # vLLM binds ipc: the recorder connects


def test_the_entry_point_is_installed_and_inert_without_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (ep,) = [
        e for e in entry_points(group="vllm.general_plugins") if e.name == "cache_trace_replay"
    ]
    assert ep.value == "replay.vllm_plugin:register"
    monkeypatch.delenv(wire.ENV, raising=False)
    ep.load()()
    assert not vllm_plugin.installed()


def test_rank_targets_are_offset_like_vllms_publisher() -> None:
    assert vllm_plugin.rank_target("tcp://*:6000", 0) == "tcp://*:6000"
    assert vllm_plugin.rank_target("tcp://*:6000", 2) == "tcp://*:6002"
    assert vllm_plugin.rank_target("/tmp/l.jsonl", 1) == "/tmp/l.jsonl_dp1"


def test_record_live_places_lookups_from_the_plugin_stream(tmp_path: Path) -> None:
    """`replay record --lookups`: the plugin's own ZMQ sink on one side, a
    publisher playing vLLM's on the other; no --config (the engine facts)."""
    lookups_endpoint = f"tcp://127.0.0.1:{free_port()}"
    sink = vllm_plugin.open_sink(lookups_endpoint)
    steps = [
        Step(seq=0, body=payload(T0, stored([1]), stored([2], parent=1))),
        Step(seq=1, body=payload(T0 + 1, removed([2]))),
    ]
    out = tmp_path / "t.parquet"
    try:
        sink.engine(engine_record())
        with Publisher(steps, with_replay=False) as pub:
            box: dict[str, Any] = {}

            def run() -> None:
                box["result"] = CliRunner().invoke(
                    record, ["--endpoint", pub.endpoint, "--lookups", lookups_endpoint,
                             "-o", str(out), "--duration", "3"],
                )  # fmt: skip

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            assert pub.done.wait(TIMEOUT)
            time.sleep(0.5)  # the lookup subscription is up (PUB drops what precedes it)
            # A step's lookups come after its events were queued: each batch
            # is held until a watermark says all its lookups are in.
            sink.send([lookup(0, 0, 1, 16)], watermark=1, instance="e1")
            sink.send([lookup(1, 1, 0, 32)], watermark=2, instance="e1")
            thread.join(TIMEOUT)
    finally:
        sink.close()
    result = box["result"]
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        f"recording {pub.endpoint} (connecting: vLLM's publisher binds there) -> {out} "
        "(Ctrl-C to stop)",
        f"lookups from the vLLM plugin at {lookups_endpoint}",
        f"waiting for the engine facts from {lookups_endpoint} (sent at the engine's next step)",
        f"recorded 3 KV events in 2 batches, 2 lookups, 0 gaps to {out}",
    ]
    assert order(out) == [
        (0, "store", [u64(1)], None),
        (1, "lookup", "r0", 16),
        (2, "store", [u64(2)], None),
        (3, "lookup", "r1", 32),
        (4, "remove", [u64(2)], None),
    ]
    trace = open_trace(out)
    assert trace.config == two_groups()
    source = trace.config.source or {}
    assert source["endpoint_socket"] == "connected"
    assert source["lookups"]["lost_messages"] == 0
    assert source["cache"] == "gpu"


def test_record_cli_says_it_binds_for_a_wildcard_endpoint(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "t.parquet"
    result = CliRunner().invoke(
        record, ["--endpoint", f"tcp://*:{port}", "--block-size", "16", "-o", str(out),
                 "--duration", "0.3"],
    )  # fmt: skip
    # Nothing arrives: the recorder said it binds, then that it heard nothing.
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[0] == (
        f"recording tcp://*:{port} (binding it: vLLM's publisher connects here) -> {out} "
        "(Ctrl-C to stop)"
    )
    assert "(bound there: vLLM's publisher must connect to it)" in result.stderr.splitlines()[1]
    assert not out.exists()


def test_a_config_that_differs_from_the_engines_is_reported(tmp_path: Path) -> None:
    lookups = write_jsonl(tmp_path / "l.jsonl", [engine_record(), lookup(0, 0, 0, 0)])
    messages: list[str] = []
    ingest_dumps([dump_three_batches(tmp_path)], tmp_path / "t.parquet", one_group(),
                 lookups=lookups, report=messages.append)  # fmt: skip
    engine = json.dumps({**two_groups().to_json(), "source": None})
    assert messages[0] == (
        f"{lookups}: the engine's KV-cache config differs from the one recording with "
        f"(engine: {engine}); leave out --config to use the engine's"
    )
    assert open_trace(tmp_path / "t.parquet").config == one_group()


def test_a_restarted_engine_is_a_new_instance_and_a_new_epoch(tmp_path: Path) -> None:
    dump = write_dump(
        tmp_path / "d.kvdump",
        [
            (frames(0, payload(T0, stored([1]))), "live"),
            (frames(1, payload(T0 + 1, stored([2], parent=1))), "live"),
            (frames(0, payload(T0 + 5, stored([3]))), "live"),  # seq back: a restart
        ],
    )
    lookups = write_jsonl(
        tmp_path / "l.jsonl",
        [
            engine_record("e1"),
            lookup(0, 1, 0, 16, instance="e1"),
            engine_record("e2"),
            lookup(0, 0, 0, 0, instance="e2"),
            lookup(1, 0, 1, 16, instance="e2"),
        ],
    )
    summary = ingest_dumps([dump], tmp_path / "t.parquet", None, lookups=lookups,
                           report=lambda m: None)  # fmt: skip
    assert summary.lookups == 3
    assert [(r[1], r[2]) for r in order(tmp_path / "t.parquet")] == [
        ("store", [u64(1)]),
        ("lookup", "r0"),  # e1, before batch 1
        ("store", [u64(2)]),
        ("clear", None),
        ("lookup", "r0"),  # e2, before its batch 0
        ("store", [u64(3)]),
        ("lookup", "r1"),
    ]
    source = open_trace(tmp_path / "t.parquet").config.source or {}
    assert source["lookups"]["engine_instances"] == ["e1", "e2"]
    assert [e["instance"] for e in source["engine"]] == ["e1", "e2"]
