"""The compiled store fold: one open-addressing table keyed on whole hashes.

A slot is ``1 + M + W`` uint64 words: a meta word (the key's mixed hash in
bits 32-63, its byte width + 1 in bits 16-31, and with at most 16 groups the
group bits in bits 0-15; 0 = empty), ``M`` words of group bits when there
are more groups (bit ``g`` set when group ``g`` holds the key; ``M = 0``
otherwise) and ``W`` words of the key itself, zero-padded: 24 bytes a slot
for a 16-byte hash. Two keys are equal only when their widths and every
word agree, so an 8-byte hash never matches a 16-byte one that
starts with it, and the Mooncake importer's 16-byte hashes, which share
their first 8 bytes (``replay.sources.hashing.digest_pairs``: lane 0 is the
Mooncake id's), are told apart:
no fingerprint, no collision probability.

One table for all groups rather than one per group: a lookup probes each of
its hash units once and reads every group's bit from the same slot, and a
key several groups hold is stored once. Linear probing with backward-shift
deletion keeps removes from leaving tombstones (an LRU store removes
millions of keys); the table doubles in place when it passes 70% load
(``_double_in_place``: the slot of a key is its mixed hash scaled to the
table, so doubling only moves keys upward) and shrinks back when every
group is cleared. The key width ``W`` grows, by a rebuild, when a store
brings a longer hash than any before.

Everything here is ``nogil``: the reader's prefetch thread decodes the next
batch while a batch folds. The machine code is kept on disk where there is
a place for it (``replay.base.jit``, shared with the what-if's kernel), so only the first run after an
install compiles.
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Any

import numpy as np

from replay.base.errors import ReplayError
from replay.base.intrinsics import prefetch
from replay.base.jit import jit

if TYPE_CHECKING:
    from replay.format.hashwords import HashWords

# Row kinds as the kernel sees them (SKIP: a row that changes nothing).
STORE, REMOVE, CLEAR, LOOKUP, SKIP = 0, 1, 2, 3, 4

_INITIAL_SLOTS = 1 << 10
#: Hashes ahead whose home slot is prefetched (a power of two): a probe's
#: cache miss then overlaps the ones before it instead of stalling on a
#: mispredicted branch. 16 measured 10% faster than 8 on the bench trace.
_AHEAD = 16
_MAX_LOAD_NUM, _MAX_LOAD_DEN = 7, 10
_HIGH32 = np.uint64(0xFFFFFFFF00000000)
#: The meta bits that name the key (hash and width), not who holds it.
_KEY_BITS = np.uint64(0xFFFFFFFFFFFF0000)
_INLINE_GROUPS = 16
#: Widths + 1 live in 16 bits.
MAX_HASH_BYTES = 0xFFFE

# fold_batch's requests to its caller, besides growing (_WIDEN - h: widen
# the keys, then resume at hash h).
_REBUILD, _EMPTIED, _WIDEN = -1, -2, -3

# info[] fields: slots, keys, key words per slot, group-bit words, heap
# words used, and heap words a store asked for (0 once the heap has them).
_CAP, _COUNT, _W, _M, _HEAP_USED, _HEAP_NEED = 0, 1, 2, 3, 4, 5
#: The widest key kept in its slot, in words; a wider one lives in the heap.
_INLINE_WORDS = 4


@jit(nogil=True)
def mix(z: Any) -> Any:
    # splitmix64's finaliser: every input bit reaches every output bit, so
    # integer ids written as big-endian bytes spread as well as digests do.
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@jit(nogil=True)
def key_meta(words: Any, start: int, nwords: int, nbytes: int) -> Any:
    # Each word times its own odd constant (independent multiplies, no
    # chain), then one full mix: equal sums of distinct keys only cost a
    # longer probe, since a match compares every word.
    acc = np.uint64(nbytes) * np.uint64(0x9E3779B97F4A7C15)
    k = np.uint64(0xD6E8FEB86659FD93)
    for i in range(nwords):
        w = words[start + i] * k
        acc ^= (w << np.uint64(29)) | (w >> np.uint64(35))
        k += np.uint64(0x9E3779B97F4A7C16)
    return (mix(acc) & _HIGH32) | (np.uint64(nbytes + 1) << np.uint64(16))


@jit(nogil=True)
def _bit(slots: Any, base: int, m: int, g: int) -> Any:
    """Whether group ``g`` holds the key of the slot at ``base``."""
    if m == 0:
        return (slots[base] >> np.uint64(g)) & np.uint64(1)
    return (slots[base + 1 + (g >> 6)] >> np.uint64(g & 63)) & np.uint64(1)


@jit(nogil=True)
def _set_bit(slots: Any, base: int, m: int, g: int, on: bool) -> None:
    i = base if m == 0 else base + 1 + (g >> 6)
    bit = np.uint64(1) << np.uint64(g if m == 0 else g & 63)
    if on:
        slots[i] |= bit
    else:
        slots[i] &= ~bit


@jit(nogil=True)
def _live(slots: Any, base: int, m: int) -> Any:
    """Some group holds the key of the slot at ``base``."""
    if m == 0:
        return (slots[base] & ~_KEY_BITS) != 0
    for j in range(m):  # noqa: SIM110 (a loop numba compiles; no generator)
        if slots[base + 1 + j] != 0:
            return True
    return False


@jit(nogil=True)
def _home(meta: Any, cap: int) -> Any:
    return np.int64(((meta >> np.uint64(32)) * np.uint64(cap)) >> np.uint64(32))


@jit(nogil=True, inline="always")
def _find(
    slots: Any,
    heap: Any,
    cap: int,
    stride: int,
    m: int,
    meta: Any,
    words: Any,
    start: int,
    nwords: int,
) -> Any:
    """The slot holding the key, or -(the empty slot where it would go) - 1.
    A key wider than ``_INLINE_WORDS`` is compared with its words in ``heap``
    (the meta word, which holds the width, already agreed).

    Inlined into ``fold_batch`` (numba's ``inline="always"``), as is
    ``_delete``: LLVM did not inline them, and a call of a compiled function
    passes each array as seven words, most of them on the stack; inlined,
    the fold's CPU on the 300k-request day fell by 30%. No call with an
    array should stay in the probe loop: a ``_find`` split in two (the
    heap's compare out of line, so that LLVM would inline the rest) left
    one and measured 25% slower than this one inlined whole."""
    i = _home(meta, cap)
    while True:
        base = i * stride
        sm = slots[base]
        if sm == 0:
            return -i - 1
        if (sm & _KEY_BITS) == meta:
            k = base + 1 + m
            same = True
            if nwords > _INLINE_WORDS:
                at = np.int64(slots[k])
                for j in range(nwords):
                    if heap[at + j] != words[start + j]:
                        same = False
                        break
            else:
                for j in range(nwords):
                    if slots[k + j] != words[start + j]:
                        same = False
                        break
            if same:
                return i
        i += 1
        if i == cap:
            i = 0


@jit(nogil=True)
def _place(slots: Any, info: Any, src: Any, sbase: int, sw: int) -> None:
    """Insert a slot copied from another layout (growth, width change)."""
    cap, w, m = info[_CAP], info[_W], info[_M]
    stride = 1 + m + w
    meta = src[sbase]
    i = _home(meta, cap)
    while slots[i * stride] != 0:
        i += 1
        if i == cap:
            i = 0
    base = i * stride
    slots[base] = meta
    for j in range(m):
        slots[base + 1 + j] = src[sbase + 1 + j]
    for j in range(sw):
        slots[base + 1 + m + j] = src[sbase + 1 + m + j]
    info[_COUNT] += 1


@jit(nogil=True)
def _rehash(slots: Any, info: Any, new: Any, cap: int, w: int) -> None:
    """Copy the live slots (some group bit set) into ``new``, a zeroed table
    of ``cap`` slots and key width ``w`` words."""
    old_cap, old_w, m = info[_CAP], info[_W], info[_M]
    old_stride = 1 + m + old_w
    info[_CAP], info[_W], info[_COUNT] = cap, w, 0
    for i in range(old_cap):
        base = i * old_stride
        if slots[base] != 0 and _live(slots, base, m):
            _place(new, info, slots, base, min(old_w, w))


@jit(nogil=True)
def _double_in_place(slots: Any, info: Any) -> int:
    """Rehash the table into twice its slots, in place: ``slots`` holds the
    table, then as many zero words again.

    A key's home at twice the slots is twice its old home (or one more),
    so walking the old slots from the top down moves each key up into the
    part already rehashed: probing from a home at or above the current
    slot only meets slots already in the new layout, and the slots emptied
    later all lie below. The few keys whose new home lies below their old
    slot (a probe run that started near slot 0 or wrapped around the end)
    wait in a side buffer and are inserted last; returns how many."""
    old_cap, w, m = info[_CAP], info[_W], info[_M]
    stride = 1 + m + w
    cap = old_cap * 2
    info[_CAP] = cap
    spill = np.empty(64 * stride, dtype=np.uint64)
    spilled = 0
    for i in range(old_cap - 1, -1, -1):
        base = i * stride
        meta = slots[base]
        if meta == 0:
            continue
        home = _home(meta, cap)
        p = home
        if home >= i:
            slots[base] = 0  # free for the probe: the key may stay where it is
            while p < cap and slots[p * stride] != 0:
                p += 1
            slots[base] = meta
        if home >= i and p < cap:
            if p != i:
                for k in range(stride):
                    slots[p * stride + k] = slots[base + k]
                    slots[base + k] = 0
            continue
        if (spilled + 1) * stride > spill.shape[0]:
            wider = np.empty(spill.shape[0] * 2, dtype=np.uint64)
            for k in range(spilled * stride):  # a loop: a slice copy compiled for 2 s
                wider[k] = spill[k]
            spill = wider
        for k in range(stride):
            spill[spilled * stride + k] = slots[base + k]
            slots[base + k] = 0
        spilled += 1
    info[_COUNT] -= spilled
    for j in range(spilled):
        _place(slots, info, spill, j * stride, w)
    return spilled


@jit(nogil=True, inline="always")
def _delete(slots: Any, info: Any, i: int, stride: int) -> None:
    """Empty slot ``i`` of a table of ``stride`` words a slot and shift later
    members of its probe run back, so a search never stops early at the
    hole (no tombstones). ``fold_batch`` inlines it with the common strides
    as constants: each slot moved is then a few fixed moves, not a loop."""
    cap = info[_CAP]
    hole = i
    j = i
    while True:
        j += 1
        if j == cap:
            j = 0
        meta = slots[j * stride]
        if meta == 0:
            break
        home = _home(meta, cap)
        # Move j into the hole unless its home lies cyclically in (hole, j].
        stays = hole < home <= j if hole <= j else home > hole or home <= j
        if not stays:
            for k in range(stride):
                slots[hole * stride + k] = slots[j * stride + k]
            hole = j
    for k in range(stride):
        slots[hole * stride + k] = 0
    info[_COUNT] -= 1


@jit(nogil=True)
def _span(voff: Any, base: int, stride: int, width: int, h: int) -> Any:
    """Hash ``h``'s first word, words and bytes (``HashWords``' layouts)."""
    fixed = voff.shape[0] == 0
    nb = np.int64(width) if fixed else np.int64(voff[h + 1]) - np.int64(voff[h])
    if stride < 0:  # packed: the second half of voff holds each hash's first word
        start = np.int64(voff[(voff.shape[0] >> 1) + h])
    elif stride == 0:
        start = (np.int64(voff[h]) - base) >> 3
    else:
        start = np.int64(h) * stride
    return start, (nb + 7) >> 3, nb


@jit(nogil=True)
def _ahead(slots: Any, at: int, last: int, after: int) -> None:
    """Prefetch the three cache lines from the slot at word ``at``, and its
    last word ``last`` words on and (for a remove) the next slot's meta
    word ``after`` words on where those lie further. A probe reads past its
    home slot often: on the 300k-request day a store of a new key probes
    2.3 slots on average, a lookup 1.7 and a remove's backward shift 3 (24
    bytes a slot); prefetching the home slot's lines alone (its first and
    last word) left those reads missing, and with three lines the fold
    took 11% less CPU than that (two lines: 6%). A prefetch past the
    table's end is harmless: a hint, it never faults."""
    prefetch(slots, at)
    prefetch(slots, at + 8)
    prefetch(slots, at + 16)
    if last >= 16:
        prefetch(slots, at + last)
    if after >= 16:
        prefetch(slots, at + after)


@jit(nogil=True, inline="always")
def _fixed_metas(words: Any, metas: Any, nw: int) -> None:
    """``_metas`` of hashes of ``nw`` words each, back to back."""
    for h in range(metas.shape[0]):
        metas[h] = key_meta(words, nw * h, nw, 8 * nw)


@jit(nogil=True)
def _metas(words: Any, voff: Any, base: int, stride: int, width: int, metas: Any) -> None:
    """Every hash's ``key_meta``, in one branch-free pass ahead of the fold
    (computed inside the probe loop they measured 10-25% slower). Hashes
    of one width packed word to word (``HashWords``' fixed layout) with a
    constant word count for the common widths: the loop then vectorises
    (16-byte hashes: 1.0 ns a hash against 3.4 through ``_span``; 8-byte
    ones, a watch's: 0.6 against 3.2)."""
    if voff.shape[0] == 0 and stride * 8 == width:
        # Inlined with the word count a constant (8 bytes: vLLM's integers,
        # as a live source sends them; 16 and 32: digests).
        if width == 8:
            _fixed_metas(words, metas, 1)
            return
        if width == 16:
            _fixed_metas(words, metas, 2)
            return
        if width == 32:
            _fixed_metas(words, metas, 4)
            return
    for h in range(metas.shape[0]):
        s, nw, nb = _span(voff, base, stride, width, h)
        metas[h] = key_meta(words, s, nw, nb)


def key_metas(
    words: HashWords, into: np.ndarray[Any, np.dtype[np.uint64]] | None = None
) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """Every hash's ``key_meta`` (``fold_batch``'s ``metas``), in ``into``
    when it is long enough. They depend on the hashes alone, not on the
    table: the replay computes them on the reader's thread, ahead of the
    fold (``replay.engine.shard.scatter``)."""
    n = words.num_hashes
    metas = into[:n] if into is not None and into.shape[0] >= n else np.empty(n, dtype=np.uint64)
    _metas(words.words, words.value_offsets, words.base, words.stride, words.width, metas)
    return metas


@jit(nogil=True)
def fold_batch(
    slots: Any,
    heap: Any,
    info: Any,
    kinds: Any,
    gids: Any,
    row_off: Any,
    words: Any,
    voff: Any,
    base: int,
    stride: int,
    width: int,
    out: Any,
    out_off: Any,
    num_groups: int,
    metas: Any,
    resume_row: int,
    resume_hash: int,
    stop_group: int,
    stop_k: int,
    stop_tail: int,
) -> Any:
    """Fold one batch of rows in order, from row ``resume_row`` (its hashes
    from ``resume_hash``). Returns ``(-1, 0)`` when done, else where to
    resume once the caller has changed the table: ``(row, hash)`` to grow
    it, ``(row, _REBUILD)`` to rebuild it (a group was cleared),
    ``(row, _EMPTIED)`` to start it afresh (every group was cleared),
    ``(row, _WIDEN - hash)`` to widen its keys (a store of a hash longer
    than any before), ``(row, hash)`` with ``info[_HEAP_NEED]`` set to grow
    the heap (a key wider than ``_INLINE_WORDS`` has no room there).

    Row ``r`` owns hashes ``row_off[r]:row_off[r + 1]``; hash ``h`` is laid
    out in ``words`` as ``_span`` reads ``voff``, ``base``, ``stride`` and
    ``width`` (``replay.format.hashwords.HashWords``). A lookup row writes ``n``
    presence bytes per group at ``out[out_off[r] + g * n]``: 1 when group
    ``g`` holds the key of hash unit ``u`` at that point. ``gids[r] == -1``
    on a clear means every group; ``metas[h]`` is hash ``h``'s
    ``key_meta``. Tables are allocated by the caller (``KeyTable``).

    With ``stop_group >= 0`` a lookup's probes stop ``stop_tail`` units
    after the first unit ``u`` with ``u % stop_k == stop_k - 1`` that group
    ``stop_group`` does not hold (``replay.rules.compiled.tables.probe_stop``:
    no answer reads past there); the units after stay 0.
    """
    m = info[_M]
    # Hashes of one width in whole words, back to back (``HashWords``' fixed
    # layout: vLLM's digests, the importers' ids), of at most
    # ``_INLINE_WORDS``: hash ``h`` is the ``stride`` words at
    # ``h * stride``: no ``_span`` per hash, no width past MAX_HASH_BYTES.
    fixed = voff.shape[0] == 0 and 0 < stride <= _INLINE_WORDS and stride * 8 == width
    for r in range(resume_row, kinds.shape[0]):
        kind = kinds[r]
        lo, hi = row_off[r], row_off[r + 1]
        if r == resume_row:
            lo = max(lo, resume_hash)
        if kind == SKIP or (kind != CLEAR and lo == hi):
            continue
        g = gids[r]
        # One runtime flag for _set_bit: literal True and False compiled it
        # twice (0.08 s more on a cold JIT cache).
        adds = kind == STORE
        stride_w = 1 + m + info[_W]
        cap = info[_CAP]
        if kind == CLEAR:
            if g < 0:
                return r + 1, _EMPTIED
            for i in range(cap):
                if slots[i * stride_w] != 0:
                    _set_bit(slots, i * stride_w, m, g, adds)
            return r + 1, _REBUILD
        # A remove also reads the slot after its key's (the backward shift).
        after = stride_w if kind == REMOVE else 0
        for h in range(lo, min(hi, lo + _AHEAD)):
            _ahead(slots, _home(metas[h], cap) * stride_w, stride_w - 1, after)
        n = hi - row_off[r]
        o = out_off[r]
        # Where this row's probes end (a lookup's may end early, see above).
        last = hi
        for h in range(lo, hi):
            if h >= last:
                break
            meta = metas[h]
            if h + _AHEAD < last:
                _ahead(slots, _home(metas[h + _AHEAD], cap) * stride_w, stride_w - 1, after)
            if fixed:
                s, nw = h * stride, stride
            else:
                s, nw, nb = _span(voff, base, stride, width, h)
                if nb > MAX_HASH_BYTES:
                    return r, _WIDEN - h
            if info[_W] < nw <= _INLINE_WORDS:
                if kind == STORE:
                    return r, _WIDEN - h
                continue  # longer than every stored key: absent everywhere
            if kind == STORE and (info[_COUNT] + 1) * _MAX_LOAD_DEN > cap * _MAX_LOAD_NUM:
                return r, h
            # One probe for every kind: one inlined copy of _find, not three.
            i = _find(slots, heap, cap, stride_w, m, meta, words, s, nw)
            if kind == STORE:
                if i < 0:
                    out_of_line = nw > _INLINE_WORDS
                    if out_of_line and info[_HEAP_USED] + nw > heap.shape[0]:
                        info[_HEAP_NEED] = nw
                        return r, h
                    i = -i - 1
                    b = i * stride_w
                    slots[b] = meta
                    if out_of_line:
                        at = info[_HEAP_USED]
                        for j in range(nw):
                            heap[at + j] = words[s + j]
                        info[_HEAP_USED] = at + nw
                        slots[b + 1 + m] = np.uint64(at)
                    else:
                        for j in range(nw):
                            slots[b + 1 + m + j] = words[s + j]
                    info[_COUNT] += 1
                _set_bit(slots, i * stride_w, m, g, adds)
            elif kind == REMOVE:
                if i < 0:
                    continue  # removing an absent key is not an error (the format)
                b = i * stride_w
                _set_bit(slots, b, m, g, adds)
                if not _live(slots, b, m):
                    # A copy per common slot (8-, 16- and 32-byte keys, at
                    # most 16 groups) with its stride a constant: 5% less
                    # of the fold's CPU on the 300k-request day.
                    if stride_w == 3:
                        _delete(slots, info, i, 3)
                    elif stride_w == 5:
                        _delete(slots, info, i, 5)
                    elif stride_w == 2:
                        _delete(slots, info, i, 2)
                    else:
                        _delete(slots, info, i, stride_w)
            elif kind == LOOKUP:
                u = h - row_off[r]
                if i >= 0:
                    for gg in range(num_groups):
                        out[o + gg * n + u] = np.uint8(_bit(slots, i * stride_w, m, gg))
                # else out stays zeroed: absent in every group
                if (
                    stop_group >= 0
                    and (stop_k == 1 or u % stop_k == stop_k - 1)  # no division per unit
                    and (i < 0 or not _bit(slots, i * stride_w, m, stop_group))
                ):
                    last = min(last, h + stop_tail + 1)
    return -1, 0


@jit(nogil=True)
def _group_counts(slots: Any, info: Any, num_groups: int) -> Any:
    cap, w, m = info[_CAP], info[_W], info[_M]
    stride = 1 + m + w
    counts = np.zeros(num_groups, dtype=np.int64)
    for i in range(cap):
        base = i * stride
        if slots[base] == 0:
            continue
        for g in range(num_groups):
            if _bit(slots, base, m, g):
                counts[g] += 1
    return counts


@jit(nogil=True)
def _heap_live(slots: Any, info: Any) -> Any:
    """The heap words the table's keys use (removed keys' words are not)."""
    cap, w, m = info[_CAP], info[_W], info[_M]
    stride = 1 + m + w
    live = np.int64(0)
    for i in range(cap):
        meta = slots[i * stride]
        nw = ((np.int64((meta >> np.uint64(16)) & np.uint64(0xFFFF)) - 1) + 7) >> 3
        if meta != 0 and nw > _INLINE_WORDS:
            live += nw
    return live


@jit(nogil=True)
def _compact_heap(slots: Any, info: Any, heap: Any, new: Any) -> Any:
    """Copy the heap words of every key in the table (the out-of-line ones)
    into ``new``, in slot order, pointing their slots there; the words of
    removed keys are left behind. Returns the words copied."""
    cap, w, m = info[_CAP], info[_W], info[_M]
    stride = 1 + m + w
    used = np.int64(0)
    for i in range(cap):
        base = i * stride
        meta = slots[base]
        if meta == 0:
            continue
        nb = np.int64((meta >> np.uint64(16)) & np.uint64(0xFFFF)) - 1
        nw = (nb + 7) >> 3
        if nw <= _INLINE_WORDS:
            continue
        at = np.int64(slots[base + 1 + m])
        for j in range(nw):
            new[used + j] = heap[at + j]
        slots[base + 1 + m] = np.uint64(used)
        used += nw
    info[_HEAP_USED] = used
    return used


def _zeroed_map(nbytes: int) -> mmap.mmap | None:
    """Zeroed anonymous memory that ``_extend`` can grow in place (Linux's
    ``mremap``: the pages already there stay, only the new ones fault in),
    or None where private anonymous maps are not available."""
    if not hasattr(mmap, "MAP_PRIVATE"):
        return None
    mem = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # Huge pages: a probe into hundreds of MB misses the TLB far less.
        mem.madvise(mmap.MADV_HUGEPAGE)
    return mem


class KeyTable:
    """The present ``(group_id, hash)`` keys of every group, folded batch by
    batch in compiled code (see the module docstring for the layout).

    The slots live in an anonymous memory map rather than a numpy
    allocation: doubling a table of hundreds of MB by allocating a new one
    faulted in twice the final size and, with huge pages, could stall for
    tenths of a second in the kernel's compaction (measured on the bench
    trace: 0.4-0.9 s of system time); extended in place it faults in only
    the new half and the old and new tables never coexist."""

    __slots__ = ("_mem", "_metas", "heap", "info", "num_groups", "slots", "stop")

    def __init__(self, num_groups: int, stop: tuple[int, int, int] | None = None) -> None:
        self.num_groups = num_groups
        #: Where a lookup's probes may stop (``fold_batch``'s ``stop_*``):
        #: ``replay.rules.compiled.tables.probe_stop``'s answer, or None to
        #: probe every unit (the presence bytes are then complete).
        self.stop = stop
        mask_words = 0 if num_groups <= _INLINE_GROUPS else (num_groups + 63) // 64
        self.info = np.array([_INITIAL_SLOTS, 0, 1, mask_words, 0, 0], dtype=np.int64)
        self._mem: mmap.mmap | None = None
        self._metas = np.zeros(0, dtype=np.uint64)
        self.slots = self._zeros(_INITIAL_SLOTS * (2 + mask_words))
        # The words of keys wider than _INLINE_WORDS (none until one comes).
        self.heap = np.zeros(0, dtype=np.uint64)

    def _zeros(self, words: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
        """A zeroed table of ``words`` words in memory of its own (the old
        map is unmapped once the last view of it goes)."""
        self._mem = _zeroed_map(words * 8)
        if self._mem is None:
            return np.zeros(words, dtype=np.uint64)
        return np.frombuffer(self._mem, dtype=np.uint64, count=words)

    def _extend(self, words: int) -> None:
        """Make the table ``words`` words long, its contents kept and the
        new words zero: in place where the map can be resized, else copied."""
        n = self.slots.shape[0]
        old = self.slots
        if self._mem is not None:
            self.slots = old = _NO_SLOTS  # a map resizes only with no view left
            try:
                self._mem.resize(words * 8)
            except (OSError, SystemError, ValueError, BufferError):
                old = np.frombuffer(self._mem, dtype=np.uint64, count=n)  # no mremap (macOS)
            else:
                self.slots = np.frombuffer(self._mem, dtype=np.uint64, count=words)
                return
        new = self._zeros(words)
        new[:n] = old
        self.slots = new

    def fold(
        self,
        kinds: np.ndarray[Any, Any],
        gids: np.ndarray[Any, Any],
        words: HashWords,
        out: np.ndarray[Any, Any],
        out_offsets: np.ndarray[Any, Any],
        metas: np.ndarray[Any, np.dtype[np.uint64]] | None = None,
    ) -> None:
        """Fold a batch of rows (``fold_batch``), widening the key words
        when a store brings a longer hash than any before. ``metas``: the
        hashes' ``key_metas`` when the caller made them, else made here."""
        n = words.num_hashes
        if metas is None:
            if self._metas.shape[0] < n:
                # Kept from batch to batch: a fresh array each time faulted
                # in new pages every batch.
                self._metas = np.empty(max(n, 2 * self._metas.shape[0]), dtype=np.uint64)
            metas = key_metas(words, self._metas)
        elif metas.shape[0] != n:
            raise ValueError(f"{metas.shape[0]} key metas for {n} hashes")
        row, at = 0, 0
        while row >= 0:
            row, at = fold_batch(
                self.slots,
                self.heap,
                self.info,
                kinds,
                gids,
                words.row_offsets,
                words.words,
                words.value_offsets,
                words.base,
                words.stride,
                words.width,
                out,
                out_offsets,
                self.num_groups,
                metas,
                row,
                at,
                *(self.stop or (-1, 1, 0)),
            )
            cap, w = int(self.info[_CAP]), int(self.info[_W])
            if row < 0:
                break
            if at == _EMPTIED:
                # Back to the initial size: a cleared store gives its memory back.
                self.slots = self._zeros(_INITIAL_SLOTS * (1 + int(self.info[_M]) + w))
                self.info[_CAP], self.info[_COUNT] = _INITIAL_SLOTS, 0
                self.heap = np.zeros(0, dtype=np.uint64)
                self.info[_HEAP_USED] = 0
                at = 0
            elif self.info[_HEAP_NEED]:
                self._grow_heap(int(self.info[_HEAP_NEED]))
            elif at == _REBUILD:
                self._rebuild(cap, w)
                at = 0
            elif at <= _WIDEN:
                widest = words.max_bytes
                if widest > MAX_HASH_BYTES:
                    raise ReplayError(
                        f"a block hash of {widest} bytes: longer than {MAX_HASH_BYTES} "
                        "bytes, the most the store keys"
                    )
                # The widest key kept in its slot: a wider one goes to the heap.
                inline = words.nbytes[words.nbytes <= 8 * _INLINE_WORDS]
                need = (int(inline.max()) + 7) // 8 if inline.shape[0] else 1
                self._rebuild(cap, max(w, need))
                at = _WIDEN - at
            else:
                self._extend(2 * cap * (1 + int(self.info[_M]) + w))
                _double_in_place(self.slots, self.info)

    def _grow_heap(self, need: int) -> None:
        """Room for ``need`` more heap words: the live keys' words copied
        into a heap of twice what they and ``need`` take (removed keys'
        words are dropped on the way), so the heap holds at most twice
        what its keys ever took."""
        live = int(_heap_live(self.slots, self.info)) if self.info[_HEAP_USED] else 0
        grown = np.zeros(max(1024, 2 * (live + need)), dtype=np.uint64)
        if self.info[_HEAP_USED]:
            _compact_heap(self.slots, self.info, self.heap, grown)
        self.heap = grown
        self.info[_HEAP_NEED] = 0

    def _rebuild(self, cap: int, w: int) -> None:
        """Rehash the live slots into a fresh table of ``cap`` slots of key
        width ``w`` words (a group was cleared, or a wider hash came)."""
        new = self._zeros(cap * (1 + int(self.info[_M]) + w))
        if self.info[_COUNT]:
            _rehash(self.slots, self.info, new, cap, w)
        else:
            # The first store's width: nothing to move (and on a cold JIT
            # cache nothing to compile for it).
            self.info[_CAP], self.info[_W] = cap, w
        self.slots = new

    def group_counts(self) -> list[int]:
        """Keys each group holds."""
        return [int(c) for c in _group_counts(self.slots, self.info, self.num_groups)]

    @property
    def num_keys(self) -> int:
        """Distinct hashes some group holds."""
        return int(self.info[_COUNT])

    @property
    def nbytes(self) -> int:
        return int(self.slots.nbytes + self.heap.nbytes)


_NO_SLOTS = np.zeros(0, dtype=np.uint64)
