"""The vLLM plugin's lookup messages read with their hex hashes packed
(``replay.sources.lookup_wire``, what ``replay watch`` and ``replay
record`` receive): a message decodes to exactly what the generic JSON path
gives, each lookup's hashes as ``replay.sources.lookup_log`` packs that
list, or the message is left to the generic path whole; so every lookup
parses alike, and every malformed one is refused in the same words.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.format.hashwords import PackedHashes
from replay.sources.lookup_log import _hex_hashes
from replay.sources.lookup_wire import decode_generic, decode_message, hex_hashes
from replay.sources.plugin_log import parse_plugin_lookup

CONFIG = TraceConfig(
    groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),),
    hash_block_size=16,
    scheduler_block_size=16,
)


def _lookup(rng: random.Random, n: int, width: int = 8) -> dict[str, Any]:
    blocks = rng.randint(1, 12)
    hashes = [rng.randbytes(width).hex() for _ in range(blocks)]
    if rng.random() < 0.2:
        hashes = [h.upper() for h in hashes]
    tokens = 16 * blocks + rng.randint(1, 15)
    return {
        "type": "lookup", "instance": "e1", "n": n, "ts": 1.8e9 + n, "step": n, "batch": n,
        "position": rng.randint(0, 3), "request_id": f"req-{n}", "block_hashes": hashes,
        "num_tokens": tokens, "num_prompt_tokens": tokens, "max_length": tokens - 1,
        "observed_hit_tokens": rng.choice([0, 16, None]),
        "admitted": rng.choice([None, True, False]),
    }  # fmt: skip


def _message(rng: random.Random, lookups: int, width: int = 8) -> bytes:
    """A message as the plugin's sink writes it (``json.dumps``' separators)."""
    records = [_lookup(rng, n, width) for n in range(lookups)]
    return json.dumps(
        {"format": "replay.lookups/1", "instance": "e1", "watermark": lookups, "records": records}
    ).encode()


def _parsed(record: Any, seq: int) -> Any:
    """What the subscriber makes of one record: the lookup, or its error."""
    if not isinstance(record, dict) or record.get("type") != "lookup":
        return ("other", record)
    try:
        placed = parse_plugin_lookup(record, seq, CONFIG)
    except ValueError as exc:
        return ("error", str(exc))
    row = placed.record.row(0)
    hashes = row.pop("block_hashes")
    return (placed, row, type(hashes), list(hashes))


def _outcome(decode: Any, payload: bytes) -> Any:
    try:
        message = decode(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        return ("refused", type(exc), str(exc))
    if not isinstance(message, dict) or not isinstance(message.get("records"), list):
        return ("not a lookup message", message)
    rest = {k: v for k, v in message.items() if k != "records"}
    return (rest, [_parsed(r, 3) for r in message["records"]])


def _same(payload: bytes) -> bool:
    """``decode_message(payload)`` checked against the generic path: the
    same message, a lookup's hashes packed as ``_hex_hashes`` packs the
    generic list, and every lookup parsed alike. Whether the hashes were
    packed here (the fast path taken)."""
    assert _outcome(decode_message, payload) == _outcome(decode_generic, payload)
    try:
        fast, generic = decode_message(payload), decode_generic(payload)
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(fast, dict) or not isinstance(fast.get("records"), list):
        return False
    packed = False
    for mine, theirs in zip(fast["records"], generic["records"], strict=True):
        if isinstance(mine, dict) and isinstance(mine.get("block_hashes"), PackedHashes):
            want = _hex_hashes(theirs["block_hashes"])
            assert want is not None
            assert (mine["block_hashes"].data, mine["block_hashes"].width) == (
                want.data,
                want.width,
            )
            assert {**mine, "block_hashes": None} == {**theirs, "block_hashes": None}
            packed = True
        else:
            assert mine == theirs
    return packed


def test_the_plugin_s_messages_are_packed_as_the_generic_path_packs_them() -> None:
    rng = random.Random(3)
    for lookups in [0, 1, 2, 5]:
        for width in [8, 16, 32, 4, 3, 1]:
            payload = _message(rng, lookups, width)
            assert _same(payload) == (lookups > 0)
    message = decode_message(_message(random.Random(4), 2))
    hashes = message["records"][0]["block_hashes"]
    assert isinstance(hashes, PackedHashes) and hashes.width == 8


@pytest.mark.parametrize(
    ("hashes", "packed"),
    [
        ('["00ff", "A1b2"]', True),
        ('[ "00ff" ,\n\t"a1b2" ]', True),
        ('["00ff","a1b2"]', True),
        ('["0123456789abcdef0a", "0123456789ABCDEF0b"]', True),
        ("[]", False),
        ('[""]', False),
        ('["0f0", "123"]', False),  # odd width
        ('["00ff", "a1"]', False),  # two widths
        ('["00ff", "a1g2"]', False),
        ('["00 ff"]', False),  # fromhex skips it; the list is read one by one
        ('["\\u0030\\u0030"]', False),  # an escape: generic
        ('["00ff", 17]', False),
        ('["00ff", null]', False),
        ("null", False),
        ('"00ff"', False),
        ('{"a": 1}', False),
        ('["00ff"', None),  # malformed JSON: refused by both
        ('["00ff",]', None),
        ('["00ff" "a1b2"]', None),
        ('["00ff",\x0b"a1b2"]', None),  # not JSON whitespace
        ('["00ff",\x0c"a1b2"]', None),
    ],
)
def test_hashes_outside_the_plain_form_go_the_generic_way(hashes: str, packed: bool | None) -> None:
    record = json.dumps(_lookup(random.Random(1), 0)).replace(
        json.dumps(_lookup(random.Random(1), 0)["block_hashes"]), hashes
    )
    payload = f'{{"format": "replay.lookups/1", "instance": "e1", "records": [{record}]}}'.encode()
    assert _same(payload) is bool(packed)
    raw = hashes.encode()
    ok = hex_hashes(raw)
    assert (ok is not None) is bool(packed)


@pytest.mark.parametrize(
    "payload",
    [
        # An engine record, an unknown field of the message or of a lookup,
        # a field twice, a record of another type, records not a list.
        b'{"format": "replay.lookups/1", "instance": "e1", "watermark": null, '
        b'"records": [{"type": "engine", "instance": "e1", "config": {}}]}',
        b'{"records": [], "extra": [1e999]}',
        b'{"records": [{"type": "lookup", "block_hashes": ["00"], "extra": 1}]}',
        b'{"records": [{"type": "lookup", "block_hashes": ["00"], "block_hashes": ["zz"]}]}',
        b'{"records": [{"type": "lookup", "block_hashes": ["zz"], "block_hashes": ["00"]}]}',
        b'{"records": [{"type": "lookup", "type": "other", "block_hashes": ["00"]}]}',
        b'{"records": [{"type": "other", "block_hashes": ["00"]}]}',
        b'{"records": [7, {"type": "lookup", "block_hashes": ["00"]}]}',
        b'{"records": {"type": "lookup"}}',
        b'{"records": [{"type": "lookup", "block_hashes": ["00"], "ts": NaN}]}',
        b'{"records": [{"type": "lookup", "block_hashes": ["00"], "n": 1e999}]}',
        b'{"records": [{"type": "lookup", "block_hashes": ["00"], "request_id": "\xff"}]}',
        b'{"records": [{"type": "lookup", "block_hashes": ["00"], "request_id": "\\ud800"}]}',
        b"[1, 2]",
        b"",
    ],
)
def test_anything_else_is_the_generic_path_s(payload: bytes) -> None:
    _same(payload)


def test_every_one_byte_change_of_a_message_reads_alike() -> None:
    """Random one-byte changes, cuts and insertions of plugin messages
    (hashes of 8 bytes, as vLLM's integers, and of other widths): each
    decodes, parses or is refused exactly as the generic path does it."""
    rng = random.Random(17)
    interesting = b'"\\,:[]{} \n\x0b0fFgG9aA-e.\x00\xff'
    fast = 0
    for _ in range(60):
        body = _message(rng, rng.randint(1, 3), rng.choice([8, 8, 8, 4, 16, 9]))
        for _ in range(40):
            changed = bytearray(body)
            at = rng.randrange(len(body))
            what = rng.random()
            if what < 0.6:
                changed[at] = rng.choice([rng.randrange(256), *interesting])
            elif what < 0.8:
                del changed[at : at + rng.randint(1, 3)]
            else:
                changed[at:at] = bytes([rng.choice(interesting)])
            fast += _same(bytes(changed))
    assert fast > 200  # a change inside a hash, a name or a number may keep the plain form
