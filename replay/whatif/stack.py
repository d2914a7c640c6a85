"""Every LRU capacity of the gpu what-if in one pass (stack distances), where
that is exact.

Mattson's stack algorithm: keep the keys in one recency order (the *stack*,
the same at every capacity) and give each access its depth in it; a cache
of ``Q`` keys holds exactly the ``Q`` shallowest. The depth of a key is the
number of distinct keys used since its last use, counted with a Fenwick tree
over last-use times: O(log T) per access, T the trace's hash units.

When it is exact (derived from ``replay.rules.blockpool``, the model the
vLLM differential tests check against ``KVCacheManager``): one KV-cache
group, full attention, block = hash unit, no EAGLE drop, hit alignment = one
block, requests run one at a time, LRU. Then, between requests, nothing is
pinned, the free queue is the unhashed blocks (front) then the cached ones
(LRU order) and a request:

* looks up the longest present prefix of its hashes, capped at
  ``max_length // block`` blocks: ``k`` blocks;
* is admitted when its ``ceil(n / block)`` blocks fit the pool (every block
  is free between requests, and the hit blocks count too), else it changes
  nothing;
* pins its ``k`` hit blocks, takes ``ceil(n / block) - k`` blocks from the
  front (freed unhashed blocks, then never-used ones, then the least recent
  cached: evictions), hashes the full blocks past the hit;
* frees its table in reverse, so its blocks ``s - 1 .. 0`` become the most
  recent, block 0 on top (``s = min(len(hashes), n // block)``), and its
  partial last block goes back to the front unhashed.

If no request finds a key of its own prompt cached past its hit, the
cached keys after every request are the top ``Q`` of one capacity-independent
stack: the request's keys on top, then the older order. ``Q`` (cached
blocks), the freed unhashed and the never-used blocks are three counters per
capacity, updated exactly from each request's hit.

A key cached past the hit (the lookup cap: ``max_length`` = n - 1 stops a
block-aligned prompt sent again one block short; a key present after a gap)
is recomputed and vLLM caches a *second copy*: the old block stays, holding
a block the stack of keys does not count, and a later hit touches the first
copy. So each capacity also keeps its stale copies (the block of a key that
is not its newest, by last-free time): a block's place in that capacity's
LRU order is its key's depth plus the stale copies newer than it, the
blocks a request pins are each hit key's first copy, the evictions are the
oldest unpinned blocks, and a stale copy goes when the order passes it. One
pass then gives, per capacity, every request's hit and the evicted blocks;
the facts of a lookup in this class follow from its hit (every hit block is
present, nothing else is looked at). ``copies=False`` is the plain stack
algorithm, kept to show where it is wrong.

Where it does not hold, the pass says so per capacity, at the first request
that breaks it, and that capacity must be simulated on its own:

* ``TOO_SMALL``: a prompt needs more blocks than the capacity: the
  request changes nothing there but moves the stack at larger capacities;
* ``DUPLICATE``: a third copy of a key (a key with a stale copy
  recomputed again), or more stale copies than the pass tracks;
* ``REPEATED``: a prompt names one hash twice (no chained hashes): it
  caches two copies of it at every capacity.

Any other configuration (hybrid models: ``tests/whatif/test_whatif_kernel.py``
shows their hits do not even grow with the capacity; an EAGLE drop, which
recomputes a present block on every hit) is refused by ``exact_config``.
The proof is ``tests/whatif/test_whatif_stack.py``: random streams and capacities
inside the class, every field equal to the per-capacity runs, and the
concrete cases outside it; ``tests/vllm/test_whatif_vllm.py`` checks it against
vLLM's own ``KVCacheManager``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from replay.base.jit import jit
from replay.base.spec import GroupKind, TraceConfig
from replay.rules.compiled.tables import SP_EAGLE
from replay.rules.store_rules import StoreSettings
from replay.whatif import kernel as whatif_kernel
from replay.whatif.requests import Requests

#: Why a capacity is not answered by the pass (``StackRun.why``).
EXACT, TOO_SMALL, DUPLICATE, REPEATED, STOPPED = 0, 1, 2, 3, 4
REASONS = {
    TOO_SMALL: "a prompt needs more blocks than the capacity (never scheduled there)",
    DUPLICATE: "a key with two copies is recomputed (vLLM caches a third)",
    REPEATED: "a prompt names one hash twice (two copies at every capacity)",
}
_NEVER = np.int64(1 << 62)
#: The most stale copies a capacity tracks; past it the capacity is simulated.
_COPIES = 1 << 14


def exact_config(config: TraceConfig, policy: str) -> str | None:
    """Why no single pass over capacities can be exact for this
    configuration (gpu cache, LRU), or None when it can (then the stream
    and each capacity are checked by the pass itself)."""
    why = whatif_kernel.supported(config, "gpu", policy)
    if why is not None:
        return why
    if config.num_groups != 1 or config.groups[0].kind is not GroupKind.FULL_ATTENTION:
        return "more than one KV-cache group (a hybrid pool's hits need not grow with capacity)"
    k = whatif_kernel.compile_config(config, policy, StoreSettings(cache="gpu"), "lru", 1, 1)
    if k.lookup.specs[0, SP_EAGLE]:
        return "an EAGLE drop (every hit recomputes a present block: a second copy)"
    if k.params[whatif_kernel.P_ALIGN] != config.groups[0].block_size:
        return "a hit alignment above one block (a hit stops short of present blocks)"
    return None


@dataclass(frozen=True, slots=True)
class StackRun:
    """The pass's answers, per capacity (rows) and request (columns)."""

    #: per capacity, per request: hit tokens, exact where ``why`` is EXACT
    #: (elsewhere what a plain stack algorithm would say)
    hits: npt.NDArray[np.int64]
    #: per capacity: evicted cached blocks
    evicted: npt.NDArray[np.int64]
    #: per capacity: EXACT, or the reason code and the request (seq order) that broke it
    why: npt.NDArray[np.int64]


def run_stack(
    requests: Requests,
    capacities: list[int],
    control: npt.NDArray[np.int64] | None = None,
    *,
    copies: bool = True,
) -> StackRun:
    """One pass over ``requests`` for every capacity (blocks), which must be
    in ``exact_config``'s class. ``control`` as ``kernel.run_gpu`` takes it
    (requests done; nonzero ``[1]``: stop, every ``why`` is then STOPPED)."""
    config = requests.config
    ids, offsets, num_tokens, max_length = requests.arrays()
    caps = np.asarray(capacities, dtype=np.int64)
    hits = np.zeros((len(caps), len(requests)), dtype=np.int64)
    evicted = np.zeros(len(caps), dtype=np.int64)
    why = np.zeros((len(caps), 2), dtype=np.int64)
    if control is None:
        control = np.zeros(2, dtype=np.int64)
    _stack_pass(
        ids,
        offsets,
        num_tokens,
        max_length,
        config.groups[0].block_size,
        len(requests.digests),
        caps,
        hits,
        evicted,
        why,
        control,
        copies,
    )
    return StackRun(hits=hits, evicted=evicted, why=why)


def facts_of(hits: npt.NDArray[np.int64], block_size: int) -> npt.NDArray[np.int64]:
    """The kernel's facts matrix (``kernel.FACT_*``) of lookups in the exact
    class, from their hits: the hit blocks are the mask, all present (no
    first absent block), no Mamba state, no EAGLE unit."""
    facts = np.full((hits.size, whatif_kernel.FACT_GROUPS + whatif_kernel.FACT_WIDTH), -1)
    facts[:, whatif_kernel.FACT_HIT] = hits
    facts[:, whatif_kernel.FACT_ATTENTION] = hits
    facts[:, whatif_kernel.FACT_GROUPS] = hits // block_size
    return facts.astype(np.int64)


@jit(nogil=True)
def _fenwick_add(tree: Any, i: int, delta: int) -> None:
    n = tree.shape[0]
    while i < n:
        tree[i] += delta
        i += i & -i


@jit(nogil=True)
def _fenwick_prefix(tree: Any, i: int) -> int:
    s = 0
    while i > 0:
        s += tree[i]
        i -= i & -i
    return s


@jit(nogil=True)
def _newer(gtime: Any, c: int, g: int, t: int) -> int:
    """Capacity ``c``'s stale copies newer than time ``t``."""
    lo, hi = 0, g
    while lo < hi:
        mid = (lo + hi) >> 1
        if gtime[c, mid] <= t:
            lo = mid + 1
        else:
            hi = mid
    return g - lo


@jit(nogil=True)
def _count_newer(times: Any, n: int, t: int) -> int:
    out = 0
    for j in range(n):
        out += times[j] > t
    return out


@jit(nogil=True)
def _find(gkey: Any, c: int, g: int, key: int) -> int:
    for j in range(g):
        if gkey[c, j] == key:
            return j
    return -1


@jit(nogil=True)
def _drop(gtime: Any, gkey: Any, gfirst: Any, c: int, g: int, j: int) -> int:
    for m in range(j, g - 1):
        gtime[c, m], gkey[c, m], gfirst[c, m] = gtime[c, m + 1], gkey[c, m + 1], gfirst[c, m + 1]
    return g - 1


@jit(nogil=True)
def _insert(
    gtime: Any, gkey: Any, gfirst: Any, c: int, g: int, t: int, key: int, first: int
) -> int:
    m = g
    while m > 0 and gtime[c, m - 1] > t:
        gtime[c, m], gkey[c, m], gfirst[c, m] = gtime[c, m - 1], gkey[c, m - 1], gfirst[c, m - 1]
        m -= 1
    gtime[c, m], gkey[c, m], gfirst[c, m] = t, key, first
    return g + 1


@jit(nogil=True)
def _stack_pass(
    ids: Any,
    offsets: Any,
    num_tokens: Any,
    max_length: Any,
    bs: int,
    num_keys: int,
    caps: Any,
    hits: Any,
    evicted: Any,
    why: Any,
    control: Any,
    copies: bool,
) -> None:
    requests = offsets.shape[0] - 1
    ncap = caps.shape[0]
    # The stack: each key's last-use time (0: never), a Fenwick tree of the
    # live times; a request's keys take times deepest first, block 0 last.
    last = np.zeros(num_keys, dtype=np.int64)
    tree = np.zeros(ids.shape[0] + 2, dtype=np.int32)
    seen = np.full(num_keys, -1, dtype=np.int64)
    clock = 0
    live = 0
    # Per capacity: cached blocks, freed unhashed blocks, never-used blocks.
    cached = np.zeros(ncap, dtype=np.int64)
    unhashed = np.zeros(ncap, dtype=np.int64)
    fresh = caps.copy()
    max_u = 0
    for i in range(requests):
        max_u = max(max_u, offsets[i + 1] - offsets[i])
    depth = np.zeros(max_u + 1, dtype=np.int64)
    rank = np.zeros(max_u + 1, dtype=np.int64)
    dup = np.zeros(max_u + 1, dtype=np.int64)
    pinned = np.zeros(max_u + 1, dtype=np.int64)
    # Per capacity, its stale copies (a key's older block while vLLM holds
    # two), oldest first: time, key, whether it is the key's first copy.
    gtime = np.zeros((ncap, _COPIES), dtype=np.int64)
    gkey = np.zeros((ncap, _COPIES), dtype=np.int64)
    gfirst = np.zeros((ncap, _COPIES), dtype=np.int64)
    gcount = np.zeros(ncap, dtype=np.int64)
    gany = np.zeros(num_keys, dtype=np.int32)
    for i in range(requests):
        control[0] = i
        if control[1]:
            for c in range(ncap):
                why[c, 0] = STOPPED
            return
        o = offsets[i]
        u = offsets[i + 1] - o
        n = num_tokens[i]
        s = min(u, n // bs)
        blocks = -(-n // bs)
        head = min(max_length[i] // bs, u)
        repeated = False
        # Depths before the request (1: the most recent key), their running
        # maximum (a prefix is present at Q iff its maximum is <= Q) and the
        # minimum from each block on (a key past the hit present at Q).
        for x in range(s):
            key = ids[o + x]
            if seen[key] == i:
                repeated = True
            seen[key] = i
            t = last[key]
            depth[x] = _NEVER if t == 0 else live - _fenwick_prefix(tree, t) + 1
        for c in range(ncap):
            if why[c, 0] == TOO_SMALL:
                continue
            if blocks > caps[c]:
                why[c, 0], why[c, 1] = TOO_SMALL, i
                hits[c, i] = whatif_kernel.NOT_ADMITTED
                continue
            if repeated and why[c, 0] == EXACT:
                why[c, 0], why[c, 1] = REPEATED, i
            q = cached[c]
            g = gcount[c]
            exact = why[c, 0] == EXACT
            # Ranks in this capacity's order: the keys' and its stale copies'.
            if g:
                for x in range(s):
                    rank[x] = depth[x]
                    if depth[x] != _NEVER:
                        rank[x] += _newer(gtime, c, g, last[ids[o + x]])
            else:
                for x in range(s):
                    rank[x] = depth[x]
            k = 0
            top = 0
            while k < head and max(top, rank[k]) <= q:
                top = max(top, rank[k])
                k += 1
            ndup = 0
            for x in range(k, s):
                if rank[x] <= q:
                    dup[ndup] = x
                    ndup += 1
            if ndup and exact:
                bad = not copies or g + ndup + k > gtime.shape[1]
                for d in range(ndup):
                    if bad:
                        break
                    # a third copy is not modelled
                    bad = gany[ids[o + dup[d]]] > 0 and _find(gkey, c, g, ids[o + dup[d]]) >= 0
                if bad:
                    why[c, 0], why[c, 1] = DUPLICATE, i
                    exact = False
            # Past a duplicate or a repeat the pass goes on as a plain stack
            # algorithm would (what the tests show differing), not exact.
            hits[c, i] = k * bs
            need = blocks - k
            take = min(need, unhashed[c])
            unhashed[c] -= take
            need -= take
            take = min(need, fresh[c])
            fresh[c] -= take
            need -= take
            # what is left comes off the LRU end of the unpinned cached blocks
            evicted[c] += need
            if exact and copies and (ndup or g):
                # The pinned blocks: each hit key's first copy (its stale
                # one while that was cached first).
                npin = 0
                for x in range(k):
                    key = ids[o + x]
                    t = last[key]
                    if gany[key] > 0:
                        j = _find(gkey, c, g, key)
                        if j >= 0 and gfirst[c, j]:
                            t = gtime[c, j]
                    pinned[npin] = t
                    npin += 1
                keep = q - k - need  # unpinned blocks that survive, from the top
                # A touched key whose stale copy came first: the copy it did
                # not touch (its newest) is now the stale one, if it survives.
                for x in range(k):
                    key = ids[o + x]
                    if gany[key] == 0:
                        continue
                    j = _find(gkey, c, g, key)
                    if j < 0 or not gfirst[c, j]:
                        continue
                    t = last[key]
                    r = rank[x] - _count_newer(pinned, npin, t)
                    g = _drop(gtime, gkey, gfirst, c, g, j)
                    gany[key] -= 1
                    if r <= keep:
                        g = _insert(gtime, gkey, gfirst, c, g, t, key, 0)
                        gany[key] += 1
                # A recomputed present key: its old copy stays, stale, if it survives.
                for d in range(ndup):
                    x = dup[d]
                    key = ids[o + x]
                    t = last[key]
                    r = rank[x] - _count_newer(pinned, npin, t)
                    if r <= keep:
                        g = _insert(gtime, gkey, gfirst, c, g, t, key, 1)
                        gany[key] += 1
                gcount[c] = g
            cached[c] += s - k - need
            unhashed[c] += blocks - s
        for x in range(s - 1, -1, -1):
            key = ids[o + x]
            t = last[key]
            if t == 0:
                live += 1
            else:
                _fenwick_add(tree, t, -1)
            clock += 1
            last[key] = clock
            _fenwick_add(tree, clock, 1)
        # Stale copies past the end of the cache were evicted.
        for c in range(ncap):
            g = gcount[c]
            while g and why[c, 0] == EXACT:
                t = gtime[c, 0]
                r = live - _fenwick_prefix(tree, t) + g
                if r <= cached[c]:
                    break
                gany[gkey[c, 0]] -= 1
                g = _drop(gtime, gkey, gfirst, c, g, 0)
            gcount[c] = g
    control[0] = requests
