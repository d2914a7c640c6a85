"""The compiled fold is exact whatever the hashes look like: every width,
mixed widths in one trace, hashes sharing their first 8 bytes, keys that
differ only by trailing zero bytes, tables that grow and shrink, one row
group per event; always against the hand-written loop over Python sets."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.base.spec import TraceConfig
from replay.engine.kernels import (
    LOOKUP,
    STORE,
    KeyTable,
    _double_in_place,
    key_meta,
    key_metas,
)
from replay.engine.shard import fold_rows
from replay.format.hashwords import hash_words
from replay.format.tracedir import open_trace
from replay.format.writer import (
    ROW_GROUP_ROWS,
    TraceWriter,
    trace_schema,
    write_bounded,
    write_trace,
)
from tests.builders import full_mamba, random_config, random_rows, replay_trace, seeds
from tests.engine.test_engine import naive_replay

SHARED8 = b"\x00\x00\x00\x00\x00\x0b\x2f\x11"


def _eight(h: bytes) -> bytes:
    return h[:8]


def _sixteen_shared(h: bytes) -> bytes:
    # The Mooncake importer's shape: one 8-byte id, then what tells them apart.
    return SHARED8 + h[:8]


def _zero_tail(h: bytes) -> bytes:
    # Same words as the 8-byte form once padded: only the width differs.
    return h[:8] + b"\x00" * 8


def _odd(width: int) -> Callable[[bytes], bytes]:
    return lambda h: h[:width]


FORMS: dict[str, Callable[[bytes], bytes]] = {
    "8": _eight,
    "16-shared-prefix": _sixteen_shared,
    "32": lambda h: h,
    "12": _odd(12),
}


def _rehashed(rows: list[dict[str, Any]], form: Callable[[bytes], bytes]) -> list[dict[str, Any]]:
    return [
        {**r, "block_hashes": [form(h) for h in r["block_hashes"]]} if "block_hashes" in r else r
        for r in rows
    ]


def _mixed(rows: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    """Each hash takes one of several forms, the same one everywhere it
    appears, so that 8-, 12-, 16-, 20- and 32-byte keys share a trace and
    some keys are another key plus zero bytes or a shared 8-byte prefix."""
    forms: list[Callable[[bytes], bytes]] = [
        _eight,
        _sixteen_shared,
        _zero_tail,
        _odd(12),
        _odd(20),
        lambda h: h,
    ]
    chosen: dict[bytes, bytes] = {}

    def form(h: bytes) -> bytes:
        if h not in chosen:
            chosen[h] = rng.choice(forms)(h)
        return chosen[h]

    return _rehashed(rows, form)


def _check(tmp_path: Path, config: TraceConfig, rows: list[dict[str, Any]], policy: str) -> None:
    path = write_trace(tmp_path / "t.parquet", config, rows)
    want = naive_replay(rows, config, policy)
    res = replay_trace(path, policy=policy, unit_present=True).results
    columns = ("seq", "hit_tokens", "mask_blocks", "loaded_blocks", "unit_present")
    assert list(zip(*(res[c].to_list() for c in columns), strict=True)) == want


@pytest.mark.parametrize("seed", seeds(12))
@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_hash_width_matches_the_naive_loop(tmp_path: Path, seed: int, form: str) -> None:
    rng = random.Random(1000 + seed)
    config = random_config(rng)
    rows = _rehashed(random_rows(rng, config, 20), FORMS[form])
    _check(tmp_path, config, rows, rng.choice(["vllm-0.33", "pre-49502"]))


@pytest.mark.parametrize("seed", seeds(20))
def test_mixed_widths_in_one_trace_match_the_naive_loop(tmp_path: Path, seed: int) -> None:
    rng = random.Random(2000 + seed)
    config = random_config(rng)
    rows = _mixed(random_rows(rng, config, 25), rng)
    _check(tmp_path, config, rows, rng.choice(["vllm-0.33", "pre-49502"]))


@pytest.mark.parametrize("seed", seeds(8))
def test_mixed_widths_one_row_group_per_event(tmp_path: Path, seed: int) -> None:
    """Batches alternate between the zero-copy view (whole words) and the
    padded copy (a 12- or 20-byte hash in the batch): a key must be the same
    key in both."""
    rng = random.Random(3000 + seed)
    config = random_config(rng)
    rows = _mixed(random_rows(rng, config, 16), rng)
    path = tmp_path / "rg.parquet"
    with TraceWriter(path, config) as writer:
        for row in rows:
            writer.write_rows([row])
    assert pq.ParquetFile(path).metadata.num_row_groups == len(rows)
    res = replay_trace(path, unit_present=True).results
    columns = ("seq", "hit_tokens", "mask_blocks", "loaded_blocks", "unit_present")
    got = list(zip(*(res[c].to_list() for c in columns), strict=True))
    assert got == naive_replay(rows, config, "vllm-0.33")


def test_keys_differing_only_by_width_or_tail_are_distinct(tmp_path: Path) -> None:
    base = bytes(range(1, 9))
    stored = [base + b"\x00" * 8]  # 16 bytes whose padded words equal the 8-byte key's
    looked = [base, base + b"\x00" * 8, SHARED8 + base, base + b"\x00" * 4]
    rows: list[dict[str, Any]] = [
        {"kind": "store", "group_id": 0, "block_hashes": stored},
        {"kind": "store", "group_id": 1, "block_hashes": [base]},
    ]
    rows += [
        {
            "kind": "lookup",
            "request_id": f"r{i}",
            "block_hashes": [h],
            "max_length": 16,
        }
        for i, h in enumerate(looked)
    ]
    rows = [{"seq": i, **r} for i, r in enumerate(rows)]
    path = write_trace(tmp_path / "w.parquet", full_mamba(eagle=False), rows)
    res = replay_trace(path, unit_present=True).results
    assert res["unit_present"].to_list() == [
        [[False], [True]],
        [[True], [False]],
        [[False], [False]],
        [[False], [False]],
    ]


@pytest.mark.parametrize(
    ("seed", "groups", "width"),
    [(0, 1, 16), (1, 3, 16), (2, 16, 16), (3, 17, 16), (4, 70, 16), (5, 2, 8), (6, 5, 32)],
)
def test_table_growth_and_churn_against_python_sets(seed: int, groups: int, width: int) -> None:
    """Thousands of keys through a table that starts at 1,024 slots: it
    doubles several times, removes shift probe runs back (wrapping around
    the end), a per-group clear rebuilds it and a clear of every group
    shrinks it; presence and per-group counts always equal a set's. Up to
    16 groups keep their bits in the meta word, more in words of their own.
    Keys of 8, 16 and 32 bytes: slots of 2, 3 and 5 words with at most 16
    groups, the strides the fold's backward shift has a copy of its own for."""
    rng = np.random.default_rng(seed)
    table = KeyTable(groups)
    truth: list[set[bytes]] = [set() for _ in range(groups)]
    largest = 0
    universe = [rng.bytes(width) for _ in range(6000)]
    for step in range(60):
        kinds: list[int] = []
        gids: list[int] = []
        hashes: list[list[bytes]] = []
        for _ in range(8):
            op = int(rng.integers(0, 10))
            g = int(rng.integers(0, groups))
            keys = [universe[i] for i in rng.integers(0, len(universe), int(rng.integers(0, 800)))]
            if op < 5:
                kinds.append(STORE)
                truth[g].update(keys)
            elif op < 9:
                kinds.append(1)  # remove
                truth[g].difference_update(keys)
            else:
                keys = []
                kinds.append(2)  # clear
                if step % 7 == 0:
                    g = -1
                    for t in truth:
                        t.clear()
                else:
                    truth[g].clear()
            gids.append(g)
            hashes.append(keys)
        probe = [universe[i] for i in rng.integers(0, len(universe), 500)]
        kinds.append(LOOKUP)
        gids.append(0)
        hashes.append(probe)
        arr = pa.array(hashes, pa.list_(pa.binary()))
        group_ids = np.array(gids, dtype=np.int32)
        out, _, _ = fold_rows(table, group_ids, arr, np.array(kinds, dtype=np.int8))
        want = [[h in truth[g] for h in probe] for g in range(groups)]
        got = out.reshape(groups, len(probe)).astype(bool).tolist()
        assert got == want
        assert table.group_counts() == [len(t) for t in truth]
        assert table.num_keys == len(set().union(*truth))
        largest = max(largest, int(table.info[0]))
    assert largest >= 8192


def _keys_homed(rng: np.random.Generator, want: int, top: Callable[[int], bool]) -> list[bytes]:
    """``want`` random 16-byte keys whose mixed hash's top 10 bits pass
    ``top``: their home slot at every table size lies in that part of it."""
    found: list[bytes] = []
    while len(found) < want:
        key = rng.bytes(16)
        if top(int(key_meta(np.frombuffer(key, dtype=np.uint64), 0, 2, 16)) >> 54):
            found.append(key)
    return found


def _fold(
    table: KeyTable, kinds: np.ndarray[Any, Any], gids: np.ndarray[Any, Any], hashes: pa.Array
) -> np.ndarray[Any, Any]:
    """The table's own fold of one batch; lookup rows' presence bytes."""
    words = hash_words(hashes)
    units = np.diff(words.row_offsets)
    offsets = np.zeros(kinds.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.where(kinds == LOOKUP, units * table.num_groups, 0), out=offsets[1:])
    out = np.zeros(int(offsets[-1]), dtype=np.uint8)
    kinds.flags.writeable = gids.flags.writeable = False
    table.fold(kinds, gids, words, out, offsets)
    return out


@pytest.mark.parametrize("seed", seeds(3, fast=1))
def test_doubling_in_place_with_probe_runs_that_wrap(seed: int) -> None:
    """Keys crowded into the last and first 1/256 of the table at every size:
    their probe runs wrap around the end and start near slot 0, the keys the
    in-place doubling has to set aside and insert last. Random keys grow the
    table from 1,024 slots to 32,768 while some of those are removed again;
    presence always equals a set's."""
    rng = np.random.default_rng(40 + seed)
    crowd = _keys_homed(rng, 400, lambda t: t >= 1020) + _keys_homed(rng, 200, lambda t: t < 4)
    spread = [rng.bytes(16) for _ in range(21_000)]
    table = KeyTable(2)
    truth: list[set[bytes]] = [set(), set()]
    universe = crowd + spread
    for step in range(30):
        fresh = spread[step * 700 : (step + 1) * 700]
        batch = [(STORE, 0, crowd[step * 20 : (step + 1) * 20] + fresh), (STORE, 1, fresh[::5])]
        batch.append((1, 0, fresh[::7] + crowd[step * 10 : step * 10 + 5]))
        for kind, g, keys in batch:
            (truth[g].update if kind == STORE else truth[g].difference_update)(keys)
        probe = [universe[i] for i in rng.integers(0, len(crowd) + (step + 1) * 700, 600)]
        batch.append((LOOKUP, 0, probe))
        arr = pa.array([keys for _, _, keys in batch], pa.list_(pa.binary()))
        kinds = np.array([k for k, _, _ in batch], dtype=np.int8)
        out = _fold(table, kinds, np.array([g for _, g, _ in batch], dtype=np.int32), arr)
        got = out.reshape(2, len(probe)).astype(bool).tolist()
        assert got == [[h in truth[g] for h in probe] for g in range(2)]
        assert table.group_counts() == [len(t) for t in truth]
    assert int(table.info[0]) == 32_768
    # One more doubling by hand: the crowded ends are what it sets aside.
    table._extend(2 * table.slots.shape[0])
    assert _double_in_place(table.slots, table.info) > 64  # the side buffer grows too
    out = _fold(
        table, kinds[-1:], np.zeros(1, np.int32), pa.array([universe], pa.list_(pa.binary()))
    )
    got = out.reshape(2, len(universe)).astype(bool).tolist()
    assert got == [[h in truth[g] for h in universe] for g in range(2)]


def test_many_keys_grow_the_table_in_a_replay(tmp_path: Path) -> None:
    """20,000 distinct keys in both groups (the table doubles from 1,024
    slots several times mid-batch), then removes of every other one."""
    rng = random.Random(5)
    keys = [rng.randbytes(32) for _ in range(20_000)]
    config = full_mamba(eagle=False)
    rows: list[dict[str, Any]] = [
        {"kind": "store", "group_id": 0, "block_hashes": keys},
        {"kind": "store", "group_id": 1, "block_hashes": keys[::3]},
        {"kind": "lookup", "request_id": "a", "block_hashes": keys[:500], "max_length": 8000},
        {"kind": "remove", "group_id": 0, "block_hashes": keys[1::2]},
        {"kind": "lookup", "request_id": "b", "block_hashes": keys[:500], "max_length": 8000},
        {"kind": "clear", "group_id": 1},
        {"kind": "lookup", "request_id": "c", "block_hashes": keys[:500], "max_length": 8000},
    ]
    rows = [{"seq": i, **r} for i, r in enumerate(rows)]
    _check(tmp_path, config, rows, "vllm-0.33")
    path = tmp_path / "t.parquet"
    from replay.analysis.summary import trace_info

    assert trace_info(path)["distinct_keys_per_group"] == [20_000, len(keys[::3])]


def test_writers_bound_their_row_groups(tmp_path: Path) -> None:
    """A large table written at once lands in several row groups, split on
    row boundaries, with every row kept in order."""
    config = full_mamba()
    n = ROW_GROUP_ROWS + 10
    table = pa.table(
        {
            "seq": pa.array(np.arange(n, dtype=np.int64)),
            "kind": pa.array(["clear"] * n),
            "block_hashes": pa.array([None] * n, pa.list_(pa.binary())),
        }
    )
    for name in trace_schema(config).names:
        if name not in table.column_names:
            table = table.append_column(name, pa.nulls(n, trace_schema(config).field(name).type))
    path = write_trace(tmp_path / "big.parquet", config, table)
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [ROW_GROUP_ROWS, 10]
    assert open_trace(path).read_frame(["seq"])["seq"].to_list() == list(range(n))
    # Hash bytes bound them too: two 12 MB rows fit the budget, the third starts a new one.
    big = [[bytes(32)] * (12 << 20 >> 5)] * 3
    out = tmp_path / "bytes.parquet"
    schema = pa.schema([pa.field("block_hashes", pa.list_(pa.binary()))])
    with pq.ParquetWriter(str(out), schema) as writer:
        write_bounded(writer, pa.table({"block_hashes": big}, schema=schema))
    meta = pq.ParquetFile(out).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [2, 1]


@pytest.mark.parametrize(
    "hash_type",
    [
        pa.list_(pa.binary()),
        pa.large_list(pa.large_binary()),
        pa.list_(pa.binary(16)),
        pa.list_(pa.binary(12)),
    ],
    ids=["list-binary", "large-list-large-binary", "fixed-16", "fixed-12"],
)
def test_every_block_hashes_type_the_format_allows(tmp_path: Path, hash_type: pa.DataType) -> None:
    """A trace whose writer chose another Arrow type for ``block_hashes``
    replays exactly as the canonical one."""
    rng = random.Random(77)
    config = random_config(rng)
    width = 12 if hash_type.value_type == pa.binary(12) else 16
    rows = _rehashed(random_rows(rng, config, 20), _odd(width))
    canonical = write_trace(tmp_path / "c.parquet", config, rows)
    table = pq.read_table(canonical)
    i = table.schema.get_field_index("block_hashes")
    table = table.set_column(
        i, pa.field("block_hashes", hash_type), table["block_hashes"].cast(hash_type)
    )
    other = tmp_path / "o.parquet"
    pq.write_table(table, other)
    columns = ["seq", "hit_tokens", "mask_blocks", "loaded_blocks", "flags", "unit_present"]
    a = replay_trace(canonical, unit_present=True).results.select(columns)
    b = replay_trace(other, unit_present=True).results.select(columns)
    assert a.equals(b)
    assert a.height == 20


def test_hash_words_of_a_sliced_array_name_each_hash_exactly() -> None:
    rng = random.Random(3)
    lists = [
        [rng.randbytes(rng.choice([8, 12, 16, 32])) for _ in range(rng.randint(0, 5))]
        for _ in range(40)
    ]
    for typ in (pa.list_(pa.binary()), pa.large_list(pa.large_binary())):
        arr = pa.array(lists, typ).slice(7, 20)
        w = hash_words(arr)
        got = []
        for r in range(len(arr)):
            row = []
            for h in range(w.row_offsets[r], w.row_offsets[r + 1]):
                raw = w.words[w.word_offsets[h] : w.word_offsets[h + 1]].tobytes()
                row.append(raw[: w.nbytes[h]])
                assert raw[w.nbytes[h] :] == bytes(len(raw) - w.nbytes[h])
            got.append(row)
        assert got == lists[7:27]
        assert not w.words.flags.writeable


@pytest.mark.parametrize("width", [8, 16, 24, 32, 40])
def test_binary_hashes_of_one_width_take_the_fixed_layout_and_key_as_before(width: int) -> None:
    """A binary column of equal whole-word hashes (as Parquet gives back a
    fixed-width digest) is viewed as the fixed-size layout, no offset per
    hash, and every hash keys as ``key_meta`` keys its own words; a column
    of mixed widths keeps its offsets."""
    rng = random.Random(width)
    lists = [[rng.randbytes(width) for _ in range(rng.randint(0, 6))] for _ in range(50)]
    arr = pa.array(lists, pa.list_(pa.binary())).slice(5, 40)
    w = hash_words(arr)
    assert (w.value_offsets.shape[0], w.stride, w.width) == (0, width // 8, width)
    flat = [h for row in lists[5:45] for h in row]
    assert [
        w.words[w.word_offsets[h] : w.word_offsets[h + 1]].tobytes() for h in range(len(flat))
    ] == flat
    want = [key_meta(np.frombuffer(h, dtype=np.uint64), 0, width // 8, width) for h in flat]
    assert key_metas(w).tolist() == want
    mixed = pa.array([[rng.randbytes(width), rng.randbytes(width + 8)]], pa.list_(pa.binary()))
    m = hash_words(mixed)
    assert m.value_offsets.tolist() == [0, width, 2 * width + 8]
    assert key_metas(m).tolist() == [
        key_meta(np.frombuffer(h, dtype=np.uint64), 0, len(h) // 8, len(h))
        for h in mixed.flatten().to_pylist()
    ]


def _meta_twins(rng: np.random.Generator, first: bytes, n: int) -> list[tuple[bytes, bytes]]:
    """Pairs of distinct 16-byte keys that share their first 8 bytes and
    their ``key_meta`` (mixed hash and width): found among ``n`` random
    second words (the birthday bound on the meta's 32 hash bits)."""
    words = np.empty(2 * n, dtype=np.uint64)
    words[0::2] = np.frombuffer(first, dtype=np.uint64)[0]
    words[1::2] = rng.integers(0, 2**63, size=n, dtype=np.uint64) * 2 + 1
    keys = pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), n, [None, pa.py_buffer(words)])
    metas = key_metas(hash_words(pa.ListArray.from_arrays(pa.array([0, n], pa.int32()), keys)))
    order = np.argsort(metas, kind="stable")
    same = np.flatnonzero(metas[order][1:] == metas[order][:-1])
    raw = words.tobytes()
    return [
        (
            raw[16 * int(order[i]) : 16 * int(order[i]) + 16],
            raw[16 * int(order[i + 1]) : 16 * int(order[i + 1]) + 16],
        )
        for i in same
    ]


def test_keys_of_one_meta_and_first_word_are_told_apart_by_the_rest() -> None:
    """16-byte keys in the fixed layout (fixed-size binary: no offsets, the
    fold reads each hash's words at ``h * 2`` without ``_span``) whose
    metas and first 8 bytes agree: only the second word tells them apart,
    so a probe that compared fewer words, or the wrong ones, would answer
    one key for its twin. Stores, removes and lookups against sets."""
    twins = _meta_twins(np.random.default_rng(11), SHARED8, 300_000)
    assert len(twins) >= 3
    a = [x for x, _ in twins]
    b = [y for _, y in twins]
    table = KeyTable(2)
    truth: list[set[bytes]] = [set(), set()]
    for batch in (
        [(STORE, 0, a)],
        [(STORE, 1, b), (1, 0, b)],
        [(1, 0, a), (STORE, 0, b[::2])],
        [(1, 1, b), (STORE, 1, a)],
    ):
        for kind, g, keys in batch:
            (truth[g].update if kind == STORE else truth[g].difference_update)(keys)
        probe = b + a
        batch = [*batch, (LOOKUP, 0, probe)]
        arr = pa.array([keys for _, _, keys in batch], pa.list_(pa.binary(16)))
        assert hash_words(arr).value_offsets.shape[0] == 0  # the fixed layout
        kinds = np.array([k for k, _, _ in batch], dtype=np.int8)
        out = _fold(table, kinds, np.array([g for _, g, _ in batch], dtype=np.int32), arr)
        got = out.reshape(2, len(probe)).astype(bool).tolist()
        assert got == [[h in truth[g] for h in probe] for g in range(2)]
        assert table.group_counts() == [len(t) for t in truth]
