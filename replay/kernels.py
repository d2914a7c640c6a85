"""The compiled store fold: one open-addressing table keyed on whole hashes.

A slot is ``1 + M + W`` uint64 words: a meta word (the key's mixed hash in
bits 32-63, its byte width + 1 in bits 16-31, and with at most 16 groups the
group bits in bits 0-15; 0 = empty), ``M`` words of group bits when there
are more groups (bit ``g`` set when group ``g`` holds the key; ``M = 0``
otherwise) and ``W`` words of the key itself, zero-padded: 24 bytes a slot
for a 16-byte hash. Two keys are equal only when their widths and every
word agree, so an 8-byte hash never matches a 16-byte one that
starts with it, and the Mooncake importer's 16-byte hashes, which share
their first 8 bytes (shared/design/performance-notes.md), are told apart:
no fingerprint, no collision probability.

One table for all groups rather than one per group: a lookup probes each of
its hash units once and reads every group's bit from the same slot, and a
key several groups hold is stored once. Linear probing with backward-shift
deletion keeps removes from leaving tombstones (an LRU store removes
millions of keys); the table doubles when it passes 70% load and
shrinks back when every group is cleared.

Everything here is ``nogil``: the reader's prefetch thread decodes the next
batch while a batch folds. ``cache=True`` keeps the machine code on disk,
so only the first run after an install compiles.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from replay.errors import ReplayError

# Row kinds as the kernel sees them (SKIP: a row that changes nothing).
STORE, REMOVE, CLEAR, LOOKUP, SKIP = 0, 1, 2, 3, 4

_INITIAL_SLOTS = 1 << 10
#: Hashes ahead whose home slot is prefetched: a probe's cache miss then
#: overlaps the ones before it instead of stalling on a mispredicted branch.
_AHEAD = 8
_MAX_LOAD_NUM, _MAX_LOAD_DEN = 7, 10
_HIGH32 = np.uint64(0xFFFFFFFF00000000)
#: The meta bits that name the key (hash and width), not who holds it.
_KEY_BITS = np.uint64(0xFFFFFFFFFFFF0000)
_INLINE_GROUPS = 16
#: Widths + 1 live in 16 bits.
MAX_HASH_BYTES = 0xFFFE

# fold_batch's requests to its caller, besides growing.
_REBUILD, _EMPTIED = -1, -2

# info[] fields
_CAP, _COUNT, _W, _M = 0, 1, 2, 3


@intrinsic
def _prefetch_intrinsic(typingctx: Any, arr: Any, idx: Any) -> Any:
    """Hint the CPU to fetch ``arr[idx]`` into cache (LLVM's prefetch)."""
    sig = types.void(arr, idx)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(  # type: ignore[no-untyped-call]
            context, builder, aryty, ary, [args[1]]
        )
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, fnty, "llvm.prefetch.p0"
        )
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


_prefetch: Any = _prefetch_intrinsic


@njit(nogil=True, cache=True)
def _mix(z: Any) -> Any:
    # splitmix64's finaliser: every input bit reaches every output bit, so
    # integer ids written as big-endian bytes spread as well as digests do.
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(nogil=True, cache=True)
def _key_meta(words: Any, start: int, nwords: int, nbytes: int) -> Any:
    # Each word times its own odd constant (independent multiplies, no
    # chain), then one full mix: equal sums of distinct keys only cost a
    # longer probe, since a match compares every word.
    acc = np.uint64(nbytes) * np.uint64(0x9E3779B97F4A7C15)
    k = np.uint64(0xD6E8FEB86659FD93)
    for i in range(nwords):
        w = words[start + i] * k
        acc ^= (w << np.uint64(29)) | (w >> np.uint64(35))
        k += np.uint64(0x9E3779B97F4A7C16)
    return (_mix(acc) & _HIGH32) | (np.uint64(nbytes + 1) << np.uint64(16))


@njit(nogil=True, cache=True)
def _bit(slots: Any, base: int, m: int, g: int) -> Any:
    """Whether group ``g`` holds the key of the slot at ``base``."""
    if m == 0:
        return (slots[base] >> np.uint64(g)) & np.uint64(1)
    return (slots[base + 1 + (g >> 6)] >> np.uint64(g & 63)) & np.uint64(1)


@njit(nogil=True, cache=True)
def _set_bit(slots: Any, base: int, m: int, g: int, on: bool) -> None:
    i = base if m == 0 else base + 1 + (g >> 6)
    bit = np.uint64(1) << np.uint64(g if m == 0 else g & 63)
    if on:
        slots[i] |= bit
    else:
        slots[i] &= ~bit


@njit(nogil=True, cache=True)
def _live(slots: Any, base: int, m: int) -> Any:
    """Some group holds the key of the slot at ``base``."""
    if m == 0:
        return (slots[base] & ~_KEY_BITS) != 0
    for j in range(m):  # noqa: SIM110 (a loop numba compiles; no generator)
        if slots[base + 1 + j] != 0:
            return True
    return False


@njit(nogil=True, cache=True)
def _home(meta: Any, cap: int) -> Any:
    return np.int64(((meta >> np.uint64(32)) * np.uint64(cap)) >> np.uint64(32))


@njit(nogil=True, cache=True)
def _find(
    slots: Any, cap: int, stride: int, m: int, meta: Any, words: Any, start: int, nwords: int
) -> Any:
    """The slot holding the key, or -(the empty slot where it would go) - 1."""
    i = _home(meta, cap)
    while True:
        base = i * stride
        sm = slots[base]
        if sm == 0:
            return -i - 1
        if (sm & _KEY_BITS) == meta:
            k = base + 1 + m
            same = True
            for j in range(nwords):
                if slots[k + j] != words[start + j]:
                    same = False
                    break
            if same:
                return i
        i += 1
        if i == cap:
            i = 0


@njit(nogil=True, cache=True)
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


@njit(nogil=True, cache=True)
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


@njit(nogil=True, cache=True)
def _metas(words: Any, woff: Any, nbytes: Any, metas: Any) -> None:
    for h in range(nbytes.shape[0]):
        metas[h] = _key_meta(words, woff[h], woff[h + 1] - woff[h], nbytes[h])


@njit(nogil=True, cache=True)
def _delete(slots: Any, info: Any, i: int) -> None:
    """Empty slot ``i`` and shift later members of its probe run back, so a
    search never stops early at the hole (no tombstones)."""
    cap, w, m = info[_CAP], info[_W], info[_M]
    stride = 1 + m + w
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


@njit(nogil=True, cache=True)
def fold_batch(
    slots: Any,
    info: Any,
    kinds: Any,
    gids: Any,
    row_off: Any,
    words: Any,
    woff: Any,
    nbytes: Any,
    out: Any,
    out_off: Any,
    num_groups: int,
    metas: Any,
    resume_row: int,
    resume_hash: int,
) -> Any:
    """Fold one batch of rows in order, from row ``resume_row`` (its hashes
    from ``resume_hash``). Returns ``(-1, 0)`` when done, else where to
    resume once the caller has changed the table: ``(row, hash)`` to grow
    it, ``(row, _REBUILD)`` to rebuild it (a group was cleared),
    ``(row, _EMPTIED)`` to start it afresh (every group was cleared).

    Row ``r`` owns hashes ``row_off[r]:row_off[r + 1]``; hash ``h`` is
    ``words[woff[h]:woff[h + 1]]`` and ``nbytes[h]`` bytes long. A lookup row
    writes ``n`` presence bytes per group at ``out[out_off[r] + g * n]``:
    1 when group ``g`` holds the key of hash unit ``u`` at that point.
    ``gids[r] == -1`` on a clear means every group. ``metas[h]`` is hash
    ``h``'s ``_key_meta``. Tables are allocated by the caller: their pages
    then come from numpy, which asks for huge pages (fewer faults and TLB misses on a
    table of hundreds of MB).
    """
    m = info[_M]
    for r in range(resume_row, kinds.shape[0]):
        kind = kinds[r]
        lo, hi = row_off[r], row_off[r + 1]
        if r == resume_row:
            lo = max(lo, resume_hash)
        if kind == SKIP or (kind != CLEAR and lo == hi):
            continue
        g = gids[r]
        stride = 1 + m + info[_W]
        for h in range(lo, min(hi, lo + _AHEAD)):
            _prefetch(slots, _home(metas[h], info[_CAP]) * stride)
        if kind == STORE:
            for h in range(lo, hi):
                if h + _AHEAD < hi:
                    _prefetch(slots, _home(metas[h + _AHEAD], info[_CAP]) * stride)
                if (info[_COUNT] + 1) * _MAX_LOAD_DEN > info[_CAP] * _MAX_LOAD_NUM:
                    return r, h
                s, nw = woff[h], woff[h + 1] - woff[h]
                meta = metas[h]
                i = _find(slots, info[_CAP], stride, m, meta, words, s, nw)
                if i < 0:
                    i = -i - 1
                    base = i * stride
                    slots[base] = meta
                    for j in range(nw):
                        slots[base + 1 + m + j] = words[s + j]
                    info[_COUNT] += 1
                _set_bit(slots, i * stride, m, g, True)
        elif kind == REMOVE:
            for h in range(lo, hi):
                if h + _AHEAD < hi:
                    _prefetch(slots, _home(metas[h + _AHEAD], info[_CAP]) * stride)
                s, nw = woff[h], woff[h + 1] - woff[h]
                i = _find(slots, info[_CAP], stride, m, metas[h], words, s, nw)
                if i < 0:
                    continue  # removing an absent key is not an error (the format)
                base = i * stride
                _set_bit(slots, base, m, g, False)
                if not _live(slots, base, m):
                    _delete(slots, info, i)
        elif kind == CLEAR:
            if g < 0:
                return r + 1, _EMPTIED
            for i in range(info[_CAP]):
                if slots[i * stride] != 0:
                    _set_bit(slots, i * stride, m, g, False)
            return r + 1, _REBUILD
        elif kind == LOOKUP:
            n = hi - lo
            o = out_off[r]
            for u in range(n):
                h = lo + u
                if h + _AHEAD < hi:
                    _prefetch(slots, _home(metas[h + _AHEAD], info[_CAP]) * stride)
                s, nw = woff[h], woff[h + 1] - woff[h]
                i = _find(slots, info[_CAP], stride, m, metas[h], words, s, nw)
                if i < 0:
                    continue  # out is zeroed: absent in every group
                for gg in range(num_groups):
                    out[o + gg * n + u] = np.uint8(_bit(slots, i * stride, m, gg))
    return -1, 0


@njit(nogil=True, cache=True)
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


class KeyTable:
    """The present ``(group_id, hash)`` keys of every group, folded batch by
    batch in compiled code (see the module docstring for the layout)."""

    __slots__ = ("info", "num_groups", "slots")

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        mask_words = 0 if num_groups <= _INLINE_GROUPS else (num_groups + 63) // 64
        self.info = np.array([_INITIAL_SLOTS, 0, 1, mask_words], dtype=np.int64)
        self.slots = np.zeros(_INITIAL_SLOTS * (2 + mask_words), dtype=np.uint64)

    def fold(
        self,
        kinds: np.ndarray[Any, Any],
        gids: np.ndarray[Any, Any],
        row_offsets: np.ndarray[Any, Any],
        words: np.ndarray[Any, Any],
        word_offsets: np.ndarray[Any, Any],
        nbytes: np.ndarray[Any, Any],
        max_words: int,
        out: np.ndarray[Any, Any],
        out_offsets: np.ndarray[Any, Any],
    ) -> None:
        """Fold a batch (``fold_batch``), widening the key words first when
        the batch holds a longer hash than any before."""
        if max_words * 8 > MAX_HASH_BYTES and int(nbytes.max()) > MAX_HASH_BYTES:
            raise ReplayError(
                f"a block hash of {int(nbytes.max())} bytes: longer than {MAX_HASH_BYTES} "
                "bytes, the most the store keys"
            )
        if max_words > self.info[_W]:
            self._grow(int(self.info[_CAP]), max_words)
        metas = np.empty(nbytes.shape[0], dtype=np.uint64)
        _metas(words, word_offsets, nbytes, metas)
        row, at = 0, 0
        while row >= 0:
            row, at = fold_batch(
                self.slots,
                self.info,
                kinds,
                gids,
                row_offsets,
                words,
                word_offsets,
                nbytes,
                out,
                out_offsets,
                self.num_groups,
                metas,
                row,
                at,
            )
            cap, w = int(self.info[_CAP]), int(self.info[_W])
            if row < 0:
                break
            if at == _EMPTIED:
                # Back to the initial size: a cleared store gives its memory back.
                self.slots = np.zeros(_INITIAL_SLOTS * (1 + int(self.info[_M]) + w), np.uint64)
                self.info[_CAP], self.info[_COUNT] = _INITIAL_SLOTS, 0
                at = 0
            elif at == _REBUILD:
                self._grow(cap, w)
                at = 0
            else:
                self._grow(cap * 2, w)

    def _grow(self, cap: int, w: int) -> None:
        new = np.zeros(cap * (1 + int(self.info[_M]) + w), dtype=np.uint64)
        _rehash(self.slots, self.info, new, cap, w)
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
        return int(self.slots.nbytes)
