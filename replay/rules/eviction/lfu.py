"""Least frequently used: fewest uses since the item's content arrived,
then the order queued.

Compiled: a bucket queue (``replay.rules.eviction.queue``) keyed by the use
count in the item's ``side`` row (column ``S_USED``), zeroed on arrival and
counted by ``used``. The Python model is
``replay.rules.eviction.order.EvictionOrder``; both meet one contract
(``tests/rules/test_eviction_orders.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.base.jit import jit

#: ``side``'s column of an item's uses (fifo and lfu share ``side``).
S_USED = 1


@jit(nogil=True)
def universe(ids: Any, offsets: Any, num_keys: int, uses_per_appearance: int) -> int:
    """The buckets of a run over these requests: one per use count, an item
    used at most ``uses_per_appearance`` times per appearance of its key."""
    counts = np.zeros(num_keys, dtype=np.int32)
    most = 0
    for p in range(offsets[-1]):
        counts[ids[p]] += 1
        most = max(most, counts[ids[p]])
    return most * uses_per_appearance + 2


@jit(nogil=True, inline="always")
def arrive(side: Any, item: int) -> None:
    """``item`` holds new content: no use yet."""
    side[item, S_USED] = 0


@jit(nogil=True, inline="always")
def used(side: Any, item: int) -> None:
    side[item, S_USED] += 1


@jit(nogil=True, inline="always")
def bucket(side: Any, item: int) -> int:
    return int(side[item, S_USED])
