"""The eviction orders as the Python models run them (the GPU block pool,
``replay.rules.blockpool``, and the Mooncake store,
``replay.rules.mooncake_store``): one class over every order, running the
orders' own compiled steps (``lru``, ``fifo``, ``lfu``, ``belady`` beside
this one, over the bucket ``queue``), the steps the what-if's kernels run,
called one by one from Python. So each order is implemented once; this
class only keeps its arrays and grows them as items and buckets come.
``tests/rules/test_eviction_orders.py`` holds it and the steps to the
orders' definition.

Items are any non-negative integers (a block, or a Mooncake store's
``key * groups + group``), queued as item + 1 (the bucket lists end at 0).
The arrays grow by doubling: ``nodes`` and ``side`` with the largest item,
the buckets with the largest arrival (fifo), use count (lfu) or next use
(belady: the buckets count down from a horizon, raised when a next use
reaches it, every queued item's bucket moving with it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from replay.base.errors import ReplayError
from replay.base.jit import jit
from replay.rules.eviction import belady, fifo, lfu, lru, queue
from replay.rules.eviction.codes import BELADY, EVICTION_CODES, EVICTIONS, FIFO, LFU, LRU, NEVER

#: The first size of the arrays (items, buckets, Belady's horizon).
_START = 1024


@jit(nogil=True)
def file(
    ev: int, st: Any, nodes: Any, side: Any, qh: Any, bits: Any, q: int, use: int, first: bool
) -> None:
    """Queue ``q`` in order ``ev``: its arrival (fifo), its uses (lfu) or
    its next use ``use`` (belady) picks the bucket; first among equals
    when ``first``. One compiled call per add from Python."""
    if ev == LRU:
        lru.append(st, nodes, q)
        return
    if ev == FIFO:
        bucket = fifo.bucket(side, q)
    elif ev == LFU:
        bucket = lfu.bucket(side, q)
    else:
        bucket = belady.bucket(use, st[queue.REQUESTS])
    if first:
        queue.add_first(st, nodes, qh, bits, q, bucket)
    else:
        queue.add(st, nodes, qh, bits, q, bucket)


@jit(nogil=True)
def take(ev: int, st: Any, nodes: Any, side: Any, qh: Any, bits: Any, now: int) -> int:
    """The victim of order ``ev``, taken out: ``q``, or ``-q`` when it was
    filed (belady) under a use that has come (the caller re-files it)."""
    if ev == LRU:
        return int(lru.pop(st, nodes))
    bucket = queue.bits_first(st, bits)
    q = int(queue.pop(st, nodes, qh, bits))
    if ev == BELADY and bucket and st[queue.REQUESTS] - bucket <= now:
        return -q
    if ev != BELADY:
        side[q, fifo.S_BORN] = 0
        side[q, lfu.S_USED] = 0
    return q


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
        self._code = EVICTION_CODES[eviction]
        #: fifo and lfu order by arrival and use counts; the others need neither
        self._counts = eviction in ("fifo", "lfu")
        # st[REQUESTS] is Belady's horizon: a next use u files in bucket
        # horizon - u (never: 0), so the furthest is the lowest bucket.
        self._st = queue.new_state(_START)
        self._horizon = _START
        self._rows = _START
        self._nodes = np.zeros((_START, queue.NODE_COLS), dtype=np.int64)
        self._side = np.zeros((_START if self._counts else 1, 2), dtype=np.int64)
        self._nbuckets = 1 if eviction == "lru" else 2 * _START
        self._qh = np.zeros((self._nbuckets, 2), dtype=np.int64)
        self._bits = queue.bits_init(self._st, self._nbuckets)

    def __len__(self) -> int:
        return int(self._st[queue.LEN])

    def _room(self, q: int) -> None:
        """Rows for queued item ``q``."""
        size = max(q + 1, 2 * self._rows)
        self._nodes = _grown(self._nodes, size)
        if self._counts:
            self._side = _grown(self._side, size)
        self._rows = size

    def _buckets(self, bucket: int) -> None:
        """Room for ``bucket``: more buckets, the bitset made anew over them."""
        if bucket < self._nbuckets:
            return
        self._nbuckets = max(bucket + 1, 2 * self._nbuckets)
        self._qh = _grown(self._qh, self._nbuckets)
        self._rebit()

    def _rebit(self) -> None:
        self._bits = queue.bits_init(self._st, self._nbuckets)
        for b in np.flatnonzero(self._qh[:, 0]):
            queue.bits_set(self._st, self._bits, int(b))

    def _later(self, use: int) -> None:
        """Belady: a horizon past next use ``use``; every queued item's
        bucket (but never's, 0) moves up with it."""
        old = self._horizon
        shift = max(use + 1, 2 * old) - old
        self._horizon = old + shift
        self._buckets(self._horizon)
        qh = self._qh
        qh[1 + shift :] = qh[1 : qh.shape[0] - shift].copy()
        qh[1 : 1 + shift] = 0
        filed = self._nodes[:, queue.N_IN] > 1
        self._nodes[filed, queue.N_IN] += shift
        self._st[queue.REQUESTS] = self._horizon
        self._rebit()

    def reset(self, item: int) -> None:
        """The item holds new content: its arrival and its use count start now."""
        if not self._counts:
            return
        q = item + 1
        if q >= self._rows:
            self._room(q)
        fifo.arrive(self._st, self._side, q)
        lfu.arrive(self._side, q)
        if self._st[queue.STAMP] >= self._nbuckets:
            self._buckets(int(self._st[queue.STAMP]))

    def used(self, item: int) -> None:
        if self._counts:
            q = item + 1
            if q >= self._rows:
                self._room(q)
            lfu.used(self._side, q)
            if self._side[q, lfu.S_USED] >= self._nbuckets:
                self._buckets(int(self._side[q, lfu.S_USED]))

    def add(self, item: int) -> None:
        q = item + 1
        if q >= self._rows:
            self._room(q)
        if self._code == LRU:
            lru.append(self._st, self._nodes, q)
            return
        use = 0
        if self._next_use is not None and self._code == BELADY:
            use = self._next_use(item, self.now)
            if self._horizon <= use < NEVER:
                self._later(use)
        file(self._code, self._st, self._nodes, self._side, self._qh, self._bits, q, use,
             self.newest_first)  # fmt: skip

    def refile(self, item: int) -> None:
        """Belady: the item's key is used now; file it under its next use.
        (A stale entry looks needed soonest, so it would never surface.)"""
        q = item + 1
        if self._code == BELADY and q < self._rows and self._nodes[q, queue.N_IN]:
            self.discard(item)
            self.add(item)

    def discard(self, item: int) -> None:
        q = item + 1
        if q >= self._rows:
            return
        if self._code == LRU:
            lru.unlink(self._st, self._nodes, q)
        else:
            queue.unlink(self._st, self._nodes, self._qh, self._bits, q)

    def pop(self) -> int:
        if not self._st[queue.LEN]:
            raise IndexError("pop from an empty eviction order")
        if self._code == LRU:
            return int(lru.pop(self._st, self._nodes)) - 1
        while True:
            q = take(self._code, self._st, self._nodes, self._side, self._qh, self._bits, self.now)
            if q > 0:
                return int(q) - 1
            # Filed under a use that has come without touching it: re-file.
            self.add(-q - 1)


def _grown(rows: Any, size: int) -> Any:
    """``rows`` with zero rows up to ``size``."""
    out = np.zeros((size, rows.shape[1]), dtype=rows.dtype)
    out[: rows.shape[0]] = rows
    return out
