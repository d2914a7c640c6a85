"""KV-event payloads as a vLLM publisher sends them, built by hand for the tests.

The layout is restated here rather than taken from ``replay.sources.kv_wire``
(a decoder tested with its own encoder proves little): a batch is an array
``[ts, events, data_parallel_rank]`` (msgspec writes every position of an
``array_like`` Struct, an unset rank as nil); an event is a map under a
``type`` tag, vLLM 0.33.0's fields without a default always present and the
others left out at their default; releases before mid-2026 sent an event as
an array, tag first, every field of their (shorter) declaration in order.
``test_kv_wire.py`` checks this layout against vLLM's own encoder.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from click.testing import CliRunner, Result

from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.cli.sources import ingest
from replay.sources.dump import DumpWriter
from replay.sources.kv_config import load_config

Hash = bytes | int
#: A wire event: the map form, or the legacy array form.
Event = dict[str, Any] | list[Any]

# vLLM 0.33.0's declaration order; the first ``_REQUIRED`` have no default.
_FIELDS = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
        "lookahead_token_ids",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}  # fmt: skip
_REQUIRED = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}
# How many fields the legacy (array) releases declared.
_LEGACY = {"BlockStored": 11, "BlockRemoved": 3, "AllBlocksCleared": 0}

T0 = 1_800_000_000.0


def event(tag: str, *, legacy: bool = False, **values: Any) -> Event:
    names = _FIELDS[tag]
    unknown = set(values) - set(names)
    if unknown:
        raise TypeError(f"{tag} has no field {sorted(unknown)}")
    if legacy:
        return [tag, *(values.get(n) for n in names[: _LEGACY[tag]])]
    kept = {
        n: values.get(n)
        for i, n in enumerate(names)
        if i < _REQUIRED[tag] or values.get(n) is not None
    }
    return {"type": tag, **kept}


def stored(
    hashes: list[Hash],
    *,
    group: int | None = 0,
    medium: str | None = "GPU",
    parent: Hash | None = None,
    legacy: bool = False,
    kind: str | None = None,
) -> Event:
    return event(
        "BlockStored",
        legacy=legacy,
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        medium=medium,
        group_idx=group,
        kv_cache_spec_kind=kind,
    )


def removed(
    hashes: list[Hash], *, group: int | None = 0, medium: str | None = "GPU", legacy: bool = False
) -> Event:
    return event("BlockRemoved", legacy=legacy, block_hashes=hashes, medium=medium, group_idx=group)


def cleared(*, legacy: bool = False) -> Event:
    return event("AllBlocksCleared", legacy=legacy)


def payload(ts: float, *events: Event, rank: int | None = 0) -> bytes:
    return msgspec.msgpack.encode([ts, list(events), rank])


def enc(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


def frames(seq: int, body: bytes, topic: bytes = b"") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), body]


def at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def two_groups() -> TraceConfig:
    return TraceConfig(
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
            GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=64),
        ),
        hash_block_size=16,
        scheduler_block_size=16,
    )


def one_group() -> TraceConfig:
    return load_config(None, 16)


def keyed(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (r["seq"], r["kind"], r.get("group_id"), r.get("block_hashes"), r.get("medium"))
        for r in rows
    ]


def write_dump(path: Path, records: list[tuple[list[bytes], str]]) -> Path:
    with DumpWriter(path) as dump:
        for i, (f, origin) in enumerate(records):
            dump.write(f, origin, T0 + 100 + i)
    return path


def run_ingest(args: list[str]) -> Result:
    return CliRunner().invoke(ingest, args, catch_exceptions=False)


def plugin_lookup(
    n: int,
    batch: int,
    position: int,
    hashes: list[int],
    hit: int,
    *,
    admitted: bool = True,
    instance: str = "e1",
) -> dict[str, Any]:
    """One lookup record as the vLLM plugin streams it: the ``n``-th lookup
    (its step and timestamp), a prompt one token past its hashed blocks of
    16 tokens, and the hit the engine served."""
    return {
        "type": "lookup",
        "instance": instance,
        "n": n,
        "ts": T0 + n,
        "step": n,
        "batch": batch,
        "position": position,
        "request_id": f"r{n}",
        "block_hashes": [u64(h).hex() for h in hashes],
        "num_tokens": 16 * len(hashes) + 1,
        "num_prompt_tokens": 16 * len(hashes) + 1,
        "max_length": 16 * len(hashes),
        "observed_hit_tokens": hit,
        "admitted": admitted,
    }
