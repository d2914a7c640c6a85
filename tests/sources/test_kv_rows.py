"""KV events -> trace rows, with copy counting (``replay.sources.kv_rows``)."""

from __future__ import annotations

from types import NoneType
from typing import Any

import pytest

from replay.format.hashwords import PackedHashes
from replay.format.writer import events_table
from replay.sources.kv_config import GroupMismatch
from replay.sources.kv_rows import EventConverter
from replay.sources.kv_wire import decode_batch
from tests import kvpayloads as kv


def convert(conv: EventConverter, ts: float, *events: kv.Event) -> list[dict[str, Any]]:
    return conv.convert(decode_batch(kv.payload(ts, *events)))


def test_a_remove_is_written_only_when_the_last_copy_goes() -> None:
    conv = EventConverter(kv.one_group())
    rows = convert(conv, kv.T0, kv.stored([1, 2]), kv.stored([1]), kv.stored([1], medium="CPU"))
    rows += convert(conv, kv.T0 + 1, kv.removed([1, 2]))  # 2 goes; 1 keeps two copies
    rows += convert(conv, kv.T0 + 2, kv.removed([1]))  # one left (on CPU)
    rows += convert(conv, kv.T0 + 3, kv.stored([1]))  # storing a present key is harmless
    rows += convert(conv, kv.T0 + 4, kv.removed([1], medium="CPU"), kv.removed([1]))
    rows += convert(conv, kv.T0 + 5, kv.removed([7]))  # never seen: written, count stays 0
    assert kv.keyed(rows) == [
        (0, "store", 0, [kv.u64(1), kv.u64(2)], "GPU"),
        (1, "store", 0, [kv.u64(1)], "GPU"),
        (2, "store", 0, [kv.u64(1)], "CPU"),
        (3, "remove", 0, [kv.u64(2)], "GPU"),
        (4, "store", 0, [kv.u64(1)], "GPU"),
        (5, "remove", 0, [kv.u64(1)], "GPU"),
        (6, "remove", 0, [kv.u64(7)], "GPU"),
    ]
    assert [r["ts"] for r in rows] == [kv.at(kv.T0)] * 3 + [kv.at(kv.T0 + t) for t in (1, 3, 4, 5)]
    assert conv.copies == {}


def test_copies_are_counted_per_group() -> None:
    conv = EventConverter(kv.two_groups())
    rows = convert(
        conv, kv.T0, kv.stored([1], group=0), kv.stored([1], group=1), kv.removed([1], group=1)
    )
    assert kv.keyed(rows) == [
        (0, "store", 0, [kv.u64(1)], "GPU"),
        (1, "store", 1, [kv.u64(1)], "GPU"),
        (2, "remove", 1, [kv.u64(1)], "GPU"),
    ]
    assert conv.copies == {(0, kv.u64(1)): 1}


def test_clear_resets_every_count() -> None:
    conv = EventConverter(kv.one_group())
    rows = convert(
        conv, kv.T0, kv.stored([1]), kv.stored([1]), kv.cleared(), kv.stored([1]), kv.removed([1])
    )
    assert kv.keyed(rows) == [
        (0, "store", 0, [kv.u64(1)], "GPU"),
        (1, "store", 0, [kv.u64(1)], "GPU"),
        (2, "clear", None, None, None),
        (3, "store", 0, [kv.u64(1)], "GPU"),
        (4, "remove", 0, [kv.u64(1)], "GPU"),
    ]


def test_medium_filter_keeps_one_tier_and_null_medium_is_gpu() -> None:
    conv = EventConverter(kv.one_group(), media=["gpu"])
    rows = convert(
        conv,
        kv.T0,
        kv.stored([1], medium=None),
        kv.stored([1], medium="cpu"),
        kv.stored([2], medium="GPU"),
        kv.removed([1], medium="CPU"),
        kv.removed([1], medium="GPU"),
    )
    assert kv.keyed(rows) == [
        (0, "store", 0, [kv.u64(1)], None),
        (1, "store", 0, [kv.u64(2)], "GPU"),
        (2, "remove", 0, [kv.u64(1)], "GPU"),
    ]
    assert conv.filtered_events == 2


def test_events_without_group_idx_belong_to_the_only_group() -> None:
    conv = EventConverter(kv.one_group())
    rows = convert(conv, kv.T0, kv.stored([1], group=None, legacy=True))
    assert kv.keyed(rows) == [(0, "store", 0, [kv.u64(1)], "GPU")]


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (kv.stored([1], group=2), "BlockStored names group_idx 2, but the config has 2 KV-cache groups (0..1)"),
        (kv.removed([1], group=None), "BlockRemoved without group_idx, but the config has 2 KV-cache groups (events without group_idx come from single-group models)"),
        (kv.stored([1], group=1, kind="mamba"), "group_idx 1: the publisher says kv_cache_spec_kind 'mamba', but the config's group 1 is sliding_window"),
    ],
)  # fmt: skip
def test_events_that_do_not_fit_the_config_are_fatal(event: kv.Event, message: str) -> None:
    with pytest.raises(GroupMismatch) as info:
        convert(EventConverter(kv.two_groups()), kv.T0, event)
    assert str(info.value) == message


def test_sliding_window_size_is_checked_too() -> None:
    body = kv.enc(
        [
            kv.T0,
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
        EventConverter(kv.two_groups()).convert(decode_batch(body))
    assert str(info.value) == (
        "group_idx 1: the publisher says sliding window 128, but the config's group 1 "
        "has sliding_window 64"
    )


def test_an_integer_hash_and_its_8_bytes_are_one_copy_33() -> None:
    # The live path counts vLLM's integers as they came (no bytes object per
    # hash); a publisher that sends the same key as 8 bytes counts the same copy.
    conv = EventConverter(kv.one_group())
    rows = convert(conv, kv.T0, kv.stored([1, 2]), kv.stored([kv.u64(1), kv.u64(3)]))
    rows += convert(conv, kv.T0 + 1, kv.removed([kv.u64(1), kv.u64(2)]))  # 2 goes; 1 has two
    rows += convert(conv, kv.T0 + 2, kv.removed([1, 3]))
    assert kv.keyed(rows) == [
        (0, "store", 0, [kv.u64(1), kv.u64(2)], "GPU"),
        (1, "store", 0, [kv.u64(1), kv.u64(3)], "GPU"),
        (2, "remove", 0, [kv.u64(2)], "GPU"),
        (3, "remove", 0, [kv.u64(1), kv.u64(3)], "GPU"),
    ]
    assert conv.copies == {}


def test_packed_rows_make_the_table_the_listed_rows_make_33() -> None:
    config = kv.one_group()
    conv = EventConverter(config)
    wide: list[bytes | int] = [bytes([i]) * 32 for i in range(3)]
    rows = convert(conv, kv.T0, kv.stored([5, 6, 7]), kv.stored(wide), kv.cleared())
    rows += convert(conv, kv.T0 + 1, kv.removed([6]))
    assert [type(r.get("block_hashes")) for r in rows] == [PackedHashes, PackedHashes, NoneType,
                                                       PackedHashes]  # fmt: skip
    listed = [{**r, "block_hashes": None if r.get("block_hashes") is None else list(r["block_hashes"])}
              for r in rows]  # fmt: skip
    packed = events_table(rows, config)
    assert packed.equals(events_table(listed, config))
    assert packed.column("block_hashes").to_pylist() == [
        [kv.u64(5), kv.u64(6), kv.u64(7)], wide, None, [kv.u64(6)]
    ]  # fmt: skip


def test_a_remove_names_a_hash_twice_or_none_33() -> None:
    # The fast path (no second copy anywhere) and the step-by-step one agree:
    # a repeat in one remove goes twice; an empty remove writes no row.
    conv = EventConverter(kv.one_group())
    rows = convert(conv, kv.T0, kv.stored([1, 2]), kv.removed([1, 1, 2]), kv.removed([]))
    rows += convert(conv, kv.T0 + 1, kv.stored([3]), kv.stored([3]), kv.removed([3, 3, 3]))
    assert kv.keyed(rows) == [
        (0, "store", 0, [kv.u64(1), kv.u64(2)], "GPU"),
        (1, "remove", 0, [kv.u64(1), kv.u64(1), kv.u64(2)], "GPU"),
        (2, "store", 0, [kv.u64(3)], "GPU"),
        (3, "store", 0, [kv.u64(3)], "GPU"),
        (4, "remove", 0, [kv.u64(3), kv.u64(3)], "GPU"),
    ]
    assert conv.copies == {}
