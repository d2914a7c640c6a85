"""vLLM's KV-cache events: decoding, copy counting, and lookups merged in.

Wire facts (vLLM 0.33.0, ``vllm/distributed/kv_events.py``; see
``shared/design/kv-events-wire.md``): a payload is msgpack of an array
``[ts, events, data_parallel_rank]`` (the rank is omitted when unset). An
event is a map with a ``type`` key (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``); releases before mid-2026 sent it as an array, tag
first, then the fields in declaration order (older releases, with fewer
fields, sent shorter arrays; fields beyond the known ones are ignored). A
block hash is bytes, or an unsigned 64-bit integer (vLLM's
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), written to the trace as 8 bytes
big-endian.

Copy counting. vLLM's prefix cache may hold several physical blocks with
the same hash (``BlockHashToBlockMap`` does not de-duplicate), and a CPU or
storage tier holds further copies; each copy gets its own ``BlockStored``
and its own ``BlockRemoved``. The trace's key is ``(group_id, hash)`` with
no tier, and a lookup asks "can this prefix be served", so a key stays
present while *any* copy is left, in any medium: :class:`EventConverter`
counts copies per ``(group_id, hash)`` summed over media and emits a trace
``remove`` only for the hashes whose last copy went. ``media`` narrows the
recording to some tiers (``{"GPU"}`` models the device prefix cache alone);
events of other tiers are then dropped before counting. A null medium is the
default tier, which is ``GPU`` in vLLM. ``AllBlocksCleared`` carries no
medium and resets every count.

Lookups. KV events carry no lookups. They come from a lookup log (JSONL,
one object per lookup, see :func:`read_lookup_log`) merged by timestamp
(:class:`LookupMerger`); ``docs/sources.md`` says what that can and cannot
reproduce.
"""

from __future__ import annotations

import heapq
import json
import math
import os
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from replay.errors import ConfigError, ReplayError, TraceError
from replay.spec import GroupKind, GroupSpec, TraceConfig

Row = dict[str, Any]

U64_MAX = (1 << 64) - 1
DEFAULT_MEDIUM = "GPU"


class MalformedBatch(ReplayError):
    """A message that is not a vLLM KV-event batch. The recorder and the
    dump importer report it, count it, and go on with the next one."""


class GroupMismatch(ConfigError):
    """An event that does not fit the KV-cache config (a group it does not
    have, or a group of another kind). Fatal: the config is wrong."""


# ------------------------------------------------------------------ events


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None = None
    num_token_ids: int | None = None
    block_size: int | None = None
    medium: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    lora_name: str | None = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True, kw_only=True)
class KVBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
    # Event types this decoder does not know (a newer vLLM); skipped one by one.
    ignored_types: tuple[str, ...] = ()

    @property
    def time(self) -> datetime:
        return datetime.fromtimestamp(self.ts, tz=UTC)


# Declaration order in vLLM 0.33.0: the positions of the legacy array form.
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": STORED_FIELDS,
    "BlockRemoved": REMOVED_FIELDS,
    "AllBlocksCleared": (),
}


def _type_name(value: object) -> str:
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, bytes | bytearray | memoryview):
        return "bin"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "map"
    return type(value).__name__


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def hash_bytes(value: object) -> bytes:
    """A block hash as the trace stores it; ``ValueError`` names what is wrong."""
    if isinstance(value, bytes | bytearray | memoryview):
        if not len(value):
            # No block of vLLM's has an empty hash; the trace format refuses one.
            raise ValueError("hash is empty (expected non-empty bytes)")
        return bytes(value)
    if _is_int(value):
        assert isinstance(value, int)
        if not 0 <= value <= U64_MAX:
            raise ValueError(f"hash {value} is not an unsigned 64-bit integer")
        return value.to_bytes(8, "big")
    raise ValueError(f"expected bytes or an unsigned 64-bit integer, got {_type_name(value)}")


class _Fields:
    """Typed access to one event's fields, with errors that name the event."""

    def __init__(self, where: str, values: Mapping[str, Any]) -> None:
        self.where = where
        self.values = values

    def _bad(self, name: str, expected: str, value: object) -> MalformedBatch:
        return MalformedBatch(
            f"{self.where}: field {name!r}: expected {expected}, got {_type_name(value)}"
        )

    def hashes(self, name: str) -> tuple[bytes, ...]:
        if name not in self.values:
            raise MalformedBatch(f"{self.where}: missing field {name!r}")
        value = self.values[name]
        if not isinstance(value, list):
            raise self._bad(name, "an array of block hashes", value)
        out = []
        for j, h in enumerate(value):
            try:
                out.append(hash_bytes(h))
            except ValueError as exc:
                raise MalformedBatch(f"{self.where}: field {name!r}[{j}]: {exc}") from None
        return tuple(out)

    def opt_hash(self, name: str) -> bytes | None:
        value = self.values.get(name)
        if value is None:
            return None
        try:
            return hash_bytes(value)
        except ValueError as exc:
            raise MalformedBatch(f"{self.where}: field {name!r}: {exc}") from None

    def opt_int(self, name: str, *, minimum: int | None = None) -> int | None:
        value = self.values.get(name)
        if value is None:
            return None
        what = "an integer" if minimum is None else f"an integer >= {minimum}"
        if not _is_int(value):
            raise self._bad(name, what, value)
        assert isinstance(value, int)
        if minimum is not None and value < minimum:
            raise MalformedBatch(f"{self.where}: field {name!r}: expected {what}, got {value}")
        return value

    def opt_str(self, name: str) -> str | None:
        value = self.values.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self._bad(name, "a string", value)
        return value

    def opt_len(self, name: str) -> int | None:
        value = self.values.get(name)
        if value is None:
            return None
        if not isinstance(value, list):
            raise self._bad(name, "an array", value)
        return len(value)


def _decode_event(index: int, raw: object) -> KVEvent | str:
    """One event, or its type name when the type is unknown (to be ignored)."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if tag is None:
            raise MalformedBatch(f"event {index}: map without a 'type' key")
        values: Mapping[str, Any] = raw
    elif isinstance(raw, list):
        if not raw:
            raise MalformedBatch(f"event {index}: empty array (expected the type tag first)")
        tag = raw[0]
        if isinstance(tag, str) and tag in EVENT_FIELDS:
            # Legacy array form: positions in declaration order; fields a
            # newer release appended beyond the known ones are ignored.
            values = dict(zip(EVENT_FIELDS[tag], raw[1:], strict=False))
        else:
            values = {}
    else:
        raise MalformedBatch(f"event {index}: expected a map or an array, got {_type_name(raw)}")
    if not isinstance(tag, str):
        raise MalformedBatch(f"event {index}: type tag must be a string, got {_type_name(tag)}")
    if tag not in EVENT_FIELDS:
        return tag
    f = _Fields(f"event {index} ({tag})", values)
    if tag == "BlockStored":
        return BlockStored(
            block_hashes=f.hashes("block_hashes"),
            parent_block_hash=f.opt_hash("parent_block_hash"),
            num_token_ids=f.opt_len("token_ids"),
            block_size=f.opt_int("block_size", minimum=0),
            medium=f.opt_str("medium"),
            group_idx=f.opt_int("group_idx", minimum=0),
            kv_cache_spec_kind=f.opt_str("kv_cache_spec_kind"),
            kv_cache_spec_sliding_window=f.opt_int("kv_cache_spec_sliding_window"),
            lora_name=f.opt_str("lora_name"),
            session_id=f.opt_str("session_id"),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=f.hashes("block_hashes"),
            medium=f.opt_str("medium"),
            group_idx=f.opt_int("group_idx", minimum=0),
        )
    return AllBlocksCleared()


_DECODER = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> KVBatch:
    """Decode one payload; raise :class:`MalformedBatch` saying what is wrong."""
    try:
        obj = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedBatch(f"payload is not msgpack ({exc})") from None
    except RecursionError:
        raise MalformedBatch("payload is not a KV-event batch (nested too deeply)") from None
    if not isinstance(obj, list) or len(obj) not in (2, 3):
        shape = f"an array of {len(obj)}" if isinstance(obj, list) else _type_name(obj)
        raise MalformedBatch(
            f"payload is not a KV-event batch (expected an array [ts, events, "
            f"data_parallel_rank], got {shape})"
        )
    ts, events = obj[0], obj[1]
    rank = obj[2] if len(obj) == 3 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise MalformedBatch(f"batch ts: expected a number of seconds, got {_type_name(ts)}")
    try:
        if not math.isfinite(ts):
            raise ValueError
        datetime.fromtimestamp(ts, tz=UTC)
    except (ValueError, OverflowError, OSError):
        raise MalformedBatch(f"batch ts: {ts!r} is not a valid time in seconds") from None
    if not isinstance(events, list):
        raise MalformedBatch(f"batch events: expected an array, got {_type_name(events)}")
    if rank is not None and not _is_int(rank):
        raise MalformedBatch(
            f"batch data_parallel_rank: expected an integer, got {_type_name(rank)}"
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


# --------------------------------------------------------- copies -> rows

# vLLM's KVCacheSpecKind values, by the trace group kind they replay as.
_SPEC_KINDS: dict[str, GroupKind] = {
    "full_attention": GroupKind.FULL_ATTENTION,
    "mla_attention": GroupKind.FULL_ATTENTION,
    "sink_full_attention": GroupKind.FULL_ATTENTION,
    "sliding_window": GroupKind.SLIDING_WINDOW,
    "sliding_window_mla": GroupKind.SLIDING_WINDOW,
    "chunked_local_attention": GroupKind.CHUNKED_LOCAL_ATTENTION,
    "mamba": GroupKind.MAMBA,
}


def medium_key(medium: str | None) -> str:
    """How a medium compares in a filter: case-insensitive, null = GPU."""
    return (medium or DEFAULT_MEDIUM).casefold()


class EventConverter:
    """Decoded batches in, trace rows out, with a running ``seq``.

    Keeps the copy count per ``(group_id, hash)`` over every medium kept by
    ``media`` (the module docstring says why). Copies stored before the
    recording started are unknown: their removal brings a count to zero
    early (it never goes below zero).
    """

    def __init__(
        self,
        config: TraceConfig,
        *,
        media: Collection[str] | None = None,
        start_seq: int = 0,
    ) -> None:
        self.config = config
        self.media = None if media is None else frozenset(medium_key(m) for m in media)
        self.next_seq = start_seq
        self.copies: dict[tuple[int, bytes], int] = {}
        self.kv_events = 0
        self.filtered_events = 0
        self._checked_groups: set[int] = set()

    def _row(self, ts: datetime, kind: str, **fields: Any) -> Row:
        row: Row = {"seq": self.next_seq, "ts": ts, "kind": kind, **fields}
        self.next_seq += 1
        return row

    def _group(self, event: BlockStored | BlockRemoved) -> int:
        n = self.config.num_groups
        gid = event.group_idx
        if gid is None:
            if n == 1:
                return 0
            raise GroupMismatch(
                f"{type(event).__name__} without group_idx, but the config has {n} "
                "KV-cache groups (events without group_idx come from single-group models)"
            )
        if gid >= n:
            raise GroupMismatch(
                f"{type(event).__name__} names group_idx {gid}, but the config has {n} "
                f"KV-cache group{'s' if n != 1 else ''} (0..{n - 1})"
            )
        if isinstance(event, BlockStored) and gid not in self._checked_groups:
            self._check_spec(gid, event)
            self._checked_groups.add(gid)
        return gid

    def _check_spec(self, gid: int, event: BlockStored) -> None:
        spec: GroupSpec = self.config.groups[gid]
        published = event.kv_cache_spec_kind
        kind = _SPEC_KINDS.get(published or "")
        if kind is not None and kind is not spec.kind:
            raise GroupMismatch(
                f"group_idx {gid}: the publisher says kv_cache_spec_kind {published!r}, "
                f"but the config's group {gid} is {spec.kind.value}"
            )
        window = event.kv_cache_spec_sliding_window
        if (
            kind is GroupKind.SLIDING_WINDOW
            and window is not None
            and window != spec.sliding_window
        ):
            raise GroupMismatch(
                f"group_idx {gid}: the publisher says sliding window {window}, "
                f"but the config's group {gid} has sliding_window {spec.sliding_window}"
            )

    def convert(self, batch: KVBatch) -> list[Row]:
        ts = batch.time
        rows: list[Row] = []
        for event in batch.events:
            self.kv_events += 1
            if isinstance(event, AllBlocksCleared):
                self.copies.clear()
                rows.append(self._row(ts, "clear", group_id=None))
                continue
            if self.media is not None and medium_key(event.medium) not in self.media:
                self.filtered_events += 1
                continue
            gid = self._group(event)
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    key = (gid, h)
                    self.copies[key] = self.copies.get(key, 0) + 1
                if event.block_hashes:
                    rows.append(
                        self._row(
                            ts,
                            "store",
                            group_id=gid,
                            block_hashes=list(event.block_hashes),
                            medium=event.medium,
                        )
                    )
            else:
                gone: list[bytes] = []
                for h in event.block_hashes:
                    key = (gid, h)
                    left = self.copies.get(key, 0) - 1
                    if left > 0:
                        self.copies[key] = left
                    else:
                        self.copies.pop(key, None)
                        gone.append(h)
                if gone:
                    rows.append(
                        self._row(
                            ts, "remove", group_id=gid, block_hashes=gone, medium=event.medium
                        )
                    )
        return rows

    def restart(self, ts: datetime) -> list[Row]:
        """A publisher restart: the new engine starts with an empty cache."""
        self.copies.clear()
        return [self._row(ts, "clear", group_id=None)]


# ------------------------------------------------------------------ config


def load_config(path: str | os.PathLike[str] | None, block_size: int | None) -> TraceConfig:
    """The KV-cache config for a recording: a JSON file holding the
    ``replay.trace`` metadata object (or a trace, whose config is taken), or
    one full-attention group of ``block_size`` tokens."""
    if path is not None and block_size is not None:
        raise ConfigError("pass either --config or --block-size, not both")
    if path is not None:
        from replay.paths import check_input
        from replay.trace import TraceReader, check_config_limits

        try:
            p = check_input(path, "a KV-cache config JSON")
        except ReplayError as exc:
            raise ConfigError(str(exc)) from None
        with open(p, "rb") as fh:  # opened once: a trace is read from it as it is
            parquet = fh.read(4) == b"PAR1"
            fh.seek(0)
            data = b"" if parquet else fh.read()
            config = TraceReader(fh).config if parquet else None
        if config is None:
            try:
                obj = json.loads(data)
            except ValueError as exc:  # bad JSON, bad UTF-8, an integer of > 4300 digits
                raise ConfigError(f"{p}: not valid JSON ({_one_line(exc)})") from None
            except RecursionError:
                raise ConfigError(f"{p}: not a KV-cache config (JSON nested too deeply)") from None
            if isinstance(obj, dict):
                # A person writing the config by hand may leave the version out.
                obj = {"version": 1, **obj}
            try:
                config = TraceConfig.from_json(obj)
            except ConfigError as exc:
                raise ConfigError(f"{p}: {exc}") from None
            check_config_limits(config, str(p))
        return TraceConfig.from_json({**config.to_json(), "source": None})
    if block_size is not None:
        return TraceConfig(
            groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=block_size),),
            hash_block_size=block_size,
            scheduler_block_size=block_size,
        )
    raise ConfigError(
        "no KV-cache config: pass --config kv-config.json (the replay.trace metadata "
        "object) or --block-size N (one full-attention group)"
    )


# ----------------------------------------------------------------- lookups


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class LookupRecord:
    ts: datetime
    line: int
    request_id: str = field(compare=False)
    block_hashes: tuple[bytes, ...] = field(compare=False)
    max_length: int = field(compare=False)
    num_tokens: int | None = field(default=None, compare=False)
    observed_hit_tokens: int | None = field(default=None, compare=False)

    def row(self, seq: int) -> Row:
        return {
            "seq": seq,
            "ts": self.ts,
            "kind": "lookup",
            "block_hashes": list(self.block_hashes),
            "request_id": self.request_id,
            "max_length": self.max_length,
            "num_tokens": self.num_tokens,
            "observed_hit_tokens": self.observed_hit_tokens,
        }


def _lookup_ts(value: object) -> datetime:
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            if not math.isfinite(value):
                raise ValueError
            return datetime.fromtimestamp(value, tz=UTC)
        except (ValueError, OverflowError, OSError):
            raise ValueError(f"{value!r} is not a valid time in seconds") from None
    if isinstance(value, str):
        try:
            ts = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an ISO 8601 time") from None
        try:
            return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)
        except OverflowError:
            raise ValueError(f"{value!r} is outside the representable time range") from None
    raise ValueError(
        f"expected seconds since the epoch or an ISO 8601 string, got {_type_name(value)}"
    )


def _lookup_hash(value: object) -> bytes:
    if isinstance(value, str):
        try:
            data = bytes.fromhex(value)
        except ValueError:
            raise ValueError(f"{value[:40]!r} is not a hex string") from None
        if not data:
            raise ValueError("hash is empty (expected a non-empty hex string)")
        return data
    if _is_int(value):
        return hash_bytes(value)
    raise ValueError(
        f"expected an unsigned 64-bit integer or a hex string, got {_type_name(value)}"
    )


def _opt_count(obj: Mapping[str, Any], name: str) -> int | None:
    from replay.trace import TOKEN_LIMIT

    value = obj.get(name)
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value <= TOKEN_LIMIT:
        raise ValueError(
            f"field {name!r}: expected an integer in 0..2**48, got {_one_line(repr(value))[:40]}"
        )
    assert isinstance(value, int)
    return value


def is_text(value: str) -> bool:
    """Whether ``value`` can be written as UTF-8: JSON may escape lone
    surrogates ("\\ud800") and a command line may hold undecodable bytes;
    no trace can hold either."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def parse_lookup(obj: object, line: int, config: TraceConfig) -> LookupRecord:
    """One lookup-log object; ``ValueError`` says what is wrong with it."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {_type_name(obj)}")
    for name in ("request_id", "ts", "block_hashes"):
        if name not in obj:
            raise ValueError(f"missing field {name!r}")
    request_id = obj["request_id"]
    if not isinstance(request_id, str | int) or isinstance(request_id, bool):
        raise ValueError(f"field 'request_id': expected a string, got {_type_name(request_id)}")
    if isinstance(request_id, str) and not is_text(request_id):
        raise ValueError("field 'request_id': holds a lone surrogate escape (not text)")
    try:
        ts = _lookup_ts(obj["ts"])
    except ValueError as exc:
        raise ValueError(f"field 'ts': {exc}") from None
    raw_hashes = obj["block_hashes"]
    if not isinstance(raw_hashes, list):
        raise ValueError(
            f"field 'block_hashes': expected a list of integers or hex strings, "
            f"got {_type_name(raw_hashes)}"
        )
    hashes = []
    for j, h in enumerate(raw_hashes):
        try:
            hashes.append(_lookup_hash(h))
        except ValueError as exc:
            raise ValueError(f"field 'block_hashes'[{j}]: {exc}") from None
    num_tokens = _opt_count(obj, "num_tokens")
    observed = _opt_count(obj, "observed_hit_tokens")
    max_length = _opt_count(obj, "max_length")
    if max_length is None:
        if num_tokens is None:
            raise ValueError("missing field 'max_length' (or 'num_tokens', giving num_tokens - 1)")
        # vLLM's scheduler asks for at most num_tokens - 1 (one token is recomputed).
        max_length = max(num_tokens - 1, 0)
    if num_tokens is not None and num_tokens < max_length:
        raise ValueError(
            f"num_tokens {num_tokens} cannot hold max_length {max_length} "
            "(expected num_tokens >= max_length)"
        )
    limit = (len(hashes) + 1) * config.hash_block_size
    if max_length >= limit:
        raise ValueError(
            f"max_length {max_length} exceeds what its {len(hashes)} block_hashes cover "
            f"(expected below (len(block_hashes) + 1) * hash_block_size = {limit})"
        )
    return LookupRecord(
        ts=ts,
        line=line,
        request_id=str(request_id),
        block_hashes=tuple(hashes),
        max_length=max_length,
        num_tokens=num_tokens,
        observed_hit_tokens=observed,
    )


def read_lookup_log(path: str | os.PathLike[str], config: TraceConfig) -> list[LookupRecord]:
    """A JSONL lookup log, sorted by time (file order among equal times)."""
    from replay.paths import check_input

    p = check_input(path, "a JSONL lookup log")
    out: list[LookupRecord] = []
    with open(p, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError as exc:  # bad JSON, bad UTF-8, an integer of > 4300 digits
                raise ReplayError(
                    f"{p}: line {line_no}: not valid JSON ({_one_line(exc)})"
                ) from None
            except RecursionError:
                raise ReplayError(f"{p}: line {line_no}: JSON nested too deeply") from None
            try:
                out.append(parse_lookup(obj, line_no, config))
            except ValueError as exc:
                raise ReplayError(f"{p}: line {line_no}: {exc}") from None
    out.sort()
    return out


class LookupMerger:
    """Interleave lookups into a stream of event rows by time, renumbering ``seq``.

    A lookup goes before the first event stamped later than it, and before
    events stamped at the same time: vLLM stamps a batch when the scheduler
    step that produced it ends (``update_from_output``), after that step's
    lookups were made.
    """

    def __init__(self, lookups: Iterable[LookupRecord], *, start_seq: int = 0) -> None:
        self._lookups: list[LookupRecord] = list(lookups)
        heapq.heapify(self._lookups)
        self.next_seq = start_seq
        self.lookups_merged = 0

    def _take_lookup(self) -> Row:
        row = heapq.heappop(self._lookups).row(self.next_seq)
        self.next_seq += 1
        self.lookups_merged += 1
        return row

    def feed(self, rows: Iterable[Mapping[str, Any]], where: str = "") -> list[Row]:
        out: list[Row] = []
        for row in rows:
            ts = row.get("ts")
            if ts is None:
                prefix = f"{where}: " if where else ""
                raise TraceError(
                    f"{prefix}seq {row.get('seq')}: no ts (lookups are merged by time, "
                    "so every event needs one)"
                )
            while self._lookups and self._lookups[0].ts <= ts:
                out.append(self._take_lookup())
            out.append({**row, "seq": self.next_seq})
            self.next_seq += 1
        return out

    def finish(self) -> list[Row]:
        out = []
        while self._lookups:
            out.append(self._take_lookup())
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class MergeSummary:
    events: int
    lookups: int


def merge_lookups(
    trace_path: str | os.PathLike[str],
    lookups_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    batch_rows: int = 65_536,
) -> MergeSummary:
    """Write ``out_path``: the trace's rows with the lookup log merged in by time."""
    from replay.trace import TraceWriter, open_trace

    reader = open_trace(trace_path)
    config = reader.config
    lookups = read_lookup_log(lookups_path, config)
    merger = LookupMerger(lookups)
    events = 0
    source = dict(config.source or {})
    source["lookups"] = {
        "file": Path(lookups_path).name,
        "count": len(lookups),
        "merged_by": "ts (a lookup goes before events with the same ts)",
    }
    with TraceWriter(out_path, config) as writer:
        for frame in reader.iter_frames(batch_size=batch_rows):
            rows = frame.to_dicts()
            events += len(rows)
            out = merger.feed(rows, where=str(trace_path))
            if out:
                writer.write_rows(out)
        tail = merger.finish()
        if tail:
            writer.write_rows(tail)
        writer.set_source(source)
    return MergeSummary(events=events, lookups=merger.lookups_merged)


# ------------------------------------------------- lookups from the plugin

PLUGIN_RECORD_TYPES = ("engine", "lookup")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacedLookup:
    """A lookup the vLLM plugin (``replay.vllm_plugin``) recorded, with its
    exact place: before the ``position``-th event of KV-event batch ``batch``
    of the engine ``instance``."""

    instance: str
    n: int
    batch: int
    position: int
    admitted: bool | None
    record: LookupRecord

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.batch, self.position, self.n)


def _plugin_int(obj: Mapping[str, Any], name: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"field {name!r}: expected an integer >= 0, got {value!r}")
    return value


def parse_plugin_lookup(obj: Mapping[str, Any], line: int, config: TraceConfig) -> PlacedLookup:
    """One ``lookup`` record of the plugin; ``ValueError`` says what is wrong."""
    instance = obj.get("instance")
    if not isinstance(instance, str):
        raise ValueError(f"field 'instance': expected a string, got {_type_name(instance)}")
    admitted = obj.get("admitted")
    if admitted is not None and not isinstance(admitted, bool):
        raise ValueError(f"field 'admitted': expected a boolean, got {_type_name(admitted)}")
    return PlacedLookup(
        instance=instance,
        n=_plugin_int(obj, "n"),
        batch=_plugin_int(obj, "batch"),
        position=_plugin_int(obj, "position"),
        admitted=admitted,
        record=parse_lookup(obj, line, config),
    )


def plugin_config(engine: Mapping[str, Any], where: str) -> TraceConfig:
    """The trace config of an ``engine`` record (the engine's own view)."""
    try:
        return TraceConfig.from_json(engine.get("config"))
    except ConfigError as exc:
        raise ReplayError(f"{where}: engine record: {exc}") from None


def is_plugin_log(path: str | os.PathLike[str]) -> bool:
    """Whether a lookup file was written by the plugin (its first object has a
    ``type`` of ``engine`` or ``lookup``) rather than being a lookup log."""
    with open(path, "rb") as fh:
        for raw in fh:
            if raw.strip():
                try:
                    obj = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                    return False
                return isinstance(obj, dict) and obj.get("type") in PLUGIN_RECORD_TYPES
    return False


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginLog:
    engines: list[dict[str, Any]]
    lookups: list[PlacedLookup]
    config: TraceConfig


def read_plugin_log(path: str | os.PathLike[str], config: TraceConfig | None) -> PluginLog:
    """The plugin's file (``REPLAY_LOOKUPS=PATH``). Without ``config`` the
    first engine record's config is used. A line cut short by a killed
    engine at the very end is ignored; anywhere else it is an error."""
    p = Path(path)
    if not p.exists():
        raise ReplayError(f"{p}: no such file (expected the vLLM plugin's lookup file)")
    objs: list[tuple[int, dict[str, Any]]] = []
    with open(p, "rb") as fh:
        lines = fh.read().split(b"\n")
    last = max((i for i, raw in enumerate(lines) if raw.strip()), default=-1)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            if i == last and i == len(lines) - 1:
                break  # the last line, cut short (no newline yet)
            raise ReplayError(f"{p}: line {i + 1}: not valid JSON ({exc})") from None
        except RecursionError:
            raise ReplayError(f"{p}: line {i + 1}: JSON nested too deeply") from None
        if not isinstance(obj, dict) or obj.get("type") not in PLUGIN_RECORD_TYPES:
            raise ReplayError(
                f"{p}: line {i + 1}: expected a plugin record (a JSON object with "
                f"'type' engine or lookup)"
            )
        objs.append((i + 1, obj))
    engines = [(line, obj) for line, obj in objs if obj["type"] == "engine"]
    if config is None:
        if not engines:
            raise ReplayError(
                f"{p}: no engine record (the plugin writes one when the scheduler starts); "
                "pass --config"
            )
        config = plugin_config(engines[0][1], f"{p}: line {engines[0][0]}")
    lookups = []
    for line, obj in objs:
        if obj["type"] != "lookup":
            continue
        try:
            lookups.append(parse_plugin_lookup(obj, line, config))
        except ValueError as exc:
            raise ReplayError(f"{p}: line {line}: {exc}") from None
    return PluginLog(engines=[obj for _, obj in engines], lookups=lookups, config=config)


_NOT_ADMITTED = "__not_admitted"


class LookupPlacer:
    """Puts each plugin lookup at its exact place among the KV events.

    Batches (their rows, one list per event) come in stream order; a batch is
    held until the lookups for it are known complete (``watermark``: the
    plugin has published at least that many batches since, so every lookup
    that precedes them was sent), then written with each lookup before the
    event at its position. Lookups of a batch that never came (a step with no
    events, or a gap) go before the next batch. Engine instances pair with
    the stream's epochs in order (a restarted engine is a new instance and a
    new epoch). ``seq`` is renumbered from 0.
    """

    def __init__(self, sink: Callable[[list[Row]], None], *, complete: bool = False) -> None:
        self.sink = sink
        self.complete = complete
        self.next_seq = 0
        self.instances: list[str] = []
        self.watermarks: dict[str, int] = {}
        self._lookups: dict[str, list[tuple[tuple[int, int, int], PlacedLookup]]] = {}
        self._pending: deque[tuple[int | None, int, list[list[Row]]]] = deque()
        self.placed = 0
        self.admitted = 0
        self.not_admitted = 0
        self.late = 0
        # The trace has no column for it: the lookups the scheduler did not
        # admit in their step (allocation failed) are listed in the source.
        self.not_admitted_seqs: list[int] = []
        self._released: dict[int, int] = {}

    def _instance(self, name: str) -> int:
        if name not in self._lookups:
            self.instances.append(name)
            self._lookups[name] = []
        return self.instances.index(name)

    def add(self, lookups: Iterable[PlacedLookup]) -> None:
        for lk in lookups:
            epoch = self._instance(lk.instance)
            if lk.batch < self._released.get(epoch, 0):
                # Its batch is already written: as close as it can go now.
                self.late += 1
                self._write([self._lookup_row(lk)])
                continue
            # (batch, position, n) is unique per instance: the lookup itself
            # is never compared.
            heapq.heappush(self._lookups[lk.instance], (lk.order, lk))

    def watermark(self, instance: str, batches: int) -> None:
        self._instance(instance)
        self.watermarks[instance] = max(self.watermarks.get(instance, 0), batches)
        self.drain()

    def batch(self, epoch: int, seq: int, per_event: list[list[Row]]) -> None:
        self._pending.append((epoch, seq, per_event))
        self.drain()

    def __call__(self, rows: list[Row]) -> None:
        """Rows outside any batch (a restart's clear), kept in stream order."""
        self._pending.append((None, 0, [rows]))
        self.drain()

    def _ready(self, epoch: int, seq: int) -> bool:
        if self.complete:
            return True
        if epoch + 1 < len(self.instances) or any(
            e is not None and e > epoch for e, _, _ in self._pending
        ):
            return True  # a later engine runs: this one sends nothing more
        if epoch >= len(self.instances):
            return False
        return self.watermarks.get(self.instances[epoch], 0) > seq

    def drain(self) -> None:
        while self._pending:
            epoch, seq, per_event = self._pending[0]
            if epoch is not None and not self._ready(epoch, seq):
                return
            self._pending.popleft()
            if epoch is None:
                self._write(per_event[0])
            else:
                self._release(epoch, seq, per_event)

    def _take(self, epoch: int, upto: tuple[int, int]) -> list[PlacedLookup]:
        if epoch >= len(self.instances):
            return []
        heap = self._lookups[self.instances[epoch]]
        taken = []
        while heap and heap[0][0][:2] < upto:
            taken.append(heapq.heappop(heap)[1])
        return taken

    def _release(self, epoch: int, seq: int, per_event: list[list[Row]]) -> None:
        out: list[Row] = []
        for i, rows in enumerate(per_event):
            out.extend(self._lookup_row(lk) for lk in self._take(epoch, (seq, i + 1)))
            out.extend(rows)
        # Lookups after the batch's last event (none, when the plugin and the
        # stream agree: their events would be in this batch).
        out.extend(self._lookup_row(lk) for lk in self._take(epoch, (seq + 1, 0)))
        self._released[epoch] = seq + 1
        self._write(out)

    def _lookup_row(self, lk: PlacedLookup) -> Row:
        self.placed += 1
        if lk.admitted is True:
            self.admitted += 1
        elif lk.admitted is False:
            self.not_admitted += 1
        return {**lk.record.row(0), _NOT_ADMITTED: lk.admitted is False}

    def _write(self, rows: list[Row]) -> None:
        if not rows:
            return
        out = []
        for row in rows:
            if row.pop(_NOT_ADMITTED, False):
                self.not_admitted_seqs.append(self.next_seq)
            out.append({**row, "seq": self.next_seq})
            self.next_seq += 1
        self.sink(out)

    def finish(self) -> None:
        """End of the stream: everything held is written, lookups of batches
        that never came last."""
        self.complete = True
        self.drain()
        for epoch in range(len(self.instances)):
            rest = self._take(epoch, (1 << 62, 0))
            self._write([self._lookup_row(lk) for lk in rest])

    def source(self) -> dict[str, Any]:
        return {
            "count": self.placed,
            "admitted": self.admitted,
            "not_admitted": self.not_admitted,
            "late": self.late,
            "not_admitted_seqs": list(self.not_admitted_seqs),
            "engine_instances": list(self.instances),
            "placed_by": "KV-event batch and position (the vLLM plugin)",
        }
