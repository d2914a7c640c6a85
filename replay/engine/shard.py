"""Key-sharded presence: the replay split by key, not by time (issue 13).

Which hash units of a lookup are present depends only on the events before
it that touch those units' keys, so the store can be split by key into K
shards that never need each other: shard ``k`` folds the stores and removes
of its keys (a clear goes to every shard) and answers its keys' probes of
every lookup. The presence bytes then come back to the lookup, which runs
the coordinator's fixed point and the facts (``replay.engine.answers``). Memory per shard is the store / K; nothing is shipped twice; and since
presence does not depend on the policy or the cache, each extra variant
costs only its fixed point.

A key's shard is a mix of its **whole** hash (the Mooncake importer's 16-byte
hashes share their first 8 bytes, so a prefix would put them all in one
shard). Every group's key of one hash lands in the same shard: the compiled
table keeps one slot per hash with a bit per group, so a shard's probe of a
unit answers every group at once. One shard is the serial replay
(``replay.engine.run.replay``): its piece is the batch itself and
gathering is the identity.

The stages (``scatter``, ``ShardFold.fold``, ``gather``, ``Answers.add``)
are the same whether they run here, one batch after another
(``replay_answers``), or as Ray tasks and actors over a directory's files
(``replay.engine.cluster``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from replay.base.errors import ReplayError
from replay.base.jit import jit
from replay.engine.answers import (
    LOOKUP_COLUMNS,
    Answers,
    LookupBatch,
    Progress,
    ReplayResult,
)
from replay.engine.kernels import (
    CLEAR,
    LOOKUP,
    REMOVE,
    SKIP,
    STORE,
    KeyTable,
    key_metas,
    mix,
)
from replay.format.columns import RowColumns
from replay.format.hashwords import HashWords, hash_words
from replay.format.schema import EVENT_KINDS, KIND_ENUM, TraceBatch
from replay.format.trace import TraceReader, prefetched
from replay.rules.compiled.tables import ProbeStop

KIND_CODES = {"store": STORE, "remove": REMOVE, "clear": CLEAR, "lookup": LOOKUP}
#: The kernel's code of each of ``EVENT_KINDS``, by its index there.
_KERNEL_KINDS = np.array([KIND_CODES[k] for k in EVENT_KINDS], dtype=np.int8)

#: Decorrelates the shard from the table slot, which uses the same key
#: meta's high bits: without it a shard's keys would crowd 1/K of its table.
_SHARD_SEED = np.uint64(0x5851F42D4C957F2D)
MAX_SHARDS = 4096


@jit(nogil=True)
def _shard_ids(metas: Any, shards: Any, out: Any) -> None:
    for h in range(metas.shape[0]):
        z = mix(metas[h] ^ _SHARD_SEED) >> np.uint64(32)
        out[h] = (z * shards) >> np.uint64(32)


def shard_of(hashes: pa.Array, shards: int) -> np.ndarray[Any, np.dtype[np.uint16]]:
    """The shard of each hash of ``hashes`` (a list array), flattened in order."""
    return _shards_of_words(hash_words(hashes), shards)


def _shards_of_words(words: HashWords, shards: int) -> np.ndarray[Any, np.dtype[np.uint16]]:
    # From the keys' metas (``key_metas``: one pass, vectorised for the
    # common widths), not a ``key_meta`` call per hash over word offsets.
    out = np.zeros(words.num_hashes, dtype=np.uint16)
    _shard_ids(key_metas(words), np.uint64(shards), out)
    return out


@jit(nogil=True)
def _group_by_shard(
    row_off: Any, sid: Any, start: Any, order: Any, offsets: Any, grid: Any, data: Any
) -> None:
    """``order``: the flat hash positions grouped by shard, each shard's in
    trace order (shard ``k``'s from ``start[k]``); ``offsets[k]``: the list
    offsets of shard ``k``'s piece, row by row; ``data``: the rows of
    ``grid`` (hashes as rows of words, when they have one width) in that
    order. One pass, no sort."""
    shards = start.shape[0] - 1
    w = grid.shape[1]
    cursor = start[:-1].copy()
    for r in range(row_off.shape[0] - 1):
        for h in range(row_off[r], row_off[r + 1]):
            k = sid[h]
            c = cursor[k]
            order[c] = h
            for j in range(w):
                data[c, j] = grid[h, j]
            cursor[k] = c + 1
        for k in range(shards):
            offsets[k, r + 1] = cursor[k] - start[k]


def _split(
    hashes: pa.Array, words: HashWords, sid: np.ndarray[Any, Any], shards: int
) -> list[pa.Array]:
    """Each shard's rows of ``hashes``, keeping only that shard's hashes.
    Hashes of one width that fills whole words (vLLM's digests, the
    importers' ids) go as fixed-size binary: no offset per hash, and a numpy
    gather of whole rows instead of Arrow's take."""
    rows = words.row_offsets.shape[0] - 1
    start = np.zeros(shards + 1, dtype=np.int64)
    np.cumsum(np.bincount(sid, minlength=shards), out=start[1:])
    order = np.empty(sid.shape[0], dtype=np.int64)
    offsets = np.zeros((shards, rows + 1), dtype=np.int32)
    widths = words.nbytes
    fixed = bool(widths.size and widths[0] % 8 == 0 and (widths == widths[0]).all())
    w = int(widths[0]) // 8 if fixed else 0
    grid = words.words[: widths.size * w].reshape(-1, w) if fixed else np.zeros((0, 0), np.uint64)
    data = np.empty((widths.size, w) if fixed else (0, 0), dtype=np.uint64)
    _group_by_shard(words.row_offsets, sid, start, order, offsets, grid, data)
    if fixed:
        typ = pa.binary(int(widths[0]))
        values = [
            pa.Array.from_buffers(typ, int(hi - lo), [None, pa.py_buffer(data[lo:hi])])
            for lo, hi in zip(start[:-1].tolist(), start[1:].tolist(), strict=True)
        ]
    else:
        flat = hashes.flatten()
        # Each shard's values in their own buffers: a slice would ship its parent.
        values = [
            flat.take(pa.array(order[lo:hi]))
            for lo, hi in zip(start[:-1].tolist(), start[1:].tolist(), strict=True)
        ]
    return [pa.ListArray.from_arrays(pa.array(offsets[k]), values[k]) for k in range(shards)]


@dataclass(frozen=True, slots=True)
class ShardPiece:
    """One batch as one shard sees it: every row, with only its keys' hashes."""

    kinds: np.ndarray[Any, np.dtype[np.int8]]
    group_ids: np.ndarray[Any, np.dtype[np.int32]]
    hashes: pa.Array
    #: The hashes' ``key_metas``, when made ahead of the fold (``scatter``'s
    #: ``metas``); else the fold makes them.
    metas: np.ndarray[Any, np.dtype[np.uint64]] | None = None
    #: The hashes' ``hash_words`` the metas were made from (kept for the
    #: fold, which else views the hashes again); only with ``metas``.
    words: HashWords | None = None

    @property
    def nbytes(self) -> int:
        size = self.kinds.nbytes + self.group_ids.nbytes + self.hashes.nbytes
        return int(size + (self.metas.nbytes if self.metas is not None else 0))


def scatter(
    batch: TraceBatch, shards: int, *, lookup_hashes: bool = False, metas: bool = False
) -> tuple[list[ShardPiece], LookupBatch]:
    """Split one validated batch into its shards' pieces and its lookups
    (with their hashes when ``lookup_hashes``: a coordinator that asks by
    hash needs them; with each piece's key metas when ``metas``: made here,
    on the reader's thread, they are off the fold's)."""
    frame = batch.frame
    # A validated batch: every kind is one of EVENT_KINDS.
    codes = frame["kind"].cast(KIND_ENUM).to_physical().to_numpy()
    kinds = _KERNEL_KINDS[codes]
    gids = frame["group_id"].fill_null(-1).to_numpy().astype(np.int32)
    is_lookup = kinds == LOOKUP
    n_hashes = frame["n_hashes"].fill_null(0).to_numpy().astype(np.int64)
    # The kinds present, counted from their codes (a polars group_by cost
    # 0.12 s over the 300k-request day's 100 batches).
    per_kind = np.bincount(codes, minlength=len(EVENT_KINDS)).tolist()
    counts = {EVENT_KINDS[i]: int(n) for i, n in enumerate(per_kind) if n}
    seq = frame["seq"]
    # The lookup columns first: the filter then never copies the other rows'
    # strings.
    lookups_rows = frame.select(LOOKUP_COLUMNS).filter(pl.Series(is_lookup))
    units = n_hashes[is_lookup]
    if shards == 1:
        pieces = [ShardPiece(kinds=kinds, group_ids=gids, hashes=batch.hashes)]
        lookup_shards = None
    else:
        words = hash_words(batch.hashes)
        sid = _shards_of_words(words, shards)
        lookup_shards = sid[np.repeat(is_lookup, n_hashes)]
        pieces = [
            ShardPiece(kinds=kinds, group_ids=gids, hashes=h)
            for h in _split(batch.hashes, words, sid, shards)
        ]
    if metas:
        views = [hash_words(p.hashes) for p in pieces]
        pieces = [
            replace(p, metas=key_metas(w), words=w) for p, w in zip(pieces, views, strict=True)
        ]
    lookups = LookupBatch(
        rows=lookups_rows,
        units=units,
        shards=lookup_shards,
        events=frame.height,
        counts=counts,
        first_seq=int(seq[0]) if frame.height else None,
        last_seq=int(seq[-1]) if frame.height else None,
        hash_entries=int(n_hashes.sum()),
        hashes=batch.hashes.take(pa.array(np.flatnonzero(is_lookup))) if lookup_hashes else None,
    )
    return pieces, lookups


def scatter_columns(
    cols: RowColumns, *, lookup_hashes: bool = False
) -> tuple[ShardPiece, LookupBatch]:
    """``scatter`` into one shard for a live source's checked columns
    (``replay.format.columns``): the same piece and lookups, without the
    polars frame (``replay.engine.live`` folds many small batches)."""
    kinds = _KERNEL_KINDS[cols.kind]
    is_lookup = kinds == LOOKUP
    lookups = LookupBatch(
        rows=cols.lookups,
        units=cols.n_hashes[is_lookup],
        shards=None,
        events=int(kinds.shape[0]),
        counts=cols.counts,
        first_seq=cols.first_seq,
        last_seq=cols.last_seq,
        hash_entries=int(cols.n_hashes.sum()),
        hashes=cols.hashes.take(pa.array(np.flatnonzero(is_lookup))) if lookup_hashes else None,
    )
    return ShardPiece(kinds=kinds, group_ids=cols.group_id, hashes=cols.hashes), lookups


class ShardFold:
    """One shard's store: the compiled table of its keys (``stop``: where a
    lookup's probes may end, ``Answers.probe_stop``; only the one shard of
    a serial replay sees a lookup's units in order)."""

    def __init__(self, num_groups: int, stop: ProbeStop | None = None) -> None:
        self.table = KeyTable(num_groups, stop)

    def fold(self, piece: ShardPiece) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Fold a piece in; the presence bytes of its lookup rows, in the
        kernel's layout (per lookup, per group, its units in this shard)."""
        out, _, _ = fold_rows(
            self.table,
            piece.group_ids,
            piece.hashes,
            piece.kinds,
            metas=piece.metas,
            words=piece.words,
        )
        return out


def fold_rows(
    table: KeyTable,
    group_ids: np.ndarray[Any, Any],
    hashes: pa.Array,
    kinds: np.ndarray[Any, Any],
    *,
    metas: np.ndarray[Any, np.dtype[np.uint64]] | None = None,
    words: HashWords | None = None,
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Fold one validated batch into ``table`` (``kinds`` as kernel codes,
    ``group_ids`` -1 where a row has none; ``metas``: the hashes'
    ``key_metas`` if already made; ``words``: ``hash_words(hashes)`` if
    already made). Returns the lookups' presence bytes,
    each row's offset into them (lookup rows: ``num_groups`` runs of the
    row's unit count) and the unit counts."""
    if words is None:
        words = hash_words(hashes)
    n_units = np.diff(words.row_offsets)
    out_offsets = np.zeros(kinds.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.where(kinds == LOOKUP, n_units * table.num_groups, 0), out=out_offsets[1:])
    out = np.zeros(int(out_offsets[-1]), dtype=np.uint8)
    table.fold(
        _readonly(kinds),
        _readonly(group_ids.astype(np.int32, copy=False)),
        words,
        out,
        out_offsets,
        metas,
    )
    return out, out_offsets, n_units


class StoredKeys:
    """The distinct stored ``(group, hash)`` keys of a trace, exact: every
    store folded into one table by the compiled fold, removes and clears
    skipped (``replay info``'s count; replay.analysis.summary calls it batch by
    batch, in the same pass as its other figures)."""

    def __init__(self, num_groups: int) -> None:
        self._table = KeyTable(num_groups)

    def add(self, batch: TraceBatch) -> None:
        frame = batch.frame
        kinds = np.where((frame["kind"] == "store").to_numpy(), STORE, SKIP).astype(np.int8)
        gids = frame["group_id"].fill_null(-1).to_numpy()
        fold_rows(self._table, gids, batch.hashes, kinds)

    def group_counts(self) -> list[int]:
        """Keys each group stored."""
        return self._table.group_counts()


def _readonly(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # One array type for the kernel (numba compiles read-only and writable
    # arrays separately), whatever the producer handed over.
    a = np.ascontiguousarray(a)
    a.flags.writeable = False
    return a


@jit(nogil=True)
def _gather(
    units: Any, unit_shards: Any, present: Any, shard_start: Any, num_groups: int, full: Any
) -> None:
    """``gather``'s copy in one pass over the lookups: ``present`` holds
    every shard's bytes back to back (shard ``k``'s from ``shard_start[k]``),
    per lookup, per group, that lookup's units in the shard in order."""
    shards = shard_start.shape[0] - 1
    at = shard_start[:-1].copy()  # each shard's next lookup's bytes
    count = np.zeros(shards, dtype=np.int64)  # this lookup's units per shard
    rank = np.zeros(shards, dtype=np.int64)
    u0 = 0
    for j in range(units.shape[0]):
        n = units[j]
        for u in range(u0, u0 + n):
            count[unit_shards[u]] += 1
        base = num_groups * u0
        for u in range(u0, u0 + n):
            k = unit_shards[u]
            nk = count[k]
            src = at[k] + rank[k]
            for g in range(num_groups):
                full[base + g * n + (u - u0)] = present[src + g * nk]
            rank[k] += 1
        for u in range(u0, u0 + n):
            k = unit_shards[u]
            if count[k]:
                at[k] += num_groups * count[k]
                count[k] = 0
                rank[k] = 0
        u0 += n


def gather(
    lookups: LookupBatch, presences: Sequence[np.ndarray[Any, Any]], num_groups: int
) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Every shard's presence bytes put back where the serial fold writes them
    (per lookup, per group, all its units): compiled, one pass (numpy's
    index arithmetic per shard cost 1.3 s of CPU over the 300k-request day
    in two shards)."""
    if lookups.shards is None:
        return presences[0]
    units = np.ascontiguousarray(lookups.units, dtype=np.int64)
    full = np.zeros(int(units.sum()) * num_groups, dtype=np.uint8)
    shard_start = np.zeros(len(presences) + 1, dtype=np.int64)
    np.cumsum([p.shape[0] for p in presences], out=shard_start[1:])
    present = np.concatenate([np.asarray(p, dtype=np.uint8) for p in presences])
    _gather(units, lookups.shards, present, shard_start, num_groups, full)
    return full


def replay_answers(
    reader: TraceReader,
    answers: Answers,
    *,
    shards: int = 1,
    progress: Callable[[Progress], None] | None = None,
    progress_every: float = 0.2,
    until_seq: int | None = None,
) -> list[ReplayResult]:
    """Every lookup of ``reader`` answered by ``answers`` (with its facts), with
    the store split into ``shards`` key shards (one: the serial replay);
    ``until_seq`` stops reading after the batch that reaches it. Three
    stages on their own threads: read, validate, split by shard and mix
    the keys (``key_metas``); fold (compiled, no GIL); and here the
    answers, so a batch folds while the one before it is being answered."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ReplayError(f"{shards} shards: expected 1 to {MAX_SHARDS}")
    num_groups = reader.config.num_groups
    stop = answers.probe_stop() if shards == 1 else None
    folds = [ShardFold(num_groups, stop) for _ in range(shards)]
    state = Progress(total_events=reader.num_rows)
    started = last = time.perf_counter()

    def scattered() -> Iterator[tuple[list[ShardPiece], LookupBatch]]:
        # Split on the reader's thread: scatter's polars calls share one
        # thread pool with the validation, and on the fold's thread they
        # waited for it (2 s of the fold thread's 8 on the 300k-request day).
        # The keys' metas too: a pass over every hash's words, they were
        # 0.6 s of the fold thread's 3.5, the stage that sets the pace.
        for batch in reader.iter_batches():
            yield scatter(batch, shards, lookup_hashes=answers.needs_hashes, metas=True)

    def folded() -> Iterator[tuple[LookupBatch, np.ndarray[Any, Any]]]:
        for pieces, lookups in prefetched(scattered()):
            presences = [f.fold(p) for f, p in zip(folds, pieces, strict=True)]
            yield lookups, gather(lookups, presences, num_groups)
            last = lookups.last_seq
            if until_seq is not None and last is not None and last >= until_seq:
                return

    for lookups, present in prefetched(folded()):
        answers.add(lookups, present)
        state.events, state.lookups = answers.events, answers.counts["lookup"]
        if progress is not None and time.perf_counter() - last >= progress_every:
            progress(state)
            last = time.perf_counter()
    if progress is not None:
        progress(state)
    # The store is no longer needed: give its table back before the results
    # are built, the run's peak (50 MB of the 300k-request day's 680).
    folds.clear()
    return answers.results(seconds=time.perf_counter() - started, trace_path=reader.name)
