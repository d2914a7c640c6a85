"""Importers for public prefix-sharing traces: Mooncake (FAST'25) and Qwen "bailian".

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

Each row becomes, in file order, a ``lookup`` (``request_id`` = the
``chat_id``, or ``line-N`` for Mooncake; ``max_length = input_length - 1``)
followed by the stores its prefill leaves behind for the chosen archetype,
through the same store logic as the generator (``replay.sources.workload``,
``replay.store_rules``).
Timestamps are kept relative: the trace's time zero is written as the Unix
epoch.

Trace hashes, one per ``block_size`` tokens (the trace's ``hash_block_size``):

* ``block_size == S`` (or a multiple of it): the id of the last source
  block inside the trace block, as 8-byte big-endian (the format's rule for
  integer ids; it names the whole prefix since ids are chained);
* ``S`` a multiple of ``block_size``: each source block becomes
  ``S / block_size`` trace blocks, hashed as a 16-byte digest of
  ``(hash_id, sub-index)`` (a bijective mix; distinct pairs never
  collide). Prefixes still match: the id names everything up to its block's
  end, the sub-index the position inside it. Tokens past the last id (a
  file that omits the partial block) are fresh content, hashed from the
  line number in a separate domain, so they never match.

Prefix reuse ratio, the trace's own, counted directly from the ids:

    reuse = sum over rows of B * h / sum over rows of input_length

where ``B = block_size`` and ``h`` is the number of leading trace blocks of
the row, among its first ``(input_length - 1) // B``, that an earlier row
(in file order) also had: block ``j`` lies in source block ``b`` at
sub-index ``s``, and an earlier row had it iff an earlier row's
``hash_ids[b]`` was the same id and covered at least ``s + 1`` trace
blocks of it (coarser trace blocks: iff an earlier row had the same id as
the last source block inside the trace block). Replaying the imported
trace with ``--model full --no-eagle`` and unbounded capacity gives exactly
this: full attention stores every full block of every earlier prompt and
hits the longest present prefix, at most ``max_length // B`` blocks.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from replay.errors import ReplayError
from replay.sources.synth import archetype_config
from replay.sources.workload import (
    Digests,
    DigestTable,
    Keys,
    WorkloadWriter,
    big_endian_ids,
    digest_pairs,
    lane_salts,
)
from replay.store_rules import StorePolicy
from replay.trace import TraceWriter

MOONCAKE_BLOCK_TOKENS = 512
BAILIAN_BLOCK_TOKENS = 16
_U64 = 1 << 64


@dataclass(frozen=True, slots=True)
class _Format:
    name: str
    block_tokens: int
    #: field -> accepted types, in the order they are checked
    fields: tuple[tuple[str, tuple[type, ...]], ...]
    #: multiply ``timestamp`` by this to get microseconds
    ts_scale: float


_INT = (int,)
_NUM = (int, float)
MOONCAKE = _Format(
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
BAILIAN = _Format(
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

_FORMATS = {"mooncake": MOONCAKE, "bailian": BAILIAN}
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", list: "a list"}


@dataclass(frozen=True, slots=True)
class _Row:
    line: int
    ts_us: int
    request_id: str
    input_length: int
    hash_ids: list[int]


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, dict):
        return "an object"
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _check_type(value: object, types: tuple[type, ...]) -> bool:
    return isinstance(value, types) and not isinstance(value, bool)


def _parse(fmt: _Format, path: Path, line_no: int, text: str) -> _Row:
    where = f"{path}: line {line_no}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReplayError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ReplayError(f"{where}: expected a JSON object, got {_json_type(obj)}")
    for name, types in fmt.fields:
        if name not in obj:
            raise ReplayError(f"{where}: missing field {name!r}")
        value = obj[name]
        if not _check_type(value, types):
            expected = "a number" if types == _NUM else " or ".join(_TYPE_NAMES[t] for t in types)
            raise ReplayError(
                f"{where}: field {name!r} must be {expected}, got {_json_type(value)}"
            )
    length = obj["input_length"]
    if length <= 0:
        raise ReplayError(f"{where}: field 'input_length' must be positive, got {length}")
    if obj["output_length"] < 0:
        raise ReplayError(
            f"{where}: field 'output_length' must be >= 0, got {obj['output_length']}"
        )
    ts = obj["timestamp"]
    if not math.isfinite(ts) or ts < 0:
        raise ReplayError(f"{where}: field 'timestamp' must be a finite number >= 0, got {ts}")
    ids = obj["hash_ids"]
    for i, h in enumerate(ids):
        if not _check_type(h, _INT) or not 0 <= h < _U64:
            raise ReplayError(
                f"{where}: field 'hash_ids'[{i}] must be an integer in [0, 2**64), "
                f"got {h if _check_type(h, _INT) else _json_type(h)}"
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
    return _Row(
        line=line_no,
        ts_us=round(ts * fmt.ts_scale),
        request_id=request_id,
        input_length=length,
        hash_ids=ids,
    )


def _rows(fmt: _Format, path: Path) -> Iterator[_Row]:
    if not path.exists():
        raise ReplayError(f"{path}: no such file")
    if path.is_dir():
        raise ReplayError(f"{path}: is a directory, expected a {fmt.name} JSONL file")
    with open(path, encoding="utf-8", errors="strict") as fh:
        try:
            for line_no, text in enumerate(fh, start=1):
                if text.strip():
                    yield _parse(fmt, path, line_no, text)
        except UnicodeDecodeError as exc:
            raise ReplayError(f"{path}: not UTF-8 text ({exc.reason})") from None


def _granularity(fmt: _Format, block_size: int) -> tuple[int, int]:
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


@dataclass(frozen=True, slots=True)
class ReuseCount:
    """The trace's own prefix reuse, counted from its ``hash_ids``."""

    reused_tokens: int
    input_tokens: int
    rows: int

    @property
    def ratio(self) -> float:
        return self.reused_tokens / self.input_tokens if self.input_tokens else 0.0


class _ReuseCounter:
    """The direct count behind the reuse ratio (module docstring), row by row."""

    def __init__(self, fine: int, coarse: int, block_size: int) -> None:
        self.fine = fine
        self.coarse = coarse
        self.block_size = block_size
        self._covered: dict[int, int] = {}  # source id -> trace blocks of it some row had
        self.reused = self.total = self.rows = 0

    def add(self, row: _Row) -> None:
        bs, fine, coarse, covered = self.block_size, self.fine, self.coarse, self._covered
        self.rows += 1
        self.total += row.input_length
        units = row.input_length // bs
        limit = min(units, (row.input_length - 1) // bs)
        ids = row.hash_ids
        hit = 0
        while hit < limit:
            if coarse > 1:
                ok = covered.get(ids[(hit + 1) * coarse - 1], 0) > 0
            else:
                b, sub = divmod(hit, fine)
                ok = b < len(ids) and covered.get(ids[b], 0) > sub
            if not ok:
                break
            hit += 1
        self.reused += hit * bs
        if coarse > 1:
            for j in range(units):
                covered[ids[(j + 1) * coarse - 1]] = 1
        else:
            for b, h in enumerate(ids):
                n = min(fine, units - b * fine)
                if n > covered.get(h, 0):
                    covered[h] = n

    def result(self) -> ReuseCount:
        return ReuseCount(reused_tokens=self.reused, input_tokens=self.total, rows=self.rows)


def count_reuse(path: str | os.PathLike[str], fmt: str, block_size: int = 16) -> ReuseCount:
    """Validate every line of a ``mooncake`` or ``bailian`` trace and count its
    prefix reuse ratio (module docstring) without writing anything."""
    form = _FORMATS[fmt]
    counter = _ReuseCounter(*_granularity(form, block_size), block_size)
    for row in _rows(form, Path(path)):
        counter.add(row)
    return counter.result()


class _KeyMap:
    """Source ids -> dense unit keys, and the digests of those keys."""

    def __init__(self, fine: int, coarse: int) -> None:
        self.fine = fine
        self.coarse = coarse
        self._dense: dict[int, int] = {}
        self._orig: list[int] = []
        self._fresh: list[bool] = []
        self._salts = lane_salts(0, 2)
        self.digest = DigestTable(self._digest)

    def _index(self, source_id: int, fresh: bool = False) -> int:
        if fresh:
            self._orig.append(source_id)
            self._fresh.append(True)
            return len(self._orig) - 1
        d = self._dense.get(source_id)
        if d is None:
            d = self._dense[source_id] = len(self._orig)
            self._orig.append(source_id)
            self._fresh.append(False)
        return d

    def keys(self, row: _Row, block_size: int) -> Keys:
        units = row.input_length // block_size
        ids = row.hash_ids
        if self.coarse > 1:
            c = self.coarse
            return np.array(
                [self._index(ids[(j + 1) * c - 1]) for j in range(units)], dtype=np.int64
            )
        f = self.fine
        blocks = [self._index(h) for h in ids[: -(-units // f)]]
        if units > len(blocks) * f:  # tokens past the last id: fresh content
            blocks.append(self._index(row.line, fresh=True))
        dense = np.repeat(np.array(blocks, dtype=np.int64), f)[:units]
        return dense * f + np.tile(np.arange(f, dtype=np.int64), len(blocks))[:units]

    def _digest(self, keys: Keys) -> Digests:
        if len(keys) == 0:
            return np.zeros((0, 8 if self.fine == 1 else 16), dtype=np.uint8)
        dense = keys // self.fine
        lo = int(dense.min())
        orig = np.array(self._orig[lo : int(dense.max()) + 1], dtype=np.uint64)[dense - lo]
        if self.fine == 1:
            return big_endian_ids(orig)
        fresh = np.array(self._fresh[lo : int(dense.max()) + 1], dtype=np.uint64)[dense - lo]
        subs = (keys % self.fine).astype(np.uint64) * np.uint64(2) + fresh
        return digest_pairs(orig, subs, self._salts)


def ingest(
    format_name: str,
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    model: str = "full",
    block_size: int = 16,
    eagle: bool = False,
    capacity_blocks: int | None = None,
    policy: StorePolicy | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Import a JSONL trace in ``format_name`` (``mooncake`` or ``bailian``);
    return a summary with the trace's own prefix-reuse ratio. ``policy``
    chooses the store rules (default: vLLM's defaults, the Mooncake store)."""
    fmt = _FORMATS[format_name]
    path = Path(src)
    fine, coarse = _granularity(fmt, block_size)
    config = archetype_config(model, block_size, None, eagle)
    policy = policy or StorePolicy()
    keymap = _KeyMap(fine, coarse)
    counter = _ReuseCounter(fine, coarse, block_size)
    with (
        TraceWriter(out, config) as trace,
        WorkloadWriter(
            config,
            trace.write_table,
            keymap.digest,
            capacity_blocks=capacity_blocks,
            policy=policy,
        ) as writer,
    ):
        done = 0
        for row in _rows(fmt, path):
            counter.add(row)
            writer.add(
                ts_us=row.ts_us,
                request_id=row.request_id,
                num_tokens=row.input_length,
                unit_keys=keymap.keys(row, block_size),
            )
            done += 1
            if progress is not None and done == 1000:
                progress(done)
                done = 0
        stats = writer.close()
        reuse = counter.result()
        trace.set_source(
            {
                "importer": f"replay.sources.mooncake ({fmt.name})",
                "format": fmt.name,
                "file": path.name,
                "rows": reuse.rows,
                "source_block_tokens": fmt.block_tokens,
                "model": model,
                "capacity_blocks": capacity_blocks,
                **policy.as_source(),
                "reuse_ratio": reuse.ratio,
                "reused_tokens": reuse.reused_tokens,
                "input_tokens": reuse.input_tokens,
            }
        )
        if progress is not None and done:
            progress(done)
    return {
        "path": str(out),
        "source": str(path),
        "format": fmt.name,
        "model": model,
        "eagle": eagle,
        "block_size": block_size,
        "capacity_blocks": capacity_blocks,
        **policy.as_source(),
        "rows": reuse.rows,
        **stats.as_dict(),
        "bytes": Path(out).stat().st_size,
        "reuse_ratio": reuse.ratio,
        "reused_tokens": reuse.reused_tokens,
        "input_tokens": reuse.input_tokens,
    }


#: Mooncake FAST'25 JSONL (``timestamp`` in ms, one ``hash_ids`` entry per 512 tokens).
ingest_mooncake = functools.partial(ingest, "mooncake")
#: Qwen bailian JSONL (``timestamp`` in s, one ``hash_ids`` entry per 16 tokens).
ingest_bailian = functools.partial(ingest, "bailian")
