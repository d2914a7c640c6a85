"""vLLM's KV-event batches read straight into columns, for ``replay watch``.

vLLM 0.33 sends a ``BlockRemoved`` for every evicted block and a
``BlockStored`` with every token of its blocks (``token_ids``): an engine
at the Mooncake conversation trace's rate sends about 1,400 events and
27,000 token ids a second, and a watch of 1,000 engines cannot make a
Python object of each. :func:`decode_columns` reads the batch as vLLM
writes it (the map form, integer hashes, the fields vLLM 0.33 writes) in
one compiled pass into flat arrays: per event its type, group, block size,
medium and hashes; the token ids are only stepped over, and vLLM's
``BlockRemoved`` of one block (most events: one an evicted block) is
matched by its bytes around its hash and group.

It reads a strict subset of what :func:`replay.sources.kv_wire.decode_batch`
accepts, and reads it to the same values: anything else (the legacy array
form, bytes hashes, an unknown event type or field, a field of an
unexpected type, a medium other than GPU, a malformed payload) gives None,
and the caller takes ``decode_batch``, whose errors name what is wrong. So
a payload decodes here to exactly what ``decode_batch`` gives, or not at
all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from replay.base.intrinsics import LITTLE_ENDIAN, load_u64
from replay.base.jit import jit

#: An event's type in ``KVColumns.kind``.
STORED, REMOVED, CLEARED = 0, 1, 2
#: ``KVColumns.medium``: the field absent or nil, or ``"GPU"``.
MEDIUM_NONE, MEDIUM_GPU = 0, 1

# The fields read, in vLLM 0.33's declaration order (``kv_wire.BlockStored``).
_FIELDS = (
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
(
    _TYPE,
    _HASHES,
    _PARENT,
    _TOKENS,
    _BLOCK_SIZE,
    _LORA_ID,
    _MEDIUM,
    _LORA_NAME,
    _EXTRA_KEYS,
    _GROUP,
    _SPEC_KIND,
    _SPEC_WINDOW,
    _LOCALITY,
    _OWNERSHIP,
    _SESSION,
    _LOOKAHEAD,
) = range(len(_FIELDS))
_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def _table(words: tuple[str, ...]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    width = max(len(w) for w in words)
    table = np.zeros((len(words), width), dtype=np.uint8)
    for i, w in enumerate(words):
        table[i, : len(w)] = np.frombuffer(w.encode(), dtype=np.uint8)
    return table, np.array([len(w) for w in words], dtype=np.int64)


_FIELD_TABLE, _FIELD_LENGTHS = _table(_FIELDS)
_TAG_TABLE, _TAG_LENGTHS = _table(_TAGS)
_GPU = np.frombuffer(b"GPU", dtype=np.uint8).copy()
# vLLM 0.33's BlockRemoved of one block (``omit_defaults``: its locality
# and ownership left out) around its hash, then its group: the bytes up to
# the hash, and from it to the group.
_REMOVED_HEAD = np.frombuffer(
    b"\x84\xa4type\xacBlockRemoved\xacblock_hashes\x91", dtype=np.uint8
).copy()
_REMOVED_TAIL = np.frombuffer(b"\xa6medium\xa3GPU\xa9group_idx", dtype=np.uint8).copy()

# Which fields each event type may carry here (a bit per field); vLLM's
# others are nil when written at all.
_STORED_FIELDS = sum(1 << f for f in range(1, len(_FIELDS)))
_REMOVED_FIELDS = sum(1 << f for f in (_HASHES, _MEDIUM, _GROUP, _LOCALITY, _OWNERSHIP))
_ALLOWED = np.array([_STORED_FIELDS, _REMOVED_FIELDS, 0], dtype=np.int64)
# A msgpack integer's size in bytes by its first byte; 0: not an integer.
_INT_SIZES = np.zeros(256, dtype=np.int64)
_INT_SIZES[:0x80] = 1
_INT_SIZES[0xE0:] = 1
for _first, _size in (
    (0xCC, 2),
    (0xCD, 3),
    (0xCE, 5),
    (0xCF, 9),
    (0xD0, 2),
    (0xD1, 3),
    (0xD2, 5),
    (0xD3, 9),
):
    _INT_SIZES[_first] = _size


@dataclass(frozen=True, slots=True)
class KVColumns:
    """A batch of known events, as flat arrays (event ``i``'s hashes are
    ``hashes[offsets[i]:offsets[i + 1]]``)."""

    ts: float
    #: None when the batch leaves it out or sends nil.
    data_parallel_rank: int | None
    #: ``STORED``, ``REMOVED`` or ``CLEARED``.
    kind: np.ndarray[Any, np.dtype[np.int8]]
    #: ``group_idx``, -1 where absent or nil.
    group: np.ndarray[Any, np.dtype[np.int64]]
    #: ``block_size``, -1 where absent or nil.
    block_size: np.ndarray[Any, np.dtype[np.int64]]
    #: ``MEDIUM_NONE`` or ``MEDIUM_GPU``.
    medium: np.ndarray[Any, np.dtype[np.int8]]
    offsets: np.ndarray[Any, np.dtype[np.int64]]
    hashes: np.ndarray[Any, np.dtype[np.uint64]]

    @property
    def events(self) -> int:
        return int(self.kind.shape[0])


@jit()
def _swapped(x: Any) -> Any:
    """``x`` with its bytes in the other order (LLVM makes it one ``bswap``)."""
    x = (x << np.uint64(32)) | (x >> np.uint64(32))
    x = ((x & np.uint64(0x0000FFFF0000FFFF)) << np.uint64(16)) | (
        (x >> np.uint64(16)) & np.uint64(0x0000FFFF0000FFFF)
    )
    return ((x & np.uint64(0x00FF00FF00FF00FF)) << np.uint64(8)) | (
        (x >> np.uint64(8)) & np.uint64(0x00FF00FF00FF00FF)
    )


@jit()
def _matches(buf: Any, pos: int, pattern: Any) -> Any:
    """Whether the bytes at ``pos`` are ``pattern`` (8 bytes or more; the
    caller keeps ``pos + len(pattern)`` within ``buf``): a word at a time,
    the last word ending where the pattern ends."""
    length = pattern.shape[0]
    k = 0
    while k + 8 < length:
        if load_u64(buf, pos + k) != load_u64(pattern, k):
            return False
        k += 8
    return load_u64(buf, pos + length - 8) == load_u64(pattern, length - 8)


@jit()
def _uint(buf: Any, pos: int) -> Any:
    """An unsigned msgpack integer at ``pos``: (found, value, next position);
    any other value is not found."""
    n = buf.shape[0]
    none = np.uint64(0)
    if pos >= n:
        return False, none, pos
    b = buf[pos]
    if b <= 0x7F:
        return True, np.uint64(b), pos + 1
    size = 0
    if b == 0xCC:
        size = 1
    elif b == 0xCD:
        size = 2
    elif b == 0xCE:
        size = 4
    elif b == 0xCF:
        size = 8
    else:
        return False, none, pos
    if pos + 1 + size > n:
        return False, none, pos
    if size == 8 and LITTLE_ENDIAN:
        # vLLM's 64-bit hashes: one load, its bytes reversed (big-endian).
        return True, _swapped(load_u64(buf, pos + 1)), pos + 9
    v = np.uint64(0)
    for k in range(size):
        v = (v << np.uint64(8)) | np.uint64(buf[pos + 1 + k])
    return True, v, pos + 1 + size


@jit()
def _int(buf: Any, pos: int) -> int:
    """The position after a msgpack integer of any sign at ``pos``; -1 if none."""
    n = buf.shape[0]
    if pos >= n:
        return -1
    b = buf[pos]
    if b <= 0x7F or b >= 0xE0:
        return pos + 1
    size = 0
    if b == 0xCC or b == 0xD0:
        size = 1
    elif b == 0xCD or b == 0xD1:
        size = 2
    elif b == 0xCE or b == 0xD2:
        size = 4
    elif b == 0xCF or b == 0xD3:
        size = 8
    else:
        return -1
    return pos + 1 + size if pos + 1 + size <= n else -1


@jit()
def _length(buf: Any, pos: int, fix: int, fix_bits: int, one: int, two: int, four: int) -> Any:
    """A msgpack header (a fix form, then 1-, 2- and 4-byte lengths; 0 when
    that form does not exist): (found, length, position of the contents)."""
    n = buf.shape[0]
    if pos >= n:
        return False, 0, pos
    b = buf[pos]
    if (b & ~fix_bits) == fix:
        return True, b & fix_bits, pos + 1
    size = 0
    if one and b == one:
        size = 1
    elif b == two:
        size = 2
    elif b == four:
        size = 4
    else:
        return False, 0, pos
    if pos + 1 + size > n:
        return False, 0, pos
    v = 0
    for k in range(size):
        v = (v << 8) | buf[pos + 1 + k]
    return True, v, pos + 1 + size


@jit()
def _str(buf: Any, pos: int) -> Any:
    """A msgpack string: (found, its length, its first byte's position)."""
    return _length(buf, pos, 0xA0, 0x1F, 0xD9, 0xDA, 0xDB)


@jit()
def _array(buf: Any, pos: int) -> Any:
    return _length(buf, pos, 0x90, 0x0F, 0, 0xDC, 0xDD)


@jit()
def _map(buf: Any, pos: int) -> Any:
    return _length(buf, pos, 0x80, 0x0F, 0, 0xDE, 0xDF)


@jit()
def _word(buf: Any, start: int, length: int, table: Any, lengths: Any) -> int:
    """Which row of ``table`` the bytes at ``start`` spell; -1 for none."""
    for w in range(table.shape[0]):
        if lengths[w] != length:
            continue
        same = True
        for k in range(length):
            if buf[start + k] != table[w, k]:
                same = False
                break
        if same:
            return w
    return -1


@jit()
def _decode(
    buf: Any,
    field_table: Any,
    field_lengths: Any,
    tag_table: Any,
    tag_lengths: Any,
    gpu: Any,
    allowed: Any,
    int_sizes: Any,
    removed_head: Any,
    removed_tail: Any,
) -> Any:
    """The batch's columns; ``ok`` False for anything outside the subset
    read here (the caller then takes ``decode_batch``)."""
    n = buf.shape[0]
    empty_i8 = np.empty(0, dtype=np.int8)
    empty_i64 = np.empty(0, dtype=np.int64)
    empty_u64 = np.empty(0, dtype=np.uint64)
    fail = (False, 0.0, -1, empty_i8, empty_i64, empty_i64, empty_i8, empty_i64, empty_u64)
    if n < 2 or (buf[0] != 0x92 and buf[0] != 0x93):
        return fail
    items = buf[0] - 0x90
    pos = 1
    # ts: a float (vLLM's), or an integer of seconds.
    b = buf[pos]
    ts = 0.0
    if b == 0xCB:
        if pos + 9 > n:
            return fail
        bits = np.uint64(0)
        for k in range(8):
            bits = (bits << np.uint64(8)) | np.uint64(buf[pos + 1 + k])
        ts = np.array([bits], dtype=np.uint64).view(np.float64)[0]
        pos += 9
    else:
        ok, v, pos = _uint(buf, pos)
        if not ok:
            return fail
        ts = float(v)
    ok, count, pos = _array(buf, pos)
    # An event takes a byte at least: a count past the payload is a lie,
    # not arrays to allocate.
    if not ok or count > n - pos:
        return fail
    kind = np.empty(count, dtype=np.int8)
    group = np.full(count, -1, dtype=np.int64)
    block_size = np.full(count, -1, dtype=np.int64)
    medium = np.zeros(count, dtype=np.int8)
    offsets = np.zeros(count + 1, dtype=np.int64)
    # A hash takes a byte at least: the payload bounds their number.
    hashes = np.empty(n, dtype=np.uint64)
    h = 0
    head_n = removed_head.shape[0]
    tail_n = removed_tail.shape[0]
    for e in range(count):
        # Most events: vLLM's BlockRemoved of one block with its group and
        # medium, matched by its bytes. Any other bytes (a field more or
        # less, another order, a group past the limit) are read field by
        # field below, from the event's start: the same values or None.
        if pos + head_n <= n and _matches(buf, pos, removed_head):
            ok, v, at = _uint(buf, pos + head_n)
            if ok and at + tail_n <= n and _matches(buf, at, removed_tail):
                ok, g, end = _uint(buf, at + tail_n)
                if ok and g <= np.uint64(1 << 62):
                    kind[e] = REMOVED
                    medium[e] = MEDIUM_GPU
                    group[e] = g
                    hashes[h] = v
                    h += 1
                    offsets[e + 1] = h
                    pos = end
                    continue
        ok, fields, pos = _map(buf, pos)
        if not ok or fields == 0:
            return fail
        # The tag first (as vLLM writes it).
        ok, length, start = _str(buf, pos)
        if not ok or start + length > n or length != 4:
            return fail
        if _word(buf, start, length, field_table, field_lengths) != 0:
            return fail
        pos = start + length
        ok, length, start = _str(buf, pos)
        if not ok or start + length > n:
            return fail
        tag = _word(buf, start, length, tag_table, tag_lengths)
        if tag < 0:
            return fail
        pos = start + length
        kind[e] = tag
        seen = 0
        for _ in range(fields - 1):
            ok, length, start = _str(buf, pos)
            if not ok or start + length > n:
                return fail
            f = _word(buf, start, length, field_table, field_lengths)
            if f <= 0 or (seen >> f) & 1 or not (allowed[tag] >> f) & 1:
                return fail
            seen |= 1 << f
            pos = start + length
            if pos >= n:
                return fail
            if buf[pos] == 0xC0 and f != _HASHES:  # nil: the field's default
                pos += 1
                continue
            if f == _HASHES:
                ok, length, pos = _array(buf, pos)
                if not ok or length == 0:
                    return fail
                for _k in range(length):
                    ok, v, pos = _uint(buf, pos)
                    if not ok:
                        return fail
                    hashes[h] = v
                    h += 1
            elif f == _PARENT:
                ok, v, pos = _uint(buf, pos)
                if not ok:
                    return fail
            elif f == _TOKENS:
                ok, length, pos = _array(buf, pos)
                if not ok:
                    return fail
                # Stepped over by each integer's size (its first byte's).
                # A token id of 2 or 4 bytes (0xCD, 0xCE: most ids of a
                # vocabulary of 151k) tested first: a branch, which the CPU
                # predicts through where the ids keep one width, where the
                # size read from the table is a load the next id's position
                # waits for (random widths: about as fast either way).
                for _k in range(length):
                    if pos >= n:
                        return fail
                    b = buf[pos]
                    if b == 0xCD:
                        pos += 3
                    elif b == 0xCE:
                        pos += 5
                    else:
                        size = int_sizes[b]
                        if size == 0:
                            return fail
                        pos += size
                if pos > n:
                    return fail
            elif f in (_BLOCK_SIZE, _GROUP):
                ok, v, pos = _uint(buf, pos)
                if not ok or v > np.uint64(1 << 62):
                    return fail
                if f == _GROUP:
                    group[e] = v
                else:
                    block_size[e] = v
            elif f == _LORA_ID:
                pos = _int(buf, pos)
                if pos < 0:
                    return fail
            elif f == _MEDIUM:
                ok, length, start = _str(buf, pos)
                if not ok or start + length > n or length != 3:
                    return fail
                for k in range(3):
                    if buf[start + k] != gpu[k]:
                        return fail
                medium[e] = 1
                pos = start + length
            elif f in (_LORA_NAME, _SESSION):
                ok, length, start = _str(buf, pos)
                if not ok or start + length > n:
                    return fail
                # Text the trace's reader takes (UTF-8) is checked by the
                # caller's fallback: ASCII only here.
                for k in range(length):
                    if buf[start + k] >= 0x80:
                        return fail
                pos = start + length
            else:
                # extra_keys, the spec's kind and window, locality,
                # ownership, lookahead token ids: nil only here.
                return fail
            if pos > n:
                return fail
        if tag != 2 and not (seen >> _HASHES) & 1:
            return fail
        offsets[e + 1] = h
    rank = np.int64(-1)
    if items == 3:
        if pos >= n:
            return fail
        if buf[pos] == 0xC0:
            pos += 1
        else:
            ok, v, pos = _uint(buf, pos)
            if not ok or v > np.uint64(1 << 62):
                return fail
            rank = np.int64(v)
    if pos != n:
        return fail
    return (True, ts, rank, kind, group, block_size, medium, offsets, hashes[:h].copy())


_LANE = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@jit()
def _mixed(x: Any) -> Any:
    """SplitMix64's finaliser: a bijection of 64-bit words."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


@jit()
def _digest(buf: Any) -> Any:
    """``payload_digest``: four lanes over the 8-byte words (word ``k`` to
    lane ``k % 4``, each step ``(lane ^ word) * odd`` then an xorshift, a
    bijection of the lane for a given word and injective in the word), the
    tail bytes and the length folded in at the end."""
    n = buf.shape[0]
    m = n // 8
    words = buf[: 8 * m].view(np.uint64)
    s32 = np.uint64(32)
    lanes = np.array([1, 2, 3, 4], dtype=np.uint64)
    a, b, c, d = lanes[0], lanes[1], lanes[2], lanes[3]
    k = 0
    while k + 4 <= m:
        a = (a ^ words[k]) * _LANE
        a ^= a >> s32
        b = (b ^ words[k + 1]) * _LANE
        b ^= b >> s32
        c = (c ^ words[k + 2]) * _LANE
        c ^= c >> s32
        d = (d ^ words[k + 3]) * _LANE
        d ^= d >> s32
        k += 4
    lanes[0], lanes[1], lanes[2], lanes[3] = a, b, c, d
    for j in range(k, m):
        x = (lanes[j - k] ^ words[j]) * _LANE
        lanes[j - k] = x ^ (x >> s32)
    tail = np.uint64(0)
    for j in range(8 * m, n):
        tail = (tail << np.uint64(8)) | np.uint64(buf[j])
    h = _mixed(np.uint64(n) ^ tail * _MIX1)
    for i in range(4):
        h ^= _mixed(lanes[i] + np.uint64(i + 1) * _MIX2)
    return _mixed(h)


def payload_digest(payload: bytes) -> int:
    """A 64-bit digest of a KV-event message's payload: the stream's test
    of a repeated batch (``replay.sources.stream``: the same seq with the
    same payload is a duplicate, another payload a restart). A compiled
    pass at memory speed (blake2b's was a tenth of a watch's CPU); not a
    cryptographic hash, but two payloads that differ only in the words of
    one lane (every payload that differs in one 8-byte word, or in its
    tail) always differ here, and others collide by chance once in 2**64,
    as blake2b's 8 bytes did."""
    return int(_digest(np.frombuffer(payload, dtype=np.uint8)))


def decode_columns(payload: bytes) -> KVColumns | None:
    """``payload`` as columns when it is of the form read here; None for
    anything else (``decode_batch`` then reads it, or says what is wrong)."""
    buf = np.frombuffer(payload, dtype=np.uint8)
    ok, ts, rank, kind, group, block_size, medium, offsets, hashes = _decode(
        buf,
        _FIELD_TABLE,
        _FIELD_LENGTHS,
        _TAG_TABLE,
        _TAG_LENGTHS,
        _GPU,
        _ALLOWED,
        _INT_SIZES,
        _REMOVED_HEAD,
        _REMOVED_TAIL,
    )
    if not ok:
        return None
    return KVColumns(
        ts=float(ts),
        data_parallel_rank=None if rank < 0 else int(rank),
        kind=kind,
        group=group,
        block_size=block_size,
        medium=medium,
        offsets=offsets,
        hashes=hashes,
    )
