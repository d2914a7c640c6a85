"""Belady (offline): the item whose key's next use is furthest ahead goes
first (never used again: before all), then the order queued (the GPU pool)
or newest first (the Mooncake store: of equally distant keys the deepest in
its prompt, since hashes chain and a store adds a prompt's keys shallow to
deep).

An item is filed under its key's next use and re-filed when that use comes.
Compiled: a bucket queue (``replay.rules.eviction.queue``), the bucket
``requests - next use`` (0: never), so the furthest next use is the lowest
bucket; the future is the trace's (``replay.whatif.requests.Requests``:
per unit its next use, or per key its uses, ``next_use``). The Python model
is ``replay.rules.eviction.order.EvictionOrder``; both meet one contract
(``tests/rules/test_eviction_orders.py``).
"""

from __future__ import annotations

from typing import Any

from replay.base.jit import jit
from replay.rules.eviction.codes import NEVER


@jit(nogil=True)
def universe(requests: int) -> int:
    """The buckets of a run of ``requests`` requests: one per request and never."""
    return requests + 1


@jit(nogil=True, inline="always")
def bucket(next_use: int, requests: int) -> int:
    return 0 if next_use >= NEVER else int(requests - next_use)


@jit(nogil=True)
def next_use(uses: Any, use_starts: Any, key: int, now: int) -> int:
    """The first request after ``now`` whose prompt holds hash ``key``
    (``uses[use_starts[key]:use_starts[key + 1]]`` its requests, ascending)."""
    lo, hi = use_starts[key], use_starts[key + 1]
    while lo < hi:
        mid = (lo + hi) >> 1
        if uses[mid] <= now:
            lo = mid + 1
        else:
            hi = mid
    return int(uses[lo]) if lo < use_starts[key + 1] else NEVER
