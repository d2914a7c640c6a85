"""The eviction orders as the Python models run them (the GPU block pool,
``replay.rules.blockpool``, and the Mooncake store,
``replay.rules.mooncake_store``): one class over every order, a heap of
(priority, add stamp) with lazy deletion (an OrderedDict for LRU).

Each order is defined in its own module (``lru``, ``fifo``, ``lfu``,
``belady`` beside this one), with the compiled steps the what-if's kernels
run; this class and those steps meet one contract
(``tests/rules/test_eviction_orders.py``): the same victims for the same
operations, against one reference.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from replay.base.errors import ReplayError
from replay.rules.eviction.codes import EVICTIONS


class EvictionOrder:
    """The eviction candidates of a cache, in an eviction order.

    ``lru``: the order items were added (vLLM's free-queue tail); ``fifo``:
    the order their content arrived (``reset``); ``lfu``: fewest uses, then
    add order; ``belady``: the furthest next use (``next_use(item, now)``,
    re-asked when the use it was filed under has come), then add order."""

    def __init__(
        self,
        eviction: str,
        next_use: Callable[[int, int], int] | None = None,
        *,
        newest_first: bool = False,
    ) -> None:
        if eviction not in EVICTIONS:
            raise ReplayError(
                f"unknown eviction {eviction!r}, expected one of {', '.join(EVICTIONS)}"
            )
        if eviction == "belady" and next_use is None:
            raise ReplayError("belady eviction needs the trace's future uses")
        self.eviction = eviction
        #: Ties go newest first (else oldest first). Of equally distant keys
        #: the deepest in its prompt should go first, since the hashes chain:
        #: a store adds a prompt's keys shallow to deep (newest first), a
        #: finished request frees its blocks deep to shallow (oldest first).
        self.newest_first = newest_first
        self.now = 0
        self._next_use = next_use
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._heap: list[tuple[int, int, int]] = []
        self._live: dict[int, tuple[int, int, int]] = {}
        self._stamp = 0
        #: fifo and lfu order by arrival and use counts; the others need neither
        self._counts = eviction in ("fifo", "lfu")
        self._born: dict[int, int] = {}
        self._uses: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._lru) if self.eviction == "lru" else len(self._live)

    def reset(self, item: int) -> None:
        """The item holds new content: its arrival and its use count start now."""
        if not self._counts:
            return
        self._stamp += 1
        self._born[item] = self._stamp
        self._uses[item] = 0

    def used(self, item: int) -> None:
        if self._counts:
            self._uses[item] = self._uses.get(item, 0) + 1

    def add(self, item: int) -> None:
        if self.eviction == "lru":
            self._lru[item] = None
            return
        self._stamp += 1
        stamp = -self._stamp if self.newest_first else self._stamp
        entry = (self._priority(item), stamp, item)
        self._live[item] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 4096:
            # Taken-out items leave their entries behind: drop them now and
            # then, or a big cache that rarely evicts grows without bound.
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def _priority(self, item: int) -> int:
        if self.eviction == "fifo":
            return self._born.get(item, 0)
        if self.eviction == "lfu":
            return self._uses.get(item, 0)
        assert self._next_use is not None
        return -self._next_use(item, self.now)

    def refile(self, item: int) -> None:
        """Belady: the item's key is used now; file it under its next use.
        (A stale entry looks needed soonest, so it would never surface.)"""
        if self.eviction == "belady" and item in self._live:
            self.discard(item)
            self.add(item)

    def discard(self, item: int) -> None:
        if self.eviction == "lru":
            self._lru.pop(item, None)
        else:
            self._live.pop(item, None)

    def pop(self) -> int:
        if self.eviction == "lru":
            return self._lru.popitem(last=False)[0]
        while True:
            entry = heapq.heappop(self._heap)
            priority, stamp, item = entry
            if self._live.get(item) is not entry:
                continue
            if self.eviction == "belady" and -priority <= self.now:
                # Filed under a use that has come without touching it: re-file.
                entry = (self._priority(item), stamp, item)
                self._live[item] = entry
                heapq.heappush(self._heap, entry)
                continue
            del self._live[item]
            if self._counts:
                self._born.pop(item, None)
                self._uses.pop(item, None)
            return item
