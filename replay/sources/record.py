"""Record a live vLLM KV-event stream into a trace, or rebuild one from dumps.

:func:`record` subscribes to a ``ZmqEventPublisher`` (SUB socket; three
frames per message: topic, 8-byte big-endian seq, msgpack payload) and
runs its messages through ``replay.sources.stream`` (seq order, gaps filled
from the replay endpoint of ``replay.sources.zmq_client``, restarts), with
``--dump`` writing each raw message to a ``replay.sources.dump`` file;
:func:`ingest_dumps` runs dumps through the same stream. Lookups come from
the vLLM plugin (``replay.sources.plugin_log``) or a lookup log
(``replay.sources.lookup_log``).

pyzmq and msgspec are the ``record`` extra: this module imports them when
a recording or an import starts, so that everything else runs without
them, and says in one line what to install when they are missing.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import signal
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.format.paths import FILE_EXTENSIONS
from replay.format.segments import DEFAULT_SEGMENT_SECONDS, SegmentedTraceWriter
from replay.format.writer import TraceWriter
from replay.sources.lookup_log import LookupMerger, read_lookup_log
from replay.sources.plugin_log import (
    LookupPlacer,
    PlacedLookup,
    check_engine,
    is_plugin_log,
    plugin_config,
    plugin_source,
    read_plugin_log,
)
from replay.sources.values import Report, Row, is_text, to_stderr

if TYPE_CHECKING:
    from replay.sources.stream import RecordSummary, StreamProcessor
    from replay.sources.zmq_client import LookupSubscriber

EXTRA_INSTALL = "pip install 'cache-trace-replay[record]'"


class EmptyRecording(ReplayError):
    """A recording that received no KV event: nothing is written."""


def _nothing_heard(endpoint: str, bound: bool, seconds: float, topic: str, why: str) -> str:
    """The one line of a recording that heard nothing: the endpoint, how the
    socket met it, and what to check."""
    if bound:
        how = "bound there: vLLM's publisher must connect to it"
        check = "that vLLM's kv_events_config endpoint names this host and port"
    else:
        how = "connected: vLLM's publisher must bind there"
        check = "that vLLM runs with kv_events_config (enable_kv_cache_events, publisher zmq) on that host and port"
    topic_text = f", and the topic {topic!r}" if topic else ""
    return (
        f"--endpoint {endpoint}: no KV event {why} ({how}); check {check}{topic_text}; "
        "no trace written"
    )


def require_extra(command: str, *modules: str) -> None:
    """Raise the one-line error that names what ``command`` lacks (pyzmq,
    msgspec: the ``record`` extra) and how to install it."""
    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append({"zmq": "pyzmq"}.get(module, module))
    if missing:
        raise ReplayError(
            f"{command} needs {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: {EXTRA_INSTALL}"
        )


class _BufferedRows:
    """Rows collected and written as row groups (by size or age)."""

    def __init__(
        self,
        writer: TraceWriter | SegmentedTraceWriter,
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


def _take_lookups(lsub: LookupSubscriber, placer: LookupPlacer, config: TraceConfig) -> None:
    for kind, item in lsub.receive(config):
        if kind == "engine":
            assert isinstance(item, dict)
            check_engine(item, config, f"--lookups {lsub.endpoint}", lsub.report)
        elif kind == "lookup":
            assert isinstance(item, PlacedLookup)
            placer.add([item])
        elif kind == "watermark":
            assert isinstance(item, tuple)
            placer.watermark(*item)


def _finish(proc: StreamProcessor, placer: LookupPlacer | None, rows: _BufferedRows) -> None:
    """The end of the stream: what the processor holds goes to the placer (or
    the rows), what the placer holds to the rows, and the rows to the trace."""
    proc.finish()
    if placer is not None:
        placer.finish()
    rows.finish()


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


def segmented(output: str | os.PathLike[str]) -> bool:
    """Whether ``replay record -o`` names a trace directory of segments: a
    name without a file's extension (``.parquet``, ``.json``, ...) that is
    not an existing file (a file, ``/dev/null``: the one-file form, whose
    checks then refuse what cannot be written)."""
    path = Path(output)
    if path.suffix.lower() in FILE_EXTENSIONS:
        return False
    return path.is_dir() or not os.path.lexists(path)


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
    report: Report = to_stderr,
    progress: Report | None = None,
    flush_rows: int = 10_000,
    flush_seconds: float = 5.0,
    silence_seconds: float = 10.0,
    reorder_seconds: float = 2.0,
    announce: Report | None = None,
    connect_timeout: float = 10.0,
    segment_seconds: float | None = DEFAULT_SEGMENT_SECONDS,
    segment_events: int | None = None,
) -> RecordSummary:
    """Record until ``max_batches`` batches were taken, ``duration`` seconds
    passed, ``stop`` is set, or Ctrl-C; then close a valid trace. Batches
    after a gap no replay endpoint answered for are held ``reorder_seconds``
    so a late one goes in its place. Nothing received for ``silence_seconds``
    is reported once (a wrong endpoint or topic looks exactly like an idle
    engine otherwise); no KV event at all within ``connect_timeout`` seconds
    is an :class:`EmptyRecording` error, and so is a recording that ends with
    none: no file is written then.

    ``bind`` None: bind when the endpoint is a bind form
    (``replay.sources.zmq_client.binds``),
    else connect. ``lookups``: the vLLM plugin's endpoint; every lookup goes
    in its exact place, and without ``config`` the plugin's engine facts
    are the config.

    ``output``: a directory (any name but ``*.parquet``) is written as closed
    segments (``replay.format.segments``), each closed every
    ``segment_seconds`` or ``segment_events`` events, so a killed recorder
    loses only the open one; a ``.parquet`` name is one file, closed at the
    end (a kill loses it; ``replay repair`` salvages its row groups)."""
    require_extra("replay record", "zmq", "msgspec")
    import zmq

    from replay.sources.dump import DumpWriter
    from replay.sources.stream import Fill, StreamProcessor
    from replay.sources.zmq_client import (
        DropWatch,
        LookupSubscriber,
        ReplayClient,
        binds,
        bounded_socket,
        zmq_reason,
    )

    for option, value in (("--endpoint", endpoint), ("--replay-endpoint", replay_endpoint), ("--topic", topic)):  # fmt: skip
        if value is not None and not is_text(value):
            raise ReplayError(f"{option} {value!r}: not valid text (undecodable bytes)")
    topic_bytes = topic.encode()
    started = time.time()
    deadline = None if duration is None else time.monotonic() + duration
    ctx: zmq.Context[Any] = zmq.Context()
    replay: ReplayClient | None = None
    try:
        if bind is None:
            bind = binds(endpoint)

        def make_sub() -> zmq.Socket[Any]:
            sock = bounded_socket(ctx, zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, topic_bytes)
            try:
                if bind:
                    sock.bind(endpoint)
                else:
                    sock.connect(endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                verb = "bind" if bind else "connect"
                raise ReplayError(
                    f"--endpoint {endpoint}: cannot {verb} ({zmq_reason(exc)})"
                ) from None
            return sock

        drops = DropWatch(make_sub, "--endpoint", endpoint, connect=not bind, report=report)
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
            replay = ReplayClient(ctx, replay_endpoint, topic_bytes, replay_timeout, report)
        with contextlib.ExitStack() as stack:
            dump_writer = stack.enter_context(DumpWriter(dump)) if dump is not None else None

            def source_now(reason: str | None = None) -> dict[str, Any]:
                """The trace's ``source``: the recording so far (a segment
                closed on the way), or whole (``reason``: why it stopped)."""
                out: dict[str, Any] = {
                    "tool": "replay record",
                    "endpoint": endpoint,
                    "endpoint_socket": "bound" if bind else "connected",
                    "replay_endpoint": replay_endpoint,
                    "topic": topic,
                    "started_at": datetime.fromtimestamp(started, tz=UTC).isoformat(),
                    "stopped_at": None if reason is None else datetime.now(tz=UTC).isoformat(),
                    "stop_reason": reason,
                    "dump": None if dump is None else Path(dump).name,
                    "dropped_connections": drops.dropped,
                    **proc.source(),
                }
                if lsub is not None and placer is not None:
                    out.update(plugin_source(placer, lsub.engines, lsub.source()))
                return out

            writer: TraceWriter | SegmentedTraceWriter
            if segmented(output):
                writer = stack.enter_context(
                    SegmentedTraceWriter(
                        output,
                        config,
                        segment_seconds=segment_seconds,
                        segment_events=segment_events,
                        source=source_now,
                    )
                )
            else:
                writer = stack.enter_context(TraceWriter(output, config, keep_on_interrupt=True))
            if isinstance(writer, SegmentedTraceWriter):
                # Rows held in memory would die with the open segment: they
                # go to it at least as often as segments close.
                if segment_seconds is not None:
                    flush_seconds = min(flush_seconds, segment_seconds)
                if segment_events is not None:
                    flush_rows = min(flush_rows, segment_events)
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
            poller.register(drops.sock, zmq.POLLIN)
            if lsub is not None:
                poller.register(lsub.sock, zmq.POLLIN)
            fill: Fill | None = replay.fetch if replay is not None else None
            live_reason = (
                "not in the publisher's replay buffer"
                if replay is not None
                else "no --replay-endpoint to ask"
            )

            def take(frames: list[bytes]) -> None:
                proc.feed(
                    frames, origin="live", recv_ts=time.time(), fill=fill, gap_reason=live_reason
                )

            reason = "stopped"
            last_progress = 0.0
            last_message = listening = time.monotonic()
            heard = False
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
                    sub = drops.sock
                    if lsub is not None and placer is not None and lsub.sock in ready:
                        _take_lookups(lsub, placer, config)
                    if sub not in ready and not heard:
                        waited = time.monotonic() - listening
                        if waited >= connect_timeout:
                            raise EmptyRecording(
                                _nothing_heard(
                                    endpoint, bind, waited, topic, f"within {connect_timeout:g} s"
                                )
                            )
                    if sub in ready:
                        heard = True
                        last_message = time.monotonic()
                        for _ in range(1000):
                            try:
                                frames = sub.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            take(frames)
                            if max_batches is not None and proc.batches >= max_batches:
                                break
                    elif (
                        heard
                        and not silence_said
                        and time.monotonic() - last_message >= silence_seconds
                    ):
                        silence_said = True
                        report(
                            f"nothing received on {endpoint} (topic {topic!r}) for "
                            f"{silence_seconds:g} s: is the engine publishing KV events there "
                            "(kv_events_config), and is the topic right? Still recording."
                        )
                    # A dropped connection (an oversized message): a new socket
                    # takes over; what the old one still held is read first.
                    for frames in drops.check(poller):
                        take(frames)
                    if lsub is not None and placer is not None and lsub.check_drops(poller):
                        _take_lookups(lsub, placer, config)
                    proc.tick(time.time())
                    rows.maybe_flush()
                    if isinstance(writer, SegmentedTraceWriter):
                        writer.tick()
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
            _finish(proc, placer, rows)
            if proc.converter.kv_events == 0:
                waited = time.monotonic() - listening
                why = f"in {waited:.1f} s (stopped: {reason})"
                if heard:
                    why = (
                        f"in {proc.batches} batches received in {waited:.1f} s (stopped: {reason})"
                    )
                raise EmptyRecording(_nothing_heard(endpoint, bind, waited, topic, why))
            writer.set_source(source_now(reason))
        summary = proc.summary(
            output, rows=writer.rows_written, filled=proc.filled, stop_reason=reason, dump=dump
        )
        summary = replace(summary, dropped=drops.dropped)
        if isinstance(writer, SegmentedTraceWriter):
            summary = replace(summary, segments=len(writer.segments))
        return summary if placer is None else replace(summary, lookups=placer.placed)
    finally:
        if replay is not None:
            replay.close()
        ctx.destroy(linger=0)


def ingest_dumps(
    paths: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    config: TraceConfig | None,
    *,
    media: Collection[str] | None = None,
    lookups: str | os.PathLike[str] | None = None,
    report: Report = to_stderr,
) -> RecordSummary:
    """Rebuild a trace from dumps, read in the order given as one stream
    (a seq going back between files is a restart, unless it repeats a batch
    already taken). ``lookups``: a lookup log merged by time, or the vLLM
    plugin's file, whose lookups go in their exact places (and whose engine
    facts are the config when ``config`` is None). No output file on error."""
    require_extra("replay ingest kv-events", "msgspec")
    from replay.sources.dump import check_dump, read_dump
    from replay.sources.stream import StreamProcessor

    if not paths:
        raise ReplayError("no dump files given")
    dumps = [Path(p) for p in paths]
    for p in dumps:
        check_dump(p)
    plugin = None
    if lookups is not None and Path(lookups).is_file() and is_plugin_log(lookups):
        plugin = read_plugin_log(lookups, config)
        if config is not None and plugin.engines:
            check_engine(plugin.engines[0], config, str(lookups), report)
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
        _finish(proc, placer, rows)
        source: dict[str, Any] = {
            "tool": "replay ingest kv-events",
            "files": [p.name for p in dumps],
            **proc.source(),
        }
        if placer is not None and plugin is not None and lookups is not None:
            source.update(plugin_source(placer, plugin.engines, {"file": Path(lookups).name}))
        if merger is not None and lookups is not None:
            source["lookups"] = {
                "file": Path(lookups).name,
                "count": merger.lookups_merged,
                "merged_by": "ts (a lookup goes before events with the same ts)",
            }
        writer.set_source(source)
    summary = proc.summary(output, rows=writer.rows_written, filled=0, stop_reason="end of input")
    return summary if placer is None else replace(summary, lookups=placer.placed)
