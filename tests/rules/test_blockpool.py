"""Exact values of the GPU block-pool model: the free queue's order, key
copies, early frees, admission (vLLM 0.33.0's ``BlockPool`` and managers)."""

from __future__ import annotations

import hashlib

import pytest

from replay.base.errors import ConfigError, ReplayError
from replay.rules.blockpool import BlockPool, GpuCache
from replay.rules.eviction import EvictionOrder
from replay.rules.store_rules import StoreSettings
from replay.sources.archetypes import archetype_config


def pool(capacity: int, eviction: str = "lru") -> BlockPool:
    return BlockPool(capacity, 1, EvictionOrder(eviction))


def test_allocation_takes_never_used_blocks_in_id_order_and_skips_the_null_block() -> None:
    p = pool(4)
    assert p.allocate(3) == [1, 2, 3]
    assert p.num_free() == 1


def test_freed_unhashed_blocks_are_reused_first_cached_ones_last() -> None:
    p = pool(6)
    a = p.allocate(4)  # 1 2 3 4
    p.cache(a[0], 0, "h1")
    p.cache(a[1], 0, "h2")
    p.free(reversed(a))  # 4 3 unhashed to the front (4 first), 2 1 cached to the tail
    # Front: 4, 3, then never-used 5, 6, then cached in free order: 2, 1.
    assert p.allocate(6) == [4, 3, 5, 6, 2, 1]
    assert p.copies[0] == {}
    assert p.evicted_blocks == 2


def test_a_cached_block_is_evicted_only_when_no_unhashed_block_is_left() -> None:
    p = pool(3)
    a = p.allocate(1)
    p.cache(a[0], 0, "k")
    p.free(a)
    assert p.allocate(2) == [2, 3]
    assert "k" in p.copies[0]
    assert p.allocate(1) == [1]
    assert "k" not in p.copies[0]


def test_a_key_with_two_copies_survives_the_first_copy_and_hits_take_the_first() -> None:
    events: list[tuple[str, int, object]] = []
    p = BlockPool(4, 1, EvictionOrder("lru"), lambda kind, g, h: events.append((kind, g, h)))
    a = p.allocate(2)
    p.cache(a[0], 0, "k")
    p.cache(a[1], 0, "k")  # a recomputed block whose key is cached
    assert p.copies[0]["k"] == [1, 2]
    assert p.first_copy(0, "k") == 1
    assert events == [("store", 0, "k")]  # the key appears once
    p.free([a[0], a[1]])
    assert p.allocate(3) == [3, 4, 1]  # never-used first, then the older free
    assert p.copies[0]["k"] == [2] and events == [("store", 0, "k")]
    assert p.allocate(1) == [2]
    assert events == [("store", 0, "k"), ("remove", 0, "k")]


def test_touch_takes_a_cached_block_out_of_the_queue_and_free_returns_it_to_the_tail() -> None:
    p = pool(3)
    a = p.allocate(2)
    p.cache(a[0], 0, "x")
    p.cache(a[1], 0, "y")
    p.free(a)  # tail: 1 (x), 2 (y)
    p.touch([1])
    assert p.num_free() == 2
    p.free([1])  # back to the tail behind 2
    assert p.allocate(3) == [3, 2, 1]


@pytest.mark.parametrize(
    ("eviction", "victim"), [("lru", 1), ("fifo", 2), ("lfu", 1), ("belady", 2)]
)
def test_policies_pick_another_victim_among_the_same_cached_blocks(
    eviction: str, victim: int
) -> None:
    future = {1: 5, 2: 9}  # block 1's key is next used by request 5, block 2's by 9
    p = BlockPool(2, 1, EvictionOrder(eviction, lambda block, now: future[block]))
    b1, b2 = p.allocate(2)
    p.cache(b2, 0, "b")  # block 2's content arrived first
    p.cache(b1, 0, "a")
    p.free([b1, b2])
    p.touch([b2])  # a hit on block 2, which then returns to the tail
    p.free([b2])
    # lru: 1 has waited longest; fifo: 2 was hashed first; lfu: 1 was never
    # used; belady: 2's next use is the furthest.
    assert p.allocate(1) == [victim]


def _units(tag: str, n: int) -> list[bytes]:
    out, parent = [], tag.encode()
    for i in range(n):
        parent = hashlib.sha256(parent + bytes([i])).digest()
        out.append(parent)
    return out


def test_full_attention_request_hashes_its_full_blocks_and_frees_them_to_the_tail() -> None:
    config = archetype_config("full", 16)
    cache = GpuCache(config, 10)
    units = _units("p", 4)  # 70 tokens: 4 full blocks + a partial fifth
    first = cache.request(units, 70, 69)
    assert (first.hit_tokens, first.admitted) == (0, True)
    # Blocks 1..5 allocated; 1..4 hashed; freed in reverse: 5 (unhashed) to
    # the front, 4 3 2 1 to the tail.
    assert [cache.pool.first_copy(0, h) for h in units] == [1, 2, 3, 4]
    again = cache.request(units, 70, 69)
    assert again.hit_tokens == 64
    # The resend touched 1..4 and took one new block (5, from the front).
    assert cache.pool.allocate(10) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]


def test_a_prompt_larger_than_the_pool_is_never_admitted() -> None:
    config = archetype_config("full", 16)
    cache = GpuCache(config, 4)
    result = cache.request(_units("big", 5), 80, 79)
    assert (result.admitted, result.hit_tokens) == (False, 0)
    assert cache.pool.num_free() == 4 and cache.pool.copies[0] == {}


def test_sliding_window_blocks_below_the_window_are_freed_at_each_chunk() -> None:
    # Window 17, blocks of 16, 16-token chunks, a 69-token prompt. At the
    # starts of chunks 3, 4 and 5 the window group's oldest block (unhashed
    # at retention 0) goes back to the front and is taken at once by full
    # attention or the window group; only the replay boundary's tail
    # (window block 3) is hashed.
    config = archetype_config("full+swa", 16, sliding_window=17)
    cache = GpuCache(
        config, 20, store_settings=StoreSettings(cache="gpu", max_num_batched_tokens=16)
    )
    units = _units("w", 4)
    assert cache.request(units, 69, 68).admitted
    # Tables: full [1, 3, 2, 4, 5], window [-, -, -, 6, 7]; freed group by
    # group, each in reverse: unhashed 5 then 7 to the front, hashed
    # 4 2 3 1 then 6 to the tail.
    assert [cache.pool.first_copy(0, h) for h in units] == [1, 3, 2, 4]
    assert list(cache.pool.copies[1].values()) == [[6]]
    assert cache.pool.allocate(20) == [7, 5, *range(8, 21), 4, 2, 3, 1, 6]


def test_mamba_frees_each_state_once_the_next_one_is_computed() -> None:
    # Same shape with a Mamba group: one new state block per chunk, the one
    # before freed at the next chunk (unhashed: reused at once); at
    # retention 0 only the state at the replay boundary (64) is hashed.
    config = archetype_config("full+mamba", 16)
    cache = GpuCache(
        config, 12, store_settings=StoreSettings(cache="gpu", max_num_batched_tokens=16)
    )
    units = _units("m", 4)
    result = cache.request(units, 67, 66)
    assert result.admitted and result.completed
    assert list(cache.pool.copies[1].values()) == [[6]]
    assert cache.pool.allocate(12) == [7, 5, *range(8, 13), 4, 2, 3, 1, 6]
    again = GpuCache(
        config, 12, store_settings=StoreSettings(cache="gpu", max_num_batched_tokens=16)
    )
    again.request(units, 67, 66)
    assert again.request(units, 67, 66).hit_tokens == 64


def test_chunked_local_groups_are_refused() -> None:
    with pytest.raises(ConfigError, match="chunked_local_attention"):
        GpuCache(archetype_config("full+chunked", 16), 10)


def test_blocks_larger_than_the_hash_unit_are_refused() -> None:
    with pytest.raises(ConfigError, match="block_size 32 equal to hash_block_size 16"):
        GpuCache(archetype_config("full+swa", 32, 16), 10)


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ReplayError, match="at least one block"):
        pool(0)
