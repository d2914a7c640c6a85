"""From requests to trace rows (lookup, store, remove), shared by the generator and the importers.

A *request* here is what every source can provide: an arrival time, an id,
its prompt length and one integer **unit key** per ``hash_block_size`` tokens
of the prompt (its full hash units). A unit key names the unit's whole
prefix exactly (two requests share a key iff they share every token up to
the unit's end), so keys play the part of vLLM's chained block hashes; the
source's ``digest`` function turns keys into the bytes written to the trace.
The keys of one prompt are distinct, and keys are small dense integers
(the cache model and the digest memo are arrays indexed by key), so the memory
is about 10 bytes per distinct key and group, plus a bounded window of
memoised digests and at most two row batches in flight.

``WorkloadWriter.add`` turns one request into the rows a production log
shows for it, in this order:

1. a ``lookup`` row: the prompt's full-unit hashes, ``max_length =
   num_tokens - 1`` (vLLM's scheduler always recomputes the last prompt
   token for its logits), ``num_tokens``;
2. ``remove`` rows (one per group, LRU order) for the keys evicted to make
   room, when the cache has a finite ``capacity_blocks``;
3. ``store`` rows (one per group, block order) for the keys the request's
   prefill leaves behind that were not already present. Keys already
   present are refreshed in the LRU but not re-stored, as vLLM's
   ``BlockStored`` events only name newly cached blocks.

Which keys a request stores is decided by ``replay.rules.store_rules`` (vLLM
0.33.0's rules for the chosen cache, retention interval and token budget),
from the hit the request's own lookup gets against the cache as it stands
(the reference coordinator) and the shared-prefix junction that lookup finds.
The prefix the hit used is refreshed in the LRU.

The cache (the Mooncake cache model's dense-key LRU mode,
``replay.rules.mooncake_store.MooncakeCache.dense_lru``): a set of
``(group, key)`` entries, unbounded, or an LRU of ``capacity_blocks`` entries counted across all groups (a Mamba state counts
as one entry like an attention block). A request touches its groups last to
first and each group's keys from the prompt's tail to its head, so the
first group's head is the most recently used and evicted last, like vLLM's
block pool, which frees a request's blocks in reverse order so that shared
prefixes outlive their tails. Evictions are
emitted before the stores, so the cache never holds more than
``capacity_blocks`` keys at any point of the log; a request larger than
the whole cache evicts its own tail, which is then never stored.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Self

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.format.schema import EVENT_KINDS
from replay.format.writer import trace_schema
from replay.rules.coordinator import Coordinator
from replay.rules.mooncake_store import EMPTY_KEYS, MooncakeCache
from replay.rules.store_rules import StoreRules, StoreSettings, group_block_keys, junction_tokens
from replay.sources.hashing import Digester, Keys

Sink = Callable[[pa.Table], None]

STORE, REMOVE, CLEAR, LOOKUP = (
    EVENT_KINDS.index(k) for k in ("store", "remove", "clear", "lookup")
)


@dataclass(slots=True)
class WorkloadStats:
    """What a writer emitted (complete after ``close``)."""

    events: int = 0
    lookups: int = 0
    # Rows of a kind, and the keys they name.
    stores: int = 0
    stored_keys: list[int] = field(default_factory=list)  # per group
    removes: int = 0
    evicted_keys: int = 0
    clears: int = 0
    hash_entries: int = 0
    max_present_keys: int = 0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class WorkloadWriter:
    """Turns requests into trace rows for one configuration, through a
    capacity-bounded LRU cache, and hands them to ``sink`` in row groups."""

    def __init__(
        self,
        config: TraceConfig,
        sink: Sink,
        digest: Digester,
        *,
        capacity_blocks: int | None = None,
        settings: StoreSettings | None = None,
        clear_every: int | None = None,
        flush_hashes: int = 2_000_000,
        flush_events: int = 200_000,
        background: bool = True,
    ) -> None:
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise ReplayError(f"capacity_blocks must be positive, got {capacity_blocks}")
        if clear_every is not None and clear_every <= 0:
            raise ReplayError(f"clear_every must be positive, got {clear_every}")
        self.config = config
        self.settings = settings or StoreSettings()
        self._sink = sink
        self._digest = digest
        self._schema = trace_schema(config)
        self.capacity = capacity_blocks
        self.clear_every = clear_every
        self._flush_hashes = flush_hashes
        self._flush_events = flush_events
        self._hbs = config.hash_block_size
        self.rules = StoreRules(config, self.settings)
        # The hit each request's prefill starts from, as a lookup of the cache
        # finds it (``explain`` for the steps that give the junction).
        self._coordinator = Coordinator(
            config, policy=self.settings.policy, cache=self.settings.cache
        )
        self._cache = MooncakeCache.dense_lru(config.num_groups, capacity_blocks)
        self.stats = WorkloadStats(stored_keys=[0] * config.num_groups)
        self.requests = 0
        self._clear_due = False
        self._seq = 0
        self._reset_buffers()
        self._pool = ThreadPoolExecutor(max_workers=1) if background else None
        self._pending: deque[Future[None]] = deque()

    # -- buffers

    def _reset_buffers(self) -> None:
        # One tuple per event (ts, kind, group_id, request_id, max_length,
        # num_tokens) and its unit keys; columns are built at flush.
        self._rows: list[
            tuple[int | None, int, int | None, str | None, int | None, int | None]
        ] = []
        self._hashes: list[Keys] = []
        self._buffered_hashes = 0

    def _event(
        self,
        ts: int | None,
        kind: int,
        gid: int | None,
        keys: Keys,
        request_id: str | None = None,
        max_length: int | None = None,
        num_tokens: int | None = None,
    ) -> int:
        self._rows.append((ts, kind, gid, request_id, max_length, num_tokens))
        self._hashes.append(keys)
        self._buffered_hashes += len(keys)
        self._seq += 1
        return self._seq - 1

    def _maybe_flush(self) -> None:
        if self._buffered_hashes >= self._flush_hashes or len(self._rows) >= self._flush_events:
            self.flush()

    def flush(self) -> None:
        """Hand the buffered rows to the sink as one table (one row group).

        In background mode the table is built and handed over by one worker
        thread (digests, Arrow arrays and the Parquet encoder mostly run
        without the GIL, so this overlaps with generating the next rows); at
        most two batches are in flight, which bounds the memory."""
        n = len(self._rows)
        if n == 0:
            return
        rows, hashes, first = self._rows, self._hashes, self._seq - n
        kinds = np.fromiter((r[1] for r in rows), dtype=np.int8, count=n)
        counts = np.bincount(kinds, minlength=len(EVENT_KINDS))
        st = self.stats
        st.events += n
        st.lookups += int(counts[LOOKUP])
        st.stores += int(counts[STORE])
        st.removes += int(counts[REMOVE])
        st.clears += int(counts[CLEAR])
        st.hash_entries += self._buffered_hashes
        self._reset_buffers()
        if self._pool is None:
            self._sink(self._table(rows, hashes, kinds, first))
            return
        while len(self._pending) >= 2:
            self._pending.popleft().result()
        self._pending.append(
            self._pool.submit(lambda: self._sink(self._table(rows, hashes, kinds, first)))
        )

    def _table(
        self,
        rows: list[tuple[int | None, int, int | None, str | None, int | None, int | None]],
        hashes: list[Keys],
        kinds: npt.NDArray[np.int8],
        first: int,
    ) -> pa.Table:
        n = len(rows)
        ts, _kind, gid, req, maxlen, ntok = zip(*rows, strict=True)
        lens = np.fromiter(map(len, hashes), dtype=np.int64, count=n)
        keys = np.concatenate(hashes)
        digests = np.ascontiguousarray(self._digest(keys))
        width = digests.shape[1] if digests.ndim == 2 else 0
        total = len(keys)
        # A batch of prompts all shorter than one block has no hash (width 0).
        value_offsets = np.arange(total + 1, dtype=np.int32) * np.int32(width)
        values = pa.Array.from_buffers(
            pa.binary(),
            total,
            [None, pa.py_buffer(value_offsets), pa.py_buffer(digests.reshape(-1))],
        )
        list_offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lens, out=list_offsets[1:])
        is_clear = kinds == CLEAR
        mask = pa.array(is_clear) if is_clear.any() else None
        block_hashes = pa.ListArray.from_arrays(pa.array(list_offsets), values, mask=mask)
        columns = [
            pa.array(np.arange(first, first + n, dtype=np.int64)),
            pa.array(ts, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            pa.DictionaryArray.from_arrays(pa.array(kinds), pa.array(list(EVENT_KINDS))),
            pa.array(gid, pa.int32()),
            block_hashes,
            pa.array(req, pa.string()),
            pa.array(maxlen, pa.int64()),
            pa.array(ntok, pa.int64()),
            pa.nulls(n, pa.int64()),
            pa.nulls(n, pa.string()),
        ]
        return pa.Table.from_arrays(columns, schema=self._schema)

    # -- the cache

    def group_views(self, unit_keys: Keys) -> list[Keys]:
        """Each group's per-block keys of a prompt."""
        return [group_block_keys(g, unit_keys, self._hbs) for g in self.config.groups]

    def stored_indices(
        self,
        num_tokens: int,
        hit_tokens: int = 0,
        junction_tokens: int = 0,
        extra_blocks: Mapping[int, Sequence[int]] | None = None,
        hit_blocks: Sequence[int] | None = None,
    ) -> list[npt.NDArray[np.int64]]:
        """Per group, the block indices the request's prefill stores (the store
        rules, ``replay.rules.store_rules``), plus any ``extra_blocks``, ascending."""
        chosen = self.rules.stores(
            num_tokens=num_tokens,
            hit_tokens=hit_tokens,
            junction_tokens=junction_tokens,
            hit_blocks=hit_blocks,
        )
        out = []
        for gid, sel in enumerate(chosen):
            idx = np.arange(sel.start, sel.stop, dtype=np.int64) if isinstance(sel, range) else sel
            extra = (extra_blocks or {}).get(gid, ())
            if extra:
                blocks = num_tokens // self.config.groups[gid].block_size
                bad = [b for b in extra if not 0 <= b < blocks]
                if bad:
                    raise ReplayError(
                        f"group {gid}: extra block {bad[0]} outside the prompt's {blocks} blocks"
                    )
                idx = np.union1d(idx, np.array(extra, dtype=np.int64))
            out.append(idx)
        return out

    def clear(self, ts_us: int | None) -> int:
        """A ``clear`` row for every group: the cache forgets everything."""
        self._cache.clear()
        self._clear_due = False
        seq = self._event(ts_us, CLEAR, None, EMPTY_KEYS)
        self._maybe_flush()
        return seq

    def add(
        self,
        *,
        ts_us: int | None,
        request_id: str,
        num_tokens: int,
        unit_keys: Keys,
        extra_blocks: Mapping[int, Sequence[int]] | None = None,
        allow_clear: bool = True,
        max_key: int | None = None,
    ) -> int:
        """Emit one request's rows; return the ``seq`` of its lookup.

        Unit keys are distinct non-negative integers, dense enough to index
        arrays (the cache allocates up to the largest); ``max_key``, when the
        caller knows a bound, saves a scan.

        ``extra_blocks`` adds block indices for a group beyond what the store
        rules select (used to inject scenarios). ``allow_clear=False`` defers a
        due ``clear`` row to the next request."""
        if num_tokens <= 0:
            raise ReplayError(
                f"request {request_id}: num_tokens must be positive, got {num_tokens}"
            )
        expected = self.config.hashed_units(num_tokens)
        if len(unit_keys) != expected:
            lookahead = self.config.num_hash_lookahead_tokens
            less = f", less {lookahead} lookahead" if lookahead else ""
            raise ReplayError(
                f"request {request_id}: {len(unit_keys)} unit keys for {num_tokens} tokens, "
                f"expected {expected} (one per {self._hbs} tokens{less})"
            )
        if self._clear_due and allow_clear:
            self.clear(ts_us)
        self.requests += 1
        if self.clear_every and self.requests % self.clear_every == 0:
            self._clear_due = True
        seq = self._event(ts_us, LOOKUP, None, unit_keys, request_id, num_tokens - 1, num_tokens)
        groups = self.config.num_groups
        cache = self._cache
        views = self.group_views(unit_keys)
        present = [cache.present(gid, unit_keys) for gid in range(groups)]
        # The prefill starts from the fixed point's hit at the prompt's
        # max_length (``converge``, also where the store's lookups enter
        # through its worker): the stores this gives are those vLLM's
        # scheduler writes (tests/vllm/test_store_rules_vllm.py).
        outcome = self._coordinator.converge(
            [p.view(np.uint8).tobytes() for p in present],
            num_tokens - 1,
            explain=self.rules.uses_junction,
        )
        hit = outcome.hit_tokens
        junction = junction_tokens(outcome) if self.rules.uses_junction else 0
        chosen = self.stored_indices(
            num_tokens, hit, junction, extra_blocks, [g.mask_blocks for g in outcome.groups]
        )
        # Touch the groups last to first, so the first group's head is the
        # most recently used entry; the prefix the hit used is refreshed, the
        # blocks the prefill computes are stored.
        new: list[Keys] = [EMPTY_KEYS] * groups
        touched = 0
        for gid in range(groups - 1, -1, -1):
            k = self.config.groups[gid].block_size // self._hbs
            used = hit // self.config.groups[gid].block_size
            used_idx = np.flatnonzero(present[gid][k - 1 :: k][:used])
            idx = chosen[gid]
            if len(used_idx):
                # The prefill stores only past the hit, so the two are disjoint
                # and in order, unless an injected block joins them.
                idx = (
                    np.union1d(used_idx, idx)
                    if extra_blocks
                    else np.concatenate((used_idx.astype(np.int64), idx))
                )
            keys = views[gid][idx]
            new[gid] = keys[cache.touch(gid, keys, max_key)]
            touched += len(keys)
        removed: list[Keys] = []
        if self.capacity is not None and cache.count > self.capacity:
            untouched = cache.count - touched
            evicted = cache.evict(cache.count - self.capacity)
            removed = cache.split(evicted[:untouched])
            if len(evicted) > untouched:
                # The request alone overflows the cache: its own oldest keys go
                # too, and the new ones among them are never stored at all.
                for gid, own in enumerate(cache.split(evicted[untouched:])):
                    fresh = new[gid]
                    dropped = np.isin(own, fresh)
                    new[gid] = fresh[~np.isin(fresh, own)]
                    removed[gid] = np.concatenate((removed[gid], own[~dropped]))
            for gid, keys in enumerate(removed):
                if len(keys):
                    self._event(ts_us, REMOVE, gid, keys)
                    self.stats.evicted_keys += len(keys)
        for gid, fresh_keys in enumerate(new):
            if len(fresh_keys):
                self._event(ts_us, STORE, gid, fresh_keys, request_id)
                self.stats.stored_keys[gid] += len(fresh_keys)
        size = cache.count
        self.stats.max_present_keys = max(self.stats.max_present_keys, size)
        self._maybe_flush()
        return seq

    @property
    def next_seq(self) -> int:
        return self._seq

    def abort(self) -> None:
        """Drop buffered rows and stop the worker (after an error): the sink is
        not called again once this returns."""
        self._reset_buffers()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abort()

    def close(self) -> WorkloadStats:
        """Flush, wait for the sink to have every row, and return the stats."""
        try:
            self.flush()
            while self._pending:
                self._pending.popleft().result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
        return self.stats
