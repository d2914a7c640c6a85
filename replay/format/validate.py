"""Validation of a trace's rows (format v1): every batch is checked as it streams, and
a bad row is reported by its seq."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from replay.base.errors import TraceError
from replay.base.limits import HASH_BYTES, ROW_HASHES, TOKEN_LIMIT
from replay.base.spec import TraceConfig, lookahead_plus
from replay.format.schema import (
    EMPTY_POLARS,
    EVENT_KINDS,
    KIND_ENUM,
    TraceBatch,
    one_line,
    string_ok,
)

_INT32 = (-(1 << 31), (1 << 31) - 1)


#: What Python's datetime can hold (the commands turn timestamps into it).
_TS_RANGE_S = (-62_135_596_800, 253_402_300_799)  # 0001-01-01 .. 9999-12-31T23:59:59


_PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}


def _combined(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _where(raw: pa.RecordBatch | pa.Table, i: int) -> str:
    seq = _combined(raw.column("seq"))[i].as_py() if "seq" in raw.column_names else None
    return f"seq {seq}" if seq is not None else f"row {i}"


def _first(mask: pa.Array) -> int | None:
    idx = pc.indices_nonzero(pc.fill_null(mask, False))
    return int(idx[0].as_py()) if len(idx) else None


def _bad_utf8(arr: pa.Array) -> int | None:
    """The first row whose string is not valid UTF-8 (the rare error path)."""
    if pa.types.is_dictionary(arr.type):
        bad = _bad_utf8(arr.dictionary)
        return None if bad is None else _first(pc.equal(arr.indices, bad))
    view = arr.view(pa.large_binary() if pa.types.is_large_string(arr.type) else pa.binary())
    for i, value in enumerate(view):
        data = value.as_py()
        if data is not None:
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                return i
    return None


def check_utf8(path: str, raw: pa.RecordBatch | pa.Table, name: str) -> None:
    """Column ``name`` holds only valid UTF-8 (nested strings included: a
    results file's ``flags``); the row is named where the column is flat."""
    if name not in raw.column_names:
        return
    col = _combined(raw.column(name))
    try:
        col.validate(full=True)
    except pa.ArrowInvalid as exc:
        i = _bad_utf8(col) if string_ok(col.type) else None
        if "utf8" not in str(exc).lower():
            raise TraceError(f"{path}: column {name!r}: invalid data ({one_line(exc)})") from None
        where = "" if i is None else f"{_where(raw, i)}: "
        raise TraceError(f"{path}: {where}column {name!r} is not valid UTF-8 text") from None


def check_ts(path: str, raw: pa.RecordBatch | pa.Table) -> None:
    if "ts" not in raw.column_names or not pa.types.is_timestamp(raw.schema.field("ts").type):
        return
    ts = _combined(raw.column("ts"))
    per = _PER_SECOND[ts.type.unit]
    # In nanoseconds the whole int64 range is representable: clip the bounds.
    # The last second of 9999 is representable to its last tick.
    first, last = _TS_RANGE_S[0] * per, (_TS_RANGE_S[1] + 1) * per - 1
    lo, hi = (min(max(b, -(1 << 63)), (1 << 63) - 1) for b in (first, last))
    if ts.null_count == len(ts):
        return
    values = ts.cast(pa.int64())
    # numpy, not pyarrow.compute with Python scalars: converting those tries
    # to import dateutil on every call (a search of sys.path when it is not
    # installed), which replay watch would pay on every engine's batch.
    ticks = np.frombuffer(values.buffers()[1], dtype=np.int64)[
        values.offset : values.offset + len(values)
    ]
    out = (ticks < lo) | (ticks > hi)
    if values.null_count:
        out &= pc.is_valid(values).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(out)
    i = int(bad[0]) if bad.size else None
    if i is not None:
        raise TraceError(
            f"{path}: {_where(raw, i)}: ts {values[i].as_py()} {ts.type.unit} since the "
            "epoch is outside the representable range (expected a time between "
            "0001-01-01 and 9999-12-31)"
        )


def utc_ts(raw: pa.RecordBatch | pa.Table) -> pa.RecordBatch | pa.Table:
    """``raw`` with a ``ts`` column of any time zone (a fixed offset such as
    +05:30, a zone name polars does not know, none) as UTC: Arrow stores
    the instant itself, in UTC, whatever the zone, so only the type changes."""
    if "ts" not in raw.column_names:
        return raw
    typ = raw.schema.field("ts").type
    if not pa.types.is_timestamp(typ) or typ.tz in (None, "UTC"):
        return raw
    utc = pa.timestamp(typ.unit, tz="UTC")
    ts = _combined(raw.column("ts")).cast(pa.int64()).cast(utc)
    i = raw.schema.get_field_index("ts")
    return raw.set_column(i, pa.field("ts", utc), ts)


def check_hash_sizes(
    path: str,
    raw: pa.RecordBatch | pa.Table,
    hashes: pa.Array,
    lens: np.ndarray[Any, Any] | None = None,
) -> None:
    """Each row's hash count and each hash's width within the limits
    (``lens``: the hashes' byte lengths, when the caller has them)."""
    counts = pc.list_value_length(hashes)
    most = pc.max(counts).as_py()
    if most is not None and most > ROW_HASHES.value():
        i = _first(pc.equal(counts, most))
        assert i is not None
        raise ROW_HASHES.refuse(f"{path}: {_where(raw, i)}: block_hashes holds", most)
    values = hashes.values
    if len(values) == 0 or pa.types.is_fixed_size_binary(values.type):
        return  # a fixed width is checked from the schema
    lo, hi = int(hashes.offsets[0].as_py()), int(hashes.offsets[-1].as_py())
    if lens is None:
        lens = _value_lengths(values, lo, hi)
    if lens.size and int(lens.max()) > HASH_BYTES.value():
        j = int(np.argmax(lens))
        row = int(pc.list_parent_indices(hashes)[j].as_py())
        k = j - (int(hashes.offsets[row].as_py()) - lo)
        raise HASH_BYTES.refuse(
            f"{path}: {_where(raw, row)}: block_hashes[{k}] holds", int(lens[j])
        )


def _value_lengths(values: pa.Array, lo: int, hi: int) -> np.ndarray[Any, Any]:
    """The byte lengths of binary values ``lo:hi``, from their offsets in place."""
    width = np.int64 if pa.types.is_large_binary(values.type) else np.int32
    offsets = np.frombuffer(values.buffers()[1], dtype=width)
    return np.diff(offsets[values.offset + lo : values.offset + hi + 1])


def check_arrow_batch(path: str, config: TraceConfig, raw: pa.RecordBatch | pa.Table) -> pa.Array:
    """What must hold before a batch is decoded (polars panics or wraps on
    these): strings are UTF-8, timestamps fit a datetime, group_id fits
    int32, and every hash is non-null, non-empty bytes. Returns the batch's
    ``block_hashes`` as one Arrow array."""
    for name in ("kind", "request_id", "medium"):
        check_utf8(path, raw, name)
    check_ts(path, raw)
    gid = _combined(raw.column("group_id"))
    # Every value of the type fits int32: nothing to check (the trace schema's
    # own int32 included; a pyarrow.compute call with Python scalars tries to
    # import dateutil each time, which a watch's small batches would pay).
    narrow = pa.types.is_integer(gid.type) and (
        gid.type.bit_width < 32
        or (gid.type.bit_width == 32 and pa.types.is_signed_integer(gid.type))
    )
    if not narrow and gid.null_count < len(gid) and not pa.types.is_null(gid.type):
        i = _first(pc.or_(pc.less(gid, _INT32[0]), pc.greater(gid, _INT32[1])))
        if i is not None:
            n = config.num_groups
            raise TraceError(
                f"{path}: {_where(raw, i)}: group_id {gid[i].as_py()} names no group "
                f"(the trace has {n}: 0..{n - 1})"
            )
    hashes = _combined(raw.column("block_hashes"))
    values = hashes.flatten()
    j: int | None = None
    what = "is null"
    lens = None
    if values.null_count:
        j = _first(pc.is_null(values))
    elif len(values) and not pa.types.is_fixed_size_binary(values.type):
        # An empty value is two equal offsets: far cheaper than binary_length.
        # The lengths serve the width check too (one pass over the offsets).
        lens = _value_lengths(values, 0, len(values))
        if int(lens.min()) <= 0:
            empty = np.flatnonzero(lens == 0)
            j, what = (int(empty[0]) if empty.size else None), "is empty"
    if j is not None:
        row = int(pc.list_parent_indices(hashes)[j].as_py())
        k = j - (int(hashes.offsets[row].as_py()) - int(hashes.offsets[0].as_py()))
        raise TraceError(
            f"{path}: {_where(raw, row)}: block_hashes[{k}] {what} "
            "(expected a hash: non-empty bytes)"
        )
    check_hash_sizes(path, raw, hashes, lens)
    return hashes


def validate_rows(
    path: str, config: TraceConfig, raw: pa.RecordBatch | pa.Table, last_seq: int | None
) -> tuple[TraceBatch, int | None]:
    """Every check of format v1 on one batch of trace rows, in file order
    after ``last_seq``; the reader and every writer go through it. Returns
    the decoded batch and its last seq."""
    raw = utc_ts(raw)
    hashes = check_arrow_batch(path, config, raw)
    frame = _canonical_frame(raw.drop_columns(["block_hashes"])).with_columns(
        pl.Series("n_hashes", pc.list_value_length(hashes), dtype=pl.Int64)
    )
    if _plainly_valid(config, frame, last_seq):
        return TraceBatch(frame=frame, hashes=hashes), (
            int(frame["seq"][-1]) if frame.height else last_seq
        )
    return TraceBatch(frame=frame, hashes=hashes), _validate_batch(path, config, frame, last_seq)


_STORE, _REMOVE, _LOOKUP = (EVENT_KINDS.index(k) for k in ("store", "remove", "lookup"))


def _plainly_valid(config: TraceConfig, frame: pl.DataFrame, last_seq: int | None) -> bool:
    """``_validate_batch``'s checks on numpy arrays (``plainly_valid``): True
    when every row passes them. A small batch (``replay watch`` folds many)
    pays polars' fixed cost per expression, about twenty of them; this is a
    few numpy calls. False (whatever the fault) sends the batch to
    ``_validate_batch``, the one home of the rules' messages, which names
    the first bad row; so this may refuse too much, never too little."""
    if frame.height == 0:
        return True
    nulls = frame.null_count().row(0, named=True)
    if nulls["seq"] or nulls["kind"]:
        return False
    try:
        kind = frame["kind"].cast(KIND_ENUM).to_physical().to_numpy()
    except pl.exceptions.InvalidOperationError:  # an unknown kind
        return False
    gid, n_hashes, max_length, num_tokens, observed = (
        frame[name].to_numpy().astype(np.float64, copy=False)
        for name in ("group_id", "n_hashes", "max_length", "num_tokens", "observed_hit_tokens")
    )
    return plainly_valid(
        config,
        last_seq,
        kind=kind,
        seq=frame["seq"].to_numpy(),
        group_id=gid,
        n_hashes=n_hashes,
        max_length=max_length,
        num_tokens=num_tokens,
        observed=observed,
        no_request_id=frame["request_id"].is_null().to_numpy() if nulls["request_id"] else None,
    )


def plainly_valid(
    config: TraceConfig,
    last_seq: int | None,
    *,
    kind: np.ndarray[Any, Any],
    seq: np.ndarray[Any, Any],
    group_id: np.ndarray[Any, Any],
    n_hashes: np.ndarray[Any, Any],
    max_length: np.ndarray[Any, Any],
    num_tokens: np.ndarray[Any, Any],
    observed: np.ndarray[Any, Any],
    no_request_id: np.ndarray[Any, Any] | None,
) -> bool:
    """The rules of ``_validate_batch`` on numpy columns of a non-empty
    batch, without a message: ``kind`` as indices into ``EVENT_KINDS``,
    ``seq`` as integers (neither null), the other numbers as float64 with
    NaN for null, ``no_request_id`` where a row has none (None: every row
    has one). The table path (``_plainly_valid``) and a live source's
    columns (``replay.format.columns``) both ask it; a batch it refuses
    goes to ``_validate_batch`` for the message.

    A comparison with NaN is False, as polars' ``fill_null(False)``; every
    value that passes is at most 2**48, exact in a float."""
    if last_seq is not None and seq[0] <= last_seq:
        return False
    if seq.shape[0] > 1 and not (seq[1:] > seq[:-1]).all():
        return False
    gid = group_id
    lookup = kind == _LOOKUP
    keyed = (kind == _STORE) | (kind == _REMOVE)
    has_hashes = ~np.isnan(n_hashes)
    bad = (keyed & (np.isnan(gid) | ~has_hashes)) | (gid < 0) | (gid >= config.num_groups)
    bad |= lookup & (np.isnan(max_length) | ~has_hashes | (max_length < 0))
    if no_request_id is not None:
        bad |= lookup & no_request_id
    bad |= (num_tokens < 0) | (num_tokens < max_length) | (observed < 0)
    bad |= (max_length > TOKEN_LIMIT) | (num_tokens > TOKEN_LIMIT) | (observed > TOKEN_LIMIT)
    covered = (
        config.max_length_bound(0) + np.where(has_hashes, n_hashes, 0) * config.hash_block_size
    )
    bad |= lookup & (max_length >= covered)
    return not bool(bad.any())


def to_polars(data: pa.RecordBatch | pa.Table) -> pl.DataFrame:
    """``data`` as a polars frame, leaving its schema and field metadata
    behind: polars panics on metadata that is not UTF-8 (a damaged footer),
    and the columns are all the frame needs."""
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    plain = pa.Table.from_arrays(data.columns, names=data.column_names)
    frame = pl.from_arrow(plain)
    assert isinstance(frame, pl.DataFrame)
    return frame


def _canonical_frame(batch: pa.RecordBatch | pa.Table) -> pl.DataFrame:
    frame = to_polars(batch)
    exprs = []
    for name, dtype in EMPTY_POLARS.items():
        if name in frame.columns:
            exprs.append(pl.col(name).cast(dtype))
        else:
            exprs.append(pl.lit(None, dtype=dtype).alias(name))
    return frame.select(exprs)


def _first_bad(frame: pl.DataFrame, mask: pl.Series) -> int | None:
    idx = mask.arg_true()
    if idx.len() == 0:
        return None
    return int(frame["seq"][int(idx[0])])


def _validate_batch(
    path: str, config: TraceConfig, frame: pl.DataFrame, last_seq: int | None
) -> int | None:
    """Check one batch; return its last seq. Raises TraceError naming the seq."""
    if frame.height == 0:
        return last_seq
    seq = frame["seq"]
    if seq.null_count():
        raise TraceError(f"{path}: column 'seq': null value (every row needs a seq)")
    prev = seq.shift(1)
    if last_seq is not None:
        prev = prev.fill_null(last_seq)
    bad = (seq <= prev).fill_null(False)
    if bad.any():
        i = int(bad.arg_true()[0])
        before = last_seq if i == 0 else int(seq[i - 1])
        raise TraceError(
            f"{path}: seq {int(seq[i])}: seq not strictly increasing (comes after seq {before})"
        )
    kind = frame["kind"]
    if kind.null_count():
        s = _first_bad(frame, kind.is_null())
        raise TraceError(
            f"{path}: seq {s}: column 'kind' is null, expected one of {', '.join(EVENT_KINDS)}"
        )
    unknown = ~kind.is_in(EVENT_KINDS)
    if unknown.any():
        i = int(unknown.arg_true()[0])
        raise TraceError(
            f"{path}: seq {int(seq[i])}: unknown event kind {kind[i]!r}, "
            f"expected one of {', '.join(EVENT_KINDS)}"
        )
    gid = frame["group_id"]
    is_lookup = kind == "lookup"
    is_keyed = kind.is_in(("store", "remove"))
    checks: list[tuple[pl.Series, str]] = [
        (
            is_keyed & gid.is_null(),
            "{kind} has no group_id (store and remove name the group whose keys change)",
        ),
        (is_keyed & frame["n_hashes"].is_null(), "{kind} has no block_hashes"),
        (
            gid.is_not_null() & ((gid < 0) | (gid >= config.num_groups)),
            f"group_id {{gid}} names no group (the trace has {config.num_groups}: "
            f"0..{config.num_groups - 1})",
        ),
        (is_lookup & frame["request_id"].is_null(), "lookup has no request_id"),
        (is_lookup & frame["max_length"].is_null(), "lookup has no max_length"),
        (is_lookup & frame["n_hashes"].is_null(), "lookup has no block_hashes"),
        (
            is_lookup & (frame["max_length"] < 0).fill_null(False),
            "lookup has a negative max_length {max_length}",
        ),
    ]
    max_length, num_tokens = frame["max_length"], frame["num_tokens"]
    observed = frame["observed_hit_tokens"]
    checks += [
        (num_tokens < 0, "num_tokens {num_tokens} is negative"),
        (
            num_tokens < max_length,
            "num_tokens {num_tokens} cannot hold max_length {max_length} "
            "(expected num_tokens >= max_length)",
        ),
        (observed < 0, "observed_hit_tokens {observed} is negative"),
    ]
    for name, col in (
        ("max_length", max_length),
        ("num_tokens", num_tokens),
        ("observed_hit_tokens", observed),
    ):
        checks.append((col > TOKEN_LIMIT, f"{name} {{{name}}} is above 2**48 tokens"))
    # vLLM indexes a group's hash view up to max_length // block_size, so a
    # lookup may not ask for more than its hashes can cover (vLLM's scheduler
    # always asks for num_tokens - 1, below (len + 1) * hash_block_size, and
    # the lookahead's tokens past the first: ``TraceConfig.max_length_bound``).
    n_hashes = frame["n_hashes"].fill_null(0)
    too_long = is_lookup & (
        frame["max_length"] >= config.max_length_bound(0) + n_hashes * config.hash_block_size
    ).fill_null(False)
    checks.append(
        (
            too_long,
            "lookup max_length {max_length} exceeds what its {n_hashes} block_hashes cover "
            f"(expected below (len(block_hashes) + 1) * hash_block_size {config.hash_block_size}"
            f"{lookahead_plus(config)})",
        )
    )
    for mask, message in checks:
        mask = mask.fill_null(False)
        if mask.any():
            i = int(mask.arg_true()[0])
            text = message.format(
                kind=kind[i],
                gid=gid[i],
                max_length=max_length[i],
                n_hashes=n_hashes[i],
                num_tokens=num_tokens[i],
                observed=observed[i],
                observed_hit_tokens=observed[i],
            )
            raise TraceError(f"{path}: seq {int(seq[i])}: {text}")
    return int(seq[-1])
