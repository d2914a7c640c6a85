"""The what-if's GPU block pool, compiled: one numba call per run.

A port of ``replay.rules.blockpool.GpuCache`` (the pool, its free queue and
eviction orders), of the reference coordinator's fixed point
(``replay.rules.coordinator.hybrid.Coordinator.lookup_present`` with the finders
of ``replay.rules.coordinator.finders``), of the store rules
(``replay.rules.store_rules.StoreRules``, ``gpu`` cache) and of the lookup
facts (``replay.rules.facts.FactRules``), for the configurations the block
pool covers: every group's block one hash unit, full attention, sliding
window and Mamba (align) groups, with or without EAGLE, under every policy.
The requests come as dense integer ids of their hashes
(``replay.whatif.requests.Requests``), so a key is ``(group, id)`` and the tables
are flat arrays indexed by it.

The Python model stays the specification: ``tests/test_whatif_kernel.py``
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
stores other Mamba states or window tails): ``tests/test_whatif_kernel.py``
finds such a request on random streams for full + Mamba and full + sliding
window. Everything outside that class is simulated, compiled, capacity by
capacity.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros as _trailing_zeros

from replay.base.spec import GroupKind, TraceConfig
from replay.format.jit import jit
from replay.rules.coordinator import Coordinator, get_policy
from replay.rules.coordinator.cache import ENGINE
from replay.rules.coordinator.hybrid import build_spec_groups, hit_alignment, partial_hits
from replay.rules.coordinator.stores import STORES_033, policy_stores
from replay.rules.store_rules import StoreRules, StoreSettings

FA, SWA, MAMBA = 0, 1, 2
LRU, FIFO, LFU, BELADY = 0, 1, 2, 3
EVICTION_CODES = {"lru": LRU, "fifo": FIFO, "lfu": LFU, "belady": BELADY}
_KINDS = {GroupKind.FULL_ATTENTION: FA, GroupKind.SLIDING_WINDOW: SWA, GroupKind.MAMBA: MAMBA}
NEVER = 1 << 62
#: Per-request results: not scheduled (the prompt never fits), preempted.
NOT_ADMITTED, PREEMPTED = -1, -2
#: ``run_gpu``'s return when its ``control`` asked it to stop.
STOPPED = -2
#: Columns of the per-request facts (``run_gpu``'s ``facts``): the lookup's
#: answer, the tokens the attention KV covers, then per group its mask
#: blocks, resumed Mamba state, first absent loaded block and whether the
#: EAGLE drop's unit is present (-1: None), as ``replay.rules.facts`` says.
FACT_HIT, FACT_ATTENTION, FACT_GROUPS, FACT_WIDTH = 0, 1, 2, 4

# Scalar parameters (``params``), by index.
(
    P_HBS,
    P_ALIGN,
    P_SINGLE,
    P_SIMPLE,
    P_VERIFY_ONCE,
    P_MAMBA_PEEK,
    P_A,
    P_BUDGET,
    P_RETENTION,
    P_HAS_MAMBA,
    P_UNITARY,
    P_USES_JUNCTION,
    P_ANY_EAGLE,
    P_MAX_MODEL_LEN,
    P_EVICTION,
    P_CAPACITY,
    P_NUM_KEYS,
    P_HAS_ATTENTION,
    P_LEN,
) = range(19)


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """The arrays a configuration compiles to (see ``compile_config``)."""

    params: np.ndarray[Any, np.dtype[np.int64]]
    #: per group: kind, block size, engine window, extra retained tokens,
    #: engine EAGLE (store rules), EAGLE attention (facts), spec group
    groups: np.ndarray[Any, np.dtype[np.int64]]
    #: per spec group: kind, block size, window, eagle, margin
    specs: np.ndarray[Any, np.dtype[np.int64]]
    #: members[s, g]: group g belongs to spec group s
    members: np.ndarray[Any, np.dtype[np.int64]]


def supported(config: TraceConfig, cache: str, policy: str | None = None) -> str | None:
    """Why the kernel cannot run this configuration, or None when it can.
    It models vLLM 0.33's engine rules, with or without the EAGLE drop once
    per candidate and Mamba's peek margin (the emulated policies); another
    release's engine runs the Python model."""
    if cache != "gpu":
        return "the compiled model covers the gpu cache"
    if policy is not None:
        rules = get_policy(policy).rules("gpu")
        if rules.but(verify_eagle_once=True, mamba_peek_margin=False) != ENGINE:
            return f"policy {policy}'s engine rules"
        if policy_stores(policy) != STORES_033:
            return f"policy {policy}'s store rules"
    return shape_supported(config, cache, _KINDS)


def shape_supported(config: TraceConfig, cache: str, kinds: Mapping[GroupKind, int]) -> str | None:
    """Why a compiled kernel over ``kinds`` of groups cannot run this
    configuration's shape in ``cache``, or None: every group's block one hash
    unit, hits aligned to whole blocks, no partial hash hits."""
    if partial_hits(config, cache):
        return "partial hash hits"
    for g in config.groups:
        if g.kind not in kinds:
            return f"{g.kind.value} groups"
        if g.block_size != config.hash_block_size:
            return "blocks larger than the hash unit"
    align = hit_alignment(config, cache)
    if any(align < g.block_size or align % g.block_size for g in config.groups):
        return "a hit alignment below a block size"
    if config.scheduler_block_size % config.hash_block_size:
        return "a scheduler block that is not whole blocks"
    return None


def compile_config(
    config: TraceConfig,
    policy: str,
    store_settings: StoreSettings,
    eviction: str,
    capacity: int,
    num_keys: int,
    max_model_len: int = 1 << 20,
) -> KernelConfig:
    coordinator = Coordinator(config, policy, "gpu")
    rules = StoreRules(config, store_settings)
    specs = build_spec_groups(config, "gpu")
    spec_of = {gid: sg.index for sg in specs for gid in sg.group_ids}
    eagle_attention = {
        gid
        for sg in specs
        if sg.eagle
        for gid in sg.group_ids
        if config.groups[gid].kind is not GroupKind.MAMBA
    }
    params = np.zeros(P_LEN, dtype=np.int64)
    params[P_HBS] = config.hash_block_size
    params[P_ALIGN] = coordinator.alignment
    params[P_SINGLE] = coordinator._single_call
    params[P_SIMPLE] = coordinator._simple_hybrid
    params[P_VERIFY_ONCE] = coordinator.cache.verify_eagle_once
    params[P_MAMBA_PEEK] = coordinator.cache.mamba_peek_margin
    params[P_A] = rules.alignment
    params[P_BUDGET] = store_settings.max_num_batched_tokens
    r = store_settings.retention_interval
    params[P_RETENTION] = -1 if r is None else r
    params[P_HAS_MAMBA] = rules.has_mamba
    params[P_UNITARY] = rules.unitary
    params[P_USES_JUNCTION] = rules.uses_junction
    params[P_ANY_EAGLE] = rules.engine_any_eagle
    params[P_MAX_MODEL_LEN] = max_model_len
    params[P_EVICTION] = EVICTION_CODES[eviction]
    params[P_CAPACITY] = capacity
    params[P_NUM_KEYS] = num_keys
    params[P_HAS_ATTENTION] = any(g.kind is not GroupKind.MAMBA for g in config.groups)
    groups = np.array(
        [
            [
                _KINDS[g.kind],
                g.block_size,
                g.sliding_window or 0,
                g.extra_retained_tokens,
                rules.groups[gid].engine_eagle,
                gid in eagle_attention,
                spec_of[gid],
            ]
            for gid, g in enumerate(config.groups)
        ],
        dtype=np.int64,
    )
    spec_rows = np.array(
        [
            [
                _KINDS[sg.kind],
                sg.spec.block_size,
                sg.spec.sliding_window or 0,
                sg.eagle,
                coordinator._margins[sg.index],
            ]
            for sg in specs
        ],
        dtype=np.int64,
    )
    members = np.zeros((len(specs), config.num_groups), dtype=np.int64)
    for sg in specs:
        for gid in sg.group_ids:
            members[sg.index, gid] = 1
    return KernelConfig(params=params, groups=groups, specs=spec_rows, members=members)


# ---------------------------------------------------------------- helpers


@jit(nogil=True)
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- eviction order
#
# ``st`` holds the order's scalars: [0] LRU head, [1] LRU tail, [2] cached
# free blocks (every order's length), [3] fifo's arrival counter, [4] the
# requests of the run, [5] the levels of the bucket bitset, [6:14] each
# level's offset in ``bits``.
_HEAD, _TAIL, _LEN, _STAMP, _REQUESTS, _LEVELS, _LOFF = 0, 1, 2, 3, 4, 5, 6
ST_LEN = _LOFF + 8


# Columns of ``blk`` (one row per block, its fields side by side).
B_KEY, B_GROUP, B_REF, B_HNEXT, B_HPREV, B_LPREV, B_LNEXT, B_INLIST = 0, 1, 2, 3, 4, 5, 6, 7
B_COLS = 8
# Columns of ``side`` (fifo and lfu only, int64): the block's arrival
# (fifo) and its use count (lfu).
S_BORN, S_USED = 0, 1
#: numba's count of a word's trailing zero bits (untyped for mypy)
trailing_zeros: Any = _trailing_zeros
# The helpers take the few 2-D arrays, not one view per field, and the LRU
# queue's per-block steps are written out where they run: every array
# argument of a call costs two atomic reference counts (numba's inlining
# keeps them), which measured 60% of a run when a call per freed block
# passed fifteen.
#
# fifo, lfu and belady are bucket queues, O(1) per add, discard and pop
# (bounded by the bitset's few levels): a bucket per priority value, each
# a doubly linked list of its blocks in the order they were added (through
# ``B_LPREV`` / ``B_LNEXT``, 0 ends a list: block 0 is never queued;
# ``B_INLIST`` holds the block's bucket + 1, 0 when not queued), and a
# bitset of the buckets that hold a block, 64-ary, its levels one word per
# 64 words below, so the first nonempty bucket is one trailing-zero count
# per level. The Python model's order is (priority, add stamp): a later add
# goes after every block already queued at its priority, so a bucket's list
# is that order exactly. Buckets: fifo the arrival (its counter), lfu the
# use count, belady ``requests - next use`` (0: never used again), so the
# furthest next use comes first. Their steps are inlined into the run
# (``inline="always"``: measured faster than a call per block).


@jit(nogil=True)
def _universe(ev: int, ids: Any, offsets: Any, num_groups: int, num_keys: int) -> int:
    """The buckets an order needs for a run over these requests: lfu one
    per use count (a block is used at most once per appearance of its
    key), fifo one per arrival (at most one per unit and group), belady one
    per request and never."""
    if ev == LFU:
        counts = np.zeros(num_keys, dtype=np.int32)
        most = 0
        for p in range(offsets[-1]):
            counts[ids[p]] += 1
            most = max(most, counts[ids[p]])
        return most + 2
    if ev == FIFO:
        return int(offsets[-1]) * num_groups + 2
    if ev == BELADY:
        return int(offsets.shape[0]) + 1
    return 1


@jit(nogil=True)
def _bits_init(st: Any, universe: int) -> Any:
    """The bitset's level offsets (into ``st``) and its zeroed words."""
    levels = 0
    total = 0
    n = universe
    while True:
        w = _cdiv(n, 64)
        st[_LOFF + levels] = total
        total += w
        levels += 1
        if w == 1:
            break
        n = w
    st[_LEVELS] = levels
    return np.zeros(total, dtype=np.uint64)


@jit(nogil=True, inline="always")
def _bits_set(st: Any, bits: Any, i: int) -> None:
    for lv in range(st[_LEVELS]):
        w = i >> 6
        at = st[_LOFF + lv] + w
        word = bits[at]
        bits[at] = word | (np.uint64(1) << np.uint64(i & 63))
        if word != 0:
            return
        i = w


@jit(nogil=True, inline="always")
def _bits_clear(st: Any, bits: Any, i: int) -> None:
    for lv in range(st[_LEVELS]):
        w = i >> 6
        at = st[_LOFF + lv] + w
        word = bits[at] & ~(np.uint64(1) << np.uint64(i & 63))
        bits[at] = word
        if word != 0:
            return
        i = w


@jit(nogil=True, inline="always")
def _bits_first(st: Any, bits: Any) -> int:
    """The lowest bucket holding a block (the queue is not empty)."""
    i = 0
    for lv in range(st[_LEVELS] - 1, -1, -1):
        word = bits[st[_LOFF + lv] + i]
        i = (i << 6) + int(trailing_zeros(word))
    return i


@jit(nogil=True, inline="always")
def _bq_add(st: Any, blk: Any, qh: Any, bits: Any, item: int, bucket: int) -> None:
    """Queue ``item`` last in ``bucket`` (it is not queued)."""
    blk[item, B_INLIST] = bucket + 1
    t = qh[bucket, 1]
    blk[item, B_LPREV] = t
    blk[item, B_LNEXT] = 0
    if t:
        blk[t, B_LNEXT] = item
    else:
        qh[bucket, 0] = item
        _bits_set(st, bits, bucket)
    qh[bucket, 1] = item
    st[_LEN] += 1


@jit(nogil=True, inline="always")
def _bq_unlink(st: Any, blk: Any, qh: Any, bits: Any, item: int) -> None:
    if not blk[item, B_INLIST]:
        return
    bucket = blk[item, B_INLIST] - 1
    blk[item, B_INLIST] = 0
    p, n = blk[item, B_LPREV], blk[item, B_LNEXT]
    if p:
        blk[p, B_LNEXT] = n
    else:
        qh[bucket, 0] = n
        if not n:
            _bits_clear(st, bits, bucket)
    if n:
        blk[n, B_LPREV] = p
    else:
        qh[bucket, 1] = p
    st[_LEN] -= 1


@jit(nogil=True, inline="always")
def _bq_pop(st: Any, blk: Any, qh: Any, bits: Any) -> int:
    item = int(qh[_bits_first(st, bits), 0])
    _bq_unlink(st, blk, qh, bits, item)
    return item


@jit(nogil=True, inline="always")
def _bucket(ev: int, item: int, st: Any, blk: Any, side: Any, knext: Any) -> int:
    """The bucket ``item`` is queued in now (see above)."""
    if ev == FIFO:
        return int(side[item, S_BORN])
    if ev == LFU:
        return int(side[item, S_USED])
    nu = knext[blk[item, B_KEY]]
    return 0 if nu >= NEVER else int(st[_REQUESTS] - nu)


# ---------------------------------------------------------------- finders


@jit(nogil=True)
def _find_full(view: Any, u: int, max_length: int, drop: bool, align: int, bs: int) -> Any:
    head = min(max_length // bs, u)
    blocks = head
    for i in range(head):
        if view[i] == 0:
            blocks = i
            break
    hit = blocks * bs
    matched = hit
    if drop and hit > 0:
        hit -= min(align, bs)
    hit -= hit % align
    return 0, min(blocks, _cdiv(hit, bs)), hit, matched


@jit(nogil=True)
def _find_swa(
    view: Any, u: int, max_length: int, drop: bool, align: int, bs: int, window: int
) -> Any:
    need = _cdiv(window - 1, bs) + (1 if drop else 0)
    max_blocks = max_length // bs
    top = min(max_blocks, min(max_blocks, u))
    run = 0
    length = -1
    nulls = 0
    for i in range(top - 1, -1, -1):
        if view[i]:
            if run == 0 and bs != align:
                post_pop = i if drop else i + 1
                if (post_pop * bs) % align:
                    continue
            run += 1
            if run >= need:
                nulls, length = i, i + run
                break
        else:
            run = 0
    if length < 0:
        nulls, length = 0, run
        if bs != align:
            while (length * bs) % align:
                length -= 1
    matched = length * bs
    if drop and length > 0:
        length -= 1
        if bs != align:
            while (length * bs) % align:
                length -= 1
    return min(nulls, length), max(0, length - nulls), length * bs, matched


@jit(nogil=True)
def _find_mamba(view: Any, u: int, max_length: int, align: int, bs: int) -> Any:
    max_blocks = min(max_length // bs, u)
    step = max(1, align // bs)
    if max_blocks < step:
        return 0, 0, 0, 0
    i = step - 1 + ((max_blocks - step) // step) * step
    while i >= 0:
        if view[i]:
            hit = (i + 1) * bs
            return i, 1, hit, hit
        i -= step
    return 0, 0, 0, 0


@jit(nogil=True)
def _call(specs: Any, s: int, merged: Any, u: int, bound: int, drop: bool, align: int) -> Any:
    kind, bs = specs[s, 0], specs[s, 1]
    view = merged[s]
    if kind == FA:
        return _find_full(view, u, bound, drop, align, bs)
    if kind == SWA:
        return _find_swa(view, u, bound, drop, align, bs, specs[s, 2])
    return _find_mamba(view, u, bound, align, bs)


@jit(nogil=True)
def _merge_present(members: Any, present: Any, merged: Any, u: int) -> None:
    """Each spec group's presence: the AND of its KV-cache groups' (units ``[0, u)``)."""
    for s in range(members.shape[0]):
        first = True
        for g in range(members.shape[1]):
            if members[s, g]:
                if first:
                    for x in range(u):
                        merged[s, x] = present[g, x]
                    first = False
                else:
                    for x in range(u):
                        merged[s, x] &= present[g, x]


@jit(nogil=True)
def _lookup(
    params: Any,
    specs: Any,
    merged: Any,
    u: int,
    max_length: int,
    res: Any,
    verified: Any,
) -> Any:
    """The fixed point over the spec groups' merged presence. ``res[s]``:
    null blocks, loaded blocks, hit, matched, called. Returns the hit and
    the longest hit a non-reused finder call found (the junction's)."""
    num_specs = specs.shape[0]
    align = params[P_ALIGN]
    for s in range(num_specs):
        res[s, 4] = 0
    longest = 0
    if params[P_SINGLE]:
        n0, l0, h0, m0 = _call(specs, 0, merged, u, max_length, specs[0, 3] != 0, align)
        res[0, 0], res[0, 1], res[0, 2], res[0, 3], res[0, 4] = n0, l0, h0, m0, 1
        return h0, h0
    hit = max_length
    peek_cap = u * params[P_HBS]
    for s in range(num_specs):
        verified[s] = 0
    while True:
        cand = hit
        for s in range(num_specs):
            kind = specs[s, 0]
            if kind == FA and res[s, 4]:
                cand = min(cand, res[s, 2])
                continue
            drop = specs[s, 3] != 0 and (verified[s] == 0 or params[P_VERIFY_ONCE] == 0)
            bound = cand
            if drop and params[P_VERIFY_ONCE] and (kind != MAMBA or params[P_MAMBA_PEEK]):
                bound = min(cand + specs[s, 4], peek_cap)
            n0, l0, h0, m0 = _call(specs, s, merged, u, bound, drop, align)
            if drop:
                verified[s] = 1
            elif h0 < cand:
                for t in range(num_specs):
                    verified[t] = 0
            longest = max(longest, h0)
            cand = h0
            res[s, 0], res[s, 1], res[s, 2], res[s, 3], res[s, 4] = n0, l0, h0, m0, 1
        if cand >= hit:
            break
        hit = cand
        if params[P_SIMPLE]:
            break
    for s in range(num_specs):
        if specs[s, 0] == FA:
            res[s, 1] = min(res[s, 1], _cdiv(hit, specs[s, 1]))
    return hit, longest


# ---------------------------------------------------------------- facts


@jit(nogil=True)
def _first_absent(view: Any, u: int, lo: int, hi: int) -> int:
    if lo >= hi:
        return -1
    for i in range(lo, min(hi, u)):
        if view[i] == 0:
            return i
    return max(lo, u) if hi > u else -1


@jit(nogil=True)
def _facts(
    params: Any,
    groups: Any,
    present: Any,
    u: int,
    hit: int,
    mask: Any,
    loaded: Any,
    facts: Any,
    i: int,
) -> None:
    """``replay.rules.facts.FactRules.facts`` for one lookup, into row ``i``
    of ``facts`` (see ``FACT_*``; -1 where the fact is None)."""
    num_groups = groups.shape[0]
    hbs = params[P_HBS]
    covered = -1
    for g in range(num_groups):
        if groups[g, 0] != MAMBA:
            c = mask[g] * groups[g, 1]
            covered = c if covered < 0 else min(covered, c)
    facts[i, FACT_HIT] = hit
    facts[i, FACT_ATTENTION] = covered
    for g in range(num_groups):
        bs = groups[g, 1]
        col = FACT_GROUPS + FACT_WIDTH * g
        facts[i, col] = mask[g]
        if groups[g, 0] == MAMBA:
            end = 0 if loaded[g] == 0 else mask[g] * bs
            facts[i, col + 1] = end
        else:
            end = hit
            facts[i, col + 1] = -1
        view = present[g]
        first, stop = mask[g] - loaded[g], mask[g]
        tail = end // bs if end % bs else -1
        if stop <= first:
            missing = -1
        elif not (first <= tail < stop):
            missing = _first_absent(view, u, first, stop)
        else:
            missing = _first_absent(view, u, first, tail)
            if missing < 0:
                lo = _cdiv(end, hbs) - 1
                ok = False
                if groups[g, 0] == MAMBA:
                    ok = lo < u and view[lo] == 1
                else:
                    for x in range(max(lo, 0), min(tail + 1, u)):
                        if view[x] == 1:
                            ok = True
                            break
                missing = _first_absent(view, u, tail + 1, stop) if ok else tail
        facts[i, col + 2] = missing
        if groups[g, 5]:
            unit = hit // bs
            facts[i, col + 3] = 1 if unit < u and present[g, unit] else 0
        else:
            facts[i, col + 3] = -1


# ---------------------------------------------------------------- store rules


@jit(nogil=True)
def _cacheable(params: Any, groups: Any, g: int, tokens: int, hashed: int) -> int:
    if params[P_UNITARY]:
        out = tokens
    else:
        a = params[P_A]
        out = tokens // a * a
        if groups[g, 4] and out > 0:
            out = min(tokens, out + groups[g, 1])
    return min(out, hashed)


@jit(nogil=True)
def _boundaries(params: Any, n: int, junction: int, eagle_group: bool, bs: int, out: Any) -> int:
    a = params[P_A]
    k = 0
    if not params[P_ANY_EAGLE]:
        out[0] = n - 1
        k = 1
    else:
        resend = (n - 1) // a * a
        extension = n // a * a
        out[0] = max(resend - a, 0)
        out[1] = max(extension - a, 0)
        k = 2
    if junction:
        out[k] = junction
        k += 1
        if eagle_group:
            out[k] = junction - bs
            k += 1
    return k


@jit(nogil=True)
def _chunk_ends(params: Any, n: int, hit: int, junction: int, ends: Any) -> int:
    a, budget = params[P_A], params[P_BUDGET]
    last_cache = n // a * a - a if params[P_ANY_EAGLE] else (n - 1) // a * a
    last_cache = max(last_cache, 0)
    k = 0
    start = hit
    while start < n:
        end = min(start + budget, n)
        if params[P_HAS_MAMBA]:
            if end < n:
                aligned = end // a * a
                if aligned > start or a <= budget:
                    end = aligned
            junction_stop = start + (junction - start) // a * a
            best = end
            s0 = (start // a + 1) * a if start % a else 0
            s2 = junction_stop if start < junction < end else 0
            if start < s0 < best:
                best = s0
            if start < last_cache < best:
                best = last_cache
            if start < s2 < best:
                best = s2
            end = best
        ends[k] = end
        k += 1
        start = end
    return k


@jit(nogil=True)
def _stores(
    params: Any,
    groups: Any,
    n: int,
    hit: int,
    junction: int,
    hashed: int,
    ends: Any,
    num_ends: int,
    stored: Any,
    stamp: int,
    bounds: Any,
) -> None:
    """Mark ``stored[g, i] = stamp`` for every block the prefill caches."""
    a = params[P_A]
    r = params[P_RETENTION]
    for g in range(groups.shape[0]):
        kind, bs = groups[g, 0], groups[g, 1]
        eagle = groups[g, 4] != 0
        nb = _boundaries(params, n, junction, eagle, bs, bounds)
        if kind == MAMBA:
            cached = hit // bs
            prev = hit
            last = -1
            for e in range(num_ends):
                end = ends[e]
                full = _cacheable(params, groups, g, end, hashed) // bs
                if full > cached:
                    for which in range(2):
                        pos = prev if which == 0 else end
                        block = pos // bs - 1
                        if pos % bs == 0 and cached <= block < full and last < block:
                            keep = r < 0
                            if not keep and r > 0:
                                per_segment = r // bs
                                keep = per_segment <= 1 or (block + 1) % per_segment == 0
                            if not keep:
                                for j in range(nb):
                                    if bounds[j] // a * a // bs - 1 == block:
                                        keep = True
                                        break
                            if keep:
                                stored[g, block] = stamp
                                last = block
                    cached = full
                prev = end
            continue
        start = hit // bs
        end = _cacheable(params, groups, g, n, hashed) // bs
        if kind != SWA:
            for i in range(start, end):
                stored[g, i] = stamp
            continue
        if end <= start:
            continue
        if a % bs:
            for i in range(start, end):
                stored[g, i] = stamp
            continue
        need = _cdiv(groups[g, 2] - 1, bs) + (1 if eagle else 0)
        shift = 1 if eagle else 0
        segment = a if r < 0 else r
        if segment:
            per_segment = segment // bs
            if need >= per_segment:
                for i in range(start, end):
                    stored[g, i] = stamp
                continue
            for i in range(start, end):
                if i >= shift and (i - shift) % per_segment >= per_segment - need:
                    stored[g, i] = stamp
        if r >= 0:
            for j in range(nb):
                tail_end = bounds[j] // a * a // bs + shift
                lo, hi = max(start, tail_end - need), min(end, tail_end)
                for i in range(lo, hi):
                    stored[g, i] = stamp


# ---------------------------------------------------------------- the run


@jit(nogil=True)
def run_gpu(
    params: Any,
    groups: Any,
    specs: Any,
    members: Any,
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
    side = np.zeros((nblocks if ev in (FIFO, LFU) else 1, 2), dtype=np.int64)
    born = side[:, S_BORN]
    nused = side[:, S_USED]
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
    st = np.zeros(ST_LEN, dtype=np.int64)
    st[_HEAD] = -1
    st[_TAIL] = -1
    st[_REQUESTS] = requests
    universe = _universe(ev, ids, offsets, num_groups, num_keys)
    # per bucket its first and last block (0: empty), and the bitset
    qh = np.zeros((universe, 2), dtype=np.int32)
    bits = _bits_init(st, universe)
    # belady: per key, its next use after the request running (or the
    # last one that held it: the same request)
    knext = np.full(num_keys if ev == BELADY else 1, NEVER, dtype=np.int64)
    evicted = 0
    # --- per-request scratch
    present = np.zeros((num_groups, max_u + 1), dtype=np.uint8)
    merged = np.zeros((num_specs, max_u + 1), dtype=np.uint8)
    res = np.zeros((num_specs, 5), dtype=np.int64)
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
                present[g, x] = 1 if kt[2 * (ids[o + x] * num_groups + g)] >= 0 else 0
        _merge_present(members, present, merged, u)
        hit, longest = _lookup(params, specs, merged, u, ml, res, verified)
        for g in range(num_groups):
            s = groups[g, 6]
            loaded[g] = res[s, 1]
            mask[g] = res[s, 0] + res[s, 1]
        _facts(params, groups, present, u, hit, mask, loaded, facts, i)
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
            if qh[now, 0]:
                qh[now, 0] = 0
                qh[now, 1] = 0
                _bits_clear(st, bits, now)
                for g in range(num_groups):
                    for x in range(u):
                        b = kt[2 * (ids[o + x] * num_groups + g)]
                        if b < 0:
                            continue
                        nu = future[o + x]
                        bucket = 0 if nu >= NEVER else requests - nu
                        while b >= 0:
                            if blk[b, B_INLIST] == now + 1:
                                st[_LEN] -= 1  # out of the emptied bucket
                            else:
                                # a hash twice in the prompt: re-filed again
                                _bq_unlink(st, blk, qh, bits, b)
                            _bq_add(st, blk, qh, bits, b, bucket)
                            b = hnext[b]
        # --- admission (get_num_blocks_to_allocate, whole prompt)
        need = 0
        for g in range(num_groups):
            kind, bs = groups[g, 0], groups[g, 1]
            nulls = mask[g] - loaded[g]
            count = mask[g]
            required = _cdiv(n, bs)
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
                cap = _cdiv(min(window, max_model_len), bs) + 1
                required = min(required, cap)
                skipped = max(0, hit - groups[g, 2] + 1 - groups[g, 3]) // bs
            else:
                skipped = 0
            need += max(required - max(skipped, count), 0)
            for x in range(max(skipped, nulls), count):
                b = kt[2 * (ids[o + x] * num_groups + g)]
                if ref[b] == 0:
                    need += 1
        if need > rlen + st[_LEN]:
            hits[i] = NOT_ADMITTED
            continue
        junction = longest if (params[P_USES_JUNCTION] and longest > hit) else 0
        hashed = u * hbs
        num_ends = _chunk_ends(params, n, hit, junction, ends)
        stamp = i + 1
        _stores(params, groups, n, hit, junction, hashed, ends, num_ends, stored, stamp, bounds)
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
                    if idx >= 0 and idx < _cdiv(start, bs) - 1 and tables[g, idx]:
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
            num_free = rlen + st[_LEN]
            if start != hit:
                # _running_blocks
                want = 0
                for g in range(num_groups):
                    new = _cdiv(end, groups[g, 1]) - tlen[g]
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
                                    if blk[b, B_INLIST]:
                                        # vLLM's free queue: unlink (written out: a call costs reference counts)
                                        blk[b, B_INLIST] = 0
                                        p_, n_ = blk[b, B_LPREV], blk[b, B_LNEXT]
                                        if p_ >= 0:
                                            blk[p_, B_LNEXT] = n_
                                        else:
                                            st[_HEAD] = n_
                                        if n_ >= 0:
                                            blk[n_, B_LPREV] = p_
                                        else:
                                            st[_TAIL] = p_
                                        st[_LEN] -= 1
                                else:
                                    _bq_unlink(st, blk, qh, bits, b)
                            ref[b] += 1
                            if ev in (FIFO, LFU):
                                nused[b] += 1
                    tlen[g] = k
                    tcached[g] = k
            # _allocate
            for g in range(num_groups):
                kind, bs = groups[g, 0], groups[g, 1]
                required = _cdiv(end, bs)
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
                if count > rlen + st[_LEN]:
                    return i
                for _ in range(count):
                    if rlen > 0:
                        b = ring[rhead]
                        rhead = (rhead + 1) % rmod
                        rlen -= 1
                    elif ev == LRU:
                        b = st[_HEAD]
                        if blk[b, B_INLIST]:
                            # vLLM's free queue: unlink (written out: a call costs reference counts)
                            blk[b, B_INLIST] = 0
                            p_, n_ = blk[b, B_LPREV], blk[b, B_LNEXT]
                            if p_ >= 0:
                                blk[p_, B_LNEXT] = n_
                            else:
                                st[_HEAD] = n_
                            if n_ >= 0:
                                blk[n_, B_LPREV] = p_
                            else:
                                st[_TAIL] = p_
                            st[_LEN] -= 1
                    else:
                        b = _bq_pop(st, blk, qh, bits)
                        if ev != BELADY:
                            born[b] = 0
                            nused[b] = 0
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
                full = _cacheable(params, groups, g, end, hashed) // bs
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
                            st[_STAMP] += 1
                            born[b] = st[_STAMP]
                            nused[b] = 0
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
                    # the free queue's tail (written out: see run_gpu)
                    if not blk[b, B_INLIST]:
                        blk[b, B_INLIST] = 1
                        t = st[_TAIL]
                        blk[b, B_LPREV] = t
                        blk[b, B_LNEXT] = -1
                        if t >= 0:
                            blk[t, B_LNEXT] = b
                        else:
                            st[_HEAD] = b
                        st[_TAIL] = b
                        st[_LEN] += 1
                else:
                    _bq_add(st, blk, qh, bits, b, _bucket(ev, b, st, blk, side, knext))
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


# ---------------------------------------------------------------- interning


@jit(nogil=True)
def _hash_at(words: Any, voff: Any, base: int, stride: int, width: int, h: int) -> Any:
    """Hash ``h``'s first word, its words and its bytes, as
    ``replay.format.hashwords.HashWords`` lays them out."""
    nb = np.int64(width) if voff.shape[0] == 0 else np.int64(voff[h + 1]) - np.int64(voff[h])
    if stride < 0:  # mixed widths, packed: voff's second half holds each hash's first word
        start = np.int64(voff[(voff.shape[0] >> 1) + h])
    elif stride == 0:
        start = (np.int64(voff[h]) - base) >> 3
    else:
        start = np.int64(h) * stride
    return start, (nb + 7) >> 3, nb


@jit(nogil=True)
def _fingerprint(words: Any, start: int, nwords: int, nbytes: int) -> Any:
    """A 64-bit mix of a hash's bytes (its table slot; equality compares
    every word): each word rotated by its position, then a murmur finaliser."""
    acc = np.uint64(nbytes) * np.uint64(0xC2B2AE3D27D4EB4F)
    for i in range(nwords):
        w = words[start + i] + np.uint64(i) * np.uint64(0x9E3779B97F4A7C15)
        acc = (acc ^ w) * np.uint64(0xFF51AFD7ED558CCD)
        acc ^= acc >> np.uint64(33)
    acc = (acc ^ (acc >> np.uint64(29))) * np.uint64(0xC4CEB9FE1A85EC53)
    return acc ^ (acc >> np.uint64(32))


@jit(nogil=True)
def _intern(
    words: Any, voff: Any, base: int, stride: int, width: int, n: int, ids: Any, first: Any
) -> int:
    """Dense ids for ``n`` hashes laid out as ``replay.format.hashwords.HashWords``, in
    order of first appearance, keyed on the whole hash (width and every
    word): ``ids[h]`` the id of hash ``h``, ``first[id]`` its first hash.
    Returns the number of distinct hashes."""
    cap = 1
    bits = 0
    while cap < n + n // 2 + 16:
        cap <<= 1
        bits += 1
    shift = np.uint64(64 - bits)
    table = np.full(cap, -1, dtype=np.int64)
    metas = np.empty(n, dtype=np.uint64)
    count = 0
    for h in range(n):
        s, nw, nb = _hash_at(words, voff, base, stride, width, h)
        meta = _fingerprint(words, s, nw, nb)
        metas[h] = meta
        i = np.int64(meta >> shift)
        while True:
            j = table[i]
            if j < 0:
                table[i] = h
                ids[h] = count
                first[count] = h
                count += 1
                break
            if metas[j] == meta:
                s2, _nw2, nb2 = _hash_at(words, voff, base, stride, width, j)
                same = nb2 == nb
                if same:
                    for k in range(nw):
                        if words[s + k] != words[s2 + k]:
                            same = False
                            break
                if same:
                    ids[h] = ids[j]
                    break
            i = (i + 1) & (cap - 1)
    return count


def intern_hashes(hashes: Any) -> tuple[np.ndarray[Any, np.dtype[np.int64]], Any]:
    """``hashes`` (an Arrow list array of binaries) as dense int64 ids, and
    the distinct hashes in id order (an Arrow array)."""
    import pyarrow as pa

    from replay.format.hashwords import hash_words

    hw = hash_words(hashes)
    n = hw.num_hashes
    ids = np.empty(n, dtype=np.int64)
    first = np.empty(n, dtype=np.int64)
    voff = hw.value_offsets
    if voff.shape[0]:
        voff = np.ascontiguousarray(voff, dtype=np.int64)
        voff.flags.writeable = False
    count = _intern(hw.words, voff, hw.base, hw.stride, hw.width, n, ids, first) if n else 0
    flat = hashes.flatten()
    digests = flat.take(pa.array(first[:count])) if count else flat.slice(0, 0)
    return ids, digests
