"""vLLM's KV events on the wire (``replay.sources.kv_wire``): both event
encodings, unknown types, one-line errors, and vLLM's own encoder.

The payloads are built by hand (``tests.kvpayloads``); the tests marked
``vllm`` encode random batches with vLLM 0.33.0's own Structs and encoder
and check that every field decodes to exactly what vLLM sent.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.sources import kv_wire
from replay.sources.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVBatch,
    MalformedBatch,
    decode_batch,
)
from tests.kvpayloads import T0, cleared, enc, event, payload, removed, stored


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
                block_hashes=(b"\xab" * 32, 7),
                token_ids=tuple(range(32)),
                block_size=16,
                medium="GPU",
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
            ),
            BlockRemoved(block_hashes=(7,), medium="GPU", group_idx=1),
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
        block_hashes=(1, 2),
        parent_block_hash=9,
        token_ids=tuple(range(32)),
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
    assert batch.events[1] == BlockRemoved(block_hashes=(7,), medium="GPU")
    # msgspec writes an unset rank as nil; a two-element array is accepted too.
    assert decode_batch(payload(T0, cleared(), rank=None)).data_parallel_rank is None
    assert decode_batch(enc([T0, [["AllBlocksCleared"]]])).events == (AllBlocksCleared(),)


def test_unknown_event_types_are_ignored_one_by_one() -> None:
    body = msgspec.msgpack.encode(
        [T0, [{"type": "BlockPinned", "x": 1}, ["BlockMoved", 1], {"type": "AllBlocksCleared"}]]
    )
    batch = decode_batch(body)
    assert batch.events == (AllBlocksCleared(),)
    assert batch.ignored_types == ("BlockPinned", "BlockMoved")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "payload is not msgpack (Input data was truncated)"),
        (b"\xc1", "payload is not msgpack (MessagePack data is malformed: invalid opcode '\\xc1' (byte 0))"),
        (b"\x91" * 100_000, "payload is not a KV-event batch (nested too deeply)"),
        (enc({"ts": 1}), "payload is not a KV-event batch (expected an array [ts, events, data_parallel_rank], got map)"),
        (enc([T0]), "payload is not a KV-event batch (expected an array [ts, events, data_parallel_rank], got an array of 1)"),
        (enc(["now", []]), "batch ts: expected a number of seconds, got str"),
        (enc([1e300, []]), "batch ts: 1e+300 is not a valid time in seconds"),
        (enc([T0, {}]), "batch events: expected an array, got map"),
        (enc([T0, [], "0"]), "batch data_parallel_rank: expected an integer, got str"),
        (enc([T0, [5]]), "event 0: expected a map or an array, got int"),
        (enc([T0, [{"block_hashes": []}]]), "event 0: map without a 'type' key"),
        (enc([T0, [[]]]), "event 0: empty array (expected the type tag first)"),
        (enc([T0, [[3, []]]]), "event 0: type tag must be a string, got int"),
        (enc([T0, [{"type": "BlockRemoved", "medium": "GPU"}]]), "event 0 (BlockRemoved): missing field 'block_hashes'"),
        (enc([T0, [{"type": "BlockRemoved", "block_hashes": "ab"}]]), "event 0 (BlockRemoved): field 'block_hashes': expected an array of block hashes, got str"),
        (enc([T0, [["BlockRemoved", [1, 2.5]]]]), "event 0 (BlockRemoved): field 'block_hashes'[1]: expected bytes or an unsigned 64-bit integer, got float"),
        (enc([T0, [["BlockRemoved", [-3]]]]), "event 0 (BlockRemoved): field 'block_hashes'[0]: hash -3 is not an unsigned 64-bit integer"),
        (enc([T0, [{"type": "BlockStored", "block_hashes": [1], "group_idx": -1}]]), "event 0 (BlockStored): field 'group_idx': expected an integer >= 0, got -1"),
        (enc([T0, [{"type": "BlockStored", "block_hashes": [1], "medium": 1}]]), "event 0 (BlockStored): field 'medium': expected a string, got int"),
        (enc([T0, [{"type": "AllBlocksCleared"}, ["BlockStored", [1], "p"]]]), "event 1 (BlockStored): field 'parent_block_hash': expected bytes or an unsigned 64-bit integer, got str"),
    ],
)  # fmt: skip
def test_malformed_payloads_say_what_is_wrong(body: bytes, message: str) -> None:
    with pytest.raises(MalformedBatch) as info:
        decode_batch(body)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (enc([T0, [["BlockStored", [1], None, None, -16]]]), "event 0 (BlockStored): field 'block_size': expected an integer >= 0, got -16"),
        (enc([T0, [["BlockStored", [1], None, "abc"]]]), "event 0 (BlockStored): field 'token_ids': expected an array, got str"),
        (enc([T0, [{"type": "BlockStored", "block_hashes": [b""]}]]), "event 0 (BlockStored): field 'block_hashes'[0]: hash is empty (expected non-empty bytes)"),
        (enc([T0, [{"type": "BlockStored", "block_hashes": ["AQ=="]}]]), "event 0 (BlockStored): field 'block_hashes'[0]: expected bytes or an unsigned 64-bit integer, got str"),
        (enc([T0, [{"type": "BlockStored", "block_hashes": [1], "group_idx": True}]]), "event 0 (BlockStored): field 'group_idx': expected an integer >= 0, got bool"),
        (enc([T0, [{"type": "BlockStored", "block_hashes": [1], "kv_cache_spec_sliding_window": 1.5}]]), "event 0 (BlockStored): field 'kv_cache_spec_sliding_window': expected an integer, got float"),
        (enc([T0, [["BlockRemoved", [1], "GPU", "0"]]]), "event 0 (BlockRemoved): field 'group_idx': expected an integer >= 0, got str"),
        (enc([T0, [{"type": "BlockStored", "block_hashes": [1], "session_id": 5}]]), "event 0 (BlockStored): field 'session_id': expected a string, got int"),
        (enc([True, []]), "batch ts: expected a number of seconds, got bool"),
        (enc([T0, [], True]), "batch data_parallel_rank: expected an integer, got bool"),
        (enc([T0, [], 0, "extra"]), "payload is not a KV-event batch (expected an array [ts, events, data_parallel_rank], got an array of 4)"),
        (enc([float("nan"), []]), "batch ts: nan is not a valid time in seconds"),
        (enc([2**64 - 1, []]), "batch ts: 18446744073709551615 is not a valid time in seconds"),
        (enc([T0, [["BlockStored"]]]), "event 0 (BlockStored): missing field 'block_hashes'"),
    ],
)  # fmt: skip
def test_what_msgspec_refuses_is_said_of_the_field_in_one_line(body: bytes, message: str) -> None:
    """The Structs' own checks (constraints, types), in either form, come out
    as the one-line message the hand-written checks gave."""
    with pytest.raises(MalformedBatch) as info:
        decode_batch(body)
    assert str(info.value) == message


def test_fields_the_replay_never_reads_are_kept_as_sent_and_later_ones_ignored() -> None:
    body = enc(
        [
            T0,
            [
                event("BlockStored", block_hashes=[1], lora_id="x", extra_keys=[[1, "a"]], locality=3),
                ["BlockRemoved", [1], None, 2, "REMOTE", None, "a field of a later release"],
                {"type": "BlockStored", "block_hashes": [2], "token_ids": ["?"], "new_field": 1},
            ],
        ]
    )  # fmt: skip
    assert decode_batch(body).events == (
        BlockStored(block_hashes=(1,), lora_id="x", extra_keys=[[1, "a"]], locality=3),
        BlockRemoved(block_hashes=(1,), group_idx=2, locality="REMOTE"),
        BlockStored(block_hashes=(2,), token_ids=("?",)),
    )


def test_a_batch_decodes_the_same_whatever_its_shape() -> None:
    """The one-call path (a known map-form batch) and the event-by-event path
    (an unknown type among the events) give the same events."""
    events = [stored([1, 2], group=1, kind="mamba"), removed([2]), cleared()]
    fast = decode_batch(payload(T0, *events))
    slow = decode_batch(payload(T0, *events, {"type": "BlockPinned"}))
    assert slow.events == fast.events
    assert (fast.ignored_types, slow.ignored_types) == ((), ("BlockPinned",))


hashes = st.lists(st.binary(min_size=1, max_size=32) | st.integers(0, 2**64 - 1), max_size=4)
media = st.none() | st.sampled_from(["GPU", "CPU", "disk"])
groups = st.none() | st.integers(0, 7)
events = st.one_of(
    st.builds(stored, hashes, group=groups, medium=media, legacy=st.booleans()),
    st.builds(removed, hashes, group=groups, medium=media, legacy=st.booleans()),
    st.builds(cleared, legacy=st.booleans()),
)
# Anything msgpack can hold, to put in place of a value.
hostile = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=3)
    | st.binary(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=6,
)  # fmt: skip


@pytest.mark.slow
@settings(derandomize=True, database=None, max_examples=300, deadline=None)
@given(st.lists(events, max_size=6), st.none() | st.integers(0, 3))
def test_the_one_call_path_and_the_event_by_event_path_agree(
    sent: list[Any], rank: int | None
) -> None:
    body = payload(T0, *sent, rank=rank)
    assert decode_batch(body) == kv_wire._decode_slowly(body)


@pytest.mark.slow
@settings(derandomize=True, database=None, max_examples=500, deadline=None)
@given(events, st.data())
def test_a_hostile_value_anywhere_in_an_event_is_one_line_naming_the_event(
    sent: Any, data: st.DataObject
) -> None:
    keys = (
        list(range(1, len(sent)))
        if isinstance(sent, list)
        else sorted(k for k in sent if k != "type")
    )
    if not keys:
        return
    key = data.draw(st.sampled_from(keys))
    sent[key] = data.draw(hostile)
    try:
        batch = decode_batch(payload(T0, sent))
    except MalformedBatch as exc:
        message = str(exc)
        assert message.startswith(
            f"event 0 ({(sent[0] if isinstance(sent, list) else sent['type'])}): "
        )
        assert "\n" not in message and "$" not in message
    else:
        assert len(batch.events) == 1


# ------------------------------------------------------- against vLLM 0.33


def _random_hash(rng: random.Random) -> bytes | int:
    if rng.random() < 0.5:
        return rng.randrange(1 << 64)
    return rng.randbytes(rng.choice([1, 8, 16, 32]))


def _maybe(rng: random.Random, value: Any) -> Any:
    return value if rng.random() < 0.5 else None


def _random_event(kv: Any, rng: random.Random) -> Any:
    kind = rng.random()
    if kind < 0.1:
        return kv.AllBlocksCleared()
    hashes = [_random_hash(rng) for _ in range(rng.randrange(0, 6))]
    medium = rng.choice([None, "GPU", "CPU", "STORAGE", "disk-7"])
    group = _maybe(rng, rng.randrange(8))
    locality = rng.choice([None, "LOCAL", "REMOTE"])
    ownership = _maybe(rng, f"tier-{rng.randrange(3)}")
    if kind < 0.45:
        return kv.BlockRemoved(
            block_hashes=hashes,
            medium=medium,
            group_idx=group,
            locality=locality,
            ownership=ownership,
        )
    block_size = rng.choice([1, 16, 64, 528])
    tokens = [rng.randrange(1 << 20) for _ in range(rng.randrange(0, 3 * block_size))]
    return kv.BlockStored(
        block_hashes=hashes,
        parent_block_hash=_maybe(rng, _random_hash(rng)),
        token_ids=tokens,
        block_size=block_size,
        lora_id=_maybe(rng, rng.randrange(100)),
        medium=medium,
        lora_name=_maybe(rng, f"adapter-{rng.randrange(9)}"),
        extra_keys=_maybe(rng, [_maybe(rng, ("mm", rng.randrange(99), 16)) for _ in hashes]),
        group_idx=group,
        kv_cache_spec_kind=_maybe(rng, rng.choice(["full_attention", "sliding_window", "mamba"])),
        kv_cache_spec_sliding_window=_maybe(rng, rng.choice([128, 1024, 4096])),
        locality=locality,
        ownership=ownership,
        session_id=_maybe(rng, f"s{rng.randrange(1000)}"),
        lookahead_token_ids=_maybe(rng, [[rng.randrange(99)] for _ in hashes]),
    )


def _plain(value: Any) -> Any:
    """Sequences as lists (vLLM's Structs hold lists, these hold tuples)."""
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _array_form(kv: Any) -> dict[type, type]:
    """vLLM's event classes in the legacy array form: the same Structs,
    ``array_like``, encoded by vLLM's own encoder."""
    return {
        cls: type(cls.__name__, (cls,), {}, array_like=True, tag=cls.__name__)
        for cls in (kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared)
    }


@pytest.mark.vllm
@pytest.mark.parametrize("form", ["map", "array"])
def test_random_batches_from_vllms_encoder_decode_to_exactly_what_it_sent(form: str) -> None:
    kv: Any = pytest.importorskip("vllm.distributed.kv_events")
    encoder = msgspec.msgpack.Encoder()
    arrays = _array_form(kv)
    rng = random.Random(f"kv-wire-{form}")
    events_checked = 0
    for n in range(300):
        sent = [_random_event(kv, rng) for _ in range(rng.randrange(0, 8))]
        if form == "array":
            sent = [arrays[type(e)](**msgspec.structs.asdict(e)) for e in sent]
        rank = _maybe(rng, rng.randrange(4))
        ts = T0 + n + rng.random()
        body = encoder.encode(kv.KVEventBatch(ts=ts, events=sent, data_parallel_rank=rank))
        if form == "array":
            assert all(isinstance(e, list) for e in msgspec.msgpack.decode(body)[1])
        got = decode_batch(body)
        assert (got.ts, got.data_parallel_rank, got.ignored_types) == (ts, rank, ())
        assert len(got.events) == len(sent)
        for theirs, ours in zip(sent, got.events, strict=True):
            assert type(ours).__name__ == type(theirs).__name__.removeprefix("_")
            names = [f.name for f in msgspec.structs.fields(theirs)]
            assert [f.name for f in msgspec.structs.fields(ours)] == names
            assert {k: _plain(getattr(ours, k)) for k in names} == {
                k: _plain(getattr(theirs, k)) for k in names
            }
            events_checked += 1
    assert events_checked > 1000
