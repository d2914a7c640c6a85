"""Record a live vLLM KV-event stream into a trace; read raw dumps back.

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

``--dump FILE`` writes every message the recorder took, in the order it
took them, so ``replay ingest kv-events FILE`` rebuilds the same trace
(under any KV-cache config). Layout: the 8 magic bytes ``RKVDUMP1``, then
records, each a 4-byte big-endian length followed by that many bytes of
msgpack ``[recv_ts, origin, frames]``: ``recv_ts`` the receive time in
seconds (float), ``origin`` ``"live"`` or ``"replay"``, ``frames`` the
message's frames as binaries (``[topic, seq, payload]`` when well formed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import struct
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any, Self

import msgspec
import zmq

from replay.errors import ReplayError
from replay.paths import check_input, output_target, signals_held
from replay.sources.kv_events import (
    EventConverter,
    GroupMismatch,
    KVBatch,
    LookupMerger,
    LookupPlacer,
    MalformedBatch,
    PlacedLookup,
    Row,
    decode_batch,
    is_plugin_log,
    is_text,
    medium_key,
    parse_plugin_lookup,
    plugin_config,
    read_lookup_log,
    read_plugin_log,
)
from replay.spec import TraceConfig
from replay.trace import TraceWriter

DUMP_MAGIC = b"RKVDUMP1"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
ORIGINS = ("live", "replay")
#: The gap reason when the replay endpoint was silent: the gap's batches
#: may still arrive late, so later ones are held for a while.
NO_ANSWER = "the replay endpoint did not answer"

# Bounded reporting: the first few of each kind go to stderr, all are counted.
_MAX_REPORTED = 20
_MAX_LISTED = 1000

Fill = Callable[[int, int | None], tuple[list[tuple[list[bytes], float]], str]]
Report = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat()


def _span(first: int, last: int) -> str:
    return f"seq {first}" if first == last else f"seq {first}-{last}"


def _zmq_reason(exc: zmq.ZMQError) -> str:
    # pyzmq appends "(addr=...)" to strerror; the address is already in the message.
    return zmq.strerror(exc.errno) if exc.errno is not None else str(exc)


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
        report: Report = _stderr,
        tap: Callable[[Sequence[bytes], str, float], None] | None = None,
        window: int = 65_536,
        placer: LookupPlacer | None = None,
        reorder_seconds: float = 0.0,
        reorder_batches: int = 10_000,
    ) -> None:
        self.converter = EventConverter(config, media=media)
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
        self._seen: dict[int, bytes] = {}
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
        self._held: dict[int, tuple[Sequence[bytes], bytes, bytes, str, float, str, str]] = {}
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

    def _remember(self, seq: int, digest: bytes) -> None:
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
        digest = hashlib.blake2b(payload, digest_size=8).digest()
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

    def _take_late(self, seq: int, payload: bytes, digest: bytes, where: str) -> None:
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

    def _take(self, seq: int, payload: bytes, digest: bytes, where: str) -> None:
        self.expected = seq + 1
        self.batches += 1
        self._remember(seq, digest)
        if not self.epochs or self.epochs[-1]["epoch"] != self.epoch:
            self.epochs.append({"epoch": self.epoch, "first_seq": seq, "last_seq": seq})
        self.epochs[-1]["last_seq"] = seq
        label = f"seq {seq}" + (f" (epoch {self.epoch})" if self.epoch else "")
        at = f"{where} ({label})" if where else label
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
        except GroupMismatch as exc:
            raise GroupMismatch(f"{at}: {exc}") from None
        self._emit(rows)

    def _place(self, seq: int, batch: KVBatch) -> None:
        assert self.placer is not None
        per_event = [
            self.converter.convert(KVBatch(ts=batch.ts, events=(event,))) for event in batch.events
        ]
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


# ------------------------------------------------------------------ dumps


class DumpWriter:
    """The raw-frame dump (layout in the module docstring): an append-only log
    that is valid after every record. The magic is written to a temporary
    file that replaces ``path`` at once, then records are appended and
    flushed as they come, so whatever stops the recorder (an error, a
    signal, even SIGKILL) leaves a dump that reads back up to its last
    complete record (:func:`read_dump` drops a torn last one)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        target = output_target(self.path, text=False, what="a KV-event dump")
        self.records = 0
        self._encoder = msgspec.msgpack.Encoder()
        if target.kind == "null":
            self._fh = open(os.devnull, "wb")  # noqa: SIM115 (closed by close())
            return
        with signals_held():
            fd, tmp = tempfile.mkstemp(
                prefix=f".{target.real.name}.", suffix=".tmp", dir=target.real.parent
            )
            try:
                os.write(fd, DUMP_MAGIC)
                os.fchmod(fd, 0o666 & ~_umask())
                os.replace(tmp, target.real)
            except BaseException:
                os.close(fd)
                Path(tmp).unlink(missing_ok=True)
                raise
        self._fh = os.fdopen(fd, "ab")

    def write(self, frames: Sequence[bytes], origin: str, recv_ts: float) -> None:
        data = self._encoder.encode([recv_ts, origin, [bytes(f) for f in frames]])
        self._fh.write(struct.pack(">I", len(data)) + data)
        self.records += 1

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


@dataclass(frozen=True, slots=True, kw_only=True)
class DumpRecord:
    index: int
    offset: int
    recv_ts: float
    origin: str
    frames: list[bytes]


def _check_dump(path: Path) -> None:
    check_input(path, "a KV-event dump")
    with open(path, "rb") as fh:
        magic = fh.read(len(DUMP_MAGIC))
    if magic != DUMP_MAGIC:
        if magic[:7] == DUMP_MAGIC[:7] and len(magic) == 8:
            raise ReplayError(
                f"{path}: dump layout version {magic[7:].decode(errors='replace')!r} is not "
                f"supported (expected {DUMP_MAGIC.decode()})"
            )
        raise ReplayError(
            f"{path}: not a KV-event dump (expected the magic bytes {DUMP_MAGIC.decode()} "
            "at the start; `replay record --dump FILE` writes one)"
        )


def read_dump(path: str | os.PathLike[str], report: Report = _stderr) -> Iterator[DumpRecord]:
    """The records of a dump, validated one by one (errors name the record).
    A torn last record (a recorder killed mid-write) is dropped, saying so
    in one line through ``report``."""
    p = Path(path)
    _check_dump(p)
    decoder = msgspec.msgpack.Decoder()
    with open(p, "rb") as fh:
        fh.seek(len(DUMP_MAGIC))
        offset = len(DUMP_MAGIC)
        index = 0
        while True:
            head = fh.read(4)
            if not head:
                return
            where = f"{p}: record {index} at byte {offset}"
            data = b""
            if len(head) == 4:
                (length,) = struct.unpack(">I", head)
                data = fh.read(length)
            if len(head) < 4 or len(data) < length:
                torn = len(head) + len(data)
                report(
                    f"{where}: truncated (the file ends {torn} bytes into it, as when the "
                    f"recorder was killed): read {index} complete records, dropped the last "
                    f"{torn} bytes"
                )
                return
            try:
                obj = decoder.decode(data)
            except msgspec.DecodeError as exc:
                raise ReplayError(f"{where}: not msgpack ({exc})") from None
            except RecursionError:
                raise ReplayError(f"{where}: not a dump record (nested too deeply)") from None
            expected = "expected a msgpack array [recv_ts, origin, frames]"
            if not isinstance(obj, list) or len(obj) != 3:
                raise ReplayError(f"{where}: {expected}")
            recv_ts, origin, frames = obj
            if (
                not isinstance(recv_ts, int | float)
                or isinstance(recv_ts, bool)
                or not math.isfinite(recv_ts)
                or origin not in ORIGINS
                or not isinstance(frames, list)
                or not all(isinstance(f, bytes) for f in frames)
            ):
                raise ReplayError(f"{where}: {expected} (origin 'live' or 'replay', frames binary)")
            yield DumpRecord(
                index=index, offset=offset, recv_ts=float(recv_ts), origin=origin, frames=frames
            )
            offset += 4 + length
            index += 1


# ------------------------------------------------------------- the sink


class _BufferedRows:
    """Rows collected and written as row groups (by size or age)."""

    def __init__(
        self,
        writer: TraceWriter,
        *,
        merger: LookupMerger | None = None,
        flush_rows: int = 10_000,
        flush_seconds: float = 5.0,
    ) -> None:
        self.writer = writer
        self.merger = merger
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self._rows: list[Row] = []
        self._last = time.monotonic()

    def __call__(self, rows: list[Row]) -> None:
        if self.merger is not None:
            rows = self.merger.feed(rows)
        self._rows.extend(rows)
        if len(self._rows) >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        if self._rows:
            self.writer.write_rows(self._rows)
            self._rows = []
        self._last = time.monotonic()

    def maybe_flush(self) -> bool:
        if time.monotonic() - self._last >= self.flush_seconds:
            self.flush()
            return True
        return False

    def finish(self) -> None:
        if self.merger is not None:
            self._rows.extend(self.merger.finish())
        self.flush()


# ----------------------------------------------------------------- replay


class _ReplayClient:
    """The DEALER side of vLLM's replay protocol."""

    def __init__(
        self, ctx: zmq.Context[Any], endpoint: str, topic: bytes, timeout: float, report: Report
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.topic = topic
        self.timeout = timeout
        self.report = report
        self.requests = 0
        self.timeouts = 0
        self.bad_replies = 0
        self._sock: zmq.Socket[Any] | None = None

    def _socket(self) -> zmq.Socket[Any]:
        if self._sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            try:
                sock.connect(self.endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                raise ReplayError(
                    f"--replay-endpoint {self.endpoint}: cannot connect ({_zmq_reason(exc)})"
                ) from None
            self._sock = sock
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def fetch(self, start: int, end: int | None) -> tuple[list[tuple[list[bytes], float]], str]:
        """Batches with seq in ``[start, end)``, in seq order, and the reason to
        give for any seq of the range that is not among them."""
        sock = self._socket()
        self.requests += 1
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got: dict[int, tuple[list[bytes], float]] = {}
        while True:
            # The timeout is per reply: a full buffer (10,000 batches by
            # default) takes a while, a silent endpoint does not.
            if not sock.poll(int(self.timeout * 1000)):
                self.timeouts += 1
                # Replies to this request may still come: a fresh socket keeps
                # them from being mistaken for the next request's.
                self.close()
                self.report(
                    f"replay endpoint {self.endpoint} did not answer within "
                    f"{self.timeout:g} s (asked from seq {start})"
                )
                return [got[s] for s in sorted(got)], NO_ANSWER
            msg = sock.recv_multipart()
            if len(msg) == 4 and msg[0] == b"" and msg[2] == END_SEQ:
                break
            if len(msg) != 4 or msg[0] != b"" or len(msg[2]) != 8:
                self.bad_replies += 1
                continue
            topic, seq_frame = msg[1], msg[2]
            if not topic.startswith(self.topic):
                continue
            seq = int.from_bytes(seq_frame, "big")
            if seq >= start and (end is None or seq < end):
                got.setdefault(seq, (msg[1:], time.time()))
        return [got[s] for s in sorted(got)], "not in the publisher's replay buffer"


# ---------------------------------------------------------- plugin lookups


def binds(endpoint: str) -> bool:
    """vLLM's publisher rule, seen from the other end: a publisher endpoint
    with ``*`` or ``::`` binds, so the recorder connects to it; given such an
    endpoint itself (``tcp://*:5557``), the recorder binds and vLLM's
    publisher, configured with this host's address, connects."""
    return "*" in endpoint or "::" in endpoint


class LookupSubscriber:
    """The SUB side of the vLLM plugin's lookup stream (``replay.vllm_plugin``):
    engine facts, lookups and watermarks, with lost messages reported."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, report: Report) -> None:
        from replay.vllm_plugin import TOPIC

        self.endpoint = endpoint
        self.report = report
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        try:
            self.sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ReplayError(
                f"--lookups {endpoint}: cannot connect ({_zmq_reason(exc)})"
            ) from None
        self.engines: list[dict[str, Any]] = []
        self.messages = 0
        self.lost = 0
        self.malformed = 0
        self._next: int | None = None
        self._held: list[tuple[int, Any, dict[str, Any]]] = []

    def receive(
        self, config: TraceConfig | None
    ) -> Iterator[tuple[str, dict[str, Any] | PlacedLookup | tuple[str, int]]]:
        """What arrived, without waiting: ``("engine", record)``,
        ``("lookup", PlacedLookup)`` and ``("watermark", (instance, batches))``
        (these two held until a config is known)."""
        if config is not None and self._held:
            yield from self._release(config)
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if len(frames) != 3 or len(frames[1]) != 8:
                    raise ValueError("expected 3 frames (topic, seq, payload)")
                seq = int.from_bytes(frames[1], "big")
                payload = json.loads(frames[2])
                if not isinstance(payload, dict) or not isinstance(payload.get("records"), list):
                    raise ValueError("payload is not a lookup message")
            except (ValueError, UnicodeDecodeError) as exc:
                self.malformed += 1
                self.report(f"lookups: skipped a malformed message ({exc})")
                continue
            self.messages += 1
            if self._next is not None and seq > self._next:
                self.lost += seq - self._next
                self.report(
                    f"lookups: {seq - self._next} message(s) from the plugin lost "
                    f"(seq {self._next}..{seq - 1}); their lookups are missing"
                )
            self._next = seq + 1
            instance = payload.get("instance")
            known = {e.get("instance") for e in self.engines}
            for rec in payload["records"]:
                if (
                    isinstance(rec, dict)
                    and rec.get("type") == "engine"
                    and rec.get("instance") not in known
                ):
                    known.add(rec.get("instance"))
                    self.engines.append(rec)
                    yield "engine", rec
            # Lookups that came before the engine facts (the plugin resends
            # them only once it sees the subscription) wait for a config.
            self._held.append((seq, instance, payload))
            if config is not None:
                yield from self._release(config)

    def _release(
        self, config: TraceConfig
    ) -> Iterator[tuple[str, dict[str, Any] | PlacedLookup | tuple[str, int]]]:
        held, self._held = self._held, []
        for seq, instance, payload in held:
            for rec in payload["records"]:
                if isinstance(rec, dict) and rec.get("type") == "lookup":
                    try:
                        yield "lookup", parse_plugin_lookup(rec, seq, config)
                    except ValueError as exc:
                        self.malformed += 1
                        self.report(f"lookups: message {seq}: skipped a lookup ({exc})")
            mark = payload.get("watermark")
            if isinstance(instance, str) and isinstance(mark, int):
                yield "watermark", (instance, mark)

    def wait_engine(self, stop: Callable[[], bool]) -> dict[str, Any] | None:
        """Block until the plugin's engine facts arrive (or ``stop()``)."""
        while not stop():
            if self.sock.poll(100):
                for kind, item in self.receive(None):
                    if kind == "engine":
                        assert isinstance(item, dict)
                        return item
        return None

    def source(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "messages": self.messages,
            "lost_messages": self.lost,
            "malformed": self.malformed,
        }


def _take_lookups(lsub: LookupSubscriber, placer: LookupPlacer, config: TraceConfig) -> None:
    for kind, item in lsub.receive(config):
        if kind == "engine":
            assert isinstance(item, dict)
            _check_engine(item, config, f"--lookups {lsub.endpoint}", lsub.report)
        elif kind == "lookup":
            assert isinstance(item, PlacedLookup)
            placer.add([item])
        elif kind == "watermark":
            assert isinstance(item, tuple)
            placer.watermark(*item)


def _check_engine(engine: dict[str, Any], config: TraceConfig, where: str, report: Report) -> None:
    """Say so when the engine's own view differs from the config in use."""
    try:
        theirs = plugin_config(engine, where)
    except ReplayError as exc:
        report(f"{exc}")
        return
    if theirs != config:
        report(
            f"{where}: the engine's KV-cache config differs from the one recording with "
            f"(engine: {json.dumps({**theirs.to_json(), 'source': None})}); leave out "
            "--config to use the engine's"
        )


def _plugin_source(
    placer: LookupPlacer, engines: list[dict[str, Any]], origin: dict[str, Any]
) -> dict[str, Any]:
    """The ``source`` entries of a trace whose lookups came from the plugin."""
    return {
        "lookups": {**placer.source(), **origin},
        "engine": [{"instance": e.get("instance"), **(e.get("engine") or {})} for e in engines],
        "cache": "gpu",
    }


# --------------------------------------------------------------- record


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

    def describe(self) -> str:
        n_gap = sum(g["count"] for g in self.gaps)
        parts = [f"{self.batches} batches", f"{self.rows} rows"]
        if self.lookups is not None:
            parts.append(f"{self.lookups} lookups placed")
        if self.filled:
            parts.append(f"{self.filled} filled from the replay endpoint")
        if self.gaps:
            parts.append(
                f"{n_gap} missing in {len(self.gaps)} gap{'s' if len(self.gaps) > 1 else ''}"
            )
        if self.restarts:
            parts.append(
                f"{len(self.restarts)} publisher restart{'s' if len(self.restarts) > 1 else ''}"
            )
        if self.skipped:
            parts.append(f"{self.skipped} malformed skipped")
        return ", ".join(parts)


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[list[int]]:
    """SIGINT, SIGTERM and SIGHUP set ``stop`` (the recorder then closes a
    valid file) and are listed in the yielded list (the CLI exits with 128 +
    the first); a second Ctrl-C interrupts at once. Only in the main thread."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def record(
    *,
    endpoint: str,
    output: str | os.PathLike[str],
    config: TraceConfig | None,
    replay_endpoint: str | None = None,
    topic: str = "",
    bind: bool | None = None,
    lookups: str | None = None,
    max_batches: int | None = None,
    duration: float | None = None,
    dump: str | os.PathLike[str] | None = None,
    media: Collection[str] | None = None,
    replay_timeout: float = 2.0,
    stop: threading.Event | None = None,
    report: Report = _stderr,
    progress: Report | None = None,
    flush_rows: int = 10_000,
    flush_seconds: float = 5.0,
    silence_seconds: float = 10.0,
    reorder_seconds: float = 2.0,
    announce: Report | None = None,
) -> RecordSummary:
    """Record until ``max_batches`` batches were taken, ``duration`` seconds
    passed, ``stop`` is set, or Ctrl-C; then close a valid trace. Batches
    after a gap no replay endpoint answered for are held ``reorder_seconds``
    so a late one goes in its place. Nothing received for ``silence_seconds``
    is reported once (a wrong endpoint or topic looks exactly like an idle
    engine otherwise).

    ``bind`` None: bind when the endpoint is a bind form (:func:`binds`),
    else connect. ``lookups``: the vLLM plugin's endpoint; every lookup goes
    in its exact place, and without ``config`` the plugin's engine facts
    are the config."""
    for option, value in (("--endpoint", endpoint), ("--replay-endpoint", replay_endpoint), ("--topic", topic)):  # fmt: skip
        if value is not None and not is_text(value):
            raise ReplayError(f"{option} {value!r}: not valid text (undecodable bytes)")
    topic_bytes = topic.encode()
    started = time.time()
    deadline = None if duration is None else time.monotonic() + duration
    ctx: zmq.Context[Any] = zmq.Context()
    replay: _ReplayClient | None = None
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic_bytes)
        if bind is None:
            bind = binds(endpoint)
        try:
            if bind:
                sub.bind(endpoint)
            else:
                sub.connect(endpoint)
        except zmq.ZMQError as exc:
            verb = "bind" if bind else "connect"
            raise ReplayError(
                f"--endpoint {endpoint}: cannot {verb} ({_zmq_reason(exc)})"
            ) from None
        if announce is not None:
            # Said once the endpoint is known good, so a bad one is the only line.
            how = (
                "binding it: vLLM's publisher connects here"
                if bind
                else "connecting: vLLM's publisher binds there"
            )
            announce(f"recording {endpoint} ({how}) -> {output} (Ctrl-C to stop)")
            if lookups is not None:
                announce(f"lookups from the vLLM plugin at {lookups}")
        lsub = None if lookups is None else LookupSubscriber(ctx, lookups, report)
        if config is None:
            if lsub is None:
                raise ReplayError("no KV-cache config: pass --config, or --lookups (the plugin)")
            report(f"waiting for the engine facts from {lookups} (sent at the engine's next step)")
            engine = lsub.wait_engine(
                lambda: (
                    (stop is not None and stop.is_set())
                    or (deadline is not None and time.monotonic() >= deadline)
                )
            )
            if engine is None:
                raise ReplayError(f"--lookups {lookups}: no engine facts arrived; nothing recorded")
            config = plugin_config(engine, f"--lookups {lookups}")
        if replay_endpoint is not None:
            replay = _ReplayClient(ctx, replay_endpoint, topic_bytes, replay_timeout, report)
        with contextlib.ExitStack() as stack:
            dump_writer = stack.enter_context(DumpWriter(dump)) if dump is not None else None
            writer = stack.enter_context(TraceWriter(output, config, keep_on_interrupt=True))
            rows = _BufferedRows(writer, flush_rows=flush_rows, flush_seconds=flush_seconds)
            placer = None if lsub is None else LookupPlacer(rows)
            proc = StreamProcessor(
                config,
                rows if placer is None else placer,
                topic=topic_bytes,
                media=media,
                report=report,
                reorder_seconds=reorder_seconds,
                tap=(lambda f, o, t: dump_writer.write(f, o, t)) if dump_writer else None,
                placer=placer,
            )
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            if lsub is not None:
                poller.register(lsub.sock, zmq.POLLIN)
            fill: Fill | None = replay.fetch if replay is not None else None
            live_reason = (
                "not in the publisher's replay buffer"
                if replay is not None
                else "no --replay-endpoint to ask"
            )
            reason = "stopped"
            last_progress = 0.0
            last_message = time.monotonic()
            silence_said = False
            try:
                if fill is not None:
                    proc.catch_up(fill)
                while True:
                    if max_batches is not None and proc.batches >= max_batches:
                        reason = "max-batches"
                        break
                    if stop is not None and stop.is_set():
                        reason = "signal"
                        break
                    wait_ms = 100
                    if deadline is not None:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            reason = "duration"
                            break
                        wait_ms = max(1, min(wait_ms, math.ceil(left * 1000)))
                    ready = dict(poller.poll(wait_ms))
                    if lsub is not None and placer is not None and lsub.sock in ready:
                        _take_lookups(lsub, placer, config)
                    if sub in ready:
                        last_message = time.monotonic()
                        for _ in range(1000):
                            try:
                                frames = sub.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            proc.feed(
                                frames,
                                origin="live",
                                recv_ts=time.time(),
                                fill=fill,
                                gap_reason=live_reason,
                            )
                            if max_batches is not None and proc.batches >= max_batches:
                                break
                    elif not silence_said and time.monotonic() - last_message >= silence_seconds:
                        silence_said = True
                        report(
                            f"nothing received on {endpoint} (topic {topic!r}) for "
                            f"{silence_seconds:g} s: is the engine publishing KV events there "
                            "(kv_events_config), and is the topic right? Still recording."
                        )
                    proc.tick(time.time())
                    rows.maybe_flush()
                    if dump_writer is not None:
                        # Every loop: a recorder killed with SIGKILL loses at
                        # most the last moment of its dump.
                        dump_writer.flush()
                    if progress is not None and time.monotonic() - last_progress >= 1.0:
                        last_progress = time.monotonic()
                        progress(
                            f"recording: {proc.batches} batches, {proc.rows} rows, "
                            f"{len(proc.gaps)} gaps"
                        )
            except KeyboardInterrupt:
                reason = "interrupted"
            if lsub is not None and placer is not None:
                _take_lookups(lsub, placer, config)
            proc.finish()
            if placer is not None:
                placer.finish()
            rows.finish()
            source: dict[str, Any] = {
                "tool": "replay record",
                "endpoint": endpoint,
                "endpoint_socket": "bound" if bind else "connected",
                "replay_endpoint": replay_endpoint,
                "topic": topic,
                "started_at": _iso(started),
                "stopped_at": _iso(time.time()),
                "stop_reason": reason,
                "dump": None if dump is None else Path(dump).name,
                **proc.source(),
            }
            if lsub is not None and placer is not None:
                source.update(_plugin_source(placer, lsub.engines, lsub.source()))
            writer.set_source(source)
        summary = proc.summary(
            output, rows=writer.rows_written, filled=proc.filled, stop_reason=reason, dump=dump
        )
        return summary if placer is None else replace(summary, lookups=placer.placed)
    finally:
        if replay is not None:
            replay.close()
        ctx.destroy(linger=0)


# ----------------------------------------------------------------- ingest


def ingest_dumps(
    paths: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    config: TraceConfig | None,
    *,
    media: Collection[str] | None = None,
    lookups: str | os.PathLike[str] | None = None,
    report: Report = _stderr,
) -> RecordSummary:
    """Rebuild a trace from dumps, read in the order given as one stream
    (a seq going back between files is a restart, unless it repeats a batch
    already taken). ``lookups``: a lookup log merged by time, or the vLLM
    plugin's file, whose lookups go in their exact places (and whose engine
    facts are the config when ``config`` is None). No output file on error."""
    if not paths:
        raise ReplayError("no dump files given")
    dumps = [Path(p) for p in paths]
    for p in dumps:
        _check_dump(p)
    plugin = None
    if lookups is not None and Path(lookups).is_file() and is_plugin_log(lookups):
        plugin = read_plugin_log(lookups, config)
        if config is not None and plugin.engines:
            _check_engine(plugin.engines[0], config, str(lookups), report)
        config = plugin.config
    if config is None:
        raise ReplayError(
            "no KV-cache config: pass --config kv-config.json or --block-size N "
            "(or --lookups with the vLLM plugin's file)"
        )
    merger = None
    if lookups is not None and plugin is None:
        merger = LookupMerger(read_lookup_log(lookups, config))
    with TraceWriter(output, config) as writer:
        rows = _BufferedRows(writer, merger=merger, flush_rows=65_536, flush_seconds=math.inf)
        placer = None if plugin is None else LookupPlacer(rows, complete=True)
        if placer is not None and plugin is not None:
            placer.add(plugin.lookups)
        proc = StreamProcessor(
            config, rows if placer is None else placer, media=media, report=report, placer=placer
        )
        for p in dumps:
            for rec in read_dump(p, report):
                proc.feed(
                    rec.frames,
                    origin=rec.origin,
                    recv_ts=rec.recv_ts,
                    where=f"{p} record {rec.index}",
                    gap_reason="missing from the dump",
                )
        proc.finish()
        if placer is not None:
            placer.finish()
        rows.finish()
        source: dict[str, Any] = {
            "tool": "replay ingest kv-events",
            "files": [p.name for p in dumps],
            **proc.source(),
        }
        if placer is not None and plugin is not None and lookups is not None:
            source.update(_plugin_source(placer, plugin.engines, {"file": Path(lookups).name}))
        if merger is not None and lookups is not None:
            source["lookups"] = {
                "file": Path(lookups).name,
                "count": merger.lookups_merged,
                "merged_by": "ts (a lookup goes before events with the same ts)",
            }
        writer.set_source(source)
    summary = proc.summary(output, rows=writer.rows_written, filled=0, stop_reason="end of input")
    return summary if placer is None else replace(summary, lookups=placer.placed)
