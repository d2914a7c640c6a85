"""Key-sharded presence: the replay split by key, not by time (issue 13).

Which hash units of a lookup are present depends only on the events before
it that touch those units' keys, so the store can be split by key into K
shards that never need each other: shard ``k`` folds the stores and removes
of its keys (a clear goes to every shard) and answers its keys' probes of
every lookup. The presence bytes then come back to the lookup, which runs
the coordinator's fixed point and the flags exactly as the serial engine
does. Memory per shard is the store / K; nothing is shipped twice; and since
presence does not depend on the policy or the cache, each extra variant
costs only its fixed point.

A key's shard is a mix of its **whole** hash (the Mooncake importer's 16-byte
hashes share their first 8 bytes, so a prefix would put them all in one
shard). Every group's key of one hash lands in the same shard: the compiled
table keeps one slot per hash with a bit per group, so a shard's probe of a
unit answers every group at once, as the serial fold does. One shard is the
serial replay: its piece is the batch itself and gathering is the identity.

The stages (``scatter``, ``ShardFold.fold``, ``gather``, ``Answers.add``)
are the same whether they run here, one batch after another
(``replay_sharded``), or as Ray tasks and actors over a directory's files
(``replay.cluster``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
from numba import njit

from analysis.flags import FlagChecker
from replay.coordinator import Coordinator
from replay.engine import (
    _LOOKUP_COLUMNS,
    KIND_CODES,
    Progress,
    ReplayResult,
    _Outcomes,
    _results_frame,
    fold_rows,
    resolve_cache,
)
from replay.errors import ReplayError
from replay.kernels import LOOKUP, KeyTable, _key_meta, _mix
from replay.spec import TraceConfig
from replay.trace import HashWords, TraceBatch, hash_words, open_trace, prefetched

#: Decorrelates the shard from the table slot, which uses the same key
#: meta's high bits: without it a shard's keys would crowd 1/K of its table.
_SHARD_SEED = np.uint64(0x5851F42D4C957F2D)
MAX_SHARDS = 4096


@njit(nogil=True, cache=True)
def _shard_ids(words: Any, woff: Any, nbytes: Any, shards: Any, out: Any) -> None:
    for h in range(nbytes.shape[0]):
        meta = _key_meta(words, woff[h], woff[h + 1] - woff[h], nbytes[h])
        z = _mix(meta ^ _SHARD_SEED) >> np.uint64(32)
        out[h] = (z * shards) >> np.uint64(32)


def shard_of(hashes: pa.Array, shards: int) -> np.ndarray[Any, np.dtype[np.uint16]]:
    """The shard of each hash of ``hashes`` (a list array), flattened in order."""
    return _shards_of_words(hash_words(hashes), shards)


def _shards_of_words(words: HashWords, shards: int) -> np.ndarray[Any, np.dtype[np.uint16]]:
    out = np.zeros(words.nbytes.shape[0], dtype=np.uint16)
    _shard_ids(words.words, words.word_offsets, words.nbytes, np.uint64(shards), out)
    return out


@njit(nogil=True, cache=True)
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

    @property
    def nbytes(self) -> int:
        return int(self.kinds.nbytes + self.group_ids.nbytes + self.hashes.nbytes)


@dataclass(frozen=True, slots=True)
class LookupBatch:
    """What a batch's lookups need once their presence is known."""

    rows: pl.DataFrame
    #: Hash units of each lookup.
    units: np.ndarray[Any, np.dtype[np.int64]]
    #: The shard of each lookup unit (lookups in order); None for one shard.
    shards: np.ndarray[Any, np.dtype[np.uint16]] | None
    events: int
    counts: dict[str, int]
    first_seq: int | None
    last_seq: int | None
    hash_entries: int

    @property
    def nbytes(self) -> int:
        size = int(self.rows.estimated_size() + self.units.nbytes)
        return size + (int(self.shards.nbytes) if self.shards is not None else 0)


def scatter(batch: TraceBatch, shards: int) -> tuple[list[ShardPiece], LookupBatch]:
    """Split one validated batch into its shards' pieces and its lookups."""
    frame = batch.frame
    kinds = frame["kind"].replace_strict(KIND_CODES, return_dtype=pl.Int8).to_numpy()
    gids = frame["group_id"].fill_null(-1).to_numpy().astype(np.int32)
    is_lookup = kinds == LOOKUP
    n_hashes = frame["n_hashes"].fill_null(0).to_numpy().astype(np.int64)
    counts = {name: int(n) for name, n in frame.group_by("kind").len().iter_rows()}
    seq = frame["seq"]
    lookups_rows = frame.filter(pl.Series(is_lookup)).select(_LOOKUP_COLUMNS)
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
    lookups = LookupBatch(
        rows=lookups_rows,
        units=units,
        shards=lookup_shards,
        events=frame.height,
        counts=counts,
        first_seq=int(seq[0]) if frame.height else None,
        last_seq=int(seq[-1]) if frame.height else None,
        hash_entries=int(n_hashes.sum()),
    )
    return pieces, lookups


class ShardFold:
    """One shard's store: the compiled table of its keys."""

    def __init__(self, num_groups: int) -> None:
        self.table = KeyTable(num_groups)

    def fold(self, piece: ShardPiece) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Fold a piece in; the presence bytes of its lookup rows, in the
        kernel's layout (per lookup, per group, its units in this shard)."""
        frame = pl.DataFrame({"group_id": pl.Series(piece.group_ids, dtype=pl.Int32)})
        out, _, _ = fold_rows(self.table, frame, piece.hashes, piece.kinds)
        return out


def gather(
    lookups: LookupBatch, presences: Sequence[np.ndarray[Any, Any]], num_groups: int
) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Every shard's presence bytes put back where the serial fold writes them
    (per lookup, per group, all its units)."""
    if lookups.shards is None:
        return presences[0]
    n = lookups.units
    starts = np.zeros(n.size + 1, dtype=np.int64)
    np.cumsum(n, out=starts[1:])
    full = np.zeros(int(starts[-1]) * num_groups, dtype=np.uint8)
    lookup_of = np.repeat(np.arange(n.size), n)
    for k, present in enumerate(presences):
        mine = np.flatnonzero(lookups.shards == k)
        if mine.size == 0:
            continue
        j = lookup_of[mine]
        n_k = np.bincount(j, minlength=n.size)
        k_starts = np.zeros(n.size + 1, dtype=np.int64)
        np.cumsum(n_k, out=k_starts[1:])
        src = num_groups * k_starts[j] + np.arange(mine.size) - k_starts[j]
        dst = num_groups * starts[j] + mine - starts[j]
        for g in range(num_groups):
            full[dst + g * n[j]] = present[src + g * n_k[j]]
    return full


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    """One way to answer the lookups: a policy in a cache."""

    policy: str
    cache: str


class Answers:
    """The fixed point and the flags of every lookup, for each variant, from
    the same presence bytes."""

    def __init__(self, config: TraceConfig, variants: Sequence[Variant]) -> None:
        self.config = config
        self.variants = list(variants)
        self.coordinators = [Coordinator(config, v.policy, v.cache) for v in self.variants]
        self.checkers = [FlagChecker(config, v.cache) for v in self.variants]
        self.outcomes = [_Outcomes(config.num_groups) for _ in self.variants]
        self.rows: list[pl.DataFrame] = []
        self.events = 0
        self.counts = {"store": 0, "remove": 0, "clear": 0, "lookup": 0}

    def add(self, lookups: LookupBatch, present: np.ndarray[Any, Any]) -> None:
        num_groups = self.config.num_groups
        buf = present.tobytes()
        sizes = lookups.units.tolist()
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(lookups.units * num_groups, out=offsets[1:])
        max_lengths = lookups.rows["max_length"].fill_null(0).to_list()
        observed = lookups.rows["observed_hit_tokens"].to_list()
        answerers = list(zip(self.coordinators, self.checkers, self.outcomes, strict=True))
        for o, n, max_length, seen in zip(
            offsets[:-1].tolist(), sizes, max_lengths, observed, strict=True
        ):
            present_g = [buf[o + g * n : o + (g + 1) * n] for g in range(num_groups)]
            for coord, checker, outcomes in answerers:
                res = coord.lookup_present(present_g, max_length)
                outcomes.add(res, checker.check_outcome(present_g, max_length, res, seen))
        if lookups.rows.height:
            self.rows.append(lookups.rows)
        self.events += lookups.events
        for name, count in lookups.counts.items():
            self.counts[name] += count

    def frames(self) -> list[pl.DataFrame]:
        """The results of each variant, one row per lookup in seq order."""
        return [
            _results_frame(self.rows, outcomes, v.policy, "reference", v.cache)
            for v, outcomes in zip(self.variants, self.outcomes, strict=True)
        ]


def variants_for(
    config: TraceConfig, policies: Sequence[str], caches: Sequence[str | None] = (None,)
) -> list[Variant]:
    """Every policy in every cache, policy by policy; each cache resolved as
    the serial run does (None: the trace's)."""
    if not policies or not caches:
        raise ReplayError("no policy or cache to replay under")
    used = [resolve_cache(config, c) for c in caches]
    pairs = dict.fromkeys((p, c) for p in policies for c in used)
    return [Variant(policy=p, cache=c) for p, c in pairs]


def results_of(
    config: TraceConfig,
    variants: Sequence[Variant],
    frames: Sequence[pl.DataFrame],
    *,
    events: int,
    counts: dict[str, int],
    seconds: float,
    trace_path: str | os.PathLike[str],
) -> list[ReplayResult]:
    return [
        ReplayResult(
            config=config,
            policy=v.policy,
            coordinator="reference",
            cache=v.cache,
            results=frame,
            events=events,
            events_by_kind=dict(counts),
            seconds=seconds,
            trace_path=str(trace_path),
        )
        for v, frame in zip(variants, frames, strict=True)
    ]


def replay_sharded(
    path: str | os.PathLike[str],
    *,
    policies: Sequence[str],
    caches: Sequence[str | None] = (None,),
    shards: int = 1,
    progress: Callable[[Progress], None] | None = None,
    progress_every: float = 0.2,
) -> list[ReplayResult]:
    """Replay in this process with the store split into ``shards`` shards,
    under each policy in each cache from one fold (``variants_for``): the
    results are those of ``replay_trace`` for every shard count."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ReplayError(f"{shards} shards: expected 1 to {MAX_SHARDS}")
    reader = open_trace(path)
    config = reader.config
    variants = variants_for(config, policies, caches)
    folds = [ShardFold(config.num_groups) for _ in range(shards)]
    answers = Answers(config, variants)
    state = Progress(total_events=reader.num_rows)
    started = last = time.perf_counter()

    def folded() -> Iterator[tuple[LookupBatch, np.ndarray[Any, Any]]]:
        for batch in reader.iter_batches(prefetch=True):
            pieces, lookups = scatter(batch, shards)
            presences = [f.fold(p) for f, p in zip(folds, pieces, strict=True)]
            yield lookups, gather(lookups, presences, config.num_groups)

    # As in replay_trace: read, fold (compiled, no GIL) and answer overlap.
    for lookups, present in prefetched(folded()):
        answers.add(lookups, present)
        state.events, state.lookups = answers.events, answers.counts["lookup"]
        if progress is not None and time.perf_counter() - last >= progress_every:
            progress(state)
            last = time.perf_counter()
    if progress is not None:
        progress(state)
    return results_of(
        config,
        variants,
        answers.frames(),
        events=answers.events,
        counts=answers.counts,
        seconds=time.perf_counter() - started,
        trace_path=path,
    )
