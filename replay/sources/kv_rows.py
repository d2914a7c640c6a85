"""KV events -> trace rows, with copy counting.

vLLM's prefix cache may hold several physical blocks with the same hash
(``BlockHashToBlockMap`` does not de-duplicate), and a CPU or storage tier
holds further copies; each copy gets its own ``BlockStored`` and its own
``BlockRemoved``. The trace's key is ``(group_id, hash)`` with no tier, and
a lookup asks "can this prefix be served", so a key stays present while
*any* copy is left, in any medium: :class:`EventConverter` counts copies
per ``(group_id, hash)`` summed over media and emits a trace ``remove``
only for the hashes whose last copy went. ``media`` narrows the recording
to some tiers (``{"GPU"}`` models the device prefix cache alone); events of
other tiers are then dropped before counting. A null medium is the default
tier, which is ``GPU`` in vLLM. ``AllBlocksCleared`` carries no medium and
resets every count. A hash sent as an integer is written to the trace as 8
bytes big-endian.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import pairwise
from typing import Any

import numpy as np

from replay.base.errors import ReplayError
from replay.base.jit import jit
from replay.base.limits import HASH_BYTES, ROW_HASHES
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.format.hashwords import PackedHashes
from replay.sources.kv_columns import CLEARED, MEDIUM_GPU, REMOVED, STORED, KVColumns
from replay.sources.kv_config import GroupMismatch
from replay.sources.kv_copies import CopyCounts, CopyKey
from replay.sources.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVBatch
from replay.sources.values import Row

DEFAULT_MEDIUM = "GPU"


def trace_hashes(hashes: tuple[bytes | int, ...]) -> list[bytes]:
    """Wire hashes (already checked by the Structs) as the trace stores them."""
    packed = _packed(hashes)
    if packed is not None:
        return _split8(packed)
    return [h if isinstance(h, bytes) else h.to_bytes(8, "big") for h in hashes]


def _fast_hashes(
    hashes: tuple[bytes | int, ...],
) -> tuple[PackedHashes, Sequence[CopyKey], int] | None:
    """Hashes all of one type and width, as the trace stores them, packed in
    C-speed calls with no object per hash: the packed row value, the copy
    keys (the integers as they came) and the longest hash's bytes (0 for
    integers: the limit is on bytes hashes); None for a mix of types or
    widths, or no hashes (read one by one)."""
    if not hashes:
        return None
    # Integers (vLLM's default) packed; bytes (a digest per hash) not tried
    # as integers first: the failed pack was a tenth of a watch's conversion.
    if not isinstance(hashes[0], bytes):
        packed = _packed(hashes)
        return None if packed is None else (PackedHashes(packed, 8), hashes, 0)
    try:
        data = b"".join(hashes)  # type: ignore[arg-type]
    except TypeError:  # an integer among bytes
        return None
    widths = set(map(len, hashes))  # type: ignore[arg-type]
    if len(widths) != 1 or 0 in widths:
        return None
    (width,) = widths
    keys = struct.unpack(f">{len(hashes)}Q", data) if width == 8 else hashes
    return PackedHashes(data, width), keys, width


def _subset(hashes: Sequence[bytes], index: list[int]) -> Sequence[bytes]:
    """``hashes`` at ``index`` (ascending): the same object when that is all of them."""
    if len(index) == len(hashes):
        return hashes
    if isinstance(hashes, PackedHashes):
        w, data = hashes.width, hashes.data
        return PackedHashes(b"".join([data[i * w : (i + 1) * w] for i in index]), w)
    return [hashes[i] for i in index]


def _copy_key(h: bytes) -> CopyKey:
    return int.from_bytes(h, "big") if len(h) == 8 else h


def _key_bytes(key: CopyKey) -> bytes:
    return key.to_bytes(8, "big") if isinstance(key, int) else key


def _packed(hashes: tuple[bytes | int, ...]) -> bytes | None:
    """Hashes that are all unsigned 64-bit integers (vLLM's default) as their
    8-byte big-endian words in one call; None when any is not one."""
    try:
        return struct.pack(f">{len(hashes)}Q", *hashes)
    except struct.error:
        return None


def _split8(packed: bytes) -> list[bytes]:
    return [packed[i : i + 8] for i in range(0, len(packed), 8)]


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


class EventOverLimit(ReplayError):
    """An event holding more hashes, or a longer hash, than the limits allow
    (the trace written would be one no reader accepts): the import stops."""


def check_limits(event: BlockStored | BlockRemoved) -> None:
    """The row and hash limits (``replay.base.limits``) of one event."""
    name = type(event).__name__
    if len(event.block_hashes) > ROW_HASHES.value():
        raise ROW_HASHES.refuse(
            f"{name} block_hashes holds", len(event.block_hashes), EventOverLimit
        )
    widest = max((len(h) for h in event.block_hashes if isinstance(h, bytes)), default=0)
    if widest > HASH_BYTES.value():
        raise HASH_BYTES.refuse(f"{name} block_hashes holds a hash of", widest, EventOverLimit)


def medium_key(medium: str | None) -> str:
    """How a medium compares in a filter: case-insensitive, null = GPU."""
    return (medium or DEFAULT_MEDIUM).casefold()


@dataclass(slots=True)
class Span:
    """The rows of events ``first`` to ``last`` of a batch (several: a run
    of removes in one row). ``bounds`` (several events) splits its one row
    by event: event ``first + i`` removed hashes ``bounds[i]:bounds[i+1]``
    of it; a lookup placed among them needs it (``per_event``)."""

    first: int
    last: int
    rows: list[Row]
    bounds: np.ndarray[Any, np.dtype[np.int64]] | None = None

    def per_event(self) -> list[list[Row]]:
        """The rows event by event (each of a run's parts a row of its own)."""
        if self.bounds is None or not self.rows:
            return [self.rows] + [[] for _ in range(self.last - self.first)]
        (row,) = self.rows
        hashes = row["block_hashes"]
        assert isinstance(hashes, PackedHashes)
        w, data = hashes.width, hashes.data
        out: list[list[Row]] = []
        for lo, hi in zip(self.bounds[:-1].tolist(), self.bounds[1:].tolist(), strict=True):
            part = PackedHashes(data[lo * w : hi * w], w)
            out.append([{**row, "block_hashes": part}] if hi > lo else [])
        return out


@jit()
def _batch_runs(
    kind: Any,
    group: Any,
    block_size: Any,
    medium: Any,
    offsets: Any,
    block_sizes: Any,
    num_groups: int,
    limit: int,
) -> Any:
    """A batch's columns checked as ``EventConverter.convert_each`` would
    take them (a group of the config, 0 when it has one and the event names
    none; a store's block size not past its group's, and its group's when
    it has several blocks; at most ``limit`` hashes an event): (ok, the
    groups, where each run starts, then the event count). A run: one
    event, or consecutive removes of one group and medium."""
    n = kind.shape[0]
    groups = group.copy()
    starts = np.empty(n + 1, dtype=np.int64)
    fail = (False, groups, starts[:0])
    m = 0
    for e in range(n):
        k = kind[e]
        count = offsets[e + 1] - offsets[e]
        if count > limit:
            return fail
        if k != CLEARED:
            g = groups[e]
            if num_groups == 1 and g < 0:
                g = 0
                groups[e] = 0
            if g < 0 or g >= num_groups:
                return fail
            if k == STORED:
                size = block_size[e]
                own = block_sizes[g]
                if size >= 0 and (size > own or (count > 1 and size != own)):
                    return fail
        if not (
            e > 0
            and k == REMOVED
            and kind[e - 1] == REMOVED
            and groups[e] == groups[e - 1]
            and medium[e] == medium[e - 1]
        ):
            starts[m] = e
            m += 1
    starts[m] = n
    return True, groups, starts[: m + 1]


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
        # Per group, its copy counts (``replay.sources.kv_copies``: vLLM's
        # integers in a compiled table, a row's in one call), keyed by
        # ``CopyKey``; see ``copies``.
        self._copies = [CopyCounts() for _ in config.groups]
        self.kv_events = 0
        self.filtered_events = 0
        self._checked_groups: set[int] = set()
        self._block_sizes = np.array([g.block_size for g in config.groups], dtype=np.int64)

    @property
    def copies(self) -> dict[tuple[int, bytes], int]:
        """The copy count per ``(group_id, hash)`` of the keys with a copy left."""
        return {
            (g, _key_bytes(h)): n for g, c in enumerate(self._copies) for h, n in c.items() if n > 0
        }

    def _clear(self) -> None:
        for c in self._copies:
            c.clear()

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
        if isinstance(event, BlockStored):
            size, own = event.block_size, self.config.groups[gid].block_size
            # A store of full blocks carries the group's block size; vLLM's
            # partial-block store (cache_partial_block) one hash of fewer
            # tokens. Hashes of another block size key other tokens: a
            # replay of them against this config would be silently wrong.
            if size is not None and (size > own or (len(event.block_hashes) > 1 and size != own)):
                raise GroupMismatch(
                    f"group_idx {gid}: the publisher says block_size {size}, but the "
                    f"config's group {gid} has block_size {own}"
                )
            if gid not in self._checked_groups:
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
        return [row for rows in self.convert_each(batch) for row in rows]

    def convert_each(self, batch: KVBatch) -> list[list[Row]]:
        """The rows of each event of ``batch``, in order (a placer puts
        lookups between them)."""
        ts = batch.time
        out: list[list[Row]] = []
        limits: tuple[int, int] | None = None
        for event in batch.events:
            self.kv_events += 1
            rows: list[Row] = []
            out.append(rows)
            if isinstance(event, AllBlocksCleared):
                self._clear()
                rows.append(self._row(ts, "clear", group_id=None))
                continue
            if self.media is not None and medium_key(event.medium) not in self.media:
                self.filtered_events += 1
                continue
            fast = _fast_hashes(event.block_hashes)
            hashes: Sequence[bytes]
            if fast is None:
                check_limits(event)
                gid = self._group(event)
                # An integer hash and its 8 bytes are one trace key.
                hashes = trace_hashes(event.block_hashes)
                keys: Sequence[CopyKey] = [_copy_key(h) for h in hashes]
            else:
                # The limits read once a batch (each is an env lookup).
                if limits is None:
                    limits = ROW_HASHES.value(), HASH_BYTES.value()
                hashes, keys, widest = fast
                if len(hashes) > limits[0] or widest > limits[1]:
                    check_limits(event)
                gid = self._group(event)
            copies = self._copies[gid]
            # The fast path's keys are of one kind (integers, or bytes of one width).
            uniform = fast is not None
            if isinstance(event, BlockStored):
                copies.add(keys, uniform=uniform)
                if hashes:
                    rows.append(
                        self._row(
                            ts,
                            "store",
                            group_id=gid,
                            block_hashes=hashes,
                            medium=event.medium,
                        )
                    )
            else:
                gone = copies.remove(keys, uniform=uniform)
                if gone is None or gone:
                    rows.append(
                        self._row(
                            ts,
                            "remove",
                            group_id=gid,
                            block_hashes=hashes if gone is None else _subset(hashes, gone),
                            medium=event.medium,
                        )
                    )
        return out

    def convert_columns(self, cols: KVColumns) -> list[Span] | None:
        """``convert_each`` of a batch read as columns
        (``replay.sources.kv_columns``), the rows of its events in spans: a
        run of ``BlockRemoved`` of one group and medium is one remove row
        (vLLM sends one a block: a row each was most of a watch's work), the
        store the same after every event of the run as after the rows
        ``convert_each`` makes. None, with nothing changed, for what only
        ``convert_each`` does or says: a medium filter, or an event it
        would refuse (its error names it)."""
        n = cols.events
        if self.media is not None or n == 0:
            return None
        kind, offsets = cols.kind, cols.offsets
        num_groups = self.config.num_groups
        limit = ROW_HASHES.value()
        if HASH_BYTES.value() < 8:
            return None
        # The checks and the runs (consecutive removes of one group and
        # medium) in one compiled pass: a dozen array operations a batch
        # were a tenth of a watch's work.
        ok, group, starts = _batch_runs(
            kind, cols.group, cols.block_size, cols.medium, offsets,
            self._block_sizes, num_groups, limit,
        )  # fmt: skip
        if not ok:
            return None
        # What ``_check_spec`` reads (the spec's kind) this form never
        # has: the group counts as checked, as after ``_group``.
        if len(self._checked_groups) < num_groups:
            self._checked_groups.update(group[kind == STORED].tolist())
        ts = datetime.fromtimestamp(cols.ts, tz=UTC)
        words = cols.hashes.astype(">u8").tobytes()
        firsts = starts.tolist()
        spans: list[Span] = []
        self.kv_events += n
        for a, end in pairwise(firsts):
            k = int(kind[a])
            if k == CLEARED:
                self._clear()
                spans.append(Span(a, a, [self._row(ts, "clear", group_id=None)]))
                continue
            gid = int(group[a])
            medium = "GPU" if cols.medium[a] == MEDIUM_GPU else None
            if k == STORED:
                lo, hi = int(offsets[a]), int(offsets[a + 1])
                self._copies[gid].add_ints(cols.hashes[lo:hi])
                hashes = PackedHashes(words[8 * lo : 8 * hi], 8)
                row = self._row(ts, "store", group_id=gid, block_hashes=hashes, medium=medium)
                spans.append(Span(a, a, [row]))
                continue
            while a < end:
                # A run's row holds at most a row's hashes (each event's are
                # within the limit, checked above).
                b = end
                if offsets[end] - offsets[a] > limit:
                    b = int(np.searchsorted(offsets, offsets[a] + limit, side="right")) - 1
                spans.append(self._remove_run(ts, gid, medium, a, b - 1, cols, words))
                a = b
        return spans

    def _remove_run(
        self,
        ts: datetime,
        gid: int,
        medium: str | None,
        first: int,
        last: int,
        cols: KVColumns,
        words: bytes,
    ) -> Span:
        """Events ``first`` to ``last`` (removes of group ``gid``) in one row."""
        offsets = cols.offsets[first : last + 2]
        lo, hi = int(offsets[0]), int(offsets[-1])
        gone = self._copies[gid].remove_ints(cols.hashes[lo:hi])
        bounds = offsets - lo
        if gone is None:
            data = words[8 * lo : 8 * hi]
        else:
            at = np.asarray(gone, dtype=np.int64)
            bounds = np.searchsorted(at, bounds)
            data = b"".join([words[8 * (lo + i) : 8 * (lo + i + 1)] for i in gone])
        if not data:
            return Span(first, last, [])
        row = self._row(
            ts, "remove", group_id=gid, block_hashes=PackedHashes(data, 8), medium=medium
        )
        return Span(first, last, [row], bounds=bounds)

    def restart(self, ts: datetime) -> list[Row]:
        """A publisher restart: the new engine starts with an empty cache."""
        self._clear()
        return [self._row(ts, "clear", group_id=None)]
