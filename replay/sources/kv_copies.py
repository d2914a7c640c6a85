"""The copy counts of one KV-cache group (``replay.sources.kv_rows``): how
many copies of each hash the engine holds, stored and removed as vLLM
sends them.

vLLM's integer hashes (and 8-byte ones, the same keys) are counted in a
compiled open-addressing table, a run of a batch's hashes in one call: a
watch of many engines stores and removes millions of hashes a second, and
a ``Counter`` step per hash was the largest part of what was left of its
work. Hashes of another width (a digest sent as bytes) go in a ``Counter``;
the two never hold the same key.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Any

import numpy as np

from replay.base.intrinsics import prefetch
from replay.base.jit import jit

#: A copy count's key: an integer hash and its 8 bytes are one key (an
#: ``int``, as vLLM sends it), any other width its bytes.
CopyKey = int | bytes

_EMPTY = 0
_MIX = np.uint64(0x9E3779B97F4A7C15)
#: How many hashes ahead a run's home slots (both arrays) are prefetched:
#: a million-key table is tens of MB, and each probe missed the cache twice
#: (keys, then counts) in turn; hinted 8 ahead, the misses overlap (the
#: conversation trace's 11M adds and removes: 0.42 s of kernel time -> 0.31).
AHEAD = 8


@jit()
def _home(key: Any, mask: int) -> Any:
    """The slot where ``key``'s probe starts."""
    return np.int64(((np.uint64(key) * _MIX) >> np.uint64(17)) & np.uint64(mask))


@jit()
def _slot(keys: Any, counts: Any, mask: int, key: Any) -> Any:
    """Where ``key`` is (its slot, or -1) and the first free slot on its path."""
    i = _home(key, mask)
    while True:
        if counts[i] == _EMPTY:
            return -1, i
        if keys[i] == key:
            return i, i
        i = (i + np.int64(1)) & np.int64(mask)


@jit()
def _hint(keys: Any, counts: Any, mask: int, key: Any) -> None:
    """Prefetch ``key``'s home slot in both arrays."""
    home = _home(key, mask)
    prefetch(keys, home)
    prefetch(counts, home)


@jit()
def _add(keys: Any, counts: Any, mask: int, hashes: Any) -> int:
    """One copy more of each of ``hashes``; the keys new to the table."""
    taken = 0
    n = hashes.shape[0]
    for k in range(n):
        if k + AHEAD < n:
            _hint(keys, counts, mask, hashes[k + AHEAD])
        h = hashes[k]
        at, free = _slot(keys, counts, mask, h)
        if at >= 0:
            counts[at] += 1
        else:
            taken += 1
            keys[free] = h
            counts[free] = 1
    return taken


@jit()
def _empty(keys: Any, counts: Any, mask: int, hole: int) -> None:
    """Slot ``hole`` emptied, leaving no tombstone (linear probing's
    backward shift): each key after it, up to the next empty slot, moved
    back into the hole when the hole is on its probe path, so every key
    stays reachable from its home and the table holds only live keys
    (tombstones filled it: a rehash of a million keys every million
    removes)."""
    j: Any = hole
    while True:
        j = (j + np.int64(1)) & np.int64(mask)
        if counts[j] == _EMPTY:
            break
        if ((j - _home(keys[j], mask)) & mask) >= ((j - hole) & mask):
            keys[hole] = keys[j]
            counts[hole] = counts[j]
            hole = j
    keys[hole] = 0
    counts[hole] = _EMPTY


@jit()
def _remove(keys: Any, counts: Any, mask: int, hashes: Any, gone: Any) -> Any:
    """One copy fewer of each of ``hashes``, in order; writes the positions
    of the ones whose last copy went (or that had none) to ``gone``, and
    returns how many, and how many keys left the table."""
    n = 0
    freed = 0
    m = hashes.shape[0]
    for k in range(m):
        if k + AHEAD < m:
            _hint(keys, counts, mask, hashes[k + AHEAD])
        at, _ = _slot(keys, counts, mask, hashes[k])
        if at >= 0 and counts[at] > 1:
            counts[at] -= 1
            continue
        if at >= 0:
            _empty(keys, counts, mask, at)
            freed += 1
        gone[n] = k
        n += 1
    return n, freed


@jit()
def _put(keys: Any, counts: Any, mask: int, held: Any, copies: Any) -> None:
    """``held`` keys (distinct, not in the table) with their ``copies``."""
    for k in range(held.shape[0]):
        _, free = _slot(keys, counts, mask, held[k])
        keys[free] = held[k]
        counts[free] = copies[k]


def _take_each(copies: Counter[bytes], keys: Sequence[bytes]) -> list[int]:
    """One copy of each of ``keys`` taken, in order: the positions of the
    ones whose last copy went (or that had none)."""
    gone: list[int] = []
    for i, key in enumerate(keys):
        left = copies.get(key, 0) - 1
        if left > 0:
            copies[key] = left
        else:
            copies.pop(key, None)
            gone.append(i)
    return gone


class CopyCounts:
    """The copies held of each hash of one group."""

    #: The integer table's slots at the start (and after ``clear``); it
    #: doubles while its keys would fill more than half of it.
    FIRST_SLOTS = 1 << 10

    def __init__(self) -> None:
        self._other: Counter[bytes] = Counter()
        self._reset(self.FIRST_SLOTS)

    def _reset(self, size: int) -> None:
        self._keys = np.zeros(size, dtype=np.uint64)
        self._counts = np.zeros(size, dtype=np.int32)
        # Slots held: the probes' load.
        self._used = 0

    def clear(self) -> None:
        self._other.clear()
        self._reset(self.FIRST_SLOTS)

    def _room(self, more: int) -> None:
        size = self._counts.shape[0]
        if 2 * (self._used + more) <= size:
            return
        held = self._counts > 0
        live = int(held.sum())
        while 4 * (live + more) > size:
            size *= 2
        keys, counts = self._keys[held], self._counts[held]
        self._reset(size)
        _put(self._keys, self._counts, size - 1, keys, counts)
        self._used = live

    def add_ints(self, hashes: np.ndarray[Any, np.dtype[np.uint64]]) -> None:
        """One copy more of each of ``hashes`` (vLLM's integers)."""
        self._room(hashes.shape[0])
        self._used += _add(self._keys, self._counts, self._counts.shape[0] - 1, hashes)

    def remove_ints(self, hashes: np.ndarray[Any, np.dtype[np.uint64]]) -> list[int] | None:
        """One copy fewer of each of ``hashes``, in order; the positions of
        the ones whose last copy went, or None for all of them."""
        gone = np.empty(hashes.shape[0], dtype=np.int64)
        n, freed = _remove(self._keys, self._counts, self._counts.shape[0] - 1, hashes, gone)
        self._used -= freed
        return None if n == hashes.shape[0] else gone[:n].tolist()

    def add(self, keys: Sequence[CopyKey], *, uniform: bool = False) -> None:
        """One copy more of each of ``keys`` (``uniform``: all of one kind)."""
        if uniform and keys:
            if isinstance(keys[0], bytes):
                self._other.update(keys)  # type: ignore[arg-type]
            else:
                self.add_ints(np.array(keys, dtype=np.uint64))
            return
        ints = [k for k in keys if isinstance(k, int)]
        if len(ints) != len(keys):
            self._other.update(k for k in keys if isinstance(k, bytes))
        if ints:
            self.add_ints(np.array(ints, dtype=np.uint64))

    def remove(self, keys: Sequence[CopyKey], *, uniform: bool = False) -> list[int] | None:
        """``remove_ints`` of keys of either kind, in order (``uniform``:
        all of one kind)."""
        if not keys:
            return []
        if uniform:
            if isinstance(keys[0], bytes):
                return self._remove_other(keys)  # type: ignore[arg-type]
            return self.remove_ints(np.array(keys, dtype=np.uint64))
        at_int = [i for i, k in enumerate(keys) if isinstance(k, int)]
        gone: list[int] = []
        if at_int:
            ints = np.array([keys[i] for i in at_int], dtype=np.uint64)
            went = self.remove_ints(ints)
            gone = at_int if went is None else [at_int[j] for j in went]
        if len(at_int) != len(keys):
            at_bytes = [i for i, k in enumerate(keys) if isinstance(k, bytes)]
            went = _take_each(self._other, [keys[i] for i in at_bytes])  # type: ignore[misc]
            gone = sorted(gone + [at_bytes[j] for j in went])
        return None if len(gone) == len(keys) else gone

    def _remove_other(self, keys: Sequence[bytes]) -> list[int] | None:
        """``remove`` of bytes keys: in the common case (no key with a
        second copy) two C-speed passes, not a Python step per hash."""
        copies = self._other
        had = list(map(copies.pop, keys, repeat(0)))
        if max(had) <= 1:
            return None
        # Some key has another copy: the counts put back as they were (a
        # repeat's second pop found none), then one copy at a time.
        for key, n in zip(keys, had, strict=True):
            if n:
                copies[key] = n
        gone = _take_each(copies, keys)
        return None if len(gone) == len(keys) else gone

    def items(self) -> Iterator[tuple[CopyKey, int]]:
        """Each key with a copy left, and its copies."""
        held = self._counts > 0
        yield from zip(self._keys[held].tolist(), self._counts[held].tolist(), strict=True)
        yield from ((k, n) for k, n in self._other.items() if n > 0)
