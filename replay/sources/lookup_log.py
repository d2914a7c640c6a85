"""The lookup log: lookups from outside the KV-event stream, merged in by time.

KV events carry no lookups. They come from a lookup log (JSONL, one object
per lookup, see :func:`read_lookup_log`) merged into a stream of event rows
by timestamp (:class:`LookupMerger`); ``docs/sources.md`` says what that can
and cannot reproduce. The vLLM plugin's own log, which places each lookup
exactly, is ``replay.sources.plugin_log``.
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from replay.base.errors import ReplayError, TraceError
from replay.base.limits import ROW_HASHES, TOKEN_LIMIT, bounded_lines
from replay.base.spec import TraceConfig, lookahead_plus
from replay.format.hashwords import PackedHashes
from replay.sources.values import (
    Row,
    hash_bytes,
    is_int,
    is_text,
    msgpack_type,
    one_line,
    parse_json,
)


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class LookupRecord:
    ts: datetime
    line: int
    request_id: str = field(compare=False)
    #: ``PackedHashes`` when they came in one form (no bytes object per hash).
    block_hashes: Sequence[bytes] = field(compare=False)
    max_length: int = field(compare=False)
    num_tokens: int | None = field(default=None, compare=False)
    observed_hit_tokens: int | None = field(default=None, compare=False)

    def row(self, seq: int) -> Row:
        return {
            "seq": seq,
            "ts": self.ts,
            "kind": "lookup",
            "block_hashes": self.block_hashes
            if isinstance(self.block_hashes, PackedHashes)
            else list(self.block_hashes),
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
        f"expected seconds since the epoch or an ISO 8601 string, got {msgpack_type(value)}"
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
    if is_int(value):
        return hash_bytes(value)
    raise ValueError(
        f"expected an unsigned 64-bit integer or a hex string, got {msgpack_type(value)}"
    )


def _hex_hashes(raw: list[Any]) -> PackedHashes | None:
    """The plugin's form, hex strings of one even width, decoded in one
    ``bytes.fromhex`` (as ``_lookup_hash`` decodes each); None for any other
    list, which ``_lookup_hash`` then reads one by one (and names the bad one)."""
    try:
        joined = "".join(raw)
    except TypeError:
        return None
    widths = set(map(len, raw))
    if len(widths) != 1:
        return None
    (width,) = widths
    if width == 0 or width % 2:
        return None
    try:
        data = bytes.fromhex(joined)
    except ValueError:
        return None
    k = width // 2
    if len(data) != k * len(raw):  # fromhex skips whitespace: read them one by one
        return None
    return PackedHashes(data, k)


def _opt_count(obj: Mapping[str, Any], name: str) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    if not is_int(value) or not 0 <= value <= TOKEN_LIMIT:
        raise ValueError(
            f"field {name!r}: expected an integer in 0..2**48, got {one_line(repr(value))[:40]}"
        )
    assert isinstance(value, int)
    return value


def parse_lookup(obj: object, line: int, config: TraceConfig) -> LookupRecord:
    """One lookup-log object; ``ValueError`` says what is wrong with it."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {msgpack_type(obj)}")
    for name in ("request_id", "ts", "block_hashes"):
        if name not in obj:
            raise ValueError(f"missing field {name!r}")
    request_id = obj["request_id"]
    if not isinstance(request_id, str | int) or isinstance(request_id, bool):
        raise ValueError(f"field 'request_id': expected a string, got {msgpack_type(request_id)}")
    if isinstance(request_id, str) and not is_text(request_id):
        raise ValueError("field 'request_id': holds a lone surrogate escape (not text)")
    try:
        ts = _lookup_ts(obj["ts"])
    except ValueError as exc:
        raise ValueError(f"field 'ts': {exc}") from None
    raw_hashes = obj["block_hashes"]
    # PackedHashes: the plugin's hex, packed as it was read
    # (``replay.sources.lookup_wire``: what ``_hex_hashes`` makes of the list).
    if not isinstance(raw_hashes, list | PackedHashes):
        raise ValueError(
            f"field 'block_hashes': expected a list of integers or hex strings, "
            f"got {msgpack_type(raw_hashes)}"
        )
    if len(raw_hashes) > ROW_HASHES.value():
        raise ValueError(str(ROW_HASHES.refuse("field 'block_hashes' holds", len(raw_hashes))))
    hashes: Sequence[bytes] | None = (
        raw_hashes if isinstance(raw_hashes, PackedHashes) else _hex_hashes(raw_hashes)
    )
    if hashes is None:
        one_by_one: list[bytes] = []
        for j, h in enumerate(raw_hashes):
            try:
                one_by_one.append(_lookup_hash(h))
            except ValueError as exc:
                raise ValueError(f"field 'block_hashes'[{j}]: {exc}") from None
        hashes = tuple(one_by_one)
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
    limit = config.max_length_bound(len(hashes))
    if max_length >= limit:
        raise ValueError(
            f"max_length {max_length} exceeds what its {len(hashes)} block_hashes cover "
            "(expected below (len(block_hashes) + 1) * hash_block_size"
            f"{lookahead_plus(config)} = {limit})"
        )
    return LookupRecord(
        ts=ts,
        line=line,
        request_id=str(request_id),
        block_hashes=hashes,
        max_length=max_length,
        num_tokens=num_tokens,
        observed_hit_tokens=observed,
    )


def read_lookup_log(path: str | os.PathLike[str], config: TraceConfig) -> list[LookupRecord]:
    """A JSONL lookup log, sorted by time (file order among equal times)."""
    from replay.format.paths import check_input

    p = check_input(path, "a JSONL lookup log")
    out: list[LookupRecord] = []
    with open(p, "rb") as fh:
        for line_no, raw in bounded_lines(fh, p):
            if not raw.strip():
                continue
            where = f"{p}: line {line_no}"
            obj = parse_json(
                raw, invalid=f"{where}: not valid JSON", nested=f"{where}: JSON nested too deeply"
            )
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
    from replay.format.tracedir import open_trace
    from replay.format.writer import TraceWriter

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
