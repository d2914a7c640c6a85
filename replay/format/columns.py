"""A live source's rows as plain columns, checked, without a trace table.

``replay watch`` folds every engine's small batches as they come, and the
table path (``events_table``, ``validate_rows``' Arrow and polars frame,
the split by kind) costs about 1.7 ms a batch however few its rows. The
rows a live source makes hold plain values (integers, strings, UTC
datetimes, ``PackedHashes``): ``row_columns`` reads them straight into
numpy and checks them by the rules of ``validate_rows`` on numpy columns
(``plainly_valid``, the same function the table path asks). Any other
value, or a row that breaks a rule, gives None: the caller then takes the
table path, whose validation names the row and says what is wrong, so
the messages keep their one home.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import repeat
from operator import attrgetter
from typing import Any

import numpy as np
import pyarrow as pa

from replay.base.limits import HASH_BYTES, ROW_HASHES
from replay.base.spec import TraceConfig
from replay.format.hashwords import PackedHashes
from replay.format.schema import EVENT_KINDS, TRACE_COLUMNS
from replay.format.validate import plainly_valid
from replay.format.writer import packed_column

_KIND_INDEX = {k: i for i, k in enumerate(EVENT_KINDS)}
_LOOKUP = EVENT_KINDS.index("lookup")
_COLUMN_SET = frozenset(TRACE_COLUMNS)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_NAN = float("nan")
_TS = pa.timestamp("us", tz="UTC")
_INT: frozenset[type] = frozenset((int, type(None)))
_TEXT: frozenset[type] = frozenset((str, type(None)))
_HASHES: frozenset[type] = frozenset((PackedHashes, type(None)))
_DICT = frozenset((dict,))
_INT_ONLY = frozenset((int,))
_STR_ONLY = frozenset((str,))
_STAMPS: frozenset[type] = frozenset((datetime, type(None)))
_TZINFO = attrgetter("tzinfo")


def _of(column: Sequence[Any], types: frozenset[type]) -> bool:
    """Whether every value of ``column`` is of exactly one of ``types``."""
    return set(map(type, column)) <= types


@dataclass(frozen=True, slots=True)
class RowColumns:
    """A checked batch of rows (at least one), as the fold and the answers
    take it."""

    #: Each row's kind, as its index in ``EVENT_KINDS``.
    kind: np.ndarray[Any, np.dtype[np.int8]]
    #: Each row's group, -1 where it names none.
    group_id: np.ndarray[Any, np.dtype[np.int32]]
    #: Each row's hash count, 0 where it has no hashes.
    n_hashes: np.ndarray[Any, np.dtype[np.int64]]
    #: ``block_hashes``, a list per row (null where a row has none).
    hashes: pa.Array
    #: The lookup rows' own columns (``replay.engine.answers.LOOKUP_COLUMNS``),
    #: in Arrow: the results frame is made from Arrow arrays.
    lookups: pa.Table
    first_seq: int
    last_seq: int

    @property
    def counts(self) -> dict[str, int]:
        """Rows by kind (the kinds present)."""
        per = np.bincount(self.kind, minlength=len(EVENT_KINDS))
        return {EVENT_KINDS[i]: int(n) for i, n in enumerate(per.tolist()) if n}


def row_columns(
    rows: Sequence[Mapping[str, Any]], config: TraceConfig, last_seq: int | None
) -> RowColumns | None:
    """``rows`` (seq order, after ``last_seq``) as checked columns, or None
    when a value is not of the plain form or a row breaks a rule (the table
    path then says which)."""
    n = len(rows)
    if n == 0 or not all(map(_COLUMN_SET.issuperset, rows)):
        return None
    # The columns and their types read by C loops (``map``), not a Python
    # step a value: a watch's batch is tens of thousands of rows.
    values: dict[str, list[Any]]
    if _of(rows, _DICT):
        get: Any = dict.get
        values = {name: list(map(get, rows, repeat(name))) for name in TRACE_COLUMNS}
    else:
        values = {name: [row.get(name) for row in rows] for name in TRACE_COLUMNS}
    seq_v, kind_v = values["seq"], values["kind"]
    if not _of(seq_v, _INT_ONLY) or not _of(kind_v, _STR_ONLY):
        return None
    for name in ("group_id", "max_length", "num_tokens", "observed_hit_tokens"):
        if not _of(values[name], _INT):
            return None
    for name in ("request_id", "medium"):
        if not _of(values[name], _TEXT):
            return None
    hashes_v = values["block_hashes"]
    ts_v = values["ts"]
    if not _of(hashes_v, _HASHES) or not _of(ts_v, _STAMPS):
        return None
    if None in map(_TZINFO, filter(None, ts_v)):  # a naive datetime
        return None
    try:
        # Text the trace can hold (a lone surrogate cannot be UTF-8).
        "".join([s for s in values["request_id"] + values["medium"] if s is not None]).encode()
        kind = np.fromiter([_KIND_INDEX[k] for k in kind_v], np.int8, n)
        seq = np.array(seq_v, dtype=np.int64)
        gid, max_length, num_tokens, observed = (
            np.array([_NAN if v is None else v for v in values[name]], dtype=np.float64)
            for name in ("group_id", "max_length", "num_tokens", "observed_hit_tokens")
        )
    except (KeyError, OverflowError, UnicodeEncodeError):
        return None
    n_hashes = np.array([_NAN if h is None else h.length for h in hashes_v], dtype=np.float64)
    present = [h for h in hashes_v if h is not None]
    if present and (
        int(np.nanmax(n_hashes)) > ROW_HASHES.value()
        or max(h.width for h in present) > HASH_BYTES.value()
    ):
        return None
    rid_v = values["request_id"]
    missing_rid = [r is None for r in rid_v]
    if not plainly_valid(
        config,
        last_seq,
        kind=kind,
        seq=seq,
        group_id=gid,
        n_hashes=n_hashes,
        max_length=max_length,
        num_tokens=num_tokens,
        observed=observed,
        no_request_id=np.array(missing_rid) if any(missing_rid) else None,
    ):
        return None
    hashes = packed_column(hashes_v, fixed=True)
    if hashes is None:
        return None
    at = np.flatnonzero(kind == _LOOKUP).tolist()

    def picked(name: str) -> list[Any]:
        column = values[name]
        return [column[i] for i in at]

    lookups = pa.table(
        {
            "seq": pa.array([seq_v[i] for i in at], pa.int64()),
            "request_id": pa.array(picked("request_id"), pa.string()),
            "max_length": pa.array(picked("max_length"), pa.int64()),
            "num_tokens": pa.array(picked("num_tokens"), pa.int64()),
            "observed_hit_tokens": pa.array(picked("observed_hit_tokens"), pa.int64()),
            # Microseconds since the epoch: the instant, whatever the zone.
            "ts": pa.array(
                [None if (t := ts_v[i]) is None else (t - _EPOCH) // _US for i in at], _TS
            ),
        }
    )
    return RowColumns(
        kind=kind,
        group_id=np.where(np.isnan(gid), -1, gid).astype(np.int32),
        n_hashes=np.nan_to_num(n_hashes).astype(np.int64),
        hashes=hashes,
        lookups=lookups,
        first_seq=int(seq[0]),
        last_seq=int(seq[-1]),
    )
