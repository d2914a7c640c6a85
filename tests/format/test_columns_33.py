"""A live source's rows as checked columns (``replay.format.columns``,
issue 33): ``replay watch`` folds every engine's small batches without the
trace table. The columns equal what the table path gives (the fold's
piece, the lookups' rows), the answers are the same frame, and a row that
breaks a rule, or a value not of the plain form, is left to the table
path, whose validation names it with the one message."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import numpy as np
import polars as pl
import pytest

from replay.base.errors import TraceError
from replay.engine.live import LiveFold
from replay.engine.shard import scatter, scatter_columns
from replay.format.columns import row_columns
from replay.format.hashwords import PackedHashes
from replay.format.validate import validate_rows
from replay.format.writer import events_table
from tests.format.test_validate_fast import BAD, CONFIG, TS, good


def table_path(rows: list[dict[str, Any]], last_seq: int | None) -> Any:
    batch, _ = validate_rows("live", CONFIG, events_table(rows, CONFIG), last_seq)
    (piece,), lookups = scatter(batch, 1, lookup_hashes=True)
    return piece, lookups


def test_the_columns_are_what_the_table_path_gives() -> None:
    rows = good()
    cols = row_columns(rows, CONFIG, 2)
    assert cols is not None
    assert (cols.first_seq, cols.last_seq) == (3, 8)
    assert cols.counts == {"store": 1, "remove": 1, "clear": 1, "lookup": 1}
    piece, lookups = scatter_columns(cols, lookup_hashes=True)
    want_piece, want = table_path(rows, 2)
    assert piece.kinds.tolist() == want_piece.kinds.tolist() == [0, 3, 1, 2]
    assert piece.group_ids.tolist() == want_piece.group_ids.tolist() == [0, -1, 1, -1]
    assert piece.hashes.to_pylist() == want_piece.hashes.to_pylist()
    frame = pl.DataFrame(pl.from_arrow(lookups.rows))
    assert frame.equals(want.rows)
    assert frame.row(0) == (4, "r", 63, 64, 48, TS)
    assert lookups.units.tolist() == want.units.tolist() == [3]
    assert lookups.counts == want.counts
    assert (lookups.events, lookups.hash_entries) == (want.events, want.hash_entries) == (4, 9)
    assert lookups.hashes is not None and want.hashes is not None
    assert lookups.hashes.to_pylist() == want.hashes.to_pylist()


def test_a_lookups_ts_is_its_instant_in_utc_to_the_microsecond() -> None:
    rows = good()
    ts = datetime(2026, 12, 3, 5, 30, 0, 123457, tzinfo=timezone(timedelta(hours=5, minutes=30)))
    rows[1] = {**rows[1], "ts": ts}
    rows[0] = {**rows[0], "ts": None}
    cols = row_columns(rows, CONFIG, None)
    assert cols is not None
    lookups = pl.DataFrame(pl.from_arrow(cols.lookups))
    assert lookups["ts"].to_list() == [datetime(2026, 12, 3, 0, 0, 0, 123457, tzinfo=UTC)]
    assert lookups.equals(table_path(rows, None)[1].rows)


@pytest.mark.parametrize(("row", "change", "message"), BAD, ids=[m for _, _, m in BAD])
def test_a_bad_row_is_left_to_the_table_path_and_its_message(
    row: int, change: dict[str, Any], message: str
) -> None:
    rows = good()
    rows[row] = {**rows[row], **change}
    assert row_columns(rows, CONFIG, 2) is None
    fold = LiveFold(CONFIG, "vllm-0.33", cache="gpu", name="live")
    fold.feed([{"seq": 2, "ts": TS, "kind": "clear"}])
    escaped = message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")
    with pytest.raises(TraceError, match="^live: " + escaped):
        fold.feed(rows)


OTHER_FORMS: list[tuple[int, dict[str, Any]]] = [
    (0, {"block_hashes": [bytes(8), bytes(8)]}),  # a list of bytes, not PackedHashes
    (0, {"ts": datetime(2026, 12, 3)}),  # no time zone
    (1, {"max_length": 63.0}),  # a float
    (1, {"num_tokens": True}),  # a bool
    (1, {"request_id": "r\udc80"}),  # a lone surrogate: not UTF-8 text
    (0, {"seq": 1 << 64}),  # past int64
    (0, {"shard": 1}),  # not a trace column
    (0, {"seq": "3"}),  # a seq as text
    (1, {"kind": b"lookup"}),  # a kind as bytes
    (0, {"medium": 1}),  # a medium not text
]


@pytest.mark.parametrize(("row", "change"), OTHER_FORMS, ids=[repr(c) for _, c in OTHER_FORMS])
def test_other_forms_are_left_to_the_table_path(row: int, change: dict[str, Any]) -> None:
    rows = good()
    rows[row] = {**rows[row], **change}
    assert row_columns(rows, CONFIG, None) is None


def test_rows_of_any_mapping_give_the_columns_of_dicts() -> None:
    from types import MappingProxyType

    rows = good()
    cols, other = (
        row_columns(rows, CONFIG, 2),
        row_columns([MappingProxyType(r) for r in rows], CONFIG, 2),
    )
    assert cols is not None and other is not None
    assert other.kind.tolist() == cols.kind.tolist() == [0, 3, 1, 2]
    assert other.n_hashes.tolist() == cols.n_hashes.tolist()
    assert other.hashes.to_pylist() == cols.hashes.to_pylist()
    assert other.lookups.equals(cols.lookups)


def test_live_answers_are_the_same_frame_either_path() -> None:
    """The same rows folded by one LiveFold through the columns and by
    another through the table path (bytes lists, not PackedHashes, take
    it): the same answers, the store hit past a removed key included."""
    keys = [bytes([k]) * 8 for k in range(1, 7)]

    def rows(packed: bool) -> list[dict[str, Any]]:
        def hs(ks: list[bytes]) -> Any:
            return PackedHashes(b"".join(ks), 8) if packed else ks

        return [
            {"seq": 0, "ts": TS, "kind": "store", "group_id": 0, "block_hashes": hs(keys[:5])},
            {"seq": 1, "ts": TS, "kind": "store", "group_id": 1, "block_hashes": hs(keys[:3])},
            {"seq": 2, "ts": TS, "kind": "lookup", "block_hashes": hs(keys), "request_id": "a",
             "max_length": 95, "num_tokens": 96, "observed_hit_tokens": 48},
            {"seq": 3, "ts": TS, "kind": "remove", "group_id": 0, "block_hashes": hs(keys[1:2])},
            {"seq": 4, "ts": None, "kind": "lookup", "block_hashes": hs(keys[:4]),
             "request_id": "b", "max_length": 63, "num_tokens": 64},
        ]  # fmt: skip

    assert row_columns(rows(True), CONFIG, None) is not None
    assert row_columns(rows(False), CONFIG, None) is None
    fast = LiveFold(CONFIG, "vllm-0.33", cache="gpu").feed(rows(True))
    table = LiveFold(CONFIG, "vllm-0.33", cache="gpu").feed(rows(False))
    assert fast.equals(table)
    assert fast["hit_tokens"].to_list() == [48, 16]
    assert np.array_equal(fast["observed_match"].to_numpy(), table["observed_match"].to_numpy())


@pytest.mark.parametrize("seed", range(20))
def test_packed_hashes_column_is_the_list_of_their_bytes(seed: int) -> None:
    """``packed_column`` (one join, offsets by arithmetic when every row has
    one width, by a sum of widths when rows differ) gives the column Arrow
    makes of the rows' lists of bytes: null rows, empty rows and all."""
    import pyarrow as pa

    from replay.format.writer import packed_column

    rng = np.random.default_rng(seed)
    one_width = seed % 2 == 0
    rows: list[Any] = []
    for _ in range(int(rng.integers(1, 40))):
        draw = rng.random()
        if draw < 0.1:
            rows.append(None)
            continue
        width = 8 if one_width else int(rng.choice([8, 9, 16, 32]))
        n = 0 if draw < 0.2 else int(rng.integers(1, 6))
        rows.append(PackedHashes(rng.bytes(n * width), width))
    column = packed_column(rows)
    assert column is not None
    expected = pa.array([None if r is None else list(r) for r in rows], type=pa.list_(pa.binary()))
    assert column.to_pylist() == expected.to_pylist()
    column.validate(full=True)
    assert column.type == pa.list_(pa.binary())
    # The live fold's form: one width as fixed-size binary (no offset per
    # hash), the same lists; rows of several widths stay binary.
    fixed = packed_column(rows, fixed=True)
    assert fixed is not None
    fixed.validate(full=True)
    assert fixed.to_pylist() == expected.to_pylist()
    widths = {r.width for r in rows if r is not None and len(r)}
    assert fixed.type == (
        pa.list_(pa.binary(widths.pop())) if len(widths) == 1 else pa.list_(pa.binary())
    )


def test_the_live_fold_reads_one_width_with_no_offset_per_hash() -> None:
    """vLLM's 8-byte integer hashes reach the fold as the fixed layout:
    ``hash_words`` views them in place (no offsets made or checked), each
    at its own word."""
    from replay.format.hashwords import hash_words

    keys = [bytes([i]) * 8 for i in range(1, 6)]
    rows = [
        {"seq": 0, "ts": TS, "kind": "store", "group_id": 0,
         "block_hashes": PackedHashes(b"".join(keys[:3]), 8)},
        {"seq": 1, "ts": TS, "kind": "lookup", "block_hashes": PackedHashes(b"".join(keys), 8),
         "request_id": "a", "max_length": 79, "num_tokens": 80, "observed_hit_tokens": 48},
    ]  # fmt: skip
    import pyarrow as pa

    cols = row_columns(rows, CONFIG, None)
    assert cols is not None
    assert cols.hashes.type == pa.list_(pa.binary(8))
    words = hash_words(cols.hashes)
    assert (words.value_offsets.shape[0], words.stride, words.width) == (0, 1, 8)
    assert words.row_offsets.tolist() == [0, 3, 8]
    assert words.words.tobytes() == b"".join(keys[:3] + keys)
