"""First in, first out: the order items' contents arrived (a use does not
move an item; a new content starts it again).

Compiled: a bucket queue (``replay.rules.eviction.queue``) keyed by the
arrival: ``arrive`` stamps an item from ``st``'s counter into its ``side``
row (column ``S_BORN``), ``bucket`` is that stamp. The Python model is
``replay.rules.eviction.order.EvictionOrder``; both meet one contract
(``tests/rules/test_eviction_orders.py``).
"""

from __future__ import annotations

from typing import Any

from replay.base.jit import jit
from replay.rules.eviction.queue import STAMP

#: ``side``'s column of an item's arrival (fifo and lfu share ``side``).
S_BORN = 0


@jit(nogil=True)
def universe(arrivals: int) -> int:
    """The buckets of a run with at most ``arrivals`` arrivals."""
    return arrivals + 2


@jit(nogil=True, inline="always")
def arrive(st: Any, side: Any, item: int) -> None:
    """``item`` holds new content: it arrives now."""
    st[STAMP] += 1
    side[item, S_BORN] = st[STAMP]


@jit(nogil=True, inline="always")
def bucket(side: Any, item: int) -> int:
    return int(side[item, S_BORN])
