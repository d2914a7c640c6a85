"""The GPU block pool's compiled steps, for ``replay.whatif.kernel.run_gpu``:
a port of ``replay.rules.blockpool`` (``BlockPool`` and ``GpuCache``'s
per-chunk steps) over flat arrays, the cached free blocks in the run's
eviction order (``replay.rules.eviction``).

The pool is four arrays:

- ``blk`` (int32, one row per block, block 0 the null block): first the
  eviction order's columns (``replay.rules.eviction.queue``'s ``nodes``),
  then the block's key (-1: none), group, reference count and its key's
  next and previous copy (``B_*``);
- ``kt`` (int32): per key and group its first and last copy (-1: none), a
  hash's groups side by side, so one probe reads every group's;
- ``ring`` (int32): the unhashed blocks, a deque in a ring;
- ``rg`` (int64): the ring's head and length and the blocks evicted (``RG_*``).

The order's arrays (``st``, ``qh``, ``bits``, ``side``, ``knext``) are
``replay.rules.eviction.queue``'s; ``knext`` holds Belady's next use per key.
A request's block tables are ``tables`` (per group, 0 the null block) and
``ts`` (per group its ``T_*`` fields: the length, the blocks hashed, the
running Mamba state and the blocks retired).

The steps run the eviction orders' own steps (``replay.rules.eviction``:
``lru``'s list, the bucket ``queue`` of fifo, lfu and Belady), and are
inlined into ``replay.whatif.kernel.run_requests`` (``inline="always"``),
which is compiled without reference counts (``replay.base.jit``'s
``refcounts=False``; they allocate nothing): numba otherwise counts two
atomic references per array for every inlined call whose counts do not
cancel within one block, which made an LRU run over twice as slow through
the ``lru`` steps and per-chunk steps like these 15-20% slower than the
one loop they replace. So measured, an LRU run costs what the one loop
cost and fifo, lfu and Belady runs a third to a quarter of it (a
20,000-request full + Mamba trace). ``test_whatif_kernel`` holds the pool
to the Python model, ``test_eviction_orders`` the orders' steps to their
definition.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.base.jit import jit
from replay.rules.compiled.finders import cdiv
from replay.rules.eviction import belady, fifo, lfu, lru, queue
from replay.rules.eviction.codes import BELADY, FIFO, LFU, LRU
from replay.whatif.kernel_config import MAMBA, SWA
from replay.whatif.store_kernel import cacheable

#: ``blk``'s columns: the order's, then the block's own.
B_LPREV, B_LNEXT, B_INLIST = queue.N_PREV, queue.N_NEXT, queue.N_IN
B_KEY, B_GROUP, B_REF, B_HNEXT, B_HPREV = range(queue.NODE_COLS, queue.NODE_COLS + 5)
B_COLS = queue.NODE_COLS + 5
#: ``rg``'s fields.
RG_HEAD, RG_LEN, RG_EVICTED = 0, 1, 2
#: ``ts``'s columns.
T_LEN, T_CACHED, T_LAST, T_RETIRED = 0, 1, 2, 3


@jit(nogil=True)
def new_pool(capacity: int, num_keys: int, num_groups: int) -> Any:
    """An empty pool of ``capacity`` allocatable blocks: ``blk``, ``kt``,
    ``ring`` (every block unhashed, in order) and ``rg``."""
    nblocks = capacity + 1
    blk = np.zeros((nblocks, B_COLS), dtype=np.int32)
    for b in range(nblocks):
        blk[b, B_KEY] = -1
        blk[b, B_HNEXT] = -1
        blk[b, B_HPREV] = -1
        blk[b, B_LPREV] = -1
        blk[b, B_LNEXT] = -1
    kt = np.full(2 * num_keys * num_groups, -1, dtype=np.int32)
    ring = np.zeros(nblocks + 1, dtype=np.int32)
    rg = np.zeros(3, dtype=np.int64)
    for b in range(1, nblocks):
        ring[rg[RG_LEN]] = b
        rg[RG_LEN] += 1
    return blk, kt, ring, rg


@jit(nogil=True)
def universe(ev: int, ids: Any, offsets: Any, num_groups: int, num_keys: int) -> int:
    """The buckets an order needs for a run of the pool over these requests:
    lfu one per use count (a block is used at most once per appearance of
    its key), fifo one per arrival (at most one per unit and group), belady
    one per request and never."""
    if ev == LFU:
        return int(lfu.universe(ids, offsets, num_keys, 1))
    if ev == FIFO:
        return int(fifo.universe(int(offsets[-1]) * num_groups))
    if ev == BELADY:
        return int(belady.universe(int(offsets.shape[0]) - 1))
    return 1


@jit(nogil=True, inline="always")
def bucket(ev: int, item: int, st: Any, blk: Any, side: Any, knext: Any) -> int:
    """The bucket ``item`` is queued in now: its arrival (fifo), its uses
    (lfu), its key's next use (belady)."""
    if ev == FIFO:
        return int(fifo.bucket(side, item))
    if ev == LFU:
        return int(lfu.bucket(side, item))
    return int(belady.bucket(knext[blk[item, B_KEY]], st[queue.REQUESTS]))


@jit(nogil=True, inline="always", refcounts=False)
def free_blocks(
    freed: Any,
    nf: int,
    ev: int,
    st: Any,
    blk: Any,
    side: Any,
    qh: Any,
    bits: Any,
    knext: Any,
    ring: Any,
    rg: Any,
) -> None:
    """``BlockPool.free`` of ``freed[:nf]``, first-to-evict first: the blocks
    reaching no reference go to the order's tail (cached) or, the first of
    them first, to the unhashed deque's front
    (``unhashed.extendleft(reversed(front))``)."""
    for j in range(nf):
        b = freed[j]
        if b == 0:
            continue
        blk[b, B_REF] -= 1
        if blk[b, B_REF] == 0:
            if blk[b, B_KEY] < 0:
                freed[j] = -b
            else:
                freed[j] = 0
                if ev == LRU:
                    lru.append(st, blk, b)  # vLLM's free queue's tail
                else:
                    queue.add(st, blk, qh, bits, b, bucket(ev, b, st, blk, side, knext))
        else:
            freed[j] = 0
    rmod = ring.shape[0]
    for j in range(nf - 1, -1, -1):
        b = freed[j]
        if b < 0:
            rg[RG_HEAD] = (rg[RG_HEAD] - 1) % rmod
            ring[rg[RG_HEAD]] = -b
            rg[RG_LEN] += 1


@jit(nogil=True, inline="always", refcounts=False)
def refile_prompt(
    st: Any,
    blk: Any,
    qh: Any,
    bits: Any,
    kt: Any,
    knext: Any,
    ids: Any,
    future: Any,
    o: int,
    u: int,
    num_groups: int,
    i: int,
) -> None:
    """Belady, as request ``i`` (units ``ids[o:o + u]``) comes: every copy
    of its prompt's keys is re-filed under its next use, in the model's
    order: by group, unit, then copy. Between requests every cached block is
    queued, and a block is filed under its key's next use, re-filed when
    that use comes: so the copies are exactly the bucket of this request's
    use, which is emptied whole (its blocks still marked with it until
    re-filed; every other bucket is lower: a later use or none)."""
    requests = st[queue.REQUESTS]
    for x in range(u):
        knext[ids[o + x]] = future[o + x]
    now = requests - i
    if not queue.empty_bucket(st, qh, bits, now):
        return
    for g in range(num_groups):
        for x in range(u):
            b = kt[2 * (ids[o + x] * num_groups + g)]
            if b < 0:
                continue
            filed = belady.bucket(future[o + x], requests)
            while b >= 0:
                if blk[b, B_INLIST] == now + 1:
                    st[queue.LEN] -= 1  # out of the emptied bucket
                else:
                    # a hash twice in the prompt: re-filed again
                    queue.unlink(st, blk, qh, bits, b)
                queue.add(st, blk, qh, bits, b, filed)
                b = blk[b, B_HNEXT]


@jit(nogil=True, inline="always", refcounts=False)
def admission_blocks(
    groups: Any,
    ids: Any,
    kt: Any,
    blk: Any,
    mask: Any,
    loaded: Any,
    o: int,
    n: int,
    hit: int,
    budget: int,
    max_model_len: int,
) -> int:
    """``GpuCache._admission_blocks``: ``get_num_blocks_to_allocate`` for
    the whole prompt of ``n`` tokens hitting ``hit``, the admission cap on."""
    num_groups = groups.shape[0]
    need = 0
    for g in range(num_groups):
        kind, bs = groups[g, 0], groups[g, 1]
        nulls = mask[g] - loaded[g]
        count = mask[g]
        required = cdiv(n, bs)
        if kind == MAMBA:
            new = required - count
            need += min(new, 1) if new > 0 else 0
            for x in range(nulls, count):
                b = kt[2 * (ids[o + x] * num_groups + g)]
                if blk[b, B_REF] == 0:
                    need += 1
            continue
        if kind == SWA:
            window = groups[g, 2] - 1 + groups[g, 3] + budget
            cap = cdiv(min(window, max_model_len), bs) + 1
            required = min(required, cap)
            skipped = max(0, hit - groups[g, 2] + 1 - groups[g, 3]) // bs
        else:
            skipped = 0
        need += max(required - max(skipped, count), 0)
        for x in range(max(skipped, nulls), count):
            b = kt[2 * (ids[o + x] * num_groups + g)]
            if blk[b, B_REF] == 0:
                need += 1
    return need


@jit(nogil=True, inline="always", refcounts=False)
def remove_skipped(
    start: int,
    groups: Any,
    tables: Any,
    ts: Any,
    freed: Any,
    ev: int,
    st: Any,
    blk: Any,
    side: Any,
    qh: Any,
    bits: Any,
    knext: Any,
    ring: Any,
    rg: Any,
) -> None:
    """``GpuCache._remove_skipped`` of every group at ``start`` computed
    tokens: the blocks below the sliding window and the Mamba states below
    the computed position go back to the pool."""
    for g in range(groups.shape[0]):
        kind, bs = groups[g, 0], groups[g, 1]
        if kind == MAMBA:
            skipped = start - 1
        elif kind == SWA:
            skipped = max(0, start - groups[g, 2] + 1 - groups[g, 3])
        else:
            continue
        nf = 0
        if kind == MAMBA:
            if skipped > 0:
                last = min(skipped // bs, ts[g, T_LEN])
                first = max(0, ts[g, T_RETIRED])
                if first < last:
                    for x in range(last - 1, first - 1, -1):
                        if tables[g, x]:
                            freed[nf] = tables[g, x]
                            nf += 1
                            tables[g, x] = 0
                    ts[g, T_RETIRED] = last
            if nf:
                free_blocks(freed, nf, ev, st, blk, side, qh, bits, knext, ring, rg)
            idx = ts[g, T_LAST]
            if idx >= 0 and idx < cdiv(start, bs) - 1 and tables[g, idx]:
                freed[0] = tables[g, idx]
                tables[g, idx] = 0
                free_blocks(freed, 1, ev, st, blk, side, qh, bits, knext, ring, rg)
            continue
        if skipped <= 0:
            continue
        last = min(skipped // bs, ts[g, T_LEN])
        for x in range(last - 1, -1, -1):
            if not tables[g, x]:
                break
            freed[nf] = tables[g, x]
            nf += 1
            tables[g, x] = 0
        if nf:
            free_blocks(freed, nf, ev, st, blk, side, qh, bits, knext, ring, rg)


@jit(nogil=True, inline="always", refcounts=False)
def running_blocks(end: int, groups: Any, ts: Any) -> int:
    """``GpuCache._running_blocks``: the blocks the next chunk, up to
    ``end`` tokens, allocates."""
    want = 0
    for g in range(groups.shape[0]):
        new = cdiv(end, groups[g, 1]) - ts[g, T_LEN]
        if new > 0:
            want += 1 if groups[g, 0] == MAMBA else new
    return want


@jit(nogil=True, inline="always", refcounts=False)
def free_tables(
    tables: Any,
    ts: Any,
    freed: Any,
    ev: int,
    st: Any,
    blk: Any,
    side: Any,
    qh: Any,
    bits: Any,
    knext: Any,
    ring: Any,
    rg: Any,
) -> None:
    """A finished (or preempted) request frees group by group in group-id
    order, each table in reverse."""
    for g in range(tables.shape[0]):
        nf = 0
        for x in range(ts[g, T_LEN] - 1, -1, -1):
            freed[nf] = tables[g, x]
            nf += 1
        free_blocks(freed, nf, ev, st, blk, side, qh, bits, knext, ring, rg)


@jit(nogil=True, inline="always", refcounts=False)
def add_hit(
    hit: int,
    groups: Any,
    mask: Any,
    loaded: Any,
    ids: Any,
    o: int,
    kt: Any,
    tables: Any,
    ts: Any,
    ev: int,
    st: Any,
    blk: Any,
    side: Any,
    qh: Any,
    bits: Any,
) -> None:
    """``GpuCache._add_hit`` of every group: the tables start with the hit's
    blocks (the first copy of each key; nulls below the window or the
    resumed Mamba state), each touched: out of the free queue, one more
    reference, one more use."""
    num_groups = groups.shape[0]
    for g in range(num_groups):
        kind, bs = groups[g, 0], groups[g, 1]
        if kind == SWA:
            skipped = max(0, hit - groups[g, 2] + 1 - groups[g, 3]) // bs
        elif kind == MAMBA:
            skipped = (hit - 1) // bs
        else:
            skipped = 0
        nulls = mask[g] - loaded[g]
        # new_computed = [0]*nulls + copies; then [skipped:]
        k = 0
        for _x in range(skipped):
            tables[g, k] = 0
            k += 1
        for x in range(max(skipped, 0), mask[g]):
            b = 0 if x < nulls else kt[2 * (ids[o + x] * num_groups + g)]
            tables[g, k] = b
            k += 1
            if b != 0:
                if blk[b, B_REF] == 0:
                    if ev == LRU:
                        lru.unlink(st, blk, b)
                    else:
                        queue.unlink(st, blk, qh, bits, b)
                blk[b, B_REF] += 1
                if ev in (FIFO, LFU):
                    lfu.used(side, b)
        ts[g, T_LEN] = k
        ts[g, T_CACHED] = k


@jit(nogil=True, inline="always", refcounts=False)
def allocate(
    end: int,
    groups: Any,
    tables: Any,
    ts: Any,
    ev: int,
    st: Any,
    blk: Any,
    side: Any,
    qh: Any,
    bits: Any,
    kt: Any,
    ring: Any,
    rg: Any,
) -> bool:
    """``GpuCache._allocate`` of every group up to ``end`` tokens: new
    blocks from the unhashed deque's front, else the order's victim, its
    key stripped (``BlockPool._strip``). False when a group finds too few
    free blocks (the Python model raises there)."""
    num_groups = groups.shape[0]
    rmod = ring.shape[0]
    # the ring's fields in locals for the loop (stored back below)
    rhead, rlen, evicted = rg[RG_HEAD], rg[RG_LEN], rg[RG_EVICTED]
    for g in range(num_groups):
        kind, bs = groups[g, 0], groups[g, 1]
        required = cdiv(end, bs)
        if required <= ts[g, T_LEN]:
            continue
        if kind == MAMBA:
            prev = ts[g, T_LEN]
            if prev > 0:
                ts[g, T_LAST] = prev - 1
            while ts[g, T_LEN] < required - 1:
                tables[g, ts[g, T_LEN]] = 0
                ts[g, T_LEN] += 1
        count = required - ts[g, T_LEN]
        if count > rlen + st[queue.LEN]:
            rg[RG_HEAD], rg[RG_LEN], rg[RG_EVICTED] = rhead, rlen, evicted
            return False
        for _ in range(count):
            if rlen > 0:
                b = ring[rhead]
                rhead = (rhead + 1) % rmod
                rlen -= 1
            elif ev == LRU:
                b = lru.pop(st, blk)  # the free queue's head
            else:
                b = queue.pop(st, blk, qh, bits)
                if ev != BELADY:
                    side[b, fifo.S_BORN] = 0
                    side[b, lfu.S_USED] = 0
            if blk[b, B_KEY] >= 0:
                # _strip
                kk = 2 * (np.int64(blk[b, B_KEY]) * num_groups + blk[b, B_GROUP])
                blk[b, B_KEY] = -1
                evicted += 1
                p, nx = blk[b, B_HPREV], blk[b, B_HNEXT]
                if p >= 0:
                    blk[p, B_HNEXT] = nx
                else:
                    kt[kk] = nx
                if nx >= 0:
                    blk[nx, B_HPREV] = p
                else:
                    kt[kk + 1] = p
                blk[b, B_HPREV] = -1
                blk[b, B_HNEXT] = -1
            blk[b, B_REF] = 1
            tables[g, ts[g, T_LEN]] = b
            ts[g, T_LEN] += 1
    rg[RG_HEAD], rg[RG_LEN], rg[RG_EVICTED] = rhead, rlen, evicted
    return True


@jit(nogil=True, inline="always", refcounts=False)
def cache_blocks(
    end: int,
    hashed: int,
    stamp: int,
    params: Any,
    groups: Any,
    tables: Any,
    ts: Any,
    stored: Any,
    ids: Any,
    o: int,
    ev: int,
    st: Any,
    blk: Any,
    side: Any,
    kt: Any,
) -> None:
    """``GpuCache._cache`` of every group up to ``end`` tokens: the full
    blocks the store rules store (``stored[g, x] == stamp``) get their key,
    as its last copy (``BlockPool.cache``), their content arriving now."""
    num_groups = groups.shape[0]
    for g in range(num_groups):
        bs = groups[g, 1]
        full = cacheable(params, groups, g, end, hashed) // bs
        if ts[g, T_CACHED] >= full:
            continue
        for x in range(ts[g, T_CACHED], full):
            b = tables[g, x]
            if b and stored[g, x] == stamp and blk[b, B_KEY] < 0:
                h = ids[o + x]
                kk = 2 * (h * num_groups + g)
                blk[b, B_KEY] = h
                blk[b, B_GROUP] = g
                t = kt[kk + 1]
                blk[b, B_HPREV] = t
                blk[b, B_HNEXT] = -1
                if t >= 0:
                    blk[t, B_HNEXT] = b
                else:
                    kt[kk] = b
                kt[kk + 1] = b
                if ev in (FIFO, LFU):
                    fifo.arrive(st, side, b)
                    lfu.arrive(side, b)
        ts[g, T_CACHED] = full
