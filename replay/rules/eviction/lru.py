"""Least recently used: the order items were queued, oldest out first.

For the GPU pool that is vLLM's free queue (``FreeKVCacheBlockQueue``): a
freed cached block goes to the tail, allocation pops the head, a hit takes
its block out (``touch``). For the Mooncake store, a touched key goes to the
tail again. Compiled: one doubly linked list over ``replay.rules.eviction.queue``'s
``nodes`` and ``st`` (``N_IN`` 1 while queued, -1 ends the list), run by both
what-if kernels (``replay.whatif.pool_kernel``, ``replay.whatif.mooncake_kernel``).
The Python model is ``replay.rules.eviction.order.EvictionOrder``; both meet
one contract (``tests/rules/test_eviction_orders.py``).
"""

from __future__ import annotations

from typing import Any

from replay.base.jit import jit
from replay.rules.eviction.queue import HEAD, LEN, N_IN, N_NEXT, N_PREV, TAIL


@jit(nogil=True, inline="always")
def append(st: Any, nodes: Any, item: int) -> None:
    """Queue ``item`` at the tail (nothing when it is queued)."""
    if nodes[item, N_IN]:
        return
    nodes[item, N_IN] = 1
    t = st[TAIL]
    nodes[item, N_PREV] = t
    nodes[item, N_NEXT] = -1
    if t >= 0:
        nodes[t, N_NEXT] = item
    else:
        st[HEAD] = item
    st[TAIL] = item
    st[LEN] += 1


@jit(nogil=True, inline="always")
def unlink(st: Any, nodes: Any, item: int) -> None:
    """Take ``item`` out (nothing when it is not queued)."""
    if not nodes[item, N_IN]:
        return
    nodes[item, N_IN] = 0
    p, n = nodes[item, N_PREV], nodes[item, N_NEXT]
    if p >= 0:
        nodes[p, N_NEXT] = n
    else:
        st[HEAD] = n
    if n >= 0:
        nodes[n, N_PREV] = p
    else:
        st[TAIL] = p
    st[LEN] -= 1


@jit(nogil=True, inline="always")
def pop(st: Any, nodes: Any) -> int:
    """The head (least recently queued), taken out (the list is not empty)."""
    item = int(st[HEAD])
    unlink(st, nodes, item)
    return item
