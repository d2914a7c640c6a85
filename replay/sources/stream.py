"""The KV-event stream, message by message: seq order, gaps, restarts, skips.

The recorder subscribes to a ``ZmqEventPublisher`` (SUB socket; three
frames per message: topic, 8-byte big-endian seq, msgpack payload) and
keeps the stream gapless where it can:

* **Gaps.** When a seq jumps, the missing range is asked of the replay
  endpoint (a DEALER sends ``["", start_seq]``; the publisher's ROUTER
  answers ``["", topic, seq, payload]`` per buffered batch with seq >= start,
  then ``["", "", -1, ""]``) and filled in order. What the replay buffer no
  longer holds (or a saturated publisher dropped) is an unfillable gap: it
  is reported on stderr and listed in the trace's ``source`` metadata as
  ``gaps`` (inclusive ``first``..``last`` seq ranges per epoch).
* **Start.** With a replay endpoint the recorder first asks for everything
  still buffered (from seq 0), so the trace starts as early as possible;
  seqs before the oldest buffered one are a gap ("joined late").
* **Publisher restart.** vLLM's seq counts from 0 per publisher, so a live
  seq below the next expected one that is not a repeat of a batch already
  taken (same seq, same payload digest) means the engine restarted. A new
  engine has an empty prefix cache: the recorder writes a ``clear`` row,
  resets the copy counts, starts a new epoch (listed in ``restarts``) and
  fills the new epoch's start from the replay endpoint. A restart is only
  seen when the seq goes back: a new publisher that is already past the old
  seq when the recorder reconnects looks like a gap (the replay fill then
  comes from the new publisher).
* **Malformed messages** (wrong frame count, a seq that is not 8 bytes, a
  payload that is not a batch) are reported, listed in ``skipped`` and
  skipped; a malformed payload still uses its seq.

The ZMQ sockets are ``replay.sources.zmq_client``; ``replay.sources.record``
runs the two (or a dump) into a trace.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from replay.base.spec import TraceConfig
from replay.sources.kv_columns import decode_columns, payload_digest
from replay.sources.kv_config import GroupMismatch
from replay.sources.kv_rows import EventConverter, EventOverLimit, medium_key
from replay.sources.kv_wire import KVBatch, MalformedBatch, decode_batch, valid_ts
from replay.sources.plugin_log import LookupPlacer
from replay.sources.values import Report, Row, to_stderr

#: The gap reason when the replay endpoint was silent: the gap's batches
#: may still arrive late, so later ones are held for a while.
NO_ANSWER = "the replay endpoint did not answer"

# Bounded reporting: the first few of each kind go to stderr, all are counted.
_MAX_REPORTED = 20
_MAX_LISTED = 1000

Fill = Callable[[int, int | None], tuple[list[tuple[list[bytes], float]], str]]


def _span(first: int, last: int) -> str:
    return f"seq {first}" if first == last else f"seq {first}-{last}"


def split_message(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """``[topic, seq, payload]`` -> (topic, seq, payload); MalformedBatch if not."""
    if len(frames) != 3:
        raise MalformedBatch(
            f"message has {len(frames)} frame{'s' if len(frames) != 1 else ''}, "
            "expected 3 (topic, seq, payload)"
        )
    topic, seq_frame, payload = frames
    if len(seq_frame) != 8:
        raise MalformedBatch(
            f"seq frame has {len(seq_frame)} bytes, expected 8 (big-endian sequence number)"
        )
    return bytes(topic), int.from_bytes(seq_frame, "big"), bytes(payload)


# ------------------------------------------------------------ the stream


class StreamProcessor:
    """Sequencing, gap and restart bookkeeping, decoding and copy counting for
    one publisher's stream, fed message by message. Shared by the live
    recorder and the dump importer, so both build the same trace."""

    def __init__(
        self,
        config: TraceConfig,
        sink: Callable[[list[Row]], None],
        *,
        topic: bytes = b"",
        media: Collection[str] | None = None,
        report: Report = to_stderr,
        tap: Callable[[Sequence[bytes], str, float], None] | None = None,
        window: int = 65_536,
        placer: LookupPlacer | None = None,
        reorder_seconds: float = 0.0,
        reorder_batches: int = 10_000,
        columnar: bool = False,
    ) -> None:
        self.converter = EventConverter(config, media=media)
        # With a placer: batches of vLLM's own form read as columns, a run
        # of removes one row (``EventConverter.convert_columns``; ``replay
        # watch``: the store at every lookup the same, the rows fewer).
        self.columnar = columnar and placer is not None
        self.sink = sink
        # With the plugin's lookups, batches go to the placer event by event
        # (it puts each lookup before the event at its position).
        self.placer = placer
        self.topic = topic
        self.report = report
        self.tap = tap
        self.epoch = 0
        self.expected = 0
        self.batches = 0
        self.filled = 0
        self.duplicates = 0
        self.other_topics = 0
        self.gaps: list[dict[str, Any]] = []
        self.restarts: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []
        self.skipped_total = 0
        self.ignored_types: Counter[str] = Counter()
        self.ranks: set[int] = set()
        self.epochs: list[dict[str, Any]] = []
        self.rows = 0
        self._reported = Counter[str]()
        self._window = window
        self._seen: dict[int, int] = {}
        self._seen_order: deque[int] = deque()
        self._pending_clear: datetime | None = None
        # Live batches past a gap nobody could answer for (no replay
        # endpoint, or it was silent), held up to ``reorder_seconds`` by
        # receive time so a late batch of the gap still goes in its place.
        # They are dumped when taken, so a dump read back (no holding) takes
        # the same order: seq -> (frames, payload, digest, where, recv_ts,
        # origin, gap_reason).
        self.reorder_seconds = reorder_seconds
        self.reorder_batches = reorder_batches
        self._held: dict[int, tuple[Sequence[bytes], bytes, int, str, float, str, str]] = {}
        self.late = 0

    # -- reporting

    def _say(self, kind: str, message: str) -> None:
        self._reported[kind] += 1
        n = self._reported[kind]
        if n <= _MAX_REPORTED:
            self.report(message)
        elif n == _MAX_REPORTED + 1:
            self.report(f"further {kind} reports are not shown (all are in the trace's source)")

    def _skip(self, seq: int | None, where: str, error: str) -> None:
        self.skipped_total += 1
        if len(self.skipped) < _MAX_LISTED:
            entry: dict[str, Any] = {"epoch": self.epoch, "seq": seq, "error": error}
            if where:
                entry["where"] = where
            self.skipped.append(entry)
        self._say("skipped message", f"skipped: {where}{': ' if where else ''}{error}")

    def _missing(self, first: int, last: int, reason: str) -> None:
        self.gaps.append(
            {
                "epoch": self.epoch,
                "first": first,
                "last": last,
                "count": last - first + 1,
                "reason": reason,
            }
        )
        n = last - first + 1
        epoch = f" (epoch {self.epoch})" if self.epoch else ""
        self._say(
            "gap",
            f"gap: {_span(first, last)}{epoch} missing ({n} batch{'es' if n != 1 else ''}): "
            f"{reason}",
        )

    # -- sequencing

    def _remember(self, seq: int, digest: int) -> None:
        self._seen[seq] = digest
        self._seen_order.append(seq)
        if len(self._seen_order) > self._window:
            self._seen.pop(self._seen_order.popleft(), None)

    def _restart(self, seq: int, payload: bytes, recv_ts: float) -> None:
        previous = self.expected - 1
        self.epoch += 1
        self.restarts.append({"epoch": self.epoch, "previous_last_seq": previous})
        self.expected = 0
        self._seen.clear()
        self._seen_order.clear()
        try:
            fallback = decode_batch(payload).time
        except MalformedBatch:
            fallback = datetime.fromtimestamp(recv_ts, tz=UTC)
        # The clear is written just before the new epoch's first batch (which a
        # replay fill may still bring), stamped with its time.
        self._pending_clear = fallback
        self._say(
            "restart",
            f"publisher restart: seq went back from {previous} to {seq}; starting epoch "
            f"{self.epoch} with a clear (a new engine has an empty cache)",
        )

    def feed(
        self,
        frames: Sequence[bytes],
        *,
        origin: str,
        recv_ts: float,
        where: str = "",
        fill: Fill | None = None,
        gap_reason: str = "missing from the stream",
    ) -> None:
        """Take one message. ``fill(start, end)`` fetches the batches with seq
        in ``[start, end)`` (``end`` None: all) when the seq jumps."""
        try:
            topic, seq, payload = split_message(frames)
        except MalformedBatch as exc:
            self._dump(frames, origin, recv_ts)
            self._skip(None, where, str(exc))
            return
        if not topic.startswith(self.topic):
            self.other_topics += 1
            return
        self.tick(recv_ts)
        digest = payload_digest(payload)
        if seq < self.expected or seq in self._held:
            held = self._held.get(seq)
            if self._seen.get(seq) == digest or (held is not None and held[2] == digest):
                self._dump(frames, origin, recv_ts)
                self.duplicates += 1
                return
            if self._in_gap(seq):
                self._dump(frames, origin, recv_ts)
                self._take_late(seq, payload, digest, where)
                return
            self.release()
            self._restart(seq, payload, recv_ts)
        answered = False
        if seq > self.expected and fill is not None and not self._held:
            filled, gap_reason = fill(self.expected, seq)
            answered = gap_reason != NO_ANSWER
            for f_frames, f_ts in filled:
                self.filled += 1
                self.feed(
                    f_frames, origin="replay", recv_ts=f_ts, where=where, gap_reason=gap_reason
                )
        holding = origin == "live" and self.reorder_seconds > 0
        if seq > self.expected and holding and (self._held or not answered):
            # The gap's batches may still come (late): hold this one.
            self._held[seq] = (frames, payload, digest, where, recv_ts, origin, gap_reason)
            if len(self._held) > self.reorder_batches:
                self.release(1)
            return
        # Dumped in the order taken (a fill before the message that asked for
        # it), so reading the dump back takes the same path.
        self._dump(frames, origin, recv_ts)
        if seq > self.expected:
            self._missing(self.expected, seq - 1, gap_reason)
        self._take(seq, payload, digest, where)
        self._drain()

    def _take_held(self, seq: int) -> None:
        frames, payload, digest, where, recv_ts, origin, _ = self._held.pop(seq)
        self._dump(frames, origin, recv_ts)
        self._take(seq, payload, digest, where)

    def _drain(self) -> None:
        while self.expected in self._held:
            self._take_held(self.expected)

    def release(self, count: int | None = None) -> None:
        """Give up waiting for an open gap (``count`` times; None: every
        gap): report it missing and take the held batches after it."""
        while self._held and (count is None or count > 0):
            first = min(self._held)
            self._missing(self.expected, first - 1, self._held[first][6])
            self._take_held(first)
            self._drain()
            if count is not None:
                count -= 1

    def tick(self, now: float) -> None:
        """Release what was held longer than ``reorder_seconds``."""
        while self._held:
            oldest = min(entry[4] for entry in self._held.values())
            if now - oldest < self.reorder_seconds:
                return
            self.release(1)

    def finish(self) -> None:
        """The end of the stream: nothing held stays unwritten."""
        self.release()

    def _in_gap(self, seq: int) -> bool:
        """A seq this epoch never took, in a gap already reported, within the
        publisher's replay window: a late batch, not a restart."""
        if seq < self.expected - self._window:
            return False
        return any(g["epoch"] == self.epoch and g["first"] <= seq <= g["last"] for g in self.gaps)

    def _take_late(self, seq: int, payload: bytes, digest: int, where: str) -> None:
        """A late batch of a gap already reported: its rows come now (the
        ones after it are written), and the gap shrinks by it."""
        for i, g in enumerate(self.gaps):
            if g["epoch"] == self.epoch and g["first"] <= seq <= g["last"]:
                parts = [
                    {**g, "first": a, "last": b, "count": b - a + 1}
                    for a, b in ((g["first"], seq - 1), (seq + 1, g["last"]))
                    if a <= b
                ]
                self.gaps[i : i + 1] = parts
                break
        self.late += 1
        self._say(
            "late batch",
            f"late batch: seq {seq} came after seq {self.expected - 1} was written; "
            "taken where it arrived",
        )
        expected, last = self.expected, self.epochs[-1]["last_seq"] if self.epochs else None
        self._take(seq, payload, digest, where)
        self.expected = expected
        if last is not None:
            self.epochs[-1]["last_seq"] = last

    def catch_up(self, fill: Fill, where: str = "") -> None:
        """Start from everything the replay endpoint still buffers."""
        filled, reason = fill(0, None)
        for i, (f_frames, f_ts) in enumerate(filled):
            self.filled += 1
            self.feed(
                f_frames,
                origin="replay",
                recv_ts=f_ts,
                where=where,
                # Only what precedes the oldest buffered batch is "joined late".
                gap_reason=f"joined late: {reason}" if i == 0 else reason,
            )

    def _take(self, seq: int, payload: bytes, digest: int, where: str) -> None:
        self.expected = seq + 1
        self.batches += 1
        self._remember(seq, digest)
        if not self.epochs or self.epochs[-1]["epoch"] != self.epoch:
            self.epochs.append({"epoch": self.epoch, "first_seq": seq, "last_seq": seq})
        self.epochs[-1]["last_seq"] = seq
        label = f"seq {seq}" + (f" (epoch {self.epoch})" if self.epoch else "")
        at = f"{where} ({label})" if where else label
        if self.columnar and self._take_columns(seq, payload):
            return
        try:
            batch = decode_batch(payload)
        except MalformedBatch as exc:
            self._flush_clear(None)
            self._skip(seq, where, f"{label}: {exc}")
            return
        self._flush_clear(batch.time)
        if batch.data_parallel_rank is not None:
            self.ranks.add(batch.data_parallel_rank)
        for name in batch.ignored_types:
            if not self.ignored_types[name]:
                self._say("event type", f"{at}: ignoring events of unknown type {name!r}")
            self.ignored_types[name] += 1
        try:
            if self.placer is not None:
                self._place(seq, batch)
                return
            rows = self.converter.convert(batch)
        except (GroupMismatch, EventOverLimit) as exc:
            raise type(exc)(f"{at}: {exc}") from None
        self._emit(rows)

    def _take_columns(self, seq: int, payload: bytes) -> bool:
        """The batch read as columns and placed; False (nothing taken) when
        it is not of that form, for ``decode_batch`` and ``convert_each``."""
        assert self.placer is not None
        cols = decode_columns(payload)
        if cols is None or not valid_ts(cols.ts):
            return False
        self._flush_clear(datetime.fromtimestamp(cols.ts, tz=UTC))
        spans = self.converter.convert_columns(cols)
        if spans is None:
            return False
        if cols.data_parallel_rank is not None:
            self.ranks.add(cols.data_parallel_rank)
        self.rows += sum(len(span.rows) for span in spans)
        self.placer.batch(self.epoch, seq, spans)
        return True

    def _place(self, seq: int, batch: KVBatch) -> None:
        assert self.placer is not None
        per_event = self.converter.convert_each(batch)
        self.rows += sum(len(rows) for rows in per_event)
        self.placer.batch(self.epoch, seq, per_event)

    def _dump(self, frames: Sequence[bytes], origin: str, recv_ts: float) -> None:
        if self.tap is not None:
            self.tap(frames, origin, recv_ts)

    def _flush_clear(self, ts: datetime | None) -> None:
        if self._pending_clear is not None:
            self._emit(self.converter.restart(ts or self._pending_clear))
            self._pending_clear = None

    def _emit(self, rows: list[Row]) -> None:
        if rows:
            self.rows += len(rows)
            self.sink(rows)

    def summary(
        self,
        path: str | os.PathLike[str],
        *,
        rows: int,
        filled: int,
        stop_reason: str,
        dump: str | os.PathLike[str] | None = None,
    ) -> RecordSummary:
        return RecordSummary(
            path=Path(path),
            batches=self.batches,
            rows=rows,
            kv_events=self.converter.kv_events,
            gaps=self.gaps,
            restarts=self.restarts,
            skipped=self.skipped_total,
            duplicates=self.duplicates,
            filled=filled,
            stop_reason=stop_reason,
            dump=None if dump is None else Path(dump),
        )

    def source(self) -> dict[str, Any]:
        media = self.converter.media
        return {
            "batches": self.batches,
            "kv_events": self.converter.kv_events,
            "rows": self.rows,
            "filled_from_replay": self.filled,
            "duplicates": self.duplicates,
            "late_batches": self.late,
            "epochs": self.epochs,
            "gaps": self.gaps,
            "missing_batches": sum(g["count"] for g in self.gaps),
            "restarts": self.restarts,
            "skipped": self.skipped,
            "skipped_total": self.skipped_total,
            "ignored_event_types": dict(self.ignored_types),
            "data_parallel_ranks": sorted(self.ranks),
            "copy_counting": (
                "per (group_id, hash), summed over media; a remove row is written "
                "when the last copy goes"
            ),
            "media": None if media is None else sorted(media),
            "filtered_events": self.converter.filtered_events,
            "lookups": "none (KV events carry no lookups; see `replay ingest merge`)",
            **self._cache(),
        }

    def _cache(self) -> dict[str, Any]:
        # Recorded KV events describe vLLM's engine prefix cache (the device
        # tier); a recording of other tiers only does not.
        media = self.converter.media
        return {"cache": "gpu"} if media is None or medium_key(None) in media else {}


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordSummary:
    path: Path
    batches: int
    rows: int
    kv_events: int
    gaps: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    duplicates: int = 0
    filled: int = 0
    stop_reason: str = ""
    dump: Path | None = None
    lookups: int | None = None
    #: Closed segments of a trace directory (None: one file).
    segments: int | None = None
    #: Connections of the KV-event socket dropped (an oversized message, a peer gone).
    dropped: int = 0
