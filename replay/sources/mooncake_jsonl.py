"""The JSONL formats of public prefix-sharing traces: Mooncake (FAST'25) and Qwen "bailian".

Both are JSONL, one request per line, with no tokens but one integer
``hash_id`` per fixed-size token block, chained over the prefix (equal ids
at equal positions mean equal prefixes):

* Mooncake: ``timestamp`` (ms since the trace's start), ``input_length``,
  ``output_length``, ``hash_ids`` (one per 512-token block).
* bailian: ``chat_id``, ``parent_chat_id`` (-1 for none), ``timestamp``
  (s since the trace's start), ``input_length``, ``output_length``,
  ``type``, ``turn``, ``hash_ids`` (one per 16-token block).

``hash_ids`` may cover the last, partial block or not: between
``input_length // S`` and ``ceil(input_length / S)`` entries are accepted
for ``S``-token source blocks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from replay.base.errors import ReplayError
from replay.base.limits import ROW_HASHES, TOKEN_LIMIT, bounded_lines
from replay.format.paths import check_input
from replay.sources.values import JSON_TYPES, is_text, type_name

#: Timestamps are kept relative to the epoch; the last one a trace can hold.
_MAX_TS_US = 253_402_300_799 * 1_000_000

MOONCAKE_BLOCK_TOKENS = 512
BAILIAN_BLOCK_TOKENS = 16
_U64 = 1 << 64


@dataclass(frozen=True, slots=True)
class SourceFormat:
    name: str
    block_tokens: int
    #: field -> accepted types, in the order they are checked
    fields: tuple[tuple[str, tuple[type, ...]], ...]
    #: multiply ``timestamp`` by this to get microseconds
    ts_scale: float


_INT = (int,)
_NUM = (int, float)
MOONCAKE = SourceFormat(
    name="mooncake",
    block_tokens=MOONCAKE_BLOCK_TOKENS,
    fields=(
        ("timestamp", _NUM),
        ("input_length", _INT),
        ("output_length", _INT),
        ("hash_ids", (list,)),
    ),
    ts_scale=1e3,
)
BAILIAN = SourceFormat(
    name="bailian",
    block_tokens=BAILIAN_BLOCK_TOKENS,
    fields=(
        ("chat_id", (int, str)),
        ("parent_chat_id", (int, str)),
        ("timestamp", _NUM),
        ("input_length", _INT),
        ("output_length", _INT),
        ("type", (str,)),
        ("turn", _INT),
        ("hash_ids", (list,)),
    ),
    ts_scale=1e6,
)

FORMATS = {"mooncake": MOONCAKE, "bailian": BAILIAN}
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", list: "a list"}


@dataclass(frozen=True, slots=True)
class SourceRow:
    line: int
    ts_us: int
    request_id: str
    input_length: int
    hash_ids: list[int]


def _check_type(value: object, types: tuple[type, ...]) -> bool:
    return isinstance(value, types) and not isinstance(value, bool)


def _parse(fmt: SourceFormat, path: Path, line_no: int, text: str) -> SourceRow:
    where = f"{path}: line {line_no}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReplayError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise ReplayError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ReplayError(f"{where}: not valid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise ReplayError(f"{where}: expected a JSON object, got {type_name(obj, JSON_TYPES)}")
    for name, types in fmt.fields:
        if name not in obj:
            raise ReplayError(f"{where}: missing field {name!r}")
        value = obj[name]
        if not _check_type(value, types):
            expected = "a number" if types == _NUM else " or ".join(_TYPE_NAMES[t] for t in types)
            raise ReplayError(
                f"{where}: field {name!r} must be {expected}, got {type_name(value, JSON_TYPES)}"
            )
    length = obj["input_length"]
    if length <= 0:
        raise ReplayError(f"{where}: field 'input_length' must be positive, got {length}")
    if obj["output_length"] < 0:
        raise ReplayError(
            f"{where}: field 'output_length' must be >= 0, got {obj['output_length']}"
        )
    ts = obj["timestamp"]
    if not math.isfinite(ts) or ts < 0 or ts * fmt.ts_scale > _MAX_TS_US:
        raise ReplayError(
            f"{where}: field 'timestamp' must be a finite number >= 0 (at most "
            f"{_MAX_TS_US / fmt.ts_scale:.0f}, the year 9999), got {ts}"
        )
    if length > TOKEN_LIMIT:
        raise ReplayError(f"{where}: field 'input_length' must be at most 2**48, got {length}")
    if fmt is BAILIAN and isinstance(obj["chat_id"], str) and not is_text(obj["chat_id"]):
        raise ReplayError(f"{where}: field 'chat_id' holds a lone surrogate escape (not text)")
    ids = obj["hash_ids"]
    if len(ids) > ROW_HASHES.value():
        raise ROW_HASHES.refuse(f"{where}: field 'hash_ids' holds", len(ids))
    for i, h in enumerate(ids):
        if not _check_type(h, _INT) or not 0 <= h < _U64:
            raise ReplayError(
                f"{where}: field 'hash_ids'[{i}] must be an integer in [0, 2**64), "
                f"got {h if _check_type(h, _INT) else type_name(h, JSON_TYPES)}"
            )
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        for h in ids:
            if h in seen:
                raise ReplayError(
                    f"{where}: field 'hash_ids' repeats id {h} (ids are chained over the "
                    "prefix, so one prompt cannot hold the same id twice)"
                )
            seen.add(h)
    s = fmt.block_tokens
    low, high = length // s, -(-length // s)
    if not low <= len(ids) <= high:
        expected = str(low) if low == high else f"{low} or {high}"
        raise ReplayError(
            f"{where}: field 'hash_ids' has {len(ids)} entries, expected {expected} for "
            f"input_length {length} in {s}-token blocks"
        )
    request_id = str(obj["chat_id"]) if "chat_id" in obj and fmt is BAILIAN else f"line-{line_no}"
    return SourceRow(
        line=line_no,
        ts_us=round(ts * fmt.ts_scale),
        request_id=request_id,
        input_length=length,
        hash_ids=ids,
    )


def read_rows(fmt: SourceFormat, path: Path) -> Iterator[SourceRow]:
    check_input(path, f"a {fmt.name} JSONL file")
    with open(path, encoding="utf-8", errors="strict") as fh:
        try:
            for line_no, text in bounded_lines(fh, path):
                if text.strip():
                    yield _parse(fmt, path, line_no, text)
        except UnicodeDecodeError as exc:
            raise ReplayError(f"{path}: not UTF-8 text ({exc.reason})") from None


def granularity(fmt: SourceFormat, block_size: int) -> tuple[int, int]:
    """(trace blocks per source block, source blocks per trace block)."""
    s = fmt.block_tokens
    if block_size <= 0:
        raise ReplayError(f"--block-size must be positive, got {block_size}")
    if s % block_size == 0:
        return s // block_size, 1
    if block_size % s == 0:
        return 1, block_size // s
    raise ReplayError(
        f"--block-size {block_size} must divide or be a multiple of the {fmt.name} trace's "
        f"{s}-token blocks"
    )
