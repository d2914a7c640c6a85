"""The vLLM plugin's lookup messages read without a string per hash, for
``replay watch`` and ``replay record`` (``replay.sources.zmq_client``).

A lookup message is JSON (``replay.adapters.vllm.plugin``): a lookup's
``block_hashes`` are hex strings, one a block (about 750 a lookup of the
Mooncake conversation trace, so 3,400 lookups a second of a 1,000-engine
fleet are 2.5M of them). Decoded as generic JSON each was a Python string,
then joined and read by ``bytes.fromhex``: most of a watch's cost per
lookup. Here the message is decoded by msgspec with the lookup records'
fields known and each ``block_hashes`` left as its raw JSON, which one
compiled pass reads straight into the packed bytes the trace keeps
(``PackedHashes``).

It reads a strict subset of what the generic path reads, to the same
values: a message with only the plugin's fields (``format``,
``records``, ``instance``, ``watermark``) whose records are all lookups
with only the plugin's fields, their hashes plain hex strings of one
even, non-zero width (no escape, no other character). Anything else (an
unknown field, an engine record, any JSON the typed decoder refuses,
hashes in another form) is read by the generic path (``decode_generic``)
as before, whose errors name what is wrong; so a message decodes here to
exactly what ``decode_generic`` gives, or not at all.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import numpy as np

from replay.base.intrinsics import LITTLE_ENDIAN, load_u64
from replay.base.jit import jit
from replay.format.hashwords import PackedHashes

#: A field the message left out (none of msgspec's values: JSON never gives it).
_ABSENT: Any = type("_Absent", (), {"__repr__": lambda self: "<absent>"})()

#: A lookup record's fields, as the plugin writes them (``LookupObserver.lookup``).
_LOOKUP_FIELDS = (
    "type",
    "instance",
    "n",
    "ts",
    "step",
    "batch",
    "position",
    "request_id",
    "block_hashes",
    "num_tokens",
    "num_prompt_tokens",
    "max_length",
    "observed_hit_tokens",
    "admitted",
)


class _Lookup(msgspec.Struct, forbid_unknown_fields=True):
    """A lookup record: every field decoded as generic JSON decodes it, but
    ``block_hashes``, left raw for ``_hex_list``."""

    type: Any = _ABSENT
    instance: Any = _ABSENT
    n: Any = _ABSENT
    ts: Any = _ABSENT
    step: Any = _ABSENT
    batch: Any = _ABSENT
    position: Any = _ABSENT
    request_id: Any = _ABSENT
    #: Empty when left out.
    block_hashes: msgspec.Raw = msgspec.Raw()
    num_tokens: Any = _ABSENT
    num_prompt_tokens: Any = _ABSENT
    max_length: Any = _ABSENT
    observed_hit_tokens: Any = _ABSENT
    admitted: Any = _ABSENT


class _Message(msgspec.Struct, forbid_unknown_fields=True):
    """A lookup message (``Sink.send``) of lookup records only."""

    records: list[_Lookup]
    format: Any = _ABSENT
    instance: Any = _ABSENT
    watermark: Any = _ABSENT


_GENERIC = msgspec.json.Decoder()
_MESSAGE = msgspec.json.Decoder(_Message)

#: A hex digit's value by its byte (either case, as ``bytes.fromhex``
#: reads them); 255: not a hex digit.
_HEX = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF", start=10):
    _HEX[_c] = _i


@jit()
def _space(buf: Any, pos: int) -> int:
    """The position after JSON whitespace at ``pos``."""
    n = buf.shape[0]
    while pos < n:
        c = buf[pos]
        if c != 0x20 and c != 0x0A and c != 0x0D and c != 0x09:
            break
        pos += 1
    return pos


_ONES = np.uint64(0x0101010101010101)
_HIGH = np.uint64(0x8080808080808080)
_NIBBLES = np.uint64(0x000F000F000F000F)


@jit()
def _hex8(w: Any) -> Any:
    """Eight hex digits (a little-endian word of their bytes): a word whose
    high bits are set where a byte is not a hex digit (0 when all are), and
    their four bytes' value (the low 32 bits, in memory order). SWAR: each
    byte's range tests by adding to it within its own byte (an ASCII byte
    never carries into the next)."""
    digit = (w + _ONES * np.uint64(0x80 - 0x30)) & ~(w + _ONES * np.uint64(0x7F - 0x39))
    lower = w | (_ONES * np.uint64(0x20))  # A-F as a-f
    letter = (lower + _ONES * np.uint64(0x80 - 0x61)) & ~(lower + _ONES * np.uint64(0x7F - 0x66))
    bad = (((digit | letter) & _HIGH) ^ _HIGH) | (w & _HIGH)
    # A digit's value: its low nibble, plus 9 for a letter (0x40 set).
    v = (w & (_ONES * np.uint64(0x0F))) + ((w >> np.uint64(6)) & _ONES) * np.uint64(9)
    pairs = ((v & _NIBBLES) << np.uint64(4)) | ((v >> np.uint64(8)) & _NIBBLES)
    half = (pairs | (pairs >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
    return bad, (half | (half >> np.uint64(16))) & np.uint64(0xFFFFFFFF)


@jit()
def _hex_list(buf: Any, hexes: Any) -> Any:
    """A JSON array of hex strings, all of one even, non-zero width, with
    no escape (``["00ff", "a1b2"]``), read into their bytes: (ok, the
    width in bytes, the bytes). ``ok`` False for any other text (an empty
    array, a string of another width, any character but a hex digit)."""
    n = buf.shape[0]
    out = np.empty(n // 2 + 1, dtype=np.uint8)
    fail = (False, 0, out[:0])
    pos = _space(buf, 0)
    if pos >= n or buf[pos] != 0x5B:  # [
        return fail
    pos = _space(buf, pos + 1)
    width = -1
    at = 0
    bad = np.uint64(0)
    while True:
        if pos >= n or buf[pos] != 0x22:  # "
            return fail
        start = pos + 1
        if width < 0:
            # The first string's width is every string's.
            end = start
            while end < n and buf[end] != 0x22:
                end += 1
            width = end - start
            if width == 0 or width % 2:
                return fail
        end = start + width
        if end >= n or buf[end] != 0x22:
            return fail
        k = 0
        # A word of 8 digits at a time (the string's closing quote is past
        # it: the load stays in the array), then a pair at a time.
        while k + 8 <= width:
            wrong, value = _hex8(load_u64(buf, start + k))
            bad |= wrong
            for j in range(4):
                out[at + j] = np.uint8((value >> np.uint64(8 * j)) & np.uint64(0xFF))
            at += 4
            k += 8
        while k < width:
            hi = hexes[buf[start + k]]
            lo = hexes[buf[start + k + 1]]
            if hi == 255 or lo == 255:
                return fail
            out[at] = (hi << 4) | lo
            at += 1
            k += 2
        pos = end + 1
        # json.dumps' separator, then any other JSON whitespace.
        if pos + 1 < n and buf[pos] == 0x2C and buf[pos + 1] == 0x20:
            pos += 2
            continue
        pos = _space(buf, pos)
        if pos >= n:
            return fail
        if buf[pos] == 0x2C:  # ,
            pos = _space(buf, pos + 1)
            continue
        if buf[pos] != 0x5D:  # ]
            return fail
        pos = _space(buf, pos + 1)
        break
    if pos != n or bad:
        return fail
    return True, width // 2, out[:at]


def hex_hashes(raw: bytes | memoryview) -> PackedHashes | None:
    """The JSON array ``raw`` of hex strings as the packed bytes
    ``replay.sources.lookup_log`` makes of it (one ``bytes.fromhex``), or
    None when it is not of the form read here."""
    if not LITTLE_ENDIAN:
        return None
    ok, width, data = _hex_list(np.frombuffer(raw, dtype=np.uint8), _HEX)
    if not ok:
        return None
    return PackedHashes(data.tobytes(), int(width))


def decode_generic(payload: bytes) -> Any:
    """A lookup message's JSON, by msgspec (a quarter faster than ``json``
    on the plugin's hex); what msgspec refuses is ``json.loads``' to read
    or to reject, in its words."""
    try:
        return _GENERIC.decode(payload)
    except msgspec.DecodeError:
        return json.loads(payload)


def _fast(payload: bytes) -> dict[str, Any] | None:
    """``decode_generic(payload)`` with each lookup's ``block_hashes`` as
    ``PackedHashes``, or None when the message is not of the form read
    here (then it is all ``decode_generic``'s)."""
    try:
        message = _MESSAGE.decode(payload)
    except msgspec.DecodeError:
        return None
    records: list[Any] = []
    for rec in message.records:
        if rec.type != "lookup" or not len(rec.block_hashes):
            return None
        hashes = hex_hashes(rec.block_hashes)
        if hashes is None:
            return None
        obj = {name: getattr(rec, name) for name in _LOOKUP_FIELDS}
        obj["block_hashes"] = hashes
        records.append({k: v for k, v in obj.items() if v is not _ABSENT})
    out: dict[str, Any] = {"records": records}
    for name in ("format", "instance", "watermark"):
        value = getattr(message, name)
        if value is not _ABSENT:
            out[name] = value
    return out


def decode_message(payload: bytes) -> Any:
    """A lookup message: ``decode_generic``'s value, but each lookup's hex
    ``block_hashes`` already packed (``PackedHashes``, what
    ``replay.sources.lookup_log.parse_lookup`` makes of the list) where the
    message is of the plugin's form; errors are ``decode_generic``'s."""
    fast = _fast(payload)
    return decode_generic(payload) if fast is None else fast
