"""The compiled containers of the eviction orders, over flat arrays, for the
what-if's kernels (``replay.whatif.kernel``, ``replay.whatif.mooncake_kernel``).

An order's state is three arrays:

- ``st`` (int64, ``ST_LEN``): its scalars: the LRU list's head and tail, the
  queued items (every order's length), fifo's arrival counter, the requests
  of the run (Belady's buckets count down from it), the levels of the bucket
  bitset and each level's offset in ``bits``;
- ``nodes`` (a 2-D int array, one row per item): an item's previous and
  next item in its list and whether (LRU) or in which bucket + 1 (the
  others) it is queued: the columns ``N_PREV``, ``N_NEXT``, ``N_IN``, the
  first columns of a row, so a kernel keeps its own per-item fields beside
  them in the same row;
- for the bucket queue, ``qh`` (per bucket its first and last item, 0: empty)
  and ``bits`` (the bitset of the nonempty buckets).

LRU (``replay.rules.eviction.lru``) is one doubly linked list (-1 ends it).
fifo, lfu and Belady (``fifo``, ``lfu``, ``belady``) are bucket queues, O(1)
per add, unlink and pop (bounded by the bitset's few levels): a bucket per
priority value, each a doubly linked list of its items in the order they
were added (0 ends a list: item 0 is never queued), and a bitset of the
buckets that hold an item, 64-ary, its levels one word per 64 words below,
so the first nonempty bucket is one trailing-zero count per level. The
Python model's order is (priority, add stamp): a later add goes after every
item already queued at its priority, so a bucket's list is that order
exactly (``add``); newest first among equals is ``add_first``.

The steps are inlined where they run (``inline="always"``: measured faster
than a call per block).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros as _trailing_zeros

from replay.base.jit import jit
from replay.rules.compiled.finders import cdiv

#: ``st``'s scalars, by index.
HEAD, TAIL, LEN, STAMP, REQUESTS, LEVELS, LOFF = 0, 1, 2, 3, 4, 5, 6
ST_LEN = LOFF + 8
#: ``nodes``' columns.
N_PREV, N_NEXT, N_IN = 0, 1, 2
NODE_COLS = 3

#: numba's count of a word's trailing zero bits (untyped for mypy)
trailing_zeros: Any = _trailing_zeros


@jit(nogil=True)
def new_state(requests: int) -> Any:
    """An empty order's scalars for a run of ``requests`` requests."""
    st = np.zeros(ST_LEN, dtype=np.int64)
    st[HEAD] = -1
    st[TAIL] = -1
    st[REQUESTS] = requests
    return st


@jit(nogil=True)
def bits_init(st: Any, universe: int) -> Any:
    """The bitset's level offsets (into ``st``) and its zeroed words."""
    levels = 0
    total = 0
    n = universe
    while True:
        w = cdiv(n, 64)
        st[LOFF + levels] = total
        total += w
        levels += 1
        if w == 1:
            break
        n = w
    st[LEVELS] = levels
    return np.zeros(total, dtype=np.uint64)


@jit(nogil=True, inline="always")
def bits_set(st: Any, bits: Any, i: int) -> None:
    for lv in range(st[LEVELS]):
        w = i >> 6
        at = st[LOFF + lv] + w
        word = bits[at]
        bits[at] = word | (np.uint64(1) << np.uint64(i & 63))
        if word != 0:
            return
        i = w


@jit(nogil=True, inline="always")
def bits_clear(st: Any, bits: Any, i: int) -> None:
    for lv in range(st[LEVELS]):
        w = i >> 6
        at = st[LOFF + lv] + w
        word = bits[at] & ~(np.uint64(1) << np.uint64(i & 63))
        bits[at] = word
        if word != 0:
            return
        i = w


@jit(nogil=True, inline="always")
def bits_first(st: Any, bits: Any) -> int:
    """The lowest bucket holding an item (the queue is not empty)."""
    i = 0
    for lv in range(st[LEVELS] - 1, -1, -1):
        word = bits[st[LOFF + lv] + i]
        i = (i << 6) + int(trailing_zeros(word))
    return i


@jit(nogil=True, inline="always")
def add(st: Any, nodes: Any, qh: Any, bits: Any, item: int, bucket: int) -> None:
    """Queue ``item`` last in ``bucket`` (it is not queued)."""
    nodes[item, N_IN] = bucket + 1
    t = qh[bucket, 1]
    nodes[item, N_PREV] = t
    nodes[item, N_NEXT] = 0
    if t:
        nodes[t, N_NEXT] = item
    else:
        qh[bucket, 0] = item
        bits_set(st, bits, bucket)
    qh[bucket, 1] = item
    st[LEN] += 1


@jit(nogil=True, inline="always")
def add_first(st: Any, nodes: Any, qh: Any, bits: Any, item: int, bucket: int) -> None:
    """Queue ``item`` first in ``bucket`` (it is not queued)."""
    nodes[item, N_IN] = bucket + 1
    h = qh[bucket, 0]
    nodes[item, N_PREV] = 0
    nodes[item, N_NEXT] = h
    if h:
        nodes[h, N_PREV] = item
    else:
        qh[bucket, 1] = item
        bits_set(st, bits, bucket)
    qh[bucket, 0] = item
    st[LEN] += 1


@jit(nogil=True, inline="always")
def unlink(st: Any, nodes: Any, qh: Any, bits: Any, item: int) -> None:
    """Take ``item`` out of its bucket (nothing when it is not queued)."""
    if not nodes[item, N_IN]:
        return
    bucket = nodes[item, N_IN] - 1
    nodes[item, N_IN] = 0
    p, n = nodes[item, N_PREV], nodes[item, N_NEXT]
    if p:
        nodes[p, N_NEXT] = n
    else:
        qh[bucket, 0] = n
        if not n:
            bits_clear(st, bits, bucket)
    if n:
        nodes[n, N_PREV] = p
    else:
        qh[bucket, 1] = p
    st[LEN] -= 1


@jit(nogil=True, inline="always")
def pop(st: Any, nodes: Any, qh: Any, bits: Any) -> int:
    """The first item of the lowest nonempty bucket, taken out (the queue
    is not empty)."""
    item = int(qh[bits_first(st, bits), 0])
    unlink(st, nodes, qh, bits, item)
    return item


@jit(nogil=True, inline="always")
def empty_bucket(st: Any, qh: Any, bits: Any, bucket: int) -> bool:
    """Empty ``bucket`` whole, its items left marked as in it (the caller
    re-files every one of them, each counted out of ``LEN`` then); False
    when it held nothing."""
    if not qh[bucket, 0]:
        return False
    qh[bucket, 0] = 0
    qh[bucket, 1] = 0
    bits_clear(st, bits, bucket)
    return True
