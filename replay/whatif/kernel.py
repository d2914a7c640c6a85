"""The what-if's GPU block pool, compiled: one numba call per run.

A port of ``replay.rules.blockpool.GpuCache`` (the pool, its free queue and
eviction orders) and of the store rules (``replay.rules.store_rules.StoreRules``,
``gpu`` cache, compiled in ``replay.whatif.store_kernel``); each request's
lookup and facts are the replay's own compiled fixed point
(``replay.rules.compiled.answer``, the port of
``replay.rules.coordinator.hybrid.Coordinator.lookup_present`` and
``replay.rules.facts.FactRules``), for the configurations the block
pool covers: every group's block one hash unit, full attention, sliding
window and Mamba (align) groups, with or without EAGLE, under every policy.
The requests come as dense integer ids of their hashes
(``replay.whatif.requests.Requests``), so a key is ``(group, id)`` and the tables
are flat arrays indexed by it.

The Python model stays the specification: ``tests/whatif/test_whatif_kernel.py``
runs both on random streams, configurations, budgets, retention settings,
capacities and evictions and requires every request's hit, every fact
count and the evicted blocks to be equal; the vLLM differential tests run
the compiled path against vLLM's own ``KVCacheManager``. What the kernel
does not cover (``supported`` says why) runs the Python model.

All capacities in one pass (stack distances) is ``replay.whatif.stack``, and
only where it is exact: LRU, one full-attention group, no EAGLE drop, every
prompt fitting the pool, chained hashes and at most two copies of a key (a
recomputed present block: the pass counts the stale copy). In a
hybrid pool a request's hit need not even grow with the capacity (a larger
pool keeps other blocks, the fixed point settles elsewhere, the request
stores other Mamba states or window tails): ``tests/whatif/test_whatif_kernel.py``
finds such a request on random streams for full + Mamba and full + sliding
window. Everything outside that class is simulated, compiled, capacity by
capacity.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.base.jit import jit
from replay.rules.compiled import answer
from replay.rules.compiled.finders import cdiv
from replay.rules.compiled.lookup import R_LEN
from replay.rules.compiled.tables import O_GROUPS, O_HIT, O_LOADED, O_MASK, O_WIDTH
from replay.rules.eviction import belady, fifo, lfu, queue
from replay.rules.eviction.codes import BELADY, FIFO, LFU, LRU, NEVER
from replay.whatif.intern import intern_hashes
from replay.whatif.kernel_config import (
    FA,
    FACT_ATTENTION,
    FACT_GROUPS,
    FACT_HIT,
    FACT_WIDTH,
    MAMBA,
    NOT_ADMITTED,
    P_A,
    P_ALIGN,
    P_BUDGET,
    P_CAPACITY,
    P_EVICTION,
    P_HBS,
    P_MAX_MODEL_LEN,
    P_NUM_KEYS,
    P_USES_JUNCTION,
    PREEMPTED,
    STOPPED,
    SWA,
    KernelConfig,
    compile_config,
    shape_supported,
    supported,
)
from replay.whatif.store_kernel import cacheable, chunk_ends, stores

__all__ = [
    "FA",
    "FACT_ATTENTION",
    "FACT_GROUPS",
    "FACT_HIT",
    "FACT_WIDTH",
    "MAMBA",
    "NOT_ADMITTED",
    "PREEMPTED",
    "P_A",
    "P_ALIGN",
    "P_HBS",
    "P_NUM_KEYS",
    "P_USES_JUNCTION",
    "STOPPED",
    "SWA",
    "KernelConfig",
    "compile_config",
    "intern_hashes",
    "run_gpu",
    "shape_supported",
    "supported",
]

# ---------------------------------------------------------------- the pool's arrays
#
# Columns of ``blk`` (one row per block, its fields side by side): first the
# eviction order's (``replay.rules.eviction.queue``'s ``nodes``: the cached
# free blocks queued in the run's order), then the block's key, group,
# reference count and its key's other copies.
B_LPREV, B_LNEXT, B_INLIST = queue.N_PREV, queue.N_NEXT, queue.N_IN
B_KEY, B_GROUP, B_REF, B_HNEXT, B_HPREV = range(queue.NODE_COLS, queue.NODE_COLS + 5)
B_COLS = queue.NODE_COLS + 5
# The helpers take the few 2-D arrays, not one view per field, and the
# orders' steps are inlined where they run: every array argument of a call
# costs two atomic reference counts (numba's inlining keeps them), which
# measured 60% of a run when a call per freed block passed fifteen. So the
# LRU list's three steps (``replay.rules.eviction.lru``: append, unlink,
# pop) are written out below where they run per block: as calls they made
# an LRU run over twice as slow (a 20,000-request full + Mamba trace), and
# the run's phases stay in this one loop: as per-chunk calls (a split into
# a pool module) they cost an LRU run 15-20% more CPU.
# ``test_whatif_kernel`` holds this copy to the Python model,
# ``test_eviction_orders`` the module's to the orders' definition.


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


# ---------------------------------------------------------------- the run


@jit(nogil=True)
def run_gpu(
    params: Any,
    groups: Any,
    lookup_params: Any,
    specs: Any,
    members: Any,
    lookup_groups: Any,
    ids: Any,
    offsets: Any,
    num_tokens: Any,
    max_length: Any,
    future: Any,
    hits: Any,
    facts: Any,
    stats: Any,
    control: Any,
) -> int:
    """Every request through one pool. ``control[0]`` counts the requests
    done (for a progress display); a nonzero ``control[1]`` stops the run
    (returns ``STOPPED``). ``hits[i]``: the request's hit
    tokens, ``NOT_ADMITTED`` or ``PREEMPTED``; ``stats``: evicted blocks.
    ``future`` (belady only): per unit of ``ids``, the next request whose
    prompt holds its hash (``NEVER``: none). Returns -1, or the request whose first chunk found too few blocks (the
    Python model raises there too)."""
    num_groups = groups.shape[0]
    num_specs = specs.shape[0]
    hbs = params[P_HBS]
    capacity = params[P_CAPACITY]
    num_keys = params[P_NUM_KEYS]
    ev = params[P_EVICTION]
    budget = params[P_BUDGET]
    max_model_len = params[P_MAX_MODEL_LEN]
    nblocks = capacity + 1
    requests = offsets.shape[0] - 1
    max_u = 0
    max_n = 0
    for i in range(requests):
        max_u = max(max_u, offsets[i + 1] - offsets[i])
        max_n = max(max_n, num_tokens[i])
    # --- the pool
    # Per block, its fields side by side (the ``B_*`` columns).
    blk = np.zeros((nblocks, B_COLS), dtype=np.int32)
    key = blk[:, B_KEY]
    kgroup = blk[:, B_GROUP]
    ref = blk[:, B_REF]
    hnext = blk[:, B_HNEXT]
    hprev = blk[:, B_HPREV]
    lprev = blk[:, B_LPREV]
    lnext = blk[:, B_LNEXT]
    # fifo's arrivals and lfu's uses, per block
    side = np.zeros((nblocks if ev in (FIFO, LFU) else 1, 2), dtype=np.int64)
    for b in range(nblocks):
        key[b] = -1
        hnext[b] = -1
        hprev[b] = -1
        lprev[b] = -1
        lnext[b] = -1
    # Per key and group: its first and last copy (-1: none); a hash's groups
    # side by side, so one probe reads every group's.
    kt = np.full(2 * num_keys * num_groups, -1, dtype=np.int32)
    # the unhashed deque, a ring
    ring = np.zeros(nblocks + 1, dtype=np.int32)
    rmod = nblocks + 1
    rhead = 0
    rlen = 0
    for b in range(1, nblocks):
        ring[rlen] = b
        rlen += 1
    # the cached order
    st = queue.new_state(requests)
    buckets = universe(ev, ids, offsets, num_groups, num_keys)
    # per bucket its first and last block (0: empty), and the bitset
    qh = np.zeros((buckets, 2), dtype=np.int32)
    bits = queue.bits_init(st, buckets)
    # belady: per key, its next use after the request running (or the
    # last one that held it: the same request)
    knext = np.full(num_keys if ev == BELADY else 1, NEVER, dtype=np.int64)
    evicted = 0
    # --- per-request scratch
    stride = max_u + 1
    present = np.zeros(num_groups * stride, dtype=np.uint8)
    merged = np.zeros(num_specs * stride, dtype=np.uint8)
    res = np.zeros((num_specs, R_LEN), dtype=np.int64)
    verified = np.zeros(num_specs, dtype=np.int64)
    mask = np.zeros(num_groups, dtype=np.int64)
    loaded = np.zeros(num_groups, dtype=np.int64)
    tables = np.zeros((num_groups, max_u + 2), dtype=np.int64)
    tlen = np.zeros(num_groups, dtype=np.int64)
    tcached = np.zeros(num_groups, dtype=np.int64)
    tlast = np.zeros(num_groups, dtype=np.int64)
    tretired = np.zeros(num_groups, dtype=np.int64)
    stored = np.zeros((num_groups, max_u + 1), dtype=np.int64)
    ends = np.zeros(max_n + 4, dtype=np.int64)
    bounds = np.zeros(4, dtype=np.int64)
    freed = np.zeros(num_groups * (max_u + 2), dtype=np.int64)

    for i in range(requests):
        control[0] = i
        if control[1]:
            return STOPPED
        o = offsets[i]
        u = offsets[i + 1] - o
        n = num_tokens[i]
        ml = max_length[i]
        # --- presence, merged per spec group
        for g in range(num_groups):
            for x in range(u):
                present[g * stride + x] = 1 if kt[2 * (ids[o + x] * num_groups + g)] >= 0 else 0
        longest = answer(
            lookup_params, specs, members, lookup_groups, present, 0, stride, u, ml,
            merged, res, verified, facts, i,
        )  # fmt: skip
        hit = facts[i, O_HIT]
        for g in range(num_groups):
            col = O_GROUPS + O_WIDTH * g
            loaded[g] = facts[i, col + O_LOADED]
            mask[g] = facts[i, col + O_MASK]
        if ev == BELADY:
            # Every copy of the prompt's keys is re-filed under its next
            # use, in the model's order: by group, unit, then copy. Between
            # requests every cached block is queued, and a block is filed
            # under its key's next use, re-filed when that use comes: so the
            # copies are exactly the bucket of this request's use, which is
            # emptied whole (its blocks still marked with it until re-filed;
            # every other bucket is lower: a later use or none).
            for x in range(u):
                knext[ids[o + x]] = future[o + x]
            now = requests - i
            if queue.empty_bucket(st, qh, bits, now):
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
                            b = hnext[b]
        # --- admission (get_num_blocks_to_allocate, whole prompt)
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
                    if ref[b] == 0:
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
                if ref[b] == 0:
                    need += 1
        if need > rlen + st[queue.LEN]:
            hits[i] = NOT_ADMITTED
            continue
        junction = longest if (params[P_USES_JUNCTION] and longest > hit) else 0
        hashed = u * hbs
        num_ends = chunk_ends(params, n, hit, junction, ends)
        stamp = i + 1
        stores(params, groups, n, hit, junction, hashed, ends, num_ends, stored, stamp, bounds)
        for g in range(num_groups):
            tlen[g] = 0
            tcached[g] = 0
            tlast[g] = -1
            tretired[g] = 0
        start = hit
        outcome = hit
        for e in range(num_ends):
            end = ends[e]
            # _remove_skipped
            for g in range(num_groups):
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
                        last = min(skipped // bs, tlen[g])
                        first = max(0, tretired[g])
                        if first < last:
                            for x in range(last - 1, first - 1, -1):
                                if tables[g, x]:
                                    freed[nf] = tables[g, x]
                                    nf += 1
                                    tables[g, x] = 0
                            tretired[g] = last
                    if nf:
                        _free(freed, nf, ev, st, blk, side, qh, bits, knext)
                        rhead, rlen = _ring_after_free(ring, rmod, rhead, rlen, freed, nf)
                    idx = tlast[g]
                    if idx >= 0 and idx < cdiv(start, bs) - 1 and tables[g, idx]:
                        freed[0] = tables[g, idx]
                        tables[g, idx] = 0
                        _free(freed, 1, ev, st, blk, side, qh, bits, knext)
                        rhead, rlen = _ring_after_free(ring, rmod, rhead, rlen, freed, 1)
                    continue
                if skipped <= 0:
                    continue
                last = min(skipped // bs, tlen[g])
                for x in range(last - 1, -1, -1):
                    if not tables[g, x]:
                        break
                    freed[nf] = tables[g, x]
                    nf += 1
                    tables[g, x] = 0
                if nf:
                    _free(freed, nf, ev, st, blk, side, qh, bits, knext)
                    rhead, rlen = _ring_after_free(ring, rmod, rhead, rlen, freed, nf)
            num_free = rlen + st[queue.LEN]
            if start != hit:
                # _running_blocks
                want = 0
                for g in range(num_groups):
                    new = cdiv(end, groups[g, 1]) - tlen[g]
                    if new > 0:
                        want += 1 if groups[g, 0] == MAMBA else new
                if want > num_free:
                    for g in range(num_groups):
                        nf = 0
                        for x in range(tlen[g] - 1, -1, -1):
                            freed[nf] = tables[g, x]
                            nf += 1
                        _free(freed, nf, ev, st, blk, side, qh, bits, knext)
                        rhead, rlen = _ring_after_free(ring, rmod, rhead, rlen, freed, nf)
                    outcome = PREEMPTED
                    break
            if start == hit:
                # _add_hit: touch the hit blocks
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
                            if ref[b] == 0:
                                if ev == LRU:
                                    # lru.unlink (written out: see above)
                                    if blk[b, B_INLIST]:
                                        blk[b, B_INLIST] = 0
                                        p_, n_ = blk[b, B_LPREV], blk[b, B_LNEXT]
                                        if p_ >= 0:
                                            blk[p_, B_LNEXT] = n_
                                        else:
                                            st[queue.HEAD] = n_
                                        if n_ >= 0:
                                            blk[n_, B_LPREV] = p_
                                        else:
                                            st[queue.TAIL] = p_
                                        st[queue.LEN] -= 1
                                else:
                                    queue.unlink(st, blk, qh, bits, b)
                            ref[b] += 1
                            if ev in (FIFO, LFU):
                                lfu.used(side, b)
                    tlen[g] = k
                    tcached[g] = k
            # _allocate
            for g in range(num_groups):
                kind, bs = groups[g, 0], groups[g, 1]
                required = cdiv(end, bs)
                if required <= tlen[g]:
                    continue
                if kind == MAMBA:
                    prev = tlen[g]
                    if prev > 0:
                        tlast[g] = prev - 1
                    while tlen[g] < required - 1:
                        tables[g, tlen[g]] = 0
                        tlen[g] += 1
                count = required - tlen[g]
                if count > rlen + st[queue.LEN]:
                    return i
                for _ in range(count):
                    if rlen > 0:
                        b = ring[rhead]
                        rhead = (rhead + 1) % rmod
                        rlen -= 1
                    elif ev == LRU:
                        # lru.pop: the free queue's head (written out: see above)
                        b = st[queue.HEAD]
                        if blk[b, B_INLIST]:
                            blk[b, B_INLIST] = 0
                            p_, n_ = blk[b, B_LPREV], blk[b, B_LNEXT]
                            if p_ >= 0:
                                blk[p_, B_LNEXT] = n_
                            else:
                                st[queue.HEAD] = n_
                            if n_ >= 0:
                                blk[n_, B_LPREV] = p_
                            else:
                                st[queue.TAIL] = p_
                            st[queue.LEN] -= 1
                    else:
                        b = queue.pop(st, blk, qh, bits)
                        if ev != BELADY:
                            side[b, fifo.S_BORN] = 0
                            side[b, lfu.S_USED] = 0
                    if key[b] >= 0:
                        # _strip
                        kk = 2 * (np.int64(key[b]) * num_groups + kgroup[b])
                        key[b] = -1
                        evicted += 1
                        p, nx = hprev[b], hnext[b]
                        if p >= 0:
                            hnext[p] = nx
                        else:
                            kt[kk] = nx
                        if nx >= 0:
                            hprev[nx] = p
                        else:
                            kt[kk + 1] = p
                        hprev[b] = -1
                        hnext[b] = -1
                    ref[b] = 1
                    tables[g, tlen[g]] = b
                    tlen[g] += 1
            # _cache
            for g in range(num_groups):
                bs = groups[g, 1]
                full = cacheable(params, groups, g, end, hashed) // bs
                if tcached[g] >= full:
                    continue
                for x in range(tcached[g], full):
                    b = tables[g, x]
                    if b and stored[g, x] == stamp and key[b] < 0:
                        h = ids[o + x]
                        kk = 2 * (h * num_groups + g)
                        key[b] = h
                        kgroup[b] = g
                        t = kt[kk + 1]
                        hprev[b] = t
                        hnext[b] = -1
                        if t >= 0:
                            hnext[t] = b
                        else:
                            kt[kk] = b
                        kt[kk + 1] = b
                        if ev in (FIFO, LFU):
                            fifo.arrive(st, side, b)
                            lfu.arrive(side, b)
                tcached[g] = full
            start = end
        if outcome == PREEMPTED:
            hits[i] = PREEMPTED
            continue
        for g in range(num_groups):
            nf = 0
            for x in range(tlen[g] - 1, -1, -1):
                freed[nf] = tables[g, x]
                nf += 1
            _free(freed, nf, ev, st, blk, side, qh, bits, knext)
            rhead, rlen = _ring_after_free(ring, rmod, rhead, rlen, freed, nf)
        hits[i] = hit
    stats[0] = evicted
    control[0] = requests
    return -1


@jit(nogil=True)
def _free(
    freed: Any,
    nf: int,
    ev: int,
    st: Any,
    blk: Any,
    side: Any,
    qh: Any,
    bits: Any,
    knext: Any,
) -> None:
    """``BlockPool.free`` of ``freed[:nf]``, first-to-evict first: the blocks
    reaching no reference go to the order's tail (cached) or, left in
    ``freed`` as ``-b``, wait for ``_ring_after_free`` to put them at the
    deque's front; the others are zeroed."""
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
                    # lru.append: the free queue's tail (written out: see above)
                    if not blk[b, B_INLIST]:
                        blk[b, B_INLIST] = 1
                        t = st[queue.TAIL]
                        blk[b, B_LPREV] = t
                        blk[b, B_LNEXT] = -1
                        if t >= 0:
                            blk[t, B_LNEXT] = b
                        else:
                            st[queue.HEAD] = b
                        st[queue.TAIL] = b
                        st[queue.LEN] += 1
                else:
                    queue.add(st, blk, qh, bits, b, bucket(ev, b, st, blk, side, knext))
        else:
            freed[j] = 0


@jit(nogil=True)
def _ring_after_free(ring: Any, rmod: int, rhead: int, rlen: int, freed: Any, nf: int) -> Any:
    """``unhashed.extendleft(reversed(front))``: the freed unhashed blocks
    (``-b`` in ``freed``) go to the front, the first of them first."""
    for j in range(nf - 1, -1, -1):
        b = freed[j]
        if b < 0:
            rhead = (rhead - 1) % rmod
            ring[rhead] = -b
            rlen += 1
    return rhead, rlen
