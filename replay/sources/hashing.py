"""Unit keys -> the fixed-width digests written to a trace as block hashes.

Every digest here is built from SplitMix64's finaliser, a bijection of
64-bit words, so distinct keys give distinct lane-0 words: no two prefixes
of a generated or imported trace can collide, by construction. Extra
lanes (salted per seed) widen a digest to the 16 or 32 bytes of vLLM's
hashes. :class:`DigestTable` memoises a digester over dense keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from replay.rules.mooncake_store import Keys as Keys  # the sources name it here too

Digests = npt.NDArray[np.uint8]
#: Unit keys -> one fixed-width digest per key, shape ``(len(keys), width)``.
Digester = Callable[[Keys], Digests]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(x: npt.NDArray[np.uint64], salt: int) -> npt.NDArray[np.uint64]:
    """SplitMix64's finaliser of ``x ^ salt``: a bijection of 64-bit words, so
    distinct inputs give distinct outputs (no collisions, by construction)."""
    z = x ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF)
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def lane_salts(seed: int, lanes: int) -> tuple[int, ...]:
    """Per-lane salts derived from a seed (so different seeds give different hashes)."""
    base = np.full(lanes, seed & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64)
    lane = np.arange(lanes, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return tuple(int(v) for v in mix64(base + lane, 0x5EED5EED5EED5EED))


def _lanes_to_bytes(lanes: Sequence[npt.NDArray[np.uint64]]) -> Digests:
    out = np.empty((len(lanes[0]), len(lanes)), dtype=">u8")
    for i, lane in enumerate(lanes):
        out[:, i] = lane
    return out.view(np.uint8).reshape(len(lanes[0]), 8 * len(lanes))


def digest_keys(keys: Keys, salts: Sequence[int]) -> Digests:
    """``8 * len(salts)`` bytes per key; lane 0 alone is collision-free over keys."""
    k = keys.astype(np.uint64)
    return _lanes_to_bytes([mix64(k, s) for s in salts])


def digest_pairs(
    ids: npt.NDArray[np.uint64], subs: npt.NDArray[np.uint64], salts: Sequence[int]
) -> Digests:
    """Digests of ``(id, sub)`` pairs: lane 0 is a bijection of ``id`` and every
    other lane of ``id`` xor'd with ``sub``, so distinct pairs never collide
    (for ``sub < 2**32``)."""
    lanes = [mix64(ids, salts[0])]
    for s in salts[1:]:
        lanes.append(mix64(mix64(ids, s) ^ subs, s))
    return _lanes_to_bytes(lanes)


def big_endian_ids(ids: npt.NDArray[np.uint64]) -> Digests:
    """Integer ids as 8-byte big-endian unsigned (the format's rule for integer ids)."""
    return ids.astype(">u8").view(np.uint8).reshape(len(ids), 8)


class DigestTable:
    """Memoises a digester over dense keys: each key's digest is computed once,
    in bulk, and later calls gather rows of a table (a lookup repeats most of
    its prefix's hashes, so this is much cheaper than hashing every entry).

    Only the ``window`` most recent keys are kept (keys grow as a trace
    goes); older ones are recomputed, which keeps the memory bounded."""

    def __init__(self, fn: Digester, window: int = 1 << 22) -> None:
        self._fn = fn
        self._window = window
        self._table: npt.NDArray[np.void] | None = None
        self._lo = 0  # keys in [lo, hi) are in the table, key k at row k - lo
        self._hi = 0
        self.width = 0

    def _extend(self, hi: int) -> None:
        """Cover keys up to ``hi`` (exclusive), dropping the oldest beyond the window."""
        lo = max(self._lo, hi - self._window)
        start = max(self._hi, lo)
        fresh = np.ascontiguousarray(self._fn(np.arange(start, hi, dtype=np.int64)))
        self.width = fresh.shape[1]
        old = self._table
        table = old
        if old is None or hi - lo > len(old):
            size = max(hi - lo, 2 * (0 if old is None else len(old)), 1 << 16)
            table = np.zeros(min(self._window, size), dtype=f"V{self.width}")
        assert table is not None
        if old is not None and lo < self._hi and (table is not old or lo > self._lo):
            table[: self._hi - lo] = old[lo - self._lo : self._hi - self._lo]
        table[start - lo : hi - lo] = fresh.view(f"V{self.width}").reshape(-1)
        self._table, self._lo, self._hi = table, lo, hi

    def __call__(self, keys: Keys) -> Digests:
        if len(keys) == 0:
            return np.zeros((0, self.width), dtype=np.uint8)
        hi = int(keys.max()) + 1
        if hi > self._hi:
            self._extend(hi)
        assert self._table is not None
        if int(keys.min()) >= self._lo:
            rows = self._table[keys - self._lo]
        else:
            old = keys < self._lo
            rows = np.empty(len(keys), dtype=f"V{self.width}")
            rows[~old] = self._table[keys[~old] - self._lo]
            fresh = np.ascontiguousarray(self._fn(keys[old]))
            rows[old] = fresh.view(f"V{self.width}").reshape(-1)
        return rows.view(np.uint8).reshape(len(keys), self.width)
