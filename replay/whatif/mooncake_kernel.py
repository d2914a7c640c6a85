"""The what-if's Mooncake store, compiled: one numba call per run.

A port of the ``mooncake`` branch of ``replay.whatif.sweep.simulate``: the
mirror's lookup (``replay.rules.coordinator`` with the ``mooncake`` cache's
rules), the capacity-bounded key cache (``replay.rules.mooncake_store.MooncakeCache``
with every eviction order of ``replay.rules.eviction``: lru, fifo, lfu and
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
stays the specification: ``tests/whatif/test_whatif_mooncake_kernel.py`` requires
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
from replay.rules.eviction import belady, fifo, lfu, lru, queue
from replay.rules.eviction.codes import BELADY, EVICTION_CODES, FIFO, LFU, LRU, NEVER
from replay.rules.store_rules import StoreSettings
from replay.whatif.kernel_config import (
    FA,
    FACT_GROUPS,
    FACT_WIDTH,
    MAMBA,
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
# Items are ``key * groups + group`` (the Python model's), queued as item + 1
# (the bucket queue's lists end at 0) in the run's eviction order
# (``replay.rules.eviction``: an LRU list, or a bucket queue keyed by the
# arrival, the uses or the next use), ``nodes`` their rows, ``side`` fifo's
# arrivals and lfu's uses. Belady files newest first among equals (of equally
# distant keys the deepest in its prompt), as the Python model's
# ``EvictionOrder(newest_first=True)``.


@jit(nogil=True, inline="always")
def _file(
    ev: int,
    item: int,
    groups: int,
    st: Any,
    nodes: Any,
    qh: Any,
    bits: Any,
    side: Any,
    uses: Any,
    use_starts: Any,
    now: int,
) -> None:
    """``EvictionOrder.add``: queue ``item`` (it is not queued)."""
    q = item + 1
    if ev == LRU:
        lru.append(st, nodes, q)
    elif ev == FIFO:
        queue.add(st, nodes, qh, bits, q, fifo.bucket(side, q))
    elif ev == LFU:
        queue.add(st, nodes, qh, bits, q, lfu.bucket(side, q))
    else:
        nu = belady.next_use(uses, use_starts, item // groups, now)
        queue.add_first(st, nodes, qh, bits, q, belady.bucket(nu, st[queue.REQUESTS]))


@jit(nogil=True, inline="always")
def _discard(ev: int, item: int, st: Any, nodes: Any, qh: Any, bits: Any) -> None:
    if ev == LRU:
        lru.unlink(st, nodes, item + 1)
    else:
        queue.unlink(st, nodes, qh, bits, item + 1)


@jit(nogil=True)
def _pop(
    ev: int,
    groups: int,
    st: Any,
    nodes: Any,
    qh: Any,
    bits: Any,
    side: Any,
    uses: Any,
    use_starts: Any,
    now: int,
) -> int:
    """``EvictionOrder.pop``: the victim, out of the order."""
    if ev == LRU:
        return int(lru.pop(st, nodes)) - 1
    while True:
        b = queue.bits_first(st, bits)
        q = int(qh[b, 0])
        queue.unlink(st, nodes, qh, bits, q)
        if ev == BELADY and b and st[queue.REQUESTS] - b <= now:
            # Filed under a use that has come without touching it: re-file
            # (every request re-files its present keys first, so a run
            # never gets here).
            _file(ev, q - 1, groups, st, nodes, qh, bits, side, uses, use_starts, now)
            continue
        if ev != BELADY:
            side[q, fifo.S_BORN] = 0
            side[q, lfu.S_USED] = 0
        return q - 1


@jit(nogil=True, inline="always")
def _touch(
    ev: int,
    item: int,
    groups: int,
    st: Any,
    nodes: Any,
    qh: Any,
    bits: Any,
    side: Any,
    uses: Any,
    use_starts: Any,
    now: int,
) -> None:
    """``MooncakeCache.touch``."""
    if ev in (FIFO, LFU):
        lfu.used(side, item + 1)
    if ev != FIFO:
        _discard(ev, item, st, nodes, qh, bits)
        _file(ev, item, groups, st, nodes, qh, bits, side, uses, use_starts, now)


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
    st = queue.new_state(requests)
    nodes = np.zeros((items + 1, queue.NODE_COLS), dtype=np.int64)
    side = np.zeros((items + 1 if ev in (FIFO, LFU) else 1, 2), dtype=np.int64)
    if ev == LFU:
        # an item is used at most twice per appearance of its key: loaded, stored
        buckets = lfu.universe(ids, offsets, num_keys, 2)
    elif ev == FIFO:
        buckets = fifo.universe(int(offsets[-1]) * num_groups)
    elif ev == BELADY:
        buckets = belady.universe(requests)
    else:
        buckets = 1
    qh = np.zeros((buckets, 2), dtype=np.int64)
    bits = queue.bits_init(st, buckets)
    size = 0
    evicted = 0
    stride = max_u + 1
    present = np.zeros(num_groups * stride, dtype=np.uint8)
    merged = np.zeros(num_specs * stride, dtype=np.uint8)
    asked = np.zeros(num_groups * stride, dtype=np.uint8)
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
        for g in range(num_groups):
            for x in range(u):
                present[g * stride + x] = pres[ids[o + x] * num_groups + g]
        if ev == BELADY:
            for g in range(num_groups):
                for x in range(u):
                    item = ids[o + x] * num_groups + g
                    if pres[item]:
                        _discard(ev, item, st, nodes, qh, bits)
                        _file(ev, item, num_groups, st, nodes, qh, bits, side, uses, use_starts, i)
        junction = answer(
            lookup_params, specs, members, lookup_groups, present, 0, stride, u, max_length[i],
            merged, res, verified, asked, facts, i, params[P_USES_JUNCTION],
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
                _touch(ev, item, num_groups, st, nodes, qh, bits, side, uses, use_starts, i)
        # The stores the request leaves.
        hashed = u * hbs  # the prompt's hash units (fewer with lookahead hashes)
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
                hi = min(n, hashed) // a * a // bs
                lo = min(hi, cdiv(hit, bs))
            for x in range(lo, min(hi, u)):
                if groups[g, 0] == MAMBA and stored[k, x] != stamp:
                    continue
                item = ids[o + x] * num_groups + g
                if pres[item]:
                    _touch(ev, item, num_groups, st, nodes, qh, bits, side, uses, use_starts, i)
                    continue
                pres[item] = 1
                if ev in (FIFO, LFU):
                    fifo.arrive(st, side, item + 1)
                    lfu.arrive(side, item + 1)
                _file(ev, item, num_groups, st, nodes, qh, bits, side, uses, use_starts, i)
                size += costs[g]
                while size > capacity:
                    victim = _pop(ev, num_groups, st, nodes, qh, bits, side, uses, use_starts, i)
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
