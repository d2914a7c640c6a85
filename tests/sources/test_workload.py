"""Requests -> trace rows through the store (``replay.sources.workload``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa

from replay.base.spec import TraceConfig
from replay.rules.store_rules import StoreSettings
from replay.sources.archetypes import archetype_config
from replay.sources.workload import WorkloadWriter

Row = tuple[str, int | None, str | None, list[int]]


def _rows(
    config: TraceConfig,
    requests: list[tuple[str, list[int], int]],
    capacity_blocks: int | None,
    **settings: Any,
) -> list[Row]:
    """The rows a writer emits for ``(request_id, unit keys, num_tokens)``,
    each unit key its own 8-byte digest."""
    tables: list[pa.Table] = []
    writer = WorkloadWriter(
        config,
        tables.append,
        lambda keys: keys.astype(">u8").view(np.uint8).reshape(len(keys), 8),
        capacity_blocks=capacity_blocks,
        settings=StoreSettings(**settings),
    )
    for rid, units, num_tokens in requests:
        keys = np.array(units, dtype=np.int64)
        writer.add(ts_us=0, request_id=rid, num_tokens=num_tokens, unit_keys=keys)
    writer.close()
    return [
        (
            r["kind"],
            r["group_id"],
            r["request_id"],
            [int.from_bytes(h, "big") for h in r["block_hashes"]],
        )
        for t in tables
        for r in t.to_pylist()
    ]


def test_lru_evicts_the_least_recently_used_tail_first() -> None:
    requests = [("a", [1, 2, 3]), ("b", [1, 2, 4]), ("c", [5, 6]), ("d", [1, 7])]
    rows = _rows(archetype_config("full"), [(r, u, 16 * len(u) + 1) for r, u in requests], 4)
    assert [(kind, rid, keys) for kind, _, rid, keys in rows] == [
        ("lookup", "a", [1, 2, 3]),
        ("store", "a", [1, 2, 3]),
        ("lookup", "b", [1, 2, 4]),
        ("store", "b", [4]),
        # LRU order is now 3, 4, 2, 1: a prompt's head is its most recent key.
        ("lookup", "c", [5, 6]),
        ("remove", None, [3, 4]),
        ("store", "c", [5, 6]),
        ("lookup", "d", [1, 7]),
        ("remove", None, [2]),
        ("store", "d", [7]),
    ]


def _store_rows(
    config: TraceConfig, requests: list[tuple[str, list[int], int]], **policy: Any
) -> list[Row]:
    return [row for row in _rows(config, requests, None, **policy) if row[0] == "store"]


def test_writer_stores_from_the_hit_the_request_gets() -> None:
    # Full attention + Mamba with EAGLE. "a": 96 tokens (units 0..5) keeps its
    # blocks and the state at 80 (block 4), none at 64. "b": 200 tokens sharing
    # a's 96; its lookup hits 80 (full attention drops a block, the state at
    # 80 is there), so its prefill runs from 80: full attention stores blocks
    # 6..11 (5 is present), Mamba the checkpoint 176 (block 10).
    config = archetype_config("full+mamba", use_eagle=True)
    a = list(range(6))
    b = a + list(range(100, 106))
    rows = _store_rows(config, [("a", a, 96), ("b", b, 200)])
    assert rows == [
        ("store", 0, "a", a),
        ("store", 1, "a", [4]),
        ("store", 0, "b", b[6:12]),
        ("store", 1, "b", [b[10]]),
    ]
    # Dense retention: the state at 96 too, and b's prefill resumes there.
    dense = _store_rows(config, [("a", a, 96), ("b", b, 200)], retention_interval=None)
    assert dense == [
        ("store", 0, "a", a),
        ("store", 1, "a", [4, 5]),
        ("store", 0, "b", b[6:12]),
        ("store", 1, "b", [b[10]]),
    ]


def test_a_mid_block_tail_keeps_no_mamba_state_with_a_finer_hash_unit() -> None:
    # The writer-against-engine case vLLM 0.32.0 caught: full attention +
    # sliding window (flagged as EAGLE's draft group, EAGLE off) + Mamba,
    # 16-token blocks, 8-token hash units, retention 0, 80 tokens a step.
    config = archetype_config(
        "full+swa+mamba", 16, 8, False, sliding_window=128, extra_retained_tokens=8
    )
    groups = list(config.groups)
    groups[1] = replace(groups[1], is_eagle_group=True)
    config = replace(config, groups=tuple(groups))
    # "a": 100 tokens (units 0..11, a block's key its second unit). The
    # flagged boundaries are 80 (block 4) and the tail unit 96 is a whole
    # block (5): both states kept. "b": 299 tokens sharing a's first 64;
    # full attention alone hits 64, so the hit is 0 with the junction at 64
    # (block 3). Its tail unit, 296, is mid-block: the scheduler still stops
    # at 288, but that state (block 17, key 39) is not kept.
    a = list(range(12))
    b = list(range(8)) + list(range(12, 41))
    rows = _store_rows(
        config,
        [("a", a, 100), ("b", b, 299)],
        retention_interval=0,
        max_num_batched_tokens=80,
        cache="gpu",
        policy="vllm-0.32",
    )
    assert rows == [
        ("store", 0, "a", a[1::2]),
        ("store", 1, "a", a[1::2]),
        ("store", 2, "a", [9, 11]),
        ("store", 0, "b", list(range(13, 41, 2))),
        ("store", 1, "b", [13, *range(23, 41, 2)]),
        ("store", 2, "b", [7]),
    ]
