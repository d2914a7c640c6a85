"""The Mooncake store model of the what-if: a capacity-bounded external key store
with an eviction order (replay.rules.blockpool.EvictionOrder).

The generators and importers keep their own, DenseStore
(replay.sources.dense_store): LRU only, over dense integer keys in numpy
arrays, counting entries rather than bytes. One model for both would change
either's costs or eviction orders, so it waits for a change that proves it
identical on every trace (issue 21)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from replay.rules.blockpool import EvictionOrder


class MooncakeStore:
    """A capacity-bounded external key store with an eviction policy."""

    def __init__(
        self,
        num_groups: int,
        order: EvictionOrder,
        capacity: int,
        costs: Sequence[int],
        on_key: Callable[[str, int, Hashable], None] | None,
    ) -> None:
        self.present: list[set[int]] = [set() for _ in range(num_groups)]
        self.order = order
        self.capacity = capacity
        self.costs = costs
        self.size = 0
        self.on_key = on_key
        self.evicted = 0
        self._num_groups = num_groups

    def item(self, gid: int, key: int) -> int:
        return key * self._num_groups + gid

    def touch(self, gid: int, key: int) -> None:
        item = self.item(gid, key)
        self.order.used(item)
        if self.order.policy != "fifo":
            self.order.discard(item)
            self.order.add(item)

    def put(self, gid: int, key: int) -> None:
        if key in self.present[gid]:
            self.touch(gid, key)
            return
        item = self.item(gid, key)
        self.present[gid].add(key)
        self.order.reset(item)
        self.order.add(item)
        self.size += self.costs[gid]
        if self.on_key is not None:
            self.on_key("store", gid, key)
        while self.size > self.capacity:
            victim = self.order.pop()
            vg, vk = victim % self._num_groups, victim // self._num_groups
            self.present[vg].discard(vk)
            self.size -= self.costs[vg]
            self.evicted += 1
            if self.on_key is not None:
                self.on_key("remove", vg, vk)
