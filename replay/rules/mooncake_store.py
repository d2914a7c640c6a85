"""The one model of the Mooncake store (the ``mooncake`` cache): a
capacity-bounded external key cache. Named a cache, as ``--cache mooncake``
does: in this project "store" is the event-sourced key state of a trace
(replay.rules.store).

Two modes of the one model:
- keyed (``MooncakeCache``): any eviction order
  (replay.rules.eviction.EvictionOrder), per-group byte costs, key
  callbacks, evicting as each key comes; the what-if.
- dense-key LRU (``MooncakeCache.dense_lru`` -> ``DenseLru``): small dense
  integer keys in numpy arrays, each entry costing one, vectorised per
  request, evicting after a request's touches; the generators and importers
  (``replay.sources.workload``).
With an LRU order, unit costs and keys one at a time the two make the same
evictions (tests/rules/test_mooncake_store.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from replay.base.deprecation import renamed
from replay.base.errors import ReplayError
from replay.rules.eviction import EvictionOrder

#: Unit keys (small dense non-negative integers), as the sources hash them.
Keys = npt.NDArray[np.int64]
EMPTY_KEYS: Keys = np.zeros(0, dtype=np.int64)


class MooncakeCache:
    """A capacity-bounded external key cache with an eviction order."""

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

    @staticmethod
    def dense_lru(groups: int, capacity: int | None) -> DenseLru:
        """The dense-key LRU mode: ``groups`` groups of small dense integer
        keys, each entry costing one, ``capacity`` entries (None: unbounded)."""
        return DenseLru(groups, capacity)

    def item(self, gid: int, key: int) -> int:
        return key * self._num_groups + gid

    def touch(self, gid: int, key: int) -> None:
        item = self.item(gid, key)
        self.order.used(item)
        if self.order.eviction != "fifo":
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


class DenseLru:
    """``MooncakeCache``'s dense-key LRU mode (``MooncakeCache.dense_lru``):
    the present ``(group, key)`` entries and, with a capacity, their LRU order.
    Every entry costs one; the caller evicts, after a request's touches, as
    many entries as exceed the capacity (``evict``).

    Unit keys are small dense integers, so an entry is a flag in an array: at
    ``(group << shift) | key``, each group owning a slot range of
    ``2 ** shift`` keys, widened when a larger key comes (group 0's index is
    the key itself). The LRU order is an append-only touch log with lazy
    deletion: a log entry is live iff its entry is present and was not
    touched again later. A request costs a few vectorised operations per
    group, or scalar ones for a group with a handful of keys (Mamba)."""

    def __init__(self, groups: int, capacity: int | None) -> None:
        self.groups = groups
        self.capacity = capacity
        self.count = 0
        self.shift = 16
        tracked = 1 << 16 if capacity is not None else 0
        self._present = np.zeros(groups << self.shift, dtype=bool)
        # A log position per entry; the log is compacted to about twice the
        # live entries, so positions fit 32 bits.
        self._last = np.zeros(groups << self.shift if tracked else 0, dtype=np.int32)
        self._log = np.zeros(tracked, dtype=np.int64)
        self._pos = np.arange(tracked, dtype=np.int32)  # log positions, preallocated
        self._head = 0
        self._len = 0

    def _restride(self, top: int) -> None:
        """Widen every group's slot range so that key ``top`` fits."""
        old, new = self.shift, max(self.shift + 1, top.bit_length())
        width = 1 << old

        def widen(arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
            out = np.zeros(self.groups << new, dtype=arr.dtype)
            for g in range(self.groups):
                out[g << new : (g << new) + width] = arr[g << old : (g + 1) << old]
            return out

        self._present = widen(self._present)
        if self.capacity is not None:
            self._last = widen(self._last)
            live = self._log[self._head : self._len]
            self._log[self._head : self._len] = ((live >> old) << new) | (live & (width - 1))
        self.shift = new

    def _live(self, window: Keys, start: int) -> npt.NDArray[np.bool_]:
        live: npt.NDArray[np.bool_] = self._present[window] & (
            self._last[window] == self._pos[start : start + len(window)]
        )
        return live

    def _compact(self) -> None:
        window = self._log[self._head : self._len]
        keep = window[self._live(window, self._head)]
        self._log[: len(keep)] = keep
        self._last[keep] = self._pos[: len(keep)]
        self._head, self._len = 0, len(keep)

    def _reserve(self, n: int) -> None:
        if self._len + n <= len(self._log):
            return
        if self._len - self._head > 2 * self.count + n:
            self._compact()
        if self._len + n > len(self._log):
            size = max(2 * len(self._log), self._len + n)
            log = np.zeros(size, dtype=np.int64)
            log[: self._len] = self._log[: self._len]
            self._log = log
            if size >= 1 << 31:
                raise ReplayError("store too large: more than 2**31 LRU log entries")
            self._pos = np.arange(size, dtype=np.int32)

    def reserve_keys(self, top: int) -> None:
        """Make room for keys up to ``top`` (an upper bound; saves a scan)."""
        if top >> self.shift:
            self._restride(top)

    def touch(self, gid: int, keys: Keys, top: int | None = None) -> npt.NDArray[np.bool_]:
        """Mark a group's entries present and most recently used, ``keys[0]``
        last (a prompt's head outlives its tail); return which were absent.
        The keys must be distinct; ``top``, when given, bounds them."""
        if len(keys) == 0:
            return np.zeros(0, dtype=bool)
        self.reserve_keys(int(keys.max()) if top is None else top)
        idx = keys if gid == 0 else keys + (gid << self.shift)
        absent = ~self._present[idx]
        self._present[idx] = True
        self.count += int(np.count_nonzero(absent))
        if self.capacity is not None:
            n = len(idx)
            self._reserve(n)
            end = self._len + n
            self._log[self._len : end] = idx[::-1]
            self._last[idx[::-1]] = self._pos[self._len : end]
            self._len = end
        return absent

    def present(self, gid: int, keys: Keys) -> npt.NDArray[np.bool_]:
        """Which of a group's keys are present (no LRU effect)."""
        out = np.zeros(len(keys), dtype=bool)
        inside = keys < (1 << self.shift)
        idx = keys[inside] + (gid << self.shift)
        out[inside] = self._present[idx]
        return out

    def evict(self, n: int) -> Keys:
        """Remove and return the ``n`` least recently used entries, oldest first
        (as ``(group << shift) | key``)."""
        out: list[Keys] = []
        got = 0
        while got < n and self._head < self._len:
            window = self._log[self._head : min(self._len, self._head + 8 * (n - got) + 256)]
            live = np.nonzero(self._live(window, self._head))[0][: n - got]
            taken = window[live]
            self._present[taken] = False
            out.append(taken)
            got += len(taken)
            self._head += int(live[-1]) + 1 if got == n else len(window)
        self.count -= got
        if len(out) == 1:
            return out[0]
        return np.concatenate(out) if out else EMPTY_KEYS

    def split(self, entries: Keys) -> list[Keys]:
        """Entries (as returned by ``evict``) -> each group's keys, in order."""
        if self.groups == 1:
            return [entries]
        others = np.flatnonzero(entries >> self.shift)
        out = [entries] + [EMPTY_KEYS] * (self.groups - 1)
        if len(others) == 0:
            return out
        mask = (1 << self.shift) - 1
        if len(others) <= 16:
            # Usually a few Mamba states among many attention blocks.
            out[0] = np.delete(entries, others)
            rest: list[list[int]] = [[] for _ in range(self.groups)]
            for e in entries[others].tolist():
                rest[e >> self.shift].append(e & mask)
            for g in range(1, self.groups):
                if rest[g]:
                    out[g] = np.array(rest[g], dtype=np.int64)
            return out
        owner = entries >> self.shift
        return [entries[owner == g] & mask for g in range(self.groups)]

    def clear(self) -> None:
        self._present[:] = False
        self._head = self._len = 0
        self.count = 0


#: ``MooncakeStore``, the old name of ``MooncakeCache`` ("store" is the
#: event-sourced key state), kept for outside callers: it warns.
__getattr__ = renamed(__name__, {"MooncakeStore": ("MooncakeCache", MooncakeCache)})
