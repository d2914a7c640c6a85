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
from replay.rules.compiled.lookup import R_LEN
from replay.rules.compiled.tables import O_GROUPS, O_HIT, O_LOADED, O_MASK, O_WIDTH
from replay.rules.eviction import queue
from replay.rules.eviction.codes import BELADY, FIFO, LFU, NEVER
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
from replay.whatif.pool_kernel import (
    RG_EVICTED,
    RG_LEN,
    T_CACHED,
    T_LAST,
    T_LEN,
    T_RETIRED,
    add_hit,
    admission_blocks,
    allocate,
    cache_blocks,
    free_tables,
    new_pool,
    refile_prompt,
    remove_skipped,
    running_blocks,
    universe,
)
from replay.whatif.store_kernel import chunk_ends, stores

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
    prompt holds its hash (``NEVER``: none). Returns -1, or the request
    whose first chunk found too few blocks (the Python model raises there
    too).

    It makes the pool and the scratch arrays; ``run_requests`` runs the
    requests over them, compiled without reference counts (it allocates
    nothing), so the pool's steps cost no atomic counts per call."""
    num_groups = groups.shape[0]
    num_specs = specs.shape[0]
    num_keys = params[P_NUM_KEYS]
    ev = params[P_EVICTION]
    requests = offsets.shape[0] - 1
    max_u = 0
    max_n = 0
    for i in range(requests):
        max_u = max(max_u, offsets[i + 1] - offsets[i])
        max_n = max(max_n, num_tokens[i])
    # --- the pool (``replay.whatif.pool_kernel``)
    blk, kt, ring, rg = new_pool(params[P_CAPACITY], num_keys, num_groups)
    # fifo's arrivals and lfu's uses, per block
    side = np.zeros((blk.shape[0] if ev in (FIFO, LFU) else 1, 2), dtype=np.int64)
    # the cached free blocks' order
    st = queue.new_state(requests)
    buckets = universe(ev, ids, offsets, num_groups, num_keys)
    # per bucket its first and last block (0: empty), and the bitset
    qh = np.zeros((buckets, 2), dtype=np.int32)
    bits = queue.bits_init(st, buckets)
    # belady: per key, its next use after the request running (or the
    # last one that held it: the same request)
    knext = np.full(num_keys if ev == BELADY else 1, NEVER, dtype=np.int64)
    # --- per-request scratch
    stride = max_u + 1
    present = np.zeros(num_groups * stride, dtype=np.uint8)
    merged = np.zeros(num_specs * stride, dtype=np.uint8)
    asked = np.zeros(num_groups * stride, dtype=np.uint8)
    res = np.zeros((num_specs, R_LEN), dtype=np.int64)
    verified = np.zeros(num_specs, dtype=np.int64)
    mask = np.zeros(num_groups, dtype=np.int64)
    loaded = np.zeros(num_groups, dtype=np.int64)
    # A block table holds the whole prompt's blocks (a block is a hash unit
    # here): past its hashed units by the lookahead's tokens.
    blocks = max(max_u, -(-max_n // params[P_HBS])) + 2
    tables = np.zeros((num_groups, blocks), dtype=np.int64)
    ts = np.zeros((num_groups, 4), dtype=np.int64)
    stored = np.zeros((num_groups, max_u + 1), dtype=np.int64)
    ends = np.zeros(max_n + 4, dtype=np.int64)
    bounds = np.zeros(4, dtype=np.int64)
    freed = np.zeros(num_groups * blocks, dtype=np.int64)
    return int(
        run_requests(
            params, groups, lookup_params, specs, members, lookup_groups, ids, offsets,
            num_tokens, max_length, future, hits, facts, stats, control,
            blk, kt, ring, rg, side, st, qh, bits, knext,
            present, merged, asked, res, verified, mask, loaded, tables, ts, stored, ends, bounds,
            freed,
        )
    )  # fmt: skip


@jit(nogil=True, refcounts=False)
def run_requests(
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
    blk: Any,
    kt: Any,
    ring: Any,
    rg: Any,
    side: Any,
    st: Any,
    qh: Any,
    bits: Any,
    knext: Any,
    present: Any,
    merged: Any,
    asked: Any,
    res: Any,
    verified: Any,
    mask: Any,
    loaded: Any,
    tables: Any,
    ts: Any,
    stored: Any,
    ends: Any,
    bounds: Any,
    freed: Any,
) -> int:
    """``run_gpu``'s requests, one by one, over the pool and the scratch
    arrays it made (``run_gpu`` says what it takes and returns)."""
    num_groups = groups.shape[0]
    hbs = params[P_HBS]
    ev = params[P_EVICTION]
    requests = offsets.shape[0] - 1
    stride = present.shape[0] // num_groups
    for i in range(requests):
        control[0] = i
        if control[1]:
            return STOPPED
        o = offsets[i]
        u = offsets[i + 1] - o
        n = num_tokens[i]
        # --- presence, then the lookup and its facts
        for g in range(num_groups):
            for x in range(u):
                present[g * stride + x] = 1 if kt[2 * (ids[o + x] * num_groups + g)] >= 0 else 0
        junction = answer(
            lookup_params, specs, members, lookup_groups, present, 0, stride, u, max_length[i],
            merged, res, verified, asked, facts, i, params[P_USES_JUNCTION],
        )  # fmt: skip
        hit = facts[i, O_HIT]
        for g in range(num_groups):
            col = O_GROUPS + O_WIDTH * g
            loaded[g] = facts[i, col + O_LOADED]
            mask[g] = facts[i, col + O_MASK]
        if ev == BELADY:
            refile_prompt(st, blk, qh, bits, kt, knext, ids, future, o, u, num_groups, i)
        # --- admission (get_num_blocks_to_allocate, whole prompt)
        need = admission_blocks(
            groups, ids, kt, blk, mask, loaded, o, n, hit,
            params[P_BUDGET], params[P_MAX_MODEL_LEN],
        )  # fmt: skip
        if need > rg[RG_LEN] + st[queue.LEN]:
            hits[i] = NOT_ADMITTED
            continue
        # --- the prefill, chunk by chunk (GpuCache.request)
        hashed = u * hbs
        num_ends = chunk_ends(params, n, hit, junction, ends)
        stamp = i + 1
        stores(params, groups, n, hit, junction, hashed, ends, num_ends, stored, stamp, bounds)
        for g in range(num_groups):
            ts[g, T_LEN] = 0
            ts[g, T_CACHED] = 0
            ts[g, T_LAST] = -1
            ts[g, T_RETIRED] = 0
        start = hit
        outcome = hit
        for e in range(num_ends):
            end = ends[e]
            remove_skipped(
                start, groups, tables, ts, freed, ev, st, blk, side, qh, bits, knext, ring, rg
            )
            if start != hit and running_blocks(end, groups, ts) > rg[RG_LEN] + st[queue.LEN]:
                free_tables(tables, ts, freed, ev, st, blk, side, qh, bits, knext, ring, rg)
                outcome = PREEMPTED
                break
            if start == hit:
                add_hit(
                    hit, groups, mask, loaded, ids, o, kt, tables, ts, ev, st, blk, side, qh, bits
                )
            if not allocate(end, groups, tables, ts, ev, st, blk, side, qh, bits, kt, ring, rg):
                return i
            cache_blocks(
                end,
                hashed,
                stamp,
                params,
                groups,
                tables,
                ts,
                stored,
                ids,
                o,
                ev,
                st,
                blk,
                side,
                kt,
            )
            start = end
        if outcome == PREEMPTED:
            hits[i] = PREEMPTED
            continue
        free_tables(tables, ts, freed, ev, st, blk, side, qh, bits, knext, ring, rg)
        hits[i] = hit
    stats[0] = rg[RG_EVICTED]
    control[0] = requests
    return -1
