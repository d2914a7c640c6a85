"""The per-kind hit finders, compiled: ``replay.rules.coordinator.finders``
line for line, over a flat presence array.

A spec group's presence is ``p[off + x]`` for its hash units ``x < u``
(1: every member holds the key of unit ``x``); a block of ``k`` hash units is
named by its last unit, so block ``i`` is present when ``p[off + i*k + k-1]``
is (the reference's ``block_view``). Each finder returns what the
reference's ``FinderResult`` holds: null blocks, loaded blocks, the hit and
the matched length before the EAGLE drop. Slices in the reference are
bounded by the same lengths here (a bound is never negative: the trace's
``max_length`` is validated, and the fixed point only shrinks it).
"""

from __future__ import annotations

from typing import Any

from replay.base.jit import jit
from replay.rules.compiled.tables import FA, MAMBA, SP_BS, SP_CHUNK, SP_KIND, SP_WINDOW, SWA


@jit(nogil=True)
def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers (the reference's ``finders.cdiv``)."""
    return -(-a // b)


@jit(nogil=True, inline="always")
def _fine_view(block_size: int, alignment: int) -> bool:
    return alignment < block_size and block_size % alignment == 0


@jit(nogil=True)
def prefix_blocks(p: Any, off: int, k: int, start: int, limit: int) -> int:
    """Present blocks from block ``start`` on, at most ``limit``: the first
    absent one ends any hit (chained hashes)."""
    for i in range(limit):
        if p[off + (start + i) * k + k - 1] == 0:
            return i
    return limit


@jit(nogil=True)
def find_full(
    p: Any, off: int, u: int, hbs: int, bs: int, max_length: int, drop: bool, align: int
) -> Any:
    k = bs // hbs
    blocks = prefix_blocks(p, off, k, 0, min(max_length // bs, u // k))
    hit = blocks * bs
    if _fine_view(bs, align):
        # Into the first incomplete block: its hash-unit boundaries, longest first.
        scale = bs // align
        first = blocks * scale
        last = min(first + scale - 1, max_length // align, u)
        for x in range(last - 1, first - 1, -1):
            if p[off + x] == 1:
                blocks += 1
                hit = (x + 1) * align
                break
    matched = hit
    if drop and hit > 0:
        hit -= min(align, bs)
    hit -= hit % align
    return 0, min(blocks, cdiv(hit, bs)), hit, matched


@jit(nogil=True)
def find_sliding_window(
    p: Any,
    off: int,
    u: int,
    hbs: int,
    bs: int,
    max_length: int,
    drop: bool,
    align: int,
    window: int,
    align_before_pop: bool,
) -> Any:
    k = bs // hbs
    need = cdiv(window - 1, bs) + (1 if drop else 0)
    max_blocks = max_length // bs
    run = 0
    length = -1
    nulls = 0
    for i in range(min(max_blocks, u // k) - 1, -1, -1):
        if p[off + i * k + k - 1]:
            if run == 0 and bs != align:
                post_pop = i if drop and not align_before_pop else i + 1
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
def find_chunked(p: Any, off: int, u: int, hbs: int, bs: int, max_length: int, chunk: int) -> Any:
    k = bs // hbs
    max_blocks = max_length // bs
    start = (max_length // chunk * chunk if max_length > 0 else 0) // bs
    limit = min(max(0, max_blocks - start), max(0, u // k - start))
    loaded = prefix_blocks(p, off, k, start, limit)
    hit = (start + loaded) * bs
    return start, loaded, hit, hit


@jit(nogil=True)
def find_mamba(p: Any, off: int, u: int, hbs: int, bs: int, max_length: int, align: int) -> Any:
    # No EAGLE drop: the state at a block is the state after it (#43559).
    if _fine_view(bs, align):
        for x in range(min(max_length // align, u) - 1, -1, -1):
            if p[off + x] == 1:
                hit = (x + 1) * align
                return x // (bs // align), 1, hit, hit
        return 0, 0, 0, 0
    k = bs // hbs
    max_blocks = min(max_length // bs, u // k)
    # Only blocks whose end is aligned hold a resumable state.
    step = max(1, align // bs)
    if max_blocks < step:
        return 0, 0, 0, 0
    i = step - 1 + ((max_blocks - step) // step) * step
    while i >= 0:
        if p[off + i * k + k - 1]:
            hit = (i + 1) * bs
            return i, 1, hit, hit
        i -= step
    return 0, 0, 0, 0


@jit(nogil=True)
def find(
    specs: Any,
    s: int,
    p: Any,
    off: int,
    u: int,
    hbs: int,
    bound: int,
    drop: bool,
    align: int,
    align_before_pop: bool,
) -> Any:
    """Spec group ``s``'s finder (the reference's ``FINDERS[kind]``)."""
    kind, bs = specs[s, SP_KIND], specs[s, SP_BS]
    if kind == FA:
        return find_full(p, off, u, hbs, bs, bound, drop, align)
    if kind == SWA:
        return find_sliding_window(
            p, off, u, hbs, bs, bound, drop, align, specs[s, SP_WINDOW], align_before_pop
        )
    if kind == MAMBA:
        return find_mamba(p, off, u, hbs, bs, bound, align)
    return find_chunked(p, off, u, hbs, bs, bound, specs[s, SP_CHUNK])
