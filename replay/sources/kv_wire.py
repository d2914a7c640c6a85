"""vLLM's KV-cache events on the wire: msgspec Structs and the batch decoder.

Wire facts (vLLM 0.33.0, ``vllm/distributed/kv_events.py``; what a trace
keeps of them: ``docs/sources.md``): a payload is msgpack of an
``array_like`` batch ``[ts, events, data_parallel_rank]`` (the rank is
omitted when unset, ``omit_defaults``). An event is a tagged Struct
(``tag=True``: the tag is the class name under the ``type`` key), sent as a
map, fields at their default left out. Releases before mid-2026 sent it as
an array, tag first, then the fields in declaration order (older releases,
with fewer fields, sent shorter arrays; fields beyond the known ones are
ignored): :func:`decode_batch` reads both. A block hash is bytes, or an
unsigned 64-bit integer (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``);
the Structs keep it as sent, ``replay.sources.kv_rows`` turns it into the
trace's bytes.

The Structs declare vLLM's fields in vLLM's order, so the array form's
positions are vLLM's. Only ``block_hashes`` is required (an older or
foreign publisher leaves more out); the fields the replay reads carry
vLLM's types with the constraints the trace needs (a hash non-empty or
unsigned, a group index and block size non-negative); the ones it never
reads (``lora_id``, ``extra_keys``, ``locality``, ...) are kept as sent
and not checked, as before the Structs. Event types this decoder does not
know (a newer vLLM) are skipped one by one and counted.

Errors: msgspec's ``ValidationError`` names a path (``$.group_idx``,
``$[1][0]``); :func:`decode_batch` turns it into the project's one line,
``event 3 (BlockStored): field 'group_idx': expected an integer >= 0, got
-1``, read off the offending value itself.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

import msgspec

from replay.base.errors import ReplayError
from replay.sources.values import hash_bytes, is_int, msgpack_type, one_line


class MalformedBatch(ReplayError):
    """A message that is not a vLLM KV-event batch. The recorder and the
    dump importer report it, count it, and go on with the next one."""


Hash = Annotated[bytes, msgspec.Meta(min_length=1)] | Annotated[int, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, frozen=True):
    """What every event shares: the tag (``type``: the class name)."""


class BlockStored(KVCacheEvent, frozen=True):
    block_hashes: tuple[Hash, ...]
    parent_block_hash: Hash | None = None
    # Only its length is read (a Mamba store may span more than its hash).
    token_ids: tuple[Any, ...] | None = None
    block_size: Count | None = None
    lora_id: Any = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: Count | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: str | None = None
    lookahead_token_ids: Any = None


class BlockRemoved(KVCacheEvent, frozen=True):
    block_hashes: tuple[Hash, ...]
    medium: str | None = None
    group_idx: Count | None = None
    locality: Any = None
    ownership: Any = None


class AllBlocksCleared(KVCacheEvent, frozen=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """The batch as a publisher sends it, events in the map form."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


# The legacy array form: the same Structs, positional. msgspec takes a
# union of tagged Structs of one form only, so each form has its decoder.
class _ArrayStored(BlockStored, array_like=True, frozen=True, tag="BlockStored"):
    pass


class _ArrayRemoved(BlockRemoved, array_like=True, frozen=True, tag="BlockRemoved"):
    pass


class _ArrayCleared(AllBlocksCleared, array_like=True, frozen=True, tag="AllBlocksCleared"):
    pass


_MAP_FORM: dict[str, type[KVCacheEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
_FIELDS: dict[str, tuple[str, ...]] = {
    tag: tuple(f.name for f in msgspec.structs.fields(cls)) for tag, cls in _MAP_FORM.items()
}
_ORDER = {tag: {name: i for i, name in enumerate(names)} for tag, names in _FIELDS.items()}
_BATCH = msgspec.msgpack.Decoder(KVEventBatch)
_ANY = msgspec.msgpack.Decoder()
_ENCODE = msgspec.msgpack.Encoder().encode
_MAP_EVENT = msgspec.msgpack.Decoder(KVEvent)
_ARRAY_EVENT = msgspec.msgpack.Decoder(_ArrayStored | _ArrayRemoved | _ArrayCleared)

# What a field's value must be, as the one-line error says it.
_EXPECTED = {
    "block_hashes": "an array of block hashes",
    "token_ids": "an array",
    "block_size": "an integer >= 0",
    "group_idx": "an integer >= 0",
    "kv_cache_spec_sliding_window": "an integer",
}
_PATH = re.compile(r"\.(\w+)|\[(\d+)\]")


@dataclass(frozen=True, slots=True, kw_only=True)
class KVBatch:
    """A decoded batch: the known events, and the types of the ones skipped."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
    # Event types this decoder does not know (a newer vLLM); skipped one by one.
    ignored_types: tuple[str, ...] = ()

    @property
    def time(self) -> datetime:
        return datetime.fromtimestamp(self.ts, tz=UTC)


def valid_ts(ts: float) -> bool:
    """Whether ``ts`` is a time in seconds a batch may carry."""
    try:
        datetime.fromtimestamp(ts, tz=UTC)
    except (ValueError, OverflowError, OSError):
        return False
    return math.isfinite(ts)


def decode_batch(payload: bytes) -> KVBatch:
    """Decode one payload; raise :class:`MalformedBatch` saying what is wrong."""
    # What a publisher sends (an array of 2 or 3, every event a known map)
    # decodes in one call; anything else takes the event-by-event path,
    # which also says exactly what is wrong.
    if payload[:1] in (b"\x92", b"\x93"):
        try:
            batch = _BATCH.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            pass
        else:
            if valid_ts(batch.ts):
                return KVBatch(
                    ts=batch.ts, events=batch.events, data_parallel_rank=batch.data_parallel_rank
                )
    return _decode_slowly(payload)


def _decode_slowly(payload: bytes) -> KVBatch:
    try:
        obj = _ANY.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedBatch(f"payload is not msgpack ({exc})") from None
    except RecursionError:
        raise MalformedBatch("payload is not a KV-event batch (nested too deeply)") from None
    if not isinstance(obj, list) or len(obj) not in (2, 3):
        shape = f"an array of {len(obj)}" if isinstance(obj, list) else msgpack_type(obj)
        raise MalformedBatch(
            f"payload is not a KV-event batch (expected an array [ts, events, "
            f"data_parallel_rank], got {shape})"
        )
    ts, events = obj[0], obj[1]
    rank = obj[2] if len(obj) == 3 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise MalformedBatch(f"batch ts: expected a number of seconds, got {msgpack_type(ts)}")
    if not valid_ts(ts):
        raise MalformedBatch(f"batch ts: {ts!r} is not a valid time in seconds")
    if not isinstance(events, list):
        raise MalformedBatch(f"batch events: expected an array, got {msgpack_type(events)}")
    if rank is not None and not is_int(rank):
        raise MalformedBatch(
            f"batch data_parallel_rank: expected an integer, got {msgpack_type(rank)}"
        )
    decoded: list[KVEvent] = []
    ignored: list[str] = []
    for i, raw in enumerate(events):
        event = _decode_event(i, raw)
        if isinstance(event, str):
            ignored.append(event)
        else:
            decoded.append(event)
    return KVBatch(
        ts=float(ts), events=tuple(decoded), data_parallel_rank=rank, ignored_types=tuple(ignored)
    )


def _decode_event(index: int, raw: object) -> KVEvent | str:
    """One event, or its type name when the type is unknown (to be ignored)."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if tag is None:
            raise MalformedBatch(f"event {index}: map without a 'type' key")
    elif isinstance(raw, list):
        if not raw:
            raise MalformedBatch(f"event {index}: empty array (expected the type tag first)")
        tag = raw[0]
    else:
        raise MalformedBatch(f"event {index}: expected a map or an array, got {msgpack_type(raw)}")
    if not isinstance(tag, str):
        raise MalformedBatch(f"event {index}: type tag must be a string, got {msgpack_type(tag)}")
    if tag not in _MAP_FORM:
        return tag
    array = isinstance(raw, list)
    if isinstance(raw, dict):
        # Fields in vLLM's order, whatever order they came in: of several
        # bad ones, the error names the first declared.
        order = _ORDER[tag]
        raw = dict(sorted(raw.items(), key=lambda kv: order.get(kv[0], len(order))))
    try:
        event: KVEvent = (_ARRAY_EVENT if array else _MAP_EVENT).decode(_ENCODE(raw))
    except msgspec.ValidationError as exc:
        raise MalformedBatch(f"event {index} ({tag}): {_problem(tag, raw, exc)}") from None
    if array:
        # One type per event kind, whichever form it came in.
        return _MAP_FORM[tag](**msgspec.structs.asdict(event))  # type: ignore[return-value]
    return event


def _problem(tag: str, raw: dict[str, Any] | list[Any], exc: msgspec.ValidationError) -> str:
    """msgspec's error, said of the offending value: which field, what it must be
    (msgspec's own words, on one line, for a path these rules do not know)."""
    message, _, where = str(exc).partition(" - at `$")
    steps = [name or int(pos) for name, pos in _PATH.findall(where)]
    try:
        return _field_problem(tag, raw, steps, message)
    except (LookupError, TypeError, ValueError):
        return one_line(message)


def _field_problem(
    tag: str, raw: dict[str, Any] | list[Any], steps: list[str | int], message: str
) -> str:
    fields = _FIELDS[tag]
    if not steps:
        # Only a required field can be missing: the hashes. A short array
        # lacks them; msgspec names the field a map lacks.
        missing = re.search(r"required field `(\w+)`", message)
        return f"missing field {missing.group(1) if missing else fields[0]!r}"
    if isinstance(raw, list):
        # Position 0 of the array form is the tag.
        name, value = fields[int(steps[0]) - 1], raw[int(steps[0])]
    else:
        name, value = str(steps[0]), raw[str(steps[0])]
    label = repr(name)
    if len(steps) > 1 and isinstance(value, list):
        label, value = f"{label}[{steps[1]}]", value[int(steps[1])]
    if name == "parent_block_hash" or label != repr(name):
        try:
            hash_bytes(value)
        except ValueError as err:
            return f"field {label}: {err}"
        return f"field {label}: {one_line(message)}"
    expected = _EXPECTED.get(name, "a string")
    got = value if is_int(value) and expected.startswith("an integer") else msgpack_type(value)
    return f"field {label}: expected {expected}, got {got}"
