"""The validator's numpy pass (``replay.format.validate._plainly_valid``):
a small batch (``replay watch`` folds many, issue 33) skips polars' checks
only when every row passes; each bad row below still gets the one message
of ``_validate_batch``, whichever check it breaks, alone in its batch."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from replay.base.errors import TraceError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.format.hashwords import PackedHashes
from replay.format.validate import validate_rows
from replay.format.writer import events_table

CONFIG = TraceConfig(
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
        GroupSpec(kind=GroupKind.MAMBA, block_size=16),
    ),
    hash_block_size=16,
    scheduler_block_size=16,
)
TS = datetime(2026, 12, 3, tzinfo=UTC)
H = PackedHashes(bytes(range(24)), 8)


def good() -> list[dict[str, Any]]:
    return [
        {"seq": 3, "ts": TS, "kind": "store", "group_id": 0, "block_hashes": H},
        {"seq": 4, "ts": TS, "kind": "lookup", "block_hashes": H, "request_id": "r",
         "max_length": 63, "num_tokens": 64, "observed_hit_tokens": 48},
        {"seq": 7, "ts": TS, "kind": "remove", "group_id": 1, "block_hashes": H},
        {"seq": 8, "ts": TS, "kind": "clear"},
    ]  # fmt: skip


def test_a_good_batch_passes_and_gives_its_last_seq() -> None:
    batch, last = validate_rows("live", CONFIG, events_table(good(), CONFIG), 2)
    assert last == 8
    assert batch.frame["n_hashes"].to_list() == [3, 3, 3, None]


BAD: list[tuple[int, dict[str, Any], str]] = [
    (1, {"seq": 3}, "seq 3: seq not strictly increasing (comes after seq 3)"),
    (0, {"kind": None}, "seq 3: column 'kind' is null"),
    (0, {"kind": "evict"}, "seq 3: unknown event kind 'evict'"),
    (0, {"group_id": None}, "seq 3: store has no group_id"),
    (2, {"block_hashes": None}, "seq 7: remove has no block_hashes"),
    (2, {"group_id": 2}, "seq 7: group_id 2 names no group (the trace has 2: 0..1)"),
    (2, {"group_id": -1}, "seq 7: group_id -1 names no group"),
    (1, {"request_id": None}, "seq 4: lookup has no request_id"),
    (1, {"max_length": None}, "seq 4: lookup has no max_length"),
    (1, {"block_hashes": None}, "seq 4: lookup has no block_hashes"),
    (1, {"max_length": -1}, "seq 4: lookup has a negative max_length -1"),
    (1, {"num_tokens": -1, "max_length": 0}, "seq 4: num_tokens -1 is negative"),
    (1, {"num_tokens": 62}, "seq 4: num_tokens 62 cannot hold max_length 63"),
    (1, {"observed_hit_tokens": -2}, "seq 4: observed_hit_tokens -2 is negative"),
    (3, {"observed_hit_tokens": (1 << 48) + 1}, "seq 8: observed_hit_tokens 281474976710657 is above 2**48"),
    (1, {"max_length": 64, "num_tokens": 65}, "seq 4: lookup max_length 64 exceeds what its 3 block_hashes cover"),
]  # fmt: skip


@pytest.mark.parametrize(("row", "change", "message"), BAD, ids=[m for _, _, m in BAD])
def test_a_bad_row_gets_the_validators_message(row: int, change: dict[str, Any], message: str) -> None:  # fmt: skip
    rows = good()
    rows[row] = {**rows[row], **change}
    with pytest.raises(TraceError, match="^live: " + message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):  # fmt: skip
        validate_rows("live", CONFIG, events_table(rows, CONFIG), 2)


def test_a_seq_at_or_before_the_last_batch_is_refused() -> None:
    with pytest.raises(TraceError, match=r"^live: seq 3: seq not strictly increasing \(comes after seq 3\)"):  # fmt: skip
        validate_rows("live", CONFIG, events_table(good(), CONFIG), 3)
