"""The one Mooncake cache model (``replay.rules.mooncake_store``): its
dense-key LRU mode and its keyed mode with an LRU order and unit costs make
the same evictions when keys come one at a time."""

from __future__ import annotations

import numpy as np
import pytest

from replay.rules.eviction import EvictionOrder
from replay.rules.mooncake_store import MooncakeCache


@pytest.mark.parametrize("seed", range(6))
def test_dense_lru_mode_agrees_with_the_keyed_lru_mode(seed: int) -> None:
    rng = np.random.default_rng(seed)
    groups = int(rng.integers(1, 4))
    capacity = int(rng.integers(1, 40))
    # Keys past 2**16 make the dense mode widen its slot ranges mid-run.
    top = int(rng.choice([60, 200, 70_000]))
    keyed_removed: list[tuple[int, int]] = []

    def on_key(kind: str, gid: int, key: object) -> None:
        if kind == "remove":
            assert isinstance(key, int)
            keyed_removed.append((gid, key))

    keyed = MooncakeCache(groups, EvictionOrder("lru"), capacity, [1] * groups, on_key)
    dense = MooncakeCache.dense_lru(groups, capacity)
    dense_removed: list[tuple[int, int]] = []
    for _ in range(600):
        gid = int(rng.integers(groups))
        key = int(rng.integers(top)) if rng.random() < 0.2 else int(rng.integers(50))
        was_absent = key not in keyed.present[gid]
        keyed.put(gid, key)
        absent = dense.touch(gid, np.array([key], dtype=np.int64))
        assert absent.tolist() == [was_absent]
        if dense.count > capacity:
            evicted = dense.evict(dense.count - capacity)
            for g, keys in enumerate(dense.split(evicted)):
                dense_removed.extend((g, int(k)) for k in keys)
        assert dense_removed == keyed_removed
        assert dense.count == keyed.size == sum(len(p) for p in keyed.present)
    for gid in range(groups):
        keys = np.array(sorted(keyed.present[gid]), dtype=np.int64)
        assert dense.present(gid, keys).all()
    assert keyed.evicted == len(dense_removed) > 0
