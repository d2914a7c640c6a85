"""The store rules of a request, compiled: which blocks a prefill caches
(``replay.rules.store_rules.StoreRules``), for the what-if's pools
(``replay.whatif.kernel``, ``replay.whatif.mooncake_kernel``): the cacheable
length, the replay boundaries, the prefill's chunk ends and the blocks each
group stores. Parameters are ``replay.whatif.kernel_config``'s ``P_*``."""

from __future__ import annotations

from typing import Any

from replay.base.jit import jit
from replay.rules.compiled.finders import cdiv
from replay.whatif.kernel_config import (
    MAMBA,
    P_A,
    P_ANY_EAGLE,
    P_BUDGET,
    P_HAS_MAMBA,
    P_HBS,
    P_LOOKAHEAD,
    P_RETENTION,
    P_UNITARY,
    SWA,
)


@jit(nogil=True)
def cacheable(params: Any, groups: Any, g: int, tokens: int, hashed: int) -> int:
    if params[P_UNITARY]:
        out = tokens
    else:
        a = params[P_A]
        out = tokens // a * a
        if groups[g, 4] and out > 0:
            out = min(tokens, out + groups[g, 1])
    return min(out, hashed)


@jit(nogil=True)
def boundaries(params: Any, n: int, junction: int, eagle_group: bool, bs: int, out: Any) -> int:
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
def checkpoint(params: Any, n: int, alignment: int) -> int:
    """``store_rules.checkpoint_position``: the last position a later hit can
    resume a Mamba state from, below N - 1 (N - lookahead), one block lower
    with EAGLE's drop."""
    if params[P_ANY_EAGLE]:
        return max(n // alignment * alignment - alignment, 0)
    lookahead: int = params[P_LOOKAHEAD]
    return max((n - max(1, lookahead)) // alignment * alignment, 0)


@jit(nogil=True)
def chunk_ends(params: Any, n: int, hit: int, junction: int, ends: Any) -> int:
    a, budget = params[P_A], params[P_BUDGET]
    last_cache = checkpoint(params, n, a)
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
def stores(
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
        nb = boundaries(params, n, junction, eagle, bs, bounds)
        if kind == MAMBA:
            cached = hit // bs
            prev = hit
            last = -1
            # The prompt's tail state, keyed at its last reusable hash unit
            # whatever the retention (``StoreRules._mamba``'s ``tail``).
            tail = checkpoint(params, n, params[P_HBS])
            for e in range(num_ends):
                end = ends[e]
                tokens = cacheable(params, groups, g, end, hashed)
                full = tokens // bs
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
                if (
                    tail
                    and tokens == tail
                    and tail % bs == 0
                    and tail > hit
                    and tail in (prev, end)
                ):
                    stored[g, tail // bs - 1] = stamp
                prev = end
            continue
        start = hit // bs
        end = cacheable(params, groups, g, n, hashed) // bs
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
        need = cdiv(groups[g, 2] - 1, bs) + (1 if eagle else 0)
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
