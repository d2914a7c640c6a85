"""vLLM KV-event decoding, copy counting, dumps, ingest and lookup merge.

The wire structs below restate vLLM 0.33.0's layout (``EventBatch`` is an
array; events are tagged maps; releases before mid-2026 sent events as
arrays, tag first, fields in declaration order) so the tests encode exactly
what a publisher sends. ``test_record_vllm.py`` checks against vLLM itself.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner, Result

from replay.cli.sources import ingest
from replay.errors import ConfigError, ReplayError, TraceError
from replay.sources.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventConverter,
    GroupMismatch,
    KVBatch,
    LookupMerger,
    MalformedBatch,
    decode_batch,
    load_config,
    read_lookup_log,
)
from replay.sources.record import DUMP_MAGIC, DumpWriter, read_dump
from replay.spec import GroupKind, GroupSpec, TraceConfig
from replay.trace import open_trace, write_trace

# ------------------------------------------------------------ wire layout

Hash = bytes | int


class WireBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class WireStored(_Event, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class WireRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class WireCleared(_Event, tag="AllBlocksCleared"):
    pass


class _LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class LegacyStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class LegacyRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class LegacyCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


def stored(
    hashes: list[Hash],
    *,
    group: int | None = 0,
    medium: str | None = "GPU",
    parent: Hash | None = None,
    legacy: bool = False,
    kind: str | None = None,
) -> msgspec.Struct:
    cls = LegacyStored if legacy else WireStored
    return cls(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=kind,
    )


def removed(
    hashes: list[Hash], *, group: int | None = 0, medium: str | None = "GPU", legacy: bool = False
) -> msgspec.Struct:
    cls = LegacyRemoved if legacy else WireRemoved
    return cls(block_hashes=hashes, medium=medium, group_idx=group)


def cleared(*, legacy: bool = False) -> msgspec.Struct:
    return LegacyCleared() if legacy else WireCleared()


def payload(ts: float, *events: msgspec.Struct, rank: int | None = 0) -> bytes:
    return msgspec.msgpack.encode(WireBatch(ts=ts, events=list(events), data_parallel_rank=rank))


def u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


def frames(seq: int, body: bytes, topic: bytes = b"") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), body]


T0 = 1_800_000_000.0


def at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def two_groups() -> TraceConfig:
    return TraceConfig(
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
            GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=64),
        ),
        hash_block_size=16,
        scheduler_block_size=16,
    )


def one_group() -> TraceConfig:
    return load_config(None, 16)


def keyed(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (r["seq"], r["kind"], r.get("group_id"), r.get("block_hashes"), r.get("medium"))
        for r in rows
    ]


# ----------------------------------------------------------------- decode


def test_decode_map_events_as_vllm_0_33_sends_them() -> None:
    body = payload(
        T0,
        stored([b"\xab" * 32, 7], group=1, parent=None, kind="sliding_window"),
        removed([7], group=1),
        cleared(),
        rank=3,
    )
    assert decode_batch(body) == KVBatch(
        ts=T0,
        events=(
            BlockStored(
                block_hashes=(b"\xab" * 32, u64(7)),
                num_token_ids=32,
                block_size=16,
                medium="GPU",
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
            ),
            BlockRemoved(block_hashes=(u64(7),), medium="GPU", group_idx=1),
            AllBlocksCleared(),
        ),
        data_parallel_rank=3,
    )


def test_decode_legacy_array_events_gives_the_same_batch() -> None:
    maps = payload(T0, stored([1, 2], parent=9, group=1), removed([2], group=1), cleared())
    arrays = payload(
        T0,
        stored([1, 2], parent=9, group=1, legacy=True),
        removed([2], group=1, legacy=True),
        cleared(legacy=True),
    )
    assert msgspec.msgpack.decode(arrays)[1][0][:3] == ["BlockStored", [1, 2], 9]
    assert decode_batch(arrays) == decode_batch(maps)
    assert decode_batch(arrays).events[0] == BlockStored(
        block_hashes=(u64(1), u64(2)),
        parent_block_hash=u64(9),
        num_token_ids=32,
        block_size=16,
        medium="GPU",
        group_idx=1,
    )


def test_decode_the_design_doc_example_and_a_batch_without_rank() -> None:
    doc = msgspec.msgpack.encode(
        [
            1796069996.58,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"\x01" * 32, 7],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3],
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "group_idx": 1,
                },
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
            ],
            0,
        ]
    )
    batch = decode_batch(doc)
    assert batch.time == datetime(2026, 11, 30, 20, 19, 56, 580000, tzinfo=UTC)
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved"]
    assert batch.events[1] == BlockRemoved(block_hashes=(u64(7),), medium="GPU")
    # msgspec writes an unset rank as nil; a two-element array is accepted too.
    assert decode_batch(payload(T0, cleared(), rank=None)).data_parallel_rank is None
    assert decode_batch(_enc([T0, [["AllBlocksCleared"]]])).events == (AllBlocksCleared(),)


def test_unknown_event_types_are_ignored_one_by_one() -> None:
    body = msgspec.msgpack.encode(
        [T0, [{"type": "BlockPinned", "x": 1}, ["BlockMoved", 1], {"type": "AllBlocksCleared"}]]
    )
    batch = decode_batch(body)
    assert batch.events == (AllBlocksCleared(),)
    assert batch.ignored_types == ("BlockPinned", "BlockMoved")


def _enc(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "payload is not msgpack (Input data was truncated)"),
        (b"\xc1", "payload is not msgpack (MessagePack data is malformed: invalid opcode '\\xc1' (byte 0))"),
        (b"\x91" * 100_000, "payload is not a KV-event batch (nested too deeply)"),
        (_enc({"ts": 1}), "payload is not a KV-event batch (expected an array [ts, events, data_parallel_rank], got map)"),
        (_enc([T0]), "payload is not a KV-event batch (expected an array [ts, events, data_parallel_rank], got an array of 1)"),
        (_enc(["now", []]), "batch ts: expected a number of seconds, got str"),
        (_enc([1e300, []]), "batch ts: 1e+300 is not a valid time in seconds"),
        (_enc([T0, {}]), "batch events: expected an array, got map"),
        (_enc([T0, [], "0"]), "batch data_parallel_rank: expected an integer, got str"),
        (_enc([T0, [5]]), "event 0: expected a map or an array, got int"),
        (_enc([T0, [{"block_hashes": []}]]), "event 0: map without a 'type' key"),
        (_enc([T0, [[]]]), "event 0: empty array (expected the type tag first)"),
        (_enc([T0, [[3, []]]]), "event 0: type tag must be a string, got int"),
        (_enc([T0, [{"type": "BlockRemoved", "medium": "GPU"}]]), "event 0 (BlockRemoved): missing field 'block_hashes'"),
        (_enc([T0, [{"type": "BlockRemoved", "block_hashes": "ab"}]]), "event 0 (BlockRemoved): field 'block_hashes': expected an array of block hashes, got str"),
        (_enc([T0, [["BlockRemoved", [1, 2.5]]]]), "event 0 (BlockRemoved): field 'block_hashes'[1]: expected bytes or an unsigned 64-bit integer, got float"),
        (_enc([T0, [["BlockRemoved", [-3]]]]), "event 0 (BlockRemoved): field 'block_hashes'[0]: hash -3 is not an unsigned 64-bit integer"),
        (_enc([T0, [{"type": "BlockStored", "block_hashes": [1], "group_idx": -1}]]), "event 0 (BlockStored): field 'group_idx': expected an integer >= 0, got -1"),
        (_enc([T0, [{"type": "BlockStored", "block_hashes": [1], "medium": 1}]]), "event 0 (BlockStored): field 'medium': expected a string, got int"),
        (_enc([T0, [{"type": "AllBlocksCleared"}, ["BlockStored", [1], "p"]]]), "event 1 (BlockStored): field 'parent_block_hash': expected bytes or an unsigned 64-bit integer, got str"),
    ],
)  # fmt: skip
def test_malformed_payloads_say_what_is_wrong(body: bytes, message: str) -> None:
    with pytest.raises(MalformedBatch) as info:
        decode_batch(body)
    assert str(info.value) == message


# ---------------------------------------------------------- copy counting


def convert(conv: EventConverter, ts: float, *events: msgspec.Struct) -> list[dict[str, Any]]:
    return conv.convert(decode_batch(payload(ts, *events)))


def test_a_remove_is_written_only_when_the_last_copy_goes() -> None:
    conv = EventConverter(one_group())
    rows = convert(conv, T0, stored([1, 2]), stored([1]), stored([1], medium="CPU"))
    rows += convert(conv, T0 + 1, removed([1, 2]))  # 2 goes; 1 keeps two copies
    rows += convert(conv, T0 + 2, removed([1]))  # one left (on CPU)
    rows += convert(conv, T0 + 3, stored([1]))  # storing a present key is harmless
    rows += convert(conv, T0 + 4, removed([1], medium="CPU"), removed([1]))
    rows += convert(conv, T0 + 5, removed([7]))  # never seen: written, count stays 0
    assert keyed(rows) == [
        (0, "store", 0, [u64(1), u64(2)], "GPU"),
        (1, "store", 0, [u64(1)], "GPU"),
        (2, "store", 0, [u64(1)], "CPU"),
        (3, "remove", 0, [u64(2)], "GPU"),
        (4, "store", 0, [u64(1)], "GPU"),
        (5, "remove", 0, [u64(1)], "GPU"),
        (6, "remove", 0, [u64(7)], "GPU"),
    ]
    assert [r["ts"] for r in rows] == [at(T0)] * 3 + [at(T0 + t) for t in (1, 3, 4, 5)]
    assert conv.copies == {}


def test_copies_are_counted_per_group() -> None:
    conv = EventConverter(two_groups())
    rows = convert(conv, T0, stored([1], group=0), stored([1], group=1), removed([1], group=1))
    assert keyed(rows) == [
        (0, "store", 0, [u64(1)], "GPU"),
        (1, "store", 1, [u64(1)], "GPU"),
        (2, "remove", 1, [u64(1)], "GPU"),
    ]
    assert conv.copies == {(0, u64(1)): 1}


def test_clear_resets_every_count() -> None:
    conv = EventConverter(one_group())
    rows = convert(conv, T0, stored([1]), stored([1]), cleared(), stored([1]), removed([1]))
    assert keyed(rows) == [
        (0, "store", 0, [u64(1)], "GPU"),
        (1, "store", 0, [u64(1)], "GPU"),
        (2, "clear", None, None, None),
        (3, "store", 0, [u64(1)], "GPU"),
        (4, "remove", 0, [u64(1)], "GPU"),
    ]


def test_medium_filter_keeps_one_tier_and_null_medium_is_gpu() -> None:
    conv = EventConverter(one_group(), media=["gpu"])
    rows = convert(
        conv,
        T0,
        stored([1], medium=None),
        stored([1], medium="cpu"),
        stored([2], medium="GPU"),
        removed([1], medium="CPU"),
        removed([1], medium="GPU"),
    )
    assert keyed(rows) == [
        (0, "store", 0, [u64(1)], None),
        (1, "store", 0, [u64(2)], "GPU"),
        (2, "remove", 0, [u64(1)], "GPU"),
    ]
    assert conv.filtered_events == 2


def test_events_without_group_idx_belong_to_the_only_group() -> None:
    conv = EventConverter(one_group())
    rows = convert(conv, T0, stored([1], group=None, legacy=True))
    assert keyed(rows) == [(0, "store", 0, [u64(1)], "GPU")]


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (stored([1], group=2), "BlockStored names group_idx 2, but the config has 2 KV-cache groups (0..1)"),
        (removed([1], group=None), "BlockRemoved without group_idx, but the config has 2 KV-cache groups (events without group_idx come from single-group models)"),
        (stored([1], group=1, kind="mamba"), "group_idx 1: the publisher says kv_cache_spec_kind 'mamba', but the config's group 1 is sliding_window"),
    ],
)  # fmt: skip
def test_events_that_do_not_fit_the_config_are_fatal(event: msgspec.Struct, message: str) -> None:
    with pytest.raises(GroupMismatch) as info:
        convert(EventConverter(two_groups()), T0, event)
    assert str(info.value) == message


def test_sliding_window_size_is_checked_too() -> None:
    body = _enc(
        [
            T0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "group_idx": 1,
                    "kv_cache_spec_kind": "sliding_window",
                    "kv_cache_spec_sliding_window": 128,
                }
            ],
        ]
    )
    with pytest.raises(GroupMismatch) as info:
        EventConverter(two_groups()).convert(decode_batch(body))
    assert str(info.value) == (
        "group_idx 1: the publisher says sliding window 128, but the config's group 1 "
        "has sliding_window 64"
    )


# ----------------------------------------------------------------- config


def test_load_config_from_json_from_a_trace_and_from_block_size(tmp_path: Path) -> None:
    cfg = two_groups()
    (tmp_path / "kv.json").write_text(json.dumps(cfg.to_json()))
    assert load_config(tmp_path / "kv.json", None) == cfg
    write_trace(tmp_path / "t.parquet", cfg, [])
    assert load_config(tmp_path / "t.parquet", None) == cfg
    single = load_config(None, 32)
    assert single.to_json()["kv_cache_groups"] == [
        {"kind": "full_attention", "block_size": 32, "is_eagle_group": False}
    ]
    assert (single.hash_block_size, single.scheduler_block_size) == (32, 32)


def test_load_config_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"version": 1, "kv_cache_groups": []}))
    cases = [
        ((None, None), "no KV-cache config: pass --config kv-config.json (the replay.trace metadata object) or --block-size N (one full-attention group)"),
        ((str(bad), 16), "pass either --config or --block-size, not both"),
        ((str(tmp_path / "nope.json"), None), f"{tmp_path}/nope.json: no such file"),
        ((str(bad), None), f"{bad}: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        ((str(wrong), None), f"{wrong}: missing field 'hash_block_size'"),
    ]  # fmt: skip
    for args, message in cases:
        with pytest.raises(ConfigError) as info:
            load_config(*args)
        assert str(info.value) == message


# ------------------------------------------------------- dumps and ingest


def write_dump(path: Path, records: list[tuple[list[bytes], str]]) -> Path:
    with DumpWriter(path) as dump:
        for i, (f, origin) in enumerate(records):
            dump.write(f, origin, T0 + 100 + i)
    return path


def run_ingest(args: list[str]) -> Result:
    return CliRunner().invoke(ingest, args, catch_exceptions=False)


def test_dump_layout_is_magic_then_length_prefixed_msgpack(tmp_path: Path) -> None:
    path = write_dump(tmp_path / "d.kvdump", [(frames(0, b"xy", b"kv"), "live")])
    data = path.read_bytes()
    assert data[:8] == DUMP_MAGIC == b"RKVDUMP1"
    length = int.from_bytes(data[8:12], "big")
    assert len(data) == 12 + length
    assert msgspec.msgpack.decode(data[12:]) == [T0 + 100, "live", [b"kv", u64(0), b"xy"]]
    (rec,) = read_dump(path)
    assert (rec.index, rec.offset, rec.origin, rec.frames) == (0, 8, "live", [b"kv", u64(0), b"xy"])
    assert not list(tmp_path.glob(".*.tmp"))


def test_ingest_rebuilds_gaps_restarts_and_skips_from_a_dump(tmp_path: Path) -> None:
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps(one_group().to_json()))
    dump = write_dump(
        tmp_path / "d.kvdump",
        [
            (frames(0, payload(T0, stored([1]))), "replay"),
            (frames(1, payload(T0 + 1, stored([2], legacy=True))), "live"),
            (frames(1, payload(T0 + 1, stored([2], legacy=True))), "live"),  # a repeat
            (frames(3, b"\xc1"), "live"),  # seq 2 missing, seq 3 malformed
            ([b"", b"\x00"], "live"),  # two frames
            (frames(4, payload(T0 + 4, removed([1]))), "live"),
            (frames(1, payload(T0 + 9, stored([8]))), "live"),  # restart, seq 0 missing
            (frames(2, payload(T0 + 10, removed([8]))), "live"),
        ],
    )
    out = tmp_path / "t.parquet"
    result = run_ingest(["kv-events", str(dump), "-o", str(out), "--config", str(cfg)])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "gap: seq 2 missing (1 batch): missing from the dump",
        f"skipped: {dump} record 3: seq 3: payload is not msgpack (MessagePack data is malformed: invalid opcode '\\xc1' (byte 0))",
        f"skipped: {dump} record 4: message has 2 frames, expected 3 (topic, seq, payload)",
        "publisher restart: seq went back from 4 to 1; starting epoch 1 with a clear (a new engine has an empty cache)",
        "gap: seq 0 (epoch 1) missing (1 batch): missing from the dump",
        f"wrote {out}: 6 batches, 6 rows, 2 missing in 2 gaps, 1 publisher restart, 2 malformed skipped",
    ]  # fmt: skip
    trace = open_trace(out)
    rows = trace.read_frame().to_dicts()
    assert keyed(rows) == [
        (0, "store", 0, [u64(1)], "GPU"),
        (1, "store", 0, [u64(2)], "GPU"),
        (2, "remove", 0, [u64(1)], "GPU"),
        (3, "clear", None, None, None),
        (4, "store", 0, [u64(8)], "GPU"),
        (5, "remove", 0, [u64(8)], "GPU"),
    ]
    assert [r["ts"] for r in rows] == [at(T0 + t) for t in (0, 1, 4, 9, 9, 10)]
    source = dict(trace.config.source or {})
    assert source["tool"] == "replay ingest kv-events"
    assert source["files"] == ["d.kvdump"]
    assert source["gaps"] == [
        {"epoch": 0, "first": 2, "last": 2, "count": 1, "reason": "missing from the dump"},
        {"epoch": 1, "first": 0, "last": 0, "count": 1, "reason": "missing from the dump"},
    ]
    assert source["restarts"] == [{"epoch": 1, "previous_last_seq": 4}]
    assert source["epochs"] == [
        {"epoch": 0, "first_seq": 0, "last_seq": 4},
        {"epoch": 1, "first_seq": 1, "last_seq": 2},
    ]
    assert [(s["seq"], s["where"]) for s in source["skipped"]] == [
        (3, f"{dump} record 3"),
        (None, f"{dump} record 4"),
    ]
    assert (source["batches"], source["duplicates"], source["missing_batches"]) == (6, 1, 2)
    assert source["data_parallel_ranks"] == [0]


def test_ingest_several_dumps_as_one_stream(tmp_path: Path) -> None:
    a = write_dump(tmp_path / "a.kvdump", [(frames(0, payload(T0, stored([1]))), "live")])
    b = write_dump(
        tmp_path / "b.kvdump",
        [
            (frames(0, payload(T0, stored([1]))), "live"),  # overlap: a repeat, not a restart
            (frames(1, payload(T0 + 1, removed([1]))), "live"),
        ],
    )
    out = tmp_path / "t.parquet"
    result = run_ingest(["kv-events", str(a), str(b), "-o", str(out), "--block-size", "16"])
    assert result.exit_code == 0, result.output
    assert keyed(open_trace(out).read_frame().to_dicts()) == [
        (0, "store", 0, [u64(1)], "GPU"),
        (1, "remove", 0, [u64(1)], "GPU"),
    ]


def test_ingest_errors_are_one_line_with_exit_2_and_no_output(tmp_path: Path) -> None:
    good = write_dump(tmp_path / "good.kvdump", [(frames(0, payload(T0, stored([1]))), "live")])
    notdump = tmp_path / "notdump.bin"
    notdump.write_bytes(b"PAR1 something else")
    badrec = tmp_path / "badrec.kvdump"
    badrec.write_bytes(DUMP_MAGIC + (3).to_bytes(4, "big") + msgspec.msgpack.encode([1, 2]))
    future = tmp_path / "future.kvdump"
    future.write_bytes(b"RKVDUMP2")
    wrong_group = write_dump(
        tmp_path / "g.kvdump", [(frames(0, payload(T0, stored([1], group=3))), "live")]
    )
    out = tmp_path / "out.parquet"
    cases = [
        (["kv-events", str(good), "-o", str(out)], "error: no KV-cache config: pass --config kv-config.json (the replay.trace metadata object) or --block-size N (one full-attention group)"),
        (["kv-events", str(tmp_path / "missing.kvdump"), "-o", str(out), "--block-size", "16"], f"error: {tmp_path}/missing.kvdump: no such file"),
        (["kv-events", str(notdump), "-o", str(out), "--block-size", "16"], f"error: {notdump}: not a KV-event dump (expected the magic bytes RKVDUMP1 at the start; `replay record --dump FILE` writes one)"),
        (["kv-events", str(future), "-o", str(out), "--block-size", "16"], f"error: {future}: dump layout version '2' is not supported (expected RKVDUMP1)"),
        (["kv-events", str(badrec), "-o", str(out), "--block-size", "16"], f"error: {badrec}: record 0 at byte 8: expected a msgpack array [recv_ts, origin, frames]"),
        (["kv-events", str(wrong_group), "-o", str(out), "--block-size", "16"], f"error: {wrong_group} record 0 (seq 0): BlockStored names group_idx 3, but the config has 1 KV-cache group (0..0)"),
        (["kv-events", str(good), "-o", str(good), "--block-size", "16"], f"error: -o {good}: is the input {good}; refusing to overwrite it (give another output path)"),
    ]  # fmt: skip
    for args, message in cases:
        result = run_ingest(args)
        assert (result.exit_code, result.stderr.strip()) == (2, message), args
        assert not out.exists()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert good.read_bytes()[:8] == DUMP_MAGIC


# ----------------------------------------------------------------- lookups


def test_lookups_merge_by_time_before_events_of_the_same_time(tmp_path: Path) -> None:
    trace = tmp_path / "events.parquet"
    write_trace(
        trace,
        one_group(),
        [
            {"seq": 10, "ts": at(T0), "kind": "store", "group_id": 0, "block_hashes": [u64(1)]},
            {
                "seq": 11,
                "ts": at(T0 + 2),
                "kind": "remove",
                "group_id": 0,
                "block_hashes": [u64(1)],
            },
        ],
    )
    log = tmp_path / "lookups.jsonl"
    log.write_text(
        "\n".join(
            json.dumps(o)
            for o in [
                {"request_id": "late", "ts": T0 + 5, "block_hashes": ["00" * 7 + "01"], "max_length": 15},
                {"request_id": "tie", "ts": T0 + 2, "block_hashes": [1, 2], "num_tokens": 32},
                {"request_id": "first", "ts": "2027-01-15T09:00:01+01:00", "block_hashes": [1], "max_length": 0, "observed_hit_tokens": 0},
            ]
        )
        + "\n\n"
    )  # fmt: skip
    out = tmp_path / "merged.parquet"
    result = run_ingest(["merge", str(trace), str(log), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stderr.strip() == f"wrote {out}: 2 events, 3 lookups merged"
    merged = open_trace(out)
    rows = merged.read_frame().to_dicts()
    assert [
        (r["seq"], r["kind"], r["request_id"], r["block_hashes"], r["max_length"], r["num_tokens"])
        for r in rows
    ] == [
        (0, "store", None, [u64(1)], None, None),
        (1, "lookup", "first", [u64(1)], 0, None),
        (2, "lookup", "tie", [u64(1), u64(2)], 31, 32),
        (3, "remove", None, [u64(1)], None, None),
        (4, "lookup", "late", [u64(1)], 15, None),
    ]
    assert rows[1]["ts"] == datetime(2027, 1, 15, 8, 0, 1, tzinfo=UTC)
    assert rows[1]["observed_hit_tokens"] == 0
    assert (merged.config.source or {})["lookups"]["count"] == 3


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1]", "line 2: expected a JSON object, got array"),
        ('{"ts": 1, "block_hashes": []}', "line 2: missing field 'request_id'"),
        ('{"request_id": "r", "ts": "soon", "block_hashes": [], "max_length": 0}', "line 2: field 'ts': 'soon' is not an ISO 8601 time"),
        ('{"request_id": "r", "ts": 1, "block_hashes": [1.5], "max_length": 0}', "line 2: field 'block_hashes'[0]: expected an unsigned 64-bit integer or a hex string, got float"),
        ('{"request_id": "r", "ts": 1, "block_hashes": ["xyz"], "max_length": 0}', "line 2: field 'block_hashes'[0]: 'xyz' is not a hex string"),
        ('{"request_id": "r", "ts": 1, "block_hashes": [1]}', "line 2: missing field 'max_length' (or 'num_tokens', giving num_tokens - 1)"),
        ('{"request_id": "r", "ts": 1, "block_hashes": [1], "max_length": 32}', "line 2: max_length 32 exceeds what its 1 block_hashes cover (expected below (len(block_hashes) + 1) * hash_block_size = 32)"),
        ("{oops", "line 2: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ],
)  # fmt: skip
def test_lookup_log_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    log = tmp_path / "l.jsonl"
    log.write_text('{"request_id": "ok", "ts": 1, "block_hashes": [], "max_length": 0}\n' + line)
    with pytest.raises(ReplayError) as info:
        read_lookup_log(log, one_group())
    assert str(info.value) == f"{log}: {message}"


def test_merge_needs_ts_on_every_event() -> None:
    merger = LookupMerger([])
    with pytest.raises(TraceError) as info:
        merger.feed([{"seq": 4, "ts": None, "kind": "clear"}], where="t.parquet")
    assert str(info.value) == (
        "t.parquet: seq 4: no ts (lookups are merged by time, so every event needs one)"
    )


def test_ingest_with_lookups_merges_them(tmp_path: Path) -> None:
    dump = write_dump(
        tmp_path / "d.kvdump",
        [
            (frames(0, payload(T0, stored([1]))), "live"),
            (frames(1, payload(T0 + 1, stored([2], parent=1))), "live"),
        ],
    )
    log = tmp_path / "l.jsonl"
    log.write_text(
        json.dumps({"request_id": "r", "ts": T0 + 0.5, "block_hashes": [1, 2], "max_length": 31})
    )
    out = tmp_path / "t.parquet"
    result = run_ingest(
        ["kv-events", str(dump), "-o", str(out), "--block-size", "16", "--lookups", str(log)]
    )
    assert result.exit_code == 0, result.output
    trace = open_trace(out)
    assert [(r["seq"], r["kind"], r["request_id"]) for r in trace.read_frame().to_dicts()] == [
        (0, "store", None),
        (1, "lookup", "r"),
        (2, "store", None),
    ]
    assert (trace.config.source or {})["lookups"]["count"] == 1
