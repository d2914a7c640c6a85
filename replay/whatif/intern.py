"""The requests' hashes as dense integer ids (``intern_hashes``), compiled:
the what-if's pools index their tables by them (``replay.whatif.requests.Requests``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.base.jit import jit


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
