"""The recorder against vLLM's own ``ZmqEventPublisher`` (vLLM 0.33.0).

Run in the vLLM environment:
``/work/main/.venv-vllm/bin/python -m pytest tests/vllm/test_record_vllm.py``.
Skipped where vLLM does not import.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.format.tracedir import open_trace
from replay.sources.record import record

pytestmark = pytest.mark.vllm

kv_events: Any = pytest.importorskip("vllm.distributed.kv_events")

T0 = 1_800_000_000.0
H1 = bytes(range(32))  # a sha256-sized hash, sent as bytes
TIMEOUT = 20.0


def u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stored(hashes: list[Any], group: int, kind: str, parent: Any = None) -> Any:
    return kv_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=kind,
    )


def removed(hashes: list[Any], group: int) -> Any:
    return kv_events.BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=group)


def batches() -> list[Any]:
    batch = kv_events.KVEventBatch
    return [
        batch(ts=T0, events=[stored([H1, 7], 0, "full_attention"), stored([7], 1, "mamba")]),
        batch(ts=T0 + 1, events=[stored([8], 0, "full_attention", parent=7)]),
        batch(ts=T0 + 2, events=[stored([H1], 0, "full_attention")]),  # a second copy
        # The history above is only in the replay buffer; the rest goes live.
        batch(ts=T0 + 3, events=[removed([H1, 8], 0), removed([7], 1)]),
        batch(ts=T0 + 4, events=[removed([H1], 0), kv_events.AllBlocksCleared()]),
        batch(ts=T0 + 5, events=[stored([9], 0, "full_attention")]),
    ]


def config() -> TraceConfig:
    return TraceConfig(
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
            GroupSpec(kind=GroupKind.MAMBA, block_size=16, mamba_cache_mode="align"),
        ),
        hash_block_size=16,
        scheduler_block_size=16,
    )


def test_recorder_captures_what_vllm_publishes(tmp_path: Path) -> None:
    port, rport = free_port(), free_port()
    publisher = kv_events.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{rport}",
        topic="kv@0",
    )
    all_batches = batches()
    messages: list[str] = []
    try:
        for b in all_batches[:3]:
            publisher.publish(b)
        publisher._event_queue.join()  # sent (and buffered) before the recorder starts

        def live() -> None:
            time.sleep(1.0)  # the recorder has subscribed by then
            for b in all_batches[3:]:
                publisher.publish(b)
                time.sleep(0.05)

        thread = threading.Thread(target=live, daemon=True)
        thread.start()
        summary = record(
            endpoint=f"tcp://127.0.0.1:{port}",
            replay_endpoint=f"tcp://127.0.0.1:{rport}",
            topic="kv@0",
            output=tmp_path / "vllm.parquet",
            config=config(),
            max_batches=len(all_batches),
            duration=TIMEOUT,
            report=messages.append,
        )
        thread.join(TIMEOUT)
    finally:
        publisher.shutdown()

    assert summary.stop_reason == "max-batches", messages
    assert messages == []
    trace = open_trace(tmp_path / "vllm.parquet")
    rows = trace.read_frame().to_dicts()
    assert [(r["seq"], r["kind"], r["group_id"], r["block_hashes"]) for r in rows] == [
        (0, "store", 0, [H1, u64(7)]),
        (1, "store", 1, [u64(7)]),
        (2, "store", 0, [u64(8)]),
        (3, "store", 0, [H1]),
        (4, "remove", 0, [u64(8)]),  # H1 keeps its second copy
        (5, "remove", 1, [u64(7)]),
        (6, "remove", 0, [H1]),
        (7, "clear", None, None),
        (8, "store", 0, [u64(9)]),
    ]
    assert [r["ts"].timestamp() for r in rows] == [T0, T0, T0 + 1, T0 + 2] + [T0 + 3] * 2 + [
        T0 + 4,
        T0 + 4,
        T0 + 5,
    ]
    source = dict(trace.config.source or {})
    assert source["gaps"] == []
    assert source["epochs"] == [{"epoch": 0, "first_seq": 0, "last_seq": 5}]
    assert source["filled_from_replay"] == 3
    assert source["data_parallel_ranks"] == [0]
