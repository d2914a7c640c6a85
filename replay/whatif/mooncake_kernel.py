"""The what-if's Mooncake store, compiled: one numba call per run.

A port of the ``mooncake`` branch of ``replay.whatif.sweep.simulate``: the
mirror's lookup (``replay.rules.coordinator`` with the ``mooncake`` cache's
rules), the capacity-bounded key cache (``replay.rules.mooncake_store.MooncakeCache``
with every ``replay.rules.blockpool.EvictionOrder``: lru, fifo, lfu and
belady, deepest first among equals), the stores a request leaves
(``replay.rules.store_rules.StoreRules``, ``mooncake`` cache) and the lookup
facts. It shares the compiled fixed point and facts with the replay
(``replay.rules.compiled.answer``, with the mirror's tables), the Mamba store
rule with the gpu pool (``replay.whatif.store_kernel.stores``: Mamba follows
the engine's rule in both caches) and the requests' interned ids
(``Requests.arrays()``).

Only the common shapes: full-attention and Mamba (align) groups, each block
one hash unit, with or without EAGLE, under a policy whose mirror rules are
vLLM 0.33's (the EAGLE drop once per candidate, with or without Mamba's peek
margin) and whose stores are 0.33's (``replay.rules.coordinator.stores``). ``supported`` says why anything else runs the Python model, which
stays the specification: ``tests/test_whatif_mooncake_kernel.py`` requires
every field of every row and every request's hit to be equal on random
traces, capacities and evictions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from replay.base.errors import ReplayError
from replay.base.jit import jit
from replay.base.spec import GroupKind, TraceConfig
from replay.rules.compiled import answer, lookup_tables
from replay.rules.compiled.finders import cdiv
from replay.rules.compiled.lookup import R_LEN
from replay.rules.compiled.tables import O_GROUPS, O_HIT, O_LOADED, O_MASK, O_WIDTH
from replay.rules.coordinator import DEFAULT_POLICY, get_policy
from replay.rules.coordinator.cache import MIRROR
from replay.rules.coordinator.stores import STORES_033, policy_stores
from replay.rules.store_rules import StoreSettings
from replay.whatif.kernel_config import (
    BELADY,
    EVICTION_CODES,
    FA,
    FACT_GROUPS,
    FACT_WIDTH,
    FIFO,
    LFU,
    LRU,
    MAMBA,
    NEVER,
    P_A,
    P_HBS,
    P_NUM_KEYS,
    P_USES_JUNCTION,
    STOPPED,
    KernelConfig,
    compile_config,
    shape_supported,
)
from replay.whatif.store_kernel import chunk_ends, stores

if TYPE_CHECKING:
    from replay.whatif.requests import Requests

_KINDS = {GroupKind.FULL_ATTENTION: FA, GroupKind.MAMBA: MAMBA}


def supported(config: TraceConfig, policy: str | None = None) -> str | None:
    """Why the compiled Mooncake store cannot run this configuration, or
    None when it can."""
    if policy is not None:
        try:
            rules = get_policy(policy).rules("mooncake")
        except ReplayError as exc:
            return str(exc)
        # Without lookahead hashes the lookahead rule (0.34.0's mirror) changes
        # nothing; with them the kernel's EAGLE groups are the newest mirror's.
        lookahead = (
            rules.lookahead_clears_eagle
            if config.num_hash_lookahead_tokens
            else MIRROR.lookahead_clears_eagle
        )
        if (
            rules.but(
                verify_eagle_once=True, mamba_peek_margin=False, lookahead_clears_eagle=lookahead
            )
            != MIRROR
        ):
            return f"policy {policy}'s mirror rules"
        if policy_stores(policy, "mooncake") != STORES_033:
            return f"policy {policy}'s store rules"
    return shape_supported(config, "mooncake", _KINDS)


def compile_mooncake(
    config: TraceConfig, policy: str, store_settings: StoreSettings, num_keys: int
) -> KernelConfig:
    """The gpu kernel's arrays for the store rules (which do not depend on
    the cache, but for the junction), with the lookup's tables the mirror's."""
    base = compile_config(config, DEFAULT_POLICY, store_settings, "lru", 1, num_keys)
    return KernelConfig(
        params=base.params,
        groups=base.groups,
        lookup=lookup_tables(config, policy, "mooncake"),
    )


# ---------------------------------------------------------------- the order
#
# Items are ``key * groups + group`` (the Python model's). LRU: a doubly
# linked list (``links[item] = prev, next``; ``lst`` head, tail). The others:
# ``EvictionOrder``'s heap of (priority, stamp, item) with lazy deletion,
# ``side`` per item (the ``S_*`` columns), ``st`` its scalars. Entries are
# unique (every add takes a new stamp), so the pop order is the total order
# of the entries, whatever the heap's layout (and compaction keeps it).
_STAMP, _HSIZE, _LIVE, _NOW = 0, 1, 2, 3
#: the live entry's priority and stamp (0: none), the arrival stamp, the uses
S_LIVE_P, S_LIVE_S, S_BORN, S_USED = 0, 1, 2, 3


@jit(nogil=True)
def _next_use(uses: Any, use_starts: Any, key: int, now: int) -> int:
    """The first request after ``now`` whose prompt holds hash ``key``."""
    lo, hi = use_starts[key], use_starts[key + 1]
    while lo < hi:
        mid = (lo + hi) >> 1
        if uses[mid] <= now:
            lo = mid + 1
        else:
            hi = mid
    return int(uses[lo]) if lo < use_starts[key + 1] else NEVER


@jit(nogil=True)
def _before(heap: Any, i: int, p0: int, p1: int, p2: int) -> bool:
    """Entry ``i`` of the heap comes before (p0, p1, p2)."""
    return bool(
        heap[i, 0] < p0
        or (heap[i, 0] == p0 and (heap[i, 1] < p1 or (heap[i, 1] == p1 and heap[i, 2] < p2)))
    )


@jit(nogil=True)
def _heap_down(heap: Any, i: int, n: int) -> None:
    p0, p1, p2 = heap[i, 0], heap[i, 1], heap[i, 2]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _before(heap, c + 1, heap[c, 0], heap[c, 1], heap[c, 2]):
            c += 1
        if not _before(heap, c, p0, p1, p2):
            break
        heap[i, 0], heap[i, 1], heap[i, 2] = heap[c, 0], heap[c, 1], heap[c, 2]
        i = c
    heap[i, 0], heap[i, 1], heap[i, 2] = p0, p1, p2


@jit(nogil=True)
def _heap_push(heap: Any, st: Any, prio: int, stamp: int, item: int) -> None:
    i = st[_HSIZE]
    st[_HSIZE] = i + 1
    while i > 0:
        q = (i - 1) >> 1
        if not _before(heap, q, prio, stamp, item):
            # the parent comes after the new entry: move it down
            heap[i, 0], heap[i, 1], heap[i, 2] = heap[q, 0], heap[q, 1], heap[q, 2]
            i = q
        else:
            break
    heap[i, 0], heap[i, 1], heap[i, 2] = prio, stamp, item


@jit(nogil=True)
def _heap_pop(heap: Any, st: Any) -> tuple[int, int, int]:
    n = st[_HSIZE] - 1
    top = (heap[0, 0], heap[0, 1], heap[0, 2])
    heap[0, 0], heap[0, 1], heap[0, 2] = heap[n, 0], heap[n, 1], heap[n, 2]
    st[_HSIZE] = n
    _heap_down(heap, 0, n)
    return top


@jit(nogil=True)
def _lru_append(links: Any, lst: Any, item: int) -> None:
    t = lst[1]
    links[item, 0] = t
    links[item, 1] = -1
    if t >= 0:
        links[t, 1] = item
    else:
        lst[0] = item
    lst[1] = item


@jit(nogil=True)
def _lru_unlink(links: Any, lst: Any, item: int) -> None:
    p, n = links[item, 0], links[item, 1]
    if p >= 0:
        links[p, 1] = n
    else:
        lst[0] = n
    if n >= 0:
        links[n, 0] = p
    else:
        lst[1] = p


@jit(nogil=True)
def _priority(
    ev: int, item: int, groups: int, side: Any, uses: Any, use_starts: Any, now: int
) -> int:
    if ev == FIFO:
        return int(side[item, S_BORN])
    if ev == LFU:
        return int(side[item, S_USED])
    return -int(_next_use(uses, use_starts, item // groups, now))


@jit(nogil=True)
def _compact(heap: Any, st: Any, side: Any) -> None:
    """Keep the live entries only (the pop order is the same: entries are
    totally ordered by (priority, stamp, item))."""
    n = 0
    for j in range(st[_HSIZE]):
        it = heap[j, 2]
        if side[it, S_LIVE_S] == heap[j, 1] and side[it, S_LIVE_P] == heap[j, 0]:
            heap[n, 0], heap[n, 1], heap[n, 2] = heap[j, 0], heap[j, 1], it
            n += 1
    st[_HSIZE] = n
    for i in range(n // 2 - 1, -1, -1):
        _heap_down(heap, i, n)


@jit(nogil=True)
def _add(
    ev: int,
    item: int,
    groups: int,
    links: Any,
    lst: Any,
    st: Any,
    side: Any,
    heap: Any,
    uses: Any,
    use_starts: Any,
) -> None:
    if ev == LRU:
        _lru_append(links, lst, item)
        return
    st[_STAMP] += 1
    stamp = -st[_STAMP] if ev == BELADY else st[_STAMP]
    prio = _priority(ev, item, groups, side, uses, use_starts, st[_NOW])
    if side[item, S_LIVE_S] == 0:
        st[_LIVE] += 1
    side[item, S_LIVE_P] = prio
    side[item, S_LIVE_S] = stamp
    _heap_push(heap, st, prio, stamp, item)
    if st[_HSIZE] > 2 * st[_LIVE] + 4096:
        _compact(heap, st, side)


@jit(nogil=True)
def _discard(ev: int, item: int, links: Any, lst: Any, st: Any, side: Any) -> None:
    if ev == LRU:
        _lru_unlink(links, lst, item)
        return
    if side[item, S_LIVE_S] != 0:
        side[item, S_LIVE_S] = 0
        st[_LIVE] -= 1


@jit(nogil=True)
def _pop(
    ev: int,
    groups: int,
    links: Any,
    lst: Any,
    st: Any,
    side: Any,
    heap: Any,
    uses: Any,
    use_starts: Any,
) -> int:
    if ev == LRU:
        item = lst[0]
        _lru_unlink(links, lst, item)
        return int(item)
    while True:
        prio, stamp, item = _heap_pop(heap, st)
        if side[item, S_LIVE_S] != stamp or side[item, S_LIVE_P] != prio:
            continue
        if ev == BELADY and -prio <= st[_NOW]:
            # Filed under a use that has come without touching it: re-file.
            p = _priority(ev, item, groups, side, uses, use_starts, st[_NOW])
            side[item, S_LIVE_P] = p
            _heap_push(heap, st, p, stamp, item)
            continue
        side[item, S_LIVE_S] = 0
        st[_LIVE] -= 1
        side[item, S_BORN] = 0
        side[item, S_USED] = 0
        return int(item)


@jit(nogil=True)
def _touch(
    ev: int,
    item: int,
    groups: int,
    links: Any,
    lst: Any,
    st: Any,
    side: Any,
    heap: Any,
    uses: Any,
    use_starts: Any,
) -> None:
    """``MooncakeCache.touch``."""
    if ev in (FIFO, LFU):
        side[item, S_USED] += 1
    if ev != FIFO:
        _discard(ev, item, links, lst, st, side)
        _add(ev, item, groups, links, lst, st, side, heap, uses, use_starts)


# ---------------------------------------------------------------- the run


@jit(nogil=True)
def run_mooncake(
    params: Any,
    groups: Any,
    lookup_params: Any,
    specs: Any,
    members: Any,
    lookup_groups: Any,
    mamba_groups: Any,
    ev: int,
    capacity: int,
    costs: Any,
    ids: Any,
    offsets: Any,
    num_tokens: Any,
    max_length: Any,
    uses: Any,
    use_starts: Any,
    hits: Any,
    facts: Any,
    stats: Any,
    control: Any,
) -> int:
    """Every request through one store. ``hits[i]``: the request's hit
    tokens; ``stats[0]``: evicted entries; ``control`` as ``run_gpu``'s.
    Returns -1, or ``STOPPED``."""
    num_groups = groups.shape[0]
    num_specs = specs.shape[0]
    hbs = params[P_HBS]
    a = params[P_A]
    requests = offsets.shape[0] - 1
    num_keys = params[P_NUM_KEYS]
    items = num_keys * num_groups
    max_u = 0
    max_n = 0
    for i in range(requests):
        max_u = max(max_u, offsets[i + 1] - offsets[i])
        max_n = max(max_n, num_tokens[i])
    pres = np.zeros(items, dtype=np.uint8)
    links = np.full((items if ev == LRU else 1, 2), -1, dtype=np.int64)
    lst = np.full(2, -1, dtype=np.int64)
    side = np.zeros((items if ev != LRU else 1, 4), dtype=np.int64)
    heap = np.zeros((2 * items + 4096 + 8 if ev != LRU else 1, 3), dtype=np.int64)
    st = np.zeros(8, dtype=np.int64)
    size = 0
    evicted = 0
    stride = max_u + 1
    present = np.zeros(num_groups * stride, dtype=np.uint8)
    merged = np.zeros(num_specs * stride, dtype=np.uint8)
    res = np.zeros((num_specs, R_LEN), dtype=np.int64)
    verified = np.zeros(num_specs, dtype=np.int64)
    mask = np.zeros(num_groups, dtype=np.int64)
    loaded = np.zeros(num_groups, dtype=np.int64)
    nm = mamba_groups.shape[0]
    stored = np.zeros((max(nm, 1), max_u + 1), dtype=np.int64)
    ends = np.zeros(max_n + 4, dtype=np.int64)
    bounds = np.zeros(4, dtype=np.int64)
    for i in range(requests):
        control[0] = i
        if control[1]:
            return STOPPED
        o = offsets[i]
        u = offsets[i + 1] - o
        n = num_tokens[i]
        st[_NOW] = i
        for g in range(num_groups):
            for x in range(u):
                present[g * stride + x] = pres[ids[o + x] * num_groups + g]
        if ev == BELADY:
            for g in range(num_groups):
                for x in range(u):
                    item = ids[o + x] * num_groups + g
                    if pres[item] and side[item, S_LIVE_S] != 0:
                        _discard(ev, item, links, lst, st, side)
                        _add(ev, item, num_groups, links, lst, st, side, heap, uses, use_starts)
        longest = answer(
            lookup_params, specs, members, lookup_groups, present, 0, stride, u, max_length[i],
            merged, res, verified, facts, i,
        )  # fmt: skip
        hit = facts[i, O_HIT]
        for g in range(num_groups):
            col = O_GROUPS + O_WIDTH * g
            loaded[g] = facts[i, col + O_LOADED]
            mask[g] = facts[i, col + O_MASK]
        hits[i] = hit
        # The keys the lookup loads are used now.
        for g in range(num_groups):
            for x in range(mask[g] - loaded[g], mask[g]):
                item = ids[o + x] * num_groups + g
                _touch(ev, item, num_groups, links, lst, st, side, heap, uses, use_starts)
        # The stores the request leaves.
        junction = longest if (params[P_USES_JUNCTION] and longest > hit) else 0
        hashed = n // hbs * hbs
        stamp = i + 1
        if nm:
            num_ends = chunk_ends(params, n, hit, junction, ends)
            stores(
                params,
                mamba_groups,
                n,
                hit,
                junction,
                hashed,
                ends,
                num_ends,
                stored,
                stamp,
                bounds,
            )
        k = 0
        for g in range(num_groups):
            bs = groups[g, 1]
            if groups[g, 0] == MAMBA:
                lo, hi = 0, u
            else:
                hi = min(n // a * a, hashed) // bs
                lo = min(hi, cdiv(hit, bs))
            for x in range(lo, min(hi, u)):
                if groups[g, 0] == MAMBA and stored[k, x] != stamp:
                    continue
                item = ids[o + x] * num_groups + g
                if pres[item]:
                    _touch(ev, item, num_groups, links, lst, st, side, heap, uses, use_starts)
                    continue
                pres[item] = 1
                if ev in (FIFO, LFU):
                    st[_STAMP] += 1
                    side[item, S_BORN] = st[_STAMP]
                    side[item, S_USED] = 0
                _add(ev, item, num_groups, links, lst, st, side, heap, uses, use_starts)
                size += costs[g]
                while size > capacity:
                    victim = _pop(ev, num_groups, links, lst, st, side, heap, uses, use_starts)
                    pres[victim] = 0
                    size -= costs[victim % num_groups]
                    evicted += 1
            if groups[g, 0] == MAMBA:
                k += 1
    stats[0] = evicted
    control[0] = requests
    return -1


def run_store(
    requests: Requests,
    policy: str,
    store_settings: StoreSettings,
    eviction: str,
    capacity: int,
    costs: tuple[int, ...],
    control: np.ndarray[Any, np.dtype[np.int64]] | None = None,
) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]], int] | None:
    """One compiled Mooncake run over ``requests`` (``replay.whatif.requests.Requests``):
    per request its hit tokens, its facts (``replay.whatif.kernel``'s
    ``FACT_*`` columns) and the entries evicted; None when ``control[1]``
    stopped it first."""
    config = requests.config
    k = compile_mooncake(config, policy, store_settings, len(requests.digests))
    mamba_rows = [gid for gid, g in enumerate(config.groups) if g.kind is GroupKind.MAMBA]
    mamba_groups = np.ascontiguousarray(k.groups[mamba_rows] if mamba_rows else k.groups[:0])
    if eviction == "belady":
        uses, starts = requests.uses()
    else:
        uses = starts = np.zeros(1, dtype=np.int64)
    hits = np.zeros(len(requests), dtype=np.int64)
    width = FACT_GROUPS + FACT_WIDTH * config.num_groups
    facts = np.zeros((len(requests), width), dtype=np.int64)
    stats = np.zeros(2, dtype=np.int64)
    if control is None:
        control = np.zeros(2, dtype=np.int64)
    done = run_mooncake(
        *k.arrays(),
        mamba_groups,
        EVICTION_CODES[eviction],
        min(capacity, NEVER),
        np.asarray(costs, dtype=np.int64),
        *requests.arrays(),
        uses,
        starts,
        hits,
        facts,
        stats,
        control,
    )
    if done == STOPPED:
        return None
    return hits, facts, int(stats[0])
