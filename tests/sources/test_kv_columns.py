"""KV-event batches read as columns (``replay.sources.kv_columns``) and their
rows in spans (``EventConverter.convert_columns``, ``replay watch``'s path).

The columns are what ``decode_batch`` reads, or None (the payload then goes
the Struct way, whose errors name what is wrong); a run of removes is one
row, split back event by event where a lookup falls among them, so the
store at every lookup is the one of the rows ``convert_each`` makes.
"""

from __future__ import annotations

import itertools
import random
from datetime import UTC, datetime
from typing import Any

import msgspec
import numpy as np
import pytest

from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.engine.live import LiveFold
from replay.rules.coordinator import DEFAULT_POLICY
from replay.sources.kv_columns import (
    CLEARED,
    REMOVED,
    STORED,
    KVColumns,
    decode_columns,
    payload_digest,
)
from replay.sources.kv_config import GroupMismatch
from replay.sources.kv_rows import _batch_runs
from replay.sources.kv_wire import (
    BlockRemoved,
    BlockStored,
    MalformedBatch,
    decode_batch,
    valid_ts,
)
from replay.sources.lookup_log import LookupRecord
from replay.sources.plugin_log import LookupPlacer, PlacedLookup
from replay.sources.stream import StreamProcessor
from replay.sources.values import Row
from tests.kvpayloads import T0, cleared, enc, event, frames, payload, removed, stored, u64


def test_columns_of_a_batch_as_vllm_0_33_sends_it() -> None:
    body = payload(
        T0,
        stored([1, 2, 2**64 - 1], group=1, parent=9),
        removed([7], group=1),
        removed([8], group=None, medium=None),
        cleared(),
        rank=3,
    )
    cols = decode_columns(body)
    assert cols is not None
    assert (cols.ts, cols.data_parallel_rank) == (T0, 3)
    assert cols.kind.tolist() == [STORED, REMOVED, REMOVED, CLEARED]
    assert cols.group.tolist() == [1, 1, -1, -1]
    assert cols.block_size.tolist() == [16, -1, -1, -1]
    assert cols.medium.tolist() == [1, 1, 0, 0]
    assert cols.offsets.tolist() == [0, 3, 4, 5, 5]
    assert cols.hashes.tolist() == [1, 2, 2**64 - 1, 7, 8]
    unset = decode_columns(payload(T0, removed([5]), rank=None))
    assert unset is not None and unset.data_parallel_rank is None


@pytest.mark.parametrize(
    ("body", "error"),
    [
        # The legacy array form and bytes hashes: read by decode_batch alone.
        (payload(T0, stored([1], legacy=True)), None),
        (payload(T0, stored([b"\x01" * 16])), None),
        (payload(T0, event("BlockRemoved", block_hashes=[1], medium="CPU")), None),
        (enc([T0, [{"type": "BlockPinned", "x": 1}]]), None),
        (
            enc([T0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": 5}]]),
            "event 0 (BlockStored): field 'token_ids': expected an array, got int",
        ),
        (
            enc([T0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": "abc"}]]),
            "event 0 (BlockStored): field 'token_ids': expected an array, got str",
        ),
        (
            enc([T0, [{"type": "BlockRemoved", "block_hashes": [-3]}]]),
            "event 0 (BlockRemoved): field 'block_hashes'[0]: hash -3 is not an unsigned "
            "64-bit integer",
        ),
        (
            enc([T0, [{"type": "BlockStored", "block_hashes": [1], "group_idx": -1}]]),
            "event 0 (BlockStored): field 'group_idx': expected an integer >= 0, got -1",
        ),
        (
            enc([T0, [{"type": "BlockRemoved", "medium": "GPU"}]]),
            "event 0 (BlockRemoved): missing field 'block_hashes'",
        ),
        (enc([T0, [{"block_hashes": [1]}]]), "event 0: map without a 'type' key"),
        (enc([1e300, []]), "batch ts: 1e+300 is not a valid time in seconds"),
        (payload(T0, removed([1]))[:-2], "payload is not msgpack (Input data was truncated)"),
        # An array header claiming 2**32 - 1 events (or hashes) in a few bytes.
        (b"\x92\x00\xdd\xff\xff\xff\xff\x81", "payload is not msgpack (Input data was truncated)"),
    ],
)
def test_anything_else_is_left_to_decode_batch(body: bytes, error: str | None) -> None:
    if error is None:
        assert decode_columns(body) is None
        decode_batch(body)
        return
    cols = decode_columns(body)
    assert cols is None or cols.ts == 1e300  # an invalid ts is the caller's to refuse
    with pytest.raises(MalformedBatch) as raised:
        decode_batch(body)
    assert str(raised.value) == error


def _random_event(rng: random.Random) -> Any:
    tag = rng.choice(["BlockStored", "BlockRemoved", "BlockRemoved", "AllBlocksCleared"])
    if tag == "AllBlocksCleared":
        return cleared()
    hashes: list[bytes | int] = [
        rng.choice([rng.randrange(200), rng.randrange(2**64)]) for _ in range(rng.randint(1, 4))
    ]
    if tag == "BlockRemoved":
        return removed(hashes, group=rng.choice([0, 1, None]), medium=rng.choice(["GPU", None]))
    return stored(hashes, group=rng.choice([0, 1]), parent=rng.choice([None, 5]))


def test_columns_are_what_decode_batch_reads() -> None:
    rng = random.Random(5)
    for _ in range(300):
        events = [_random_event(rng) for _ in range(rng.randint(0, 6))]
        body = payload(T0 + rng.random(), *events, rank=rng.choice([None, 0, 2]))
        assert decode_columns(body) is not None
        _same_as_decode_batch(body)


def test_vllm_s_one_block_removes_read_by_their_bytes_as_field_by_field() -> None:
    """vLLM's ``BlockRemoved`` of one block (hash, medium, group: matched by
    its bytes) with hashes and groups of every integer width, and one byte
    changes of such batches (every value of every byte of a small one): the
    columns are ``decode_batch``'s or None, as when each event is read
    field by field."""
    rng = random.Random(11)
    events = [
        removed([h], group=g)
        for h in [0, 5, 200, 40_000, 2**31, 2**64 - 1]
        for g in [0, 1, 255, 70_000, 2**62]
    ]
    for _ in range(20):
        body = payload(T0, *rng.sample(events, 5), stored([3]), *rng.sample(events, 3))
        assert _same_as_decode_batch(body) is not None
        for at in rng.sample(range(len(body)), 60):
            changed = bytearray(body)
            changed[at] = rng.randrange(256)
            _same_as_decode_batch(bytes(changed))
    # A group past the columns' limit: not read here, as field by field.
    assert decode_columns(payload(T0, removed([1], group=2**62 + 1))) is None
    body = payload(T0, removed([2**64 - 1], group=2), removed([7], group=0))
    cols = _same_as_decode_batch(body)
    assert cols is not None
    assert (cols.hashes.tolist(), cols.group.tolist()) == ([2**64 - 1, 7], [2, 0])
    for at in range(len(body)):
        for value in range(256):
            changed = bytearray(body)
            changed[at] = value
            _same_as_decode_batch(bytes(changed))


def _same_as_decode_batch(body: bytes) -> KVColumns | None:
    """``decode_columns(body)``, checked to be None or what ``decode_batch``
    reads (an invalid ts is the caller's to refuse, as ``decode_batch`` does)."""
    cols = decode_columns(body)
    if cols is None:
        return None
    if not valid_ts(cols.ts):
        with pytest.raises(MalformedBatch):
            decode_batch(body)
        return None
    batch = decode_batch(body)
    assert (cols.ts, cols.data_parallel_rank) == (batch.ts, batch.data_parallel_rank)
    want: list[tuple[int, int, int, int, list[bytes | int]]] = []
    for e in batch.events:
        if isinstance(e, BlockStored | BlockRemoved):
            kind = STORED if isinstance(e, BlockStored) else REMOVED
            size = e.block_size if isinstance(e, BlockStored) else None
            want.append(
                (kind, -1 if e.group_idx is None else e.group_idx,
                 -1 if size is None else size, int(e.medium == "GPU"), list(e.block_hashes))
            )  # fmt: skip
        else:
            want.append((CLEARED, -1, -1, 0, []))
    got: list[tuple[int, int, int, int, list[bytes | int]]] = [
        (int(k), int(g), int(s), int(m), cols.hashes[a:b].tolist())
        for k, g, s, m, a, b in zip(
            cols.kind, cols.group, cols.block_size, cols.medium,
            cols.offsets[:-1], cols.offsets[1:], strict=True,
        )
    ]  # fmt: skip
    assert got == want
    return cols


def _config(groups: int = 1) -> TraceConfig:
    return TraceConfig(
        groups=tuple(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16) for _ in range(groups)
        ),
        hash_block_size=16,
        scheduler_block_size=16,
    )


def _lookup(n: int, batch: int, position: int, hashes: list[int]) -> PlacedLookup:
    return PlacedLookup(
        instance="e",
        n=n,
        batch=batch,
        position=position,
        admitted=True,
        record=LookupRecord(
            ts=datetime.fromtimestamp(T0, tz=UTC),
            line=0,
            request_id=f"r{n}",
            block_hashes=[u64(h) for h in hashes],
            max_length=16 * len(hashes),
            num_tokens=16 * len(hashes) + 1,
        ),
    )


def _rows(
    bodies: list[bytes], lookups: list[PlacedLookup], *, columnar: bool, groups: int = 1
) -> list[Row]:
    out: list[Row] = []
    placer = LookupPlacer(out.extend)
    proc = StreamProcessor(_config(groups), placer, placer=placer, columnar=columnar)
    placer.add(lookups)
    for seq, body in enumerate(bodies):
        proc.feed(frames(seq, body), origin="live", recv_ts=T0)
    placer.watermark("e", len(bodies))
    proc.finish()
    placer.finish()
    return out


def _plain(rows: list[Row]) -> list[tuple[Any, ...]]:
    return [
        (r["seq"], r["kind"], r.get("group_id"), [int.from_bytes(h, "big") for h in r["block_hashes"] or []])
        for r in rows
    ]  # fmt: skip


def test_a_run_of_removes_is_one_row_split_where_a_lookup_falls_among_them() -> None:
    first = payload(T0, stored([1, 2, 3, 4, 5]), removed([1]), removed([2]), removed([3]))
    second = payload(T0, removed([4]), removed([5]), stored([6]), removed([6]))
    lookups = [_lookup(0, 0, 2, [1, 2, 3]), _lookup(1, 1, 0, [4, 5])]
    assert _plain(_rows([first, second], lookups, columnar=True)) == [
        (0, "store", 0, [1, 2, 3, 4, 5]),
        (1, "remove", 0, [1]),  # the lookup at position 2: after the first remove
        (2, "lookup", None, [1, 2, 3]),
        (3, "remove", 0, [2]),
        (4, "remove", 0, [3]),
        (5, "lookup", None, [4, 5]),
        (6, "remove", 0, [4, 5]),  # no lookup among them: one row
        (7, "store", 0, [6]),
        (8, "remove", 0, [6]),
    ]
    # The Struct path: a row per event, the same store at each lookup.
    assert _plain(_rows([first, second], lookups, columnar=False)) == [
        (0, "store", 0, [1, 2, 3, 4, 5]),
        (1, "remove", 0, [1]),
        (2, "lookup", None, [1, 2, 3]),
        (3, "remove", 0, [2]),
        (4, "remove", 0, [3]),
        (5, "lookup", None, [4, 5]),
        (6, "remove", 0, [4]),
        (7, "remove", 0, [5]),
        (8, "store", 0, [6]),
        (9, "remove", 0, [6]),
    ]


def test_a_run_keeps_the_copies_left_and_breaks_at_a_group_or_medium() -> None:
    # Hash 2 stored twice: its first remove leaves a copy (no row for it).
    body = payload(
        T0,
        stored([1, 2, 3], group=0),
        stored([2, 9], group=0),
        stored([9], group=1),
        removed([1], group=0),
        removed([2], group=0),
        removed([3], group=0),
        removed([9], group=1),
        removed([2], group=0, medium=None),
        removed([9], group=0, medium=None),
    )
    lookups = [_lookup(0, 0, 5, [1, 2, 3])]
    assert _plain(_rows([body], lookups, columnar=True, groups=2)) == [
        (0, "store", 0, [1, 2, 3]),
        (1, "store", 0, [2, 9]),
        (2, "store", 1, [9]),
        (3, "remove", 0, [1]),  # 2 keeps a copy; the lookup at 5 splits the run
        (4, "lookup", None, [1, 2, 3]),
        (5, "remove", 0, [3]),
        (6, "remove", 1, [9]),
        (7, "remove", 0, [2, 9]),  # medium None: a run of its own
    ]
    assert _plain(_rows([body], [], columnar=True, groups=2))[3:] == [
        (3, "remove", 0, [1, 3]),
        (4, "remove", 1, [9]),
        (5, "remove", 0, [2, 9]),
    ]


def test_what_the_columns_refuse_is_said_as_the_struct_path_says_it() -> None:
    reports: list[str] = []
    placer = LookupPlacer(lambda rows: None)
    proc = StreamProcessor(_config(), placer, placer=placer, columnar=True, report=reports.append)
    bad = enc([T0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": 5}]])
    proc.feed(frames(0, bad), origin="live", recv_ts=T0)
    assert reports == [
        "skipped: seq 0: event 0 (BlockStored): field 'token_ids': expected an array, got int"
    ]
    assert proc.skipped_total == 1


def test_a_group_the_config_lacks_is_the_struct_path_error() -> None:
    placer = LookupPlacer(lambda rows: None)
    proc = StreamProcessor(_config(), placer, placer=placer, columnar=True)
    with pytest.raises(GroupMismatch) as raised:
        proc.feed(frames(0, payload(T0, removed([1], group=3))), origin="live", recv_ts=T0)
    assert str(raised.value) == (
        "seq 0: BlockRemoved names group_idx 3, but the config has 1 KV-cache group (0..0)"
    )


def test_random_streams_answer_alike_both_ways() -> None:
    """Random batches of stores and removes (copies included) with lookups
    at random places: the rows of both paths, folded, answer every lookup
    alike, and hold the same hashes in the same order."""
    rng = random.Random(11)
    config = _config(2)
    for _ in range(40):
        bodies, lookups, n = [], [], 0
        for b in range(rng.randint(1, 6)):
            events = []
            for _e in range(rng.randint(1, 12)):
                hashes: list[bytes | int] = [rng.randrange(12) for _ in range(rng.randint(1, 3))]
                group = rng.randrange(2)
                if rng.random() < 0.4:
                    events.append(stored(hashes, group=group))
                else:
                    events.append(removed(hashes[:1], group=group))
            for _k in range(rng.randint(0, 3)):
                probe = [rng.randrange(12) for _ in range(rng.randint(1, 4))]
                lookups.append(_lookup(n, b, rng.randint(0, len(events)), probe))
                n += 1
            bodies.append(payload(T0 + b, *events))
        answers = []
        flat = []
        for columnar in (True, False):
            rows = _rows(bodies, lookups, columnar=columnar, groups=2)
            fold = LiveFold(config, DEFAULT_POLICY, cache="gpu")
            frame = fold.feed(rows)
            answers.append(frame.select("request_id", "hit_tokens").rows())
            flat.append(
                [(r["kind"], r.get("group_id"), list(r["block_hashes"] or [])) for r in rows]
            )
        assert answers[0] == answers[1]
        assert len(answers[0]) == len(lookups)

        # Joined up, the same hashes in the same order, lookups where they were.
        def joined(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
            return [
                (k, g, h)
                for k, g, hashes in rows
                for h in (hashes if k == "remove" else [tuple(hashes)])
            ]

        assert joined(flat[0]) == joined(flat[1])


def test_token_ids_are_stepped_over_whatever_their_width() -> None:
    body = msgspec.msgpack.encode(
        [T0, [event("BlockStored", block_hashes=[1], token_ids=[0, 200, -5, 70_000, 2**40, -(2**40)],
                    block_size=16, medium="GPU", group_idx=0, lora_name="adapter", session_id="s")]]
    )  # fmt: skip
    cols = decode_columns(body)
    assert cols is not None
    assert cols.hashes.tolist() == [1]
    assert np.array_equal(cols.offsets, [0, 1])


#: Token ids at every msgpack integer width's edges, and a vocabulary's.
_EDGES = [0, 127, 128, 255, 256, 65_535, 65_536, 151_000, 2**32 - 1, 2**32, 2**64 - 1,
          -1, -32, -33, -128, -129, -(2**15), -(2**15) - 1, -(2**31) - 1, -(2**63)]  # fmt: skip


def test_token_ids_of_every_width_and_one_byte_changes_read_as_decode_batch() -> None:
    """Token ids of every width (a 2- and 4-byte id stepped over by a
    branch, the others by their size's table) and 64-bit hashes (one
    load), each batch and every one-byte change of it (to a random byte,
    and to each width's first byte): ``decode_batch``'s columns or None."""
    rng = random.Random(23)
    firsts = [0x00, 0x7F, 0x80, 0xC0, 0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3, 0xE0, 0xFF]
    for _ in range(40):
        tokens = [
            rng.choice(_EDGES) if rng.random() < 0.3 else rng.randrange(151_000)
            for _ in range(rng.randint(0, 24))
        ]
        hashes = [rng.choice([rng.randrange(2**64), 2**64 - 1, 2**32, 7]) for _ in range(2)]
        body = msgspec.msgpack.encode(
            [T0, [event("BlockStored", block_hashes=hashes, parent_block_hash=hashes[0] ^ 1,
                        token_ids=tokens, block_size=16, medium="GPU", group_idx=0),
                  removed([rng.randrange(2**64)], group=1)], None]
        )  # fmt: skip
        cols = _same_as_decode_batch(body)
        assert cols is not None and cols.hashes[:2].tolist() == hashes
        for at in rng.sample(range(len(body)), min(len(body), 40)):
            for value in [rng.randrange(256), *rng.sample(firsts, 3)]:
                changed = bytearray(body)
                changed[at] = value
                _same_as_decode_batch(bytes(changed))


def test_a_run_is_cut_at_a_row_s_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REPLAY_MAX_ROW_HASHES", "3")
    body = payload(T0, stored([1, 2, 3]), stored([4, 5]), *(removed([h]) for h in range(1, 6)))
    assert _plain(_rows([body], [], columnar=True)) == [
        (0, "store", 0, [1, 2, 3]),
        (1, "store", 0, [4, 5]),
        (2, "remove", 0, [1, 2, 3]),
        (3, "remove", 0, [4, 5]),
    ]


def test_every_cut_of_a_batch_is_left_to_decode_batch() -> None:
    body = payload(T0, stored([1, 2**40], parent=3), removed([2**64 - 1]), cleared(), rank=1)
    for end in range(len(body)):
        assert decode_columns(body[:end]) is None
        with pytest.raises(MalformedBatch):
            decode_batch(body[:end])
    assert decode_columns(body + b"\x00") is None  # trailing bytes


def test_the_payload_digest_tells_every_one_word_change_apart() -> None:
    """``payload_digest`` (the stream's test of a repeated batch): equal
    payloads alike; a payload with any one byte changed, cut or lengthened
    never alike (a change within one 8-byte word, or the tail, changes one
    lane of a bijective pass), and random payloads of every length up to a
    few lanes' words all different."""
    rng = random.Random(33)
    seen: dict[int, bytes] = {}
    for size in [*range(0, 80), 1000, 4096, 65_537]:
        body = rng.randbytes(size)
        digest = payload_digest(body)
        assert payload_digest(bytes(body)) == digest
        assert seen.setdefault(digest, body) == body
        if size:
            assert payload_digest(body[:-1]) != digest
        assert payload_digest(body + b"\0") != digest
        for at in range(size) if size <= 80 else rng.sample(range(size), 200):
            changed = bytearray(body)
            changed[at] ^= 1 << rng.randrange(8)
            assert payload_digest(bytes(changed)) != digest, (size, at)
    # Two payloads that differ in several words (a restart's new batch).
    for _ in range(2000):
        body = rng.randbytes(rng.randrange(1, 300))
        digest = payload_digest(body)
        assert seen.setdefault(digest, body) == body


def test_a_repeated_batch_is_a_duplicate_and_another_payload_a_restart() -> None:
    """The stream by the digest: a batch sent again with its seq (a replay
    fill overlapping the live stream) is counted and dropped; the same seq
    with another payload starts a new epoch."""
    config = TraceConfig(
        groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),),
        hash_block_size=16,
        scheduler_block_size=16,
    )
    rows: list[Row] = []
    proc = StreamProcessor(config, rows.extend, report=lambda _: None)
    first = [payload(T0 + i, stored([10 + i])) for i in range(3)]
    for seq, body in enumerate(first):
        proc.feed(frames(seq, body), origin="live", recv_ts=0.0)
    proc.feed(frames(1, first[1]), origin="replay", recv_ts=0.0)
    assert (proc.duplicates, proc.restarts, len(rows)) == (1, [], 3)
    # One byte of the hash changed: not the batch taken at seq 1.
    other = payload(T0 + 1, stored([11 ^ 1]))
    assert len(other) == len(first[1])
    proc.feed(frames(1, other), origin="live", recv_ts=0.0)
    assert proc.duplicates == 1
    assert proc.restarts == [{"epoch": 1, "previous_last_seq": 2}]
    assert [r["kind"] for r in rows[3:]] == ["clear", "store"]


def _runs_by_arrays(
    kind: Any,
    group: Any,
    block_size: Any,
    medium: Any,
    offsets: Any,
    sizes: Any,
    groups: int,
    limit: int,
) -> tuple[list[int], list[int]] | None:
    """``_batch_runs`` as ``convert_columns`` worked it out before, by array
    operations: the groups and the runs' starts, or None."""
    counts = np.diff(offsets)
    group = group.copy()
    known = kind != CLEARED
    if groups == 1:
        group[known & (group < 0)] = 0
    if (known & ((group < 0) | (group >= groups))).any():
        return None
    if int(counts.max(initial=0)) > limit:
        return None
    stores = kind == STORED
    if stores.any():
        own = sizes[group[stores]]
        size = block_size[stores]
        if ((size >= 0) & ((size > own) | ((counts[stores] > 1) & (size != own)))).any():
            return None
    removes = kind == REMOVED
    starts = np.ones(len(kind), dtype=bool)
    starts[1:] = ~(
        removes[1:] & removes[:-1] & (group[1:] == group[:-1]) & (medium[1:] == medium[:-1])
    )
    return group.tolist(), [*np.flatnonzero(starts).tolist(), len(kind)]


def test_a_batch_s_checks_and_runs_in_one_pass_are_the_array_operations() -> None:
    """Random columns (groups past the config's or none, block sizes above,
    below and equal to the group's, clears, media, events past the hash
    limit): the compiled pass refuses what the array operations refused,
    and otherwise gives their groups and runs."""
    rng = random.Random(5)
    refused = 0
    for _ in range(3000):
        n = rng.randint(1, 12)
        groups = rng.choice([1, 2, 3])
        sizes = np.array([rng.choice([16, 32]) for _ in range(groups)], dtype=np.int64)
        kind = np.array([rng.choice([STORED, REMOVED, REMOVED, CLEARED]) for _ in range(n)],
                        dtype=np.int8)  # fmt: skip
        group = np.array([rng.choice([-1, 0, 0, 1, 2, 3]) for _ in range(n)], dtype=np.int64)
        block_size = np.array([rng.choice([-1, 8, 16, 32, 64]) for _ in range(n)], dtype=np.int64)
        medium = np.array([rng.choice([0, 1, 1]) for _ in range(n)], dtype=np.int8)
        counts = [0 if k == CLEARED else rng.choice([1, 1, 2, 3]) for k in kind]
        offsets = np.array([0, *itertools.accumulate(counts)], dtype=np.int64)
        limit = rng.choice([1, 2, 3, 100])
        want = _runs_by_arrays(kind, group, block_size, medium, offsets, sizes, groups, limit)
        ok, got_group, starts = _batch_runs(
            kind, group, block_size, medium, offsets, sizes, groups, limit
        )
        refused += not ok
        assert (None if not ok else (got_group.tolist(), starts.tolist())) == want
    assert 300 < refused < 2700
