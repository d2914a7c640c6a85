"""From requests to trace rows: the store logic shared by the generator and the importers.

A *request* here is what every source can provide: an arrival time, an id,
its prompt length and one integer **unit key** per ``hash_block_size`` tokens
of the prompt (its full hash units). A unit key names the unit's whole
prefix exactly (two requests share a key iff they share every token up to
the unit's end), so keys play the part of vLLM's chained block hashes; the
source's ``digest`` function turns keys into the bytes written to the trace.
The keys of one prompt are distinct, and keys are small dense integers
(the store and the digest memo are arrays indexed by key), so the memory
is about 10 bytes per distinct key and group, plus a bounded window of
memoised digests and at most two row batches in flight.

``WorkloadWriter.add`` turns one request into the rows a production log
shows for it, in this order:

1. a ``lookup`` row: the prompt's full-unit hashes, ``max_length =
   num_tokens - 1`` (vLLM's scheduler always recomputes the last prompt
   token for its logits), ``num_tokens``;
2. ``remove`` rows (one per group, LRU order) for the keys evicted to make
   room, when the store has a finite ``capacity_blocks``;
3. ``store`` rows (one per group, block order) for the keys the request's
   prefill leaves behind that were not already present. Keys already
   present are refreshed in the LRU but not re-stored, as vLLM's
   ``BlockStored`` events only name newly cached blocks.

What each kind of group stores after a prefill of ``N`` tokens (block size
``B``, hit alignment ``A`` = the scheduler block size). These follow the
masks vLLM 0.33.0's Mooncake store connector writes
(``MooncakeStoreCoordinator.store_mask`` over each manager's
``reachable_block_mask``, and the Mamba ``boundary_state_offloads``), with
``retention_interval`` playing ``prefix_cache_retention_interval``:

* full attention, chunked local attention: every full block of the prompt
  (their managers keep all blocks; only the finders skip some).
* sliding window (window widened by ``extra_retained_tokens``): the tail of
  ``need = ceil((W - 1) / B)`` blocks (one more with EAGLE, whose run ends
  one block past the boundary) that ends at each aligned boundary, i.e.
  block ``i`` is kept iff ``i >= shift`` and ``(i - shift) % (A / B) >=
  A / B - need``. With the default dense retention and ``A == B`` that is
  every block, which is what vLLM does. With a retention interval the
  segments are that many tokens long (``0``: none) and the tails ending at
  the replay boundaries below are added.
* Mamba (``align`` mode): a recurrent state only where align mode has one
  and a later hit can resume from it:

  - the *replay boundaries* (vLLM's ``replay_boundaries``): without EAGLE
    the resend position ``(N - 1) // A * A``; with EAGLE the positions one
    block below the resend and the extension hits (``resend - A`` and
    ``N // A * A - A``), since EAGLE drops one block from the attention
    hit and the state must sit where that hit lands;
  - the ends of the prefill chunks, where align mode snapshots the state
    between scheduler steps: approximated as every multiple of
    ``prefill_chunk_tokens`` (rounded down to ``A``) inside the prompt,
    counted from token 0 rather than from the request's own prefix hit
    (dense retention); every ``retention_interval`` tokens instead when
    one is set, none when it is ``0``.

  Not modelled: vLLM's shared-prefix junction checkpoints
  (``shared_prefix_boundary``), partial-tail hash units, and decode-time
  blocks (only what the prefill leaves behind is stored).

The store: a set of ``(group, key)`` entries, unbounded, or an LRU of
``capacity_blocks`` entries counted across all groups (a Mamba state counts
as one entry like an attention block). A request touches its groups last to
first and each group's keys from the prompt's tail to its head, so the
first group's head is the most recently used and evicted last, like vLLM's
block pool, which frees a request's blocks in reverse order so that shared
prefixes outlive their tails. Evictions are
emitted before the stores, so the store never holds more than
``capacity_blocks`` keys at any point of the log; a request larger than
the whole store evicts its own tail, which is then never stored.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from replay.errors import ReplayError
from replay.spec import GroupKind, GroupSpec, TraceConfig
from replay.trace import EVENT_KINDS, trace_schema

Keys = npt.NDArray[np.int64]
Digests = npt.NDArray[np.uint8]
#: Unit keys -> one fixed-width digest per key, shape ``(len(keys), width)``.
Digester = Callable[[Keys], Digests]
Sink = Callable[[pa.Table], None]

_EMPTY_KEYS: Keys = np.zeros(0, dtype=np.int64)

STORE, REMOVE, CLEAR, LOOKUP = (
    EVENT_KINDS.index(k) for k in ("store", "remove", "clear", "lookup")
)

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


# ---------------------------------------------------------------- digests


def mix64(x: npt.NDArray[np.uint64], salt: int) -> npt.NDArray[np.uint64]:
    """SplitMix64's finaliser of ``x ^ salt``: a bijection of 64-bit words, so
    distinct inputs give distinct outputs (no collisions, by construction)."""
    z = x ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF)
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def lane_salts(seed: int, lanes: int) -> tuple[int, ...]:
    """Per-lane salts derived from a seed (so different seeds give different hashes)."""
    base = np.full(lanes, seed & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64)
    lane = np.arange(lanes, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return tuple(int(v) for v in mix64(base + lane, 0x5EED5EED5EED5EED))


def _lanes_to_bytes(lanes: Sequence[npt.NDArray[np.uint64]]) -> Digests:
    out = np.empty((len(lanes[0]), len(lanes)), dtype=">u8")
    for i, lane in enumerate(lanes):
        out[:, i] = lane
    return out.view(np.uint8).reshape(len(lanes[0]), 8 * len(lanes))


def digest_keys(keys: Keys, salts: Sequence[int]) -> Digests:
    """``8 * len(salts)`` bytes per key; lane 0 alone is collision-free over keys."""
    k = keys.astype(np.uint64)
    return _lanes_to_bytes([mix64(k, s) for s in salts])


def digest_pairs(
    ids: npt.NDArray[np.uint64], subs: npt.NDArray[np.uint64], salts: Sequence[int]
) -> Digests:
    """Digests of ``(id, sub)`` pairs: lane 0 is a bijection of ``id`` and every
    other lane of ``id`` xor'd with ``sub``, so distinct pairs never collide
    (for ``sub < 2**32``)."""
    lanes = [mix64(ids, salts[0])]
    for s in salts[1:]:
        lanes.append(mix64(mix64(ids, s) ^ subs, s))
    return _lanes_to_bytes(lanes)


def big_endian_ids(ids: npt.NDArray[np.uint64]) -> Digests:
    """Integer ids as 8-byte big-endian unsigned (the format's rule for integer ids)."""
    return ids.astype(">u8").view(np.uint8).reshape(len(ids), 8)


class DigestTable:
    """Memoises a digester over dense keys: each key's digest is computed once,
    in bulk, and later calls gather rows of a table (a lookup repeats most of
    its prefix's hashes, so this is much cheaper than hashing every entry).

    Only the ``window`` most recent keys are kept (keys grow as a trace
    goes); older ones are recomputed, which keeps the memory bounded."""

    def __init__(self, fn: Digester, window: int = 1 << 22) -> None:
        self._fn = fn
        self._window = window
        self._table: npt.NDArray[np.void] | None = None
        self._lo = 0  # keys in [lo, hi) are in the table, key k at row k - lo
        self._hi = 0
        self.width = 0

    def _extend(self, hi: int) -> None:
        """Cover keys up to ``hi`` (exclusive), dropping the oldest beyond the window."""
        lo = max(self._lo, hi - self._window)
        start = max(self._hi, lo)
        fresh = np.ascontiguousarray(self._fn(np.arange(start, hi, dtype=np.int64)))
        self.width = fresh.shape[1]
        old = self._table
        table = old
        if old is None or hi - lo > len(old):
            size = max(hi - lo, 2 * (0 if old is None else len(old)), 1 << 16)
            table = np.zeros(min(self._window, size), dtype=f"V{self.width}")
        assert table is not None
        if old is not None and lo < self._hi and (table is not old or lo > self._lo):
            table[: self._hi - lo] = old[lo - self._lo : self._hi - self._lo]
        table[start - lo : hi - lo] = fresh.view(f"V{self.width}").reshape(-1)
        self._table, self._lo, self._hi = table, lo, hi

    def __call__(self, keys: Keys) -> Digests:
        if len(keys) == 0:
            return np.zeros((0, self.width), dtype=np.uint8)
        hi = int(keys.max()) + 1
        if hi > self._hi:
            self._extend(hi)
        assert self._table is not None
        if int(keys.min()) >= self._lo:
            rows = self._table[keys - self._lo]
        else:
            old = keys < self._lo
            rows = np.empty(len(keys), dtype=f"V{self.width}")
            rows[~old] = self._table[keys[~old] - self._lo]
            fresh = np.ascontiguousarray(self._fn(keys[old]))
            rows[old] = fresh.view(f"V{self.width}").reshape(-1)
        return rows.view(np.uint8).reshape(len(keys), self.width)


# ---------------------------------------------------------------- what a prefill stores


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def replay_boundaries(num_tokens: int, alignment: int, use_eagle: bool) -> tuple[int, ...]:
    """Token positions a later request replaying this prompt can resume at
    (vLLM 0.33.0 ``replay_boundaries``): the resend hit, capped at
    ``num_tokens - 1``; with EAGLE one block below it and below the extension
    hit of a longer sibling, since EAGLE drops one block from the hit."""
    if not use_eagle:
        return (max(num_tokens - 1, 0),)
    resend = (num_tokens - 1) // alignment * alignment
    extension = num_tokens // alignment * alignment
    return tuple(sorted({max(resend - alignment, 0), max(extension - alignment, 0)}))


def eagle_groups(config: TraceConfig) -> tuple[bool, ...]:
    """Which groups drop a block for EAGLE: the flagged ones, or all of them when
    ``use_eagle`` is on and none is flagged (the coordinator's rule)."""
    flagged = tuple(g.is_eagle_group for g in config.groups)
    if config.use_eagle and not any(flagged):
        return tuple(True for _ in config.groups)
    return flagged


@dataclass(frozen=True, slots=True, kw_only=True)
class StorePolicy:
    """The connector-side knobs that decide which blocks a prefill leaves behind."""

    #: vLLM's ``prefix_cache_retention_interval``: None = dense (the default),
    #: 0 = only the replay boundaries, k > 0 = one tail or state per k tokens.
    retention_interval: int | None = None
    #: Scheduler token budget per step (``max_num_batched_tokens``): align-mode
    #: Mamba snapshots its state at the end of each prefill chunk.
    prefill_chunk_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.retention_interval is not None and self.retention_interval < 0:
            raise ReplayError(
                f"retention_interval must be >= 0 or unset, got {self.retention_interval}"
            )
        if self.prefill_chunk_tokens <= 0:
            raise ReplayError(
                f"prefill_chunk_tokens must be positive, got {self.prefill_chunk_tokens}"
            )


def stored_blocks(
    spec: GroupSpec,
    *,
    num_blocks: int,
    num_tokens: int,
    alignment: int,
    group_eagle: bool,
    any_eagle: bool,
    policy: StorePolicy,
) -> npt.NDArray[np.int64] | None:
    """Indices (in the group's blocks) of the blocks a prefill of ``num_tokens``
    tokens stores for this group, ascending; ``None`` means all
    ``num_blocks`` full blocks. See the module docstring for the rules."""
    if spec.kind in (GroupKind.FULL_ATTENTION, GroupKind.CHUNKED_LOCAL_ATTENTION):
        return None
    bs = spec.block_size
    retention = policy.retention_interval
    if spec.kind is GroupKind.SLIDING_WINDOW:
        if alignment % bs:
            return None  # vLLM falls back to dense when the mask cannot be block-exact
        window = spec.coverage_window or 0
        need = cdiv(window - 1, bs) + (1 if group_eagle else 0)
        shift = 1 if group_eagle else 0
        mask = np.zeros(num_blocks, dtype=bool)
        segment = alignment if retention is None else (retention or None)
        if segment is not None:
            per_segment = segment // bs
            if need >= per_segment:
                return None
            idx = np.arange(num_blocks, dtype=np.int64)
            mask |= (idx >= shift) & ((idx - shift) % per_segment >= per_segment - need)
        if retention is not None:
            for boundary in replay_boundaries(num_tokens, alignment, any_eagle):
                end = boundary // alignment * alignment // bs + shift
                mask[max(0, end - need) : max(0, min(num_blocks, end))] = True
        return np.flatnonzero(mask).astype(np.int64)
    # Mamba: the states align mode keeps and a later hit can resume from.
    step = mamba_state_step(policy, alignment)
    blocks = mamba_state_blocks(num_blocks, num_tokens, bs, alignment, any_eagle, step)
    return np.array(blocks, dtype=np.int64)


def mamba_state_step(policy: StorePolicy, alignment: int) -> int:
    """Tokens between the Mamba states kept inside a prompt (0: none): the
    prefill chunk (dense retention) or the retention interval, aligned."""
    step = (
        policy.prefill_chunk_tokens
        if policy.retention_interval is None
        else policy.retention_interval
    )
    return max(step // alignment * alignment, alignment) if step else 0


def mamba_state_blocks(
    num_blocks: int, num_tokens: int, block_size: int, alignment: int, any_eagle: bool, step: int
) -> list[int]:
    """Block indices (ascending) of the Mamba states a prefill keeps: the
    replay boundaries and every ``step`` tokens (see the module docstring)."""
    a = alignment
    limit = num_blocks * block_size
    resend = (num_tokens - 1) // a * a
    if any_eagle:
        extension = num_tokens // a * a
        positions = [resend - a] if extension == resend else [resend - a, extension - a]
    else:
        positions = [resend]
    if step and step <= limit:
        positions = sorted({*positions, *range(step, limit + 1, step)})
    return [p // block_size - 1 for p in positions if 0 < p <= limit and p % block_size == 0]


# ---------------------------------------------------------------- the writer


class DenseStore:
    """The present ``(group, key)`` entries and, with a capacity, their LRU order.

    Unit keys are small dense integers, so an entry is a flag in an array: at
    ``(group << shift) | key``, each group owning a slot range of
    ``2 ** shift`` keys, widened when a larger key comes (group 0's index is
    the key itself). The LRU order is an append-only touch log with lazy
    deletion: a log entry is live iff its entry is present and was not
    touched again later. A request costs a few vectorised operations per
    group, or scalar ones for a group with a handful of keys (Mamba)."""

    def __init__(self, groups: int, capacity: int | None) -> None:
        self.groups = groups
        self.capacity = capacity
        self.count = 0
        self.shift = 16
        tracked = 1 << 16 if capacity is not None else 0
        self._present = np.zeros(groups << self.shift, dtype=bool)
        # A log position per entry; the log is compacted to about twice the
        # live entries, so positions fit 32 bits.
        self._last = np.zeros(groups << self.shift if tracked else 0, dtype=np.int32)
        self._log = np.zeros(tracked, dtype=np.int64)
        self._pos = np.arange(tracked, dtype=np.int32)  # log positions, preallocated
        self._head = 0
        self._len = 0

    def _restride(self, top: int) -> None:
        """Widen every group's slot range so that key ``top`` fits."""
        old, new = self.shift, max(self.shift + 1, top.bit_length())
        width = 1 << old

        def widen(arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
            out = np.zeros(self.groups << new, dtype=arr.dtype)
            for g in range(self.groups):
                out[g << new : (g << new) + width] = arr[g << old : (g + 1) << old]
            return out

        self._present = widen(self._present)
        if self.capacity is not None:
            self._last = widen(self._last)
            live = self._log[self._head : self._len]
            self._log[self._head : self._len] = ((live >> old) << new) | (live & (width - 1))
        self.shift = new

    def _live(self, window: Keys, start: int) -> npt.NDArray[np.bool_]:
        live: npt.NDArray[np.bool_] = self._present[window] & (
            self._last[window] == self._pos[start : start + len(window)]
        )
        return live

    def _compact(self) -> None:
        window = self._log[self._head : self._len]
        keep = window[self._live(window, self._head)]
        self._log[: len(keep)] = keep
        self._last[keep] = self._pos[: len(keep)]
        self._head, self._len = 0, len(keep)

    def _reserve(self, n: int) -> None:
        if self._len + n <= len(self._log):
            return
        if self._len - self._head > 2 * self.count + n:
            self._compact()
        if self._len + n > len(self._log):
            size = max(2 * len(self._log), self._len + n)
            log = np.zeros(size, dtype=np.int64)
            log[: self._len] = self._log[: self._len]
            self._log = log
            if size >= 1 << 31:
                raise ReplayError("store too large: more than 2**31 LRU log entries")
            self._pos = np.arange(size, dtype=np.int32)

    def reserve_keys(self, top: int) -> None:
        """Make room for keys up to ``top`` (an upper bound; saves a scan)."""
        if top >> self.shift:
            self._restride(top)

    def touch(self, gid: int, keys: Keys, top: int | None = None) -> npt.NDArray[np.bool_]:
        """Mark a group's entries present and most recently used, ``keys[0]``
        last (a prompt's head outlives its tail); return which were absent.
        The keys must be distinct; ``top``, when given, bounds them."""
        if len(keys) == 0:
            return np.zeros(0, dtype=bool)
        self.reserve_keys(int(keys.max()) if top is None else top)
        idx = keys if gid == 0 else keys + (gid << self.shift)
        absent = ~self._present[idx]
        self._present[idx] = True
        self.count += int(np.count_nonzero(absent))
        if self.capacity is not None:
            n = len(idx)
            self._reserve(n)
            end = self._len + n
            self._log[self._len : end] = idx[::-1]
            self._last[idx[::-1]] = self._pos[self._len : end]
            self._len = end
        return absent

    def touch_few(self, gid: int, keys: list[int]) -> list[bool]:
        """``touch`` for a handful of keys, with scalar operations."""
        if keys and max(keys) >> self.shift:
            self._restride(max(keys))
        base = gid << self.shift
        present = self._present
        absent = [not present[base + k] for k in keys]
        for k in keys:
            present[base + k] = True
        self.count += sum(absent)
        if self.capacity is not None:
            self._reserve(len(keys))
            log, last, pos = self._log, self._last, self._len
            for k in reversed(keys):
                log[pos] = base + k
                last[base + k] = pos
                pos += 1
            self._len = pos
        return absent

    def evict(self, n: int) -> Keys:
        """Remove and return the ``n`` least recently used entries, oldest first
        (as ``(group << shift) | key``)."""
        out: list[Keys] = []
        got = 0
        while got < n and self._head < self._len:
            window = self._log[self._head : min(self._len, self._head + 8 * (n - got) + 256)]
            live = np.nonzero(self._live(window, self._head))[0][: n - got]
            taken = window[live]
            self._present[taken] = False
            out.append(taken)
            got += len(taken)
            self._head += int(live[-1]) + 1 if got == n else len(window)
        self.count -= got
        if len(out) == 1:
            return out[0]
        return np.concatenate(out) if out else _EMPTY_KEYS

    def split(self, entries: Keys) -> list[Keys]:
        """Entries (as returned by ``evict``) -> each group's keys, in order."""
        if self.groups == 1:
            return [entries]
        others = np.flatnonzero(entries >> self.shift)
        out = [entries] + [_EMPTY_KEYS] * (self.groups - 1)
        if len(others) == 0:
            return out
        mask = (1 << self.shift) - 1
        if len(others) <= 16:
            # Usually a few Mamba states among many attention blocks.
            out[0] = np.delete(entries, others)
            rest: list[list[int]] = [[] for _ in range(self.groups)]
            for e in entries[others].tolist():
                rest[e >> self.shift].append(e & mask)
            for g in range(1, self.groups):
                if rest[g]:
                    out[g] = np.array(rest[g], dtype=np.int64)
            return out
        owner = entries >> self.shift
        return [entries[owner == g] & mask for g in range(self.groups)]

    def clear(self) -> None:
        self._present[:] = False
        self._head = self._len = 0
        self.count = 0


@dataclass(slots=True)
class WorkloadStats:
    """What a writer emitted (complete after ``close``)."""

    events: int = 0
    lookups: int = 0
    stores: int = 0
    removes: int = 0
    clears: int = 0
    hash_entries: int = 0
    stored_keys: list[int] = field(default_factory=list)
    evicted_keys: int = 0
    max_present_keys: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "events": self.events,
            "lookups": self.lookups,
            "stores": self.stores,
            "removes": self.removes,
            "clears": self.clears,
            "hash_entries": self.hash_entries,
            "stored_keys": list(self.stored_keys),
            "evicted_keys": self.evicted_keys,
            "max_present_keys": self.max_present_keys,
        }


class WorkloadWriter:
    """Turns requests into trace rows for one configuration, through a
    capacity-bounded LRU store, and hands them to ``sink`` in row groups."""

    def __init__(
        self,
        config: TraceConfig,
        sink: Sink,
        digest: Digester,
        *,
        capacity_blocks: int | None = None,
        policy: StorePolicy | None = None,
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
        self.policy = policy or StorePolicy()
        self._sink = sink
        self._digest = digest
        self._schema = trace_schema(config)
        self.capacity = capacity_blocks
        self.clear_every = clear_every
        self._flush_hashes = flush_hashes
        self._flush_events = flush_events
        self._hbs = config.hash_block_size
        self._alignment = config.scheduler_block_size
        self._eagle = eagle_groups(config)
        self._any_eagle = any(self._eagle)
        self._store = DenseStore(config.num_groups, capacity_blocks)
        # Mamba keeps a handful of states per prompt: scalar store operations.
        self._few = tuple(g.kind is GroupKind.MAMBA for g in config.groups)
        self._mamba_step = mamba_state_step(self.policy, self._alignment)
        # Kinds whose managers keep every block (see ``stored_blocks``).
        self._dense = tuple(
            g.kind in (GroupKind.FULL_ATTENTION, GroupKind.CHUNKED_LOCAL_ATTENTION)
            for g in config.groups
        )
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
        value_offsets = np.arange(0, (total + 1) * width, width, dtype=np.int32)[: total + 1]
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

    # -- the store

    def group_keys(
        self,
        gid: int,
        unit_keys: Keys,
        num_tokens: int,
        extra_blocks: Sequence[int] = (),
    ) -> Keys:
        """The unit keys of the blocks group ``gid`` stores for this prompt, in
        block order (``extra_blocks``: more block indices to store)."""
        spec = self.config.groups[gid]
        k = spec.block_size // self._hbs
        view = unit_keys[k - 1 :: k] if k > 1 else unit_keys
        if not extra_blocks:
            if self._dense[gid]:
                return view
            if spec.kind is GroupKind.MAMBA:
                return view[
                    mamba_state_blocks(
                        len(view),
                        num_tokens,
                        spec.block_size,
                        self._alignment,
                        self._any_eagle,
                        self._mamba_step,
                    )
                ]
        sel = stored_blocks(
            spec,
            num_blocks=len(view),
            num_tokens=num_tokens,
            alignment=self._alignment,
            group_eagle=self._eagle[gid],
            any_eagle=self._any_eagle,
            policy=self.policy,
        )
        if extra_blocks:
            base = np.arange(len(view), dtype=np.int64) if sel is None else sel
            bad = [b for b in extra_blocks if not 0 <= b < len(view)]
            if bad:
                raise ReplayError(
                    f"group {gid}: extra block {bad[0]} outside the prompt's {len(view)} blocks"
                )
            sel = np.union1d(base, np.array(extra_blocks, dtype=np.int64))
        return view if sel is None else view[sel]

    def _few_keys(self, gid: int, unit_keys: Keys, num_tokens: int) -> list[int]:
        """``group_keys`` of a Mamba group, as Python ints."""
        spec = self.config.groups[gid]
        k = spec.block_size // self._hbs
        blocks = mamba_state_blocks(
            len(unit_keys) // k,
            num_tokens,
            spec.block_size,
            self._alignment,
            self._any_eagle,
            self._mamba_step,
        )
        return [int(unit_keys[(b + 1) * k - 1]) for b in blocks]

    def clear(self, ts_us: int | None) -> int:
        """A ``clear`` row for every group: the store forgets everything."""
        self._store.clear()
        self._clear_due = False
        seq = self._event(ts_us, CLEAR, None, _EMPTY_KEYS)
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
        arrays (the store allocates up to the largest); ``max_key``, when the
        caller knows a bound, saves a scan.

        ``extra_blocks`` adds block indices for a group beyond what the store
        rules select (used to inject scenarios). ``allow_clear=False`` defers a
        due ``clear`` row to the next request."""
        if num_tokens <= 0:
            raise ReplayError(
                f"request {request_id}: num_tokens must be positive, got {num_tokens}"
            )
        expected = num_tokens // self._hbs
        if len(unit_keys) != expected:
            raise ReplayError(
                f"request {request_id}: {len(unit_keys)} unit keys for {num_tokens} tokens, "
                f"expected {expected} (one per {self._hbs} tokens)"
            )
        if self._clear_due and allow_clear:
            self.clear(ts_us)
        self.requests += 1
        if self.clear_every and self.requests % self.clear_every == 0:
            self._clear_due = True
        seq = self._event(ts_us, LOOKUP, None, unit_keys, request_id, num_tokens - 1, num_tokens)
        groups = self.config.num_groups
        store = self._store
        # Touch the groups last to first, so the first group's head is the
        # most recently used entry.
        new: list[Keys | list[int]] = [_EMPTY_KEYS] * groups
        touched = 0
        for gid in range(groups - 1, -1, -1):
            extra = extra_blocks.get(gid, ()) if extra_blocks else ()
            if self._few[gid] and not extra:
                few = self._few_keys(gid, unit_keys, num_tokens)
                absent_few = store.touch_few(gid, few)
                new[gid] = [k for k, a in zip(few, absent_few, strict=True) if a]
                touched += len(few)
            else:
                keys = self.group_keys(gid, unit_keys, num_tokens, extra)
                new[gid] = keys[store.touch(gid, keys, max_key)]
                touched += len(keys)
        removed: list[Keys] = []
        if self.capacity is not None and store.count > self.capacity:
            untouched = store.count - touched
            evicted = store.evict(store.count - self.capacity)
            removed = store.split(evicted[:untouched])
            if len(evicted) > untouched:
                # The request alone overflows the store: its own oldest keys go
                # too, and the new ones among them are never stored at all.
                for gid, own in enumerate(store.split(evicted[untouched:])):
                    fresh = np.asarray(new[gid], dtype=np.int64)
                    dropped = np.isin(own, fresh)
                    new[gid] = fresh[~np.isin(fresh, own)]
                    removed[gid] = np.concatenate((removed[gid], own[~dropped]))
            for gid, keys in enumerate(removed):
                if len(keys):
                    self._event(ts_us, REMOVE, gid, keys)
                    self.stats.evicted_keys += len(keys)
        for gid, fresh_keys in enumerate(new):
            if len(fresh_keys):
                arr = (
                    fresh_keys
                    if isinstance(fresh_keys, np.ndarray)
                    else np.array(fresh_keys, dtype=np.int64)
                )
                self._event(ts_us, STORE, gid, arr, request_id)
                self.stats.stored_keys[gid] += len(arr)
        size = store.count
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


def lcm(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out
