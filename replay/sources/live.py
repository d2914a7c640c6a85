"""One engine heard live, for ``replay watch`` (issue 33): its KV events and
the vLLM plugin's lookups, made into trace rows in their exact order as they
arrive, by the recorder's own pieces.

An engine is a KV-event endpoint (vLLM's ``ZmqEventPublisher``), an
optional replay endpoint (gap recovery) and the plugin's lookup stream
(``REPLAY_LOOKUPS=tcp://...``); a data-parallel rank is an engine of its own.
The stream is ``replay.sources.stream.StreamProcessor`` (seq order, gaps
filled from the replay endpoint, restarts turned into a clear row), the
lookups are placed by ``replay.sources.plugin_log.LookupPlacer`` exactly as
``replay record`` places them, so the rows a watch folds are the rows a
recording of the same engine writes, but for one thing: the batches vLLM
sends are read as columns (``replay.sources.kv_columns``) and a run of
removes of one group is one row (vLLM sends a ``BlockRemoved`` a block), so
the store at every lookup is the recording's in fewer rows.

Unlike a recording, nothing here may grow with time or block the engine:
both SUB sockets have a receive high-water mark (ZMQ then drops at the
publisher, which never blocks: vLLM's PUB socket drops for a slow
subscriber), and what was dropped shows as a gap in the KV events' seq or in
the plugin's message numbers, counted. KV messages that come before the
engine's facts (its config) wait in a bounded queue.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.sources.plugin_log import LookupPlacer, PlacedLookup, plugin_config
from replay.sources.stream import Fill, StreamProcessor
from replay.sources.values import Report, Row, is_text
from replay.sources.zmq_client import (
    DropWatch,
    LookupSubscriber,
    ReplayClient,
    binds,
    bounded_socket,
    zmq_reason,
)

#: KV messages taken per engine per turn of the loop, so that one busy
#: engine does not starve the others (or the status line).
TAKE_PER_TURN = 2000
#: When a watch stops: how long it goes on reading what is on its way in,
#: and how long the sockets must be quiet to end sooner.
DRAIN_SECONDS = 5.0
QUIET_MS = 200


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineEndpoints:
    """Where one engine is heard. ``name`` labels its metrics and files."""

    name: str
    kv: str
    lookups: str
    replay: str | None = None
    topic: str = ""

    @classmethod
    def parse(cls, text: str, index: int) -> EngineEndpoints:
        """``kv=tcp://h:5557,lookups=tcp://h:5560[,replay=tcp://h:5558][,name=N][,topic=T]``;
        ``ReplayError`` names what is wrong."""
        fields: dict[str, str] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in ("kv", "lookups", "replay", "name", "topic"):
                raise ReplayError(
                    f"--engine {text!r}: expected comma-separated kv=, lookups=, and optionally "
                    "replay=, name=, topic= (got {part!r})".replace("{part!r}", repr(part))
                )
            if key in fields:
                raise ReplayError(f"--engine {text!r}: {key}= given twice")
            if not is_text(value):
                raise ReplayError(f"--engine {text!r}: {key}= is not valid text")
            fields[key] = value.strip()
        for needed in ("kv", "lookups"):
            if not fields.get(needed):
                raise ReplayError(f"--engine {text!r}: {needed}= is required")
        return cls(
            name=fields.get("name") or f"engine{index}",
            kv=fields["kv"],
            lookups=fields["lookups"],
            replay=fields.get("replay") or None,
            topic=fields.get("topic", ""),
        )


#: Rows released together, with the time the message that released them
#: arrived (the start of the lag a verdict reports).
Released = tuple[list[Row], float]


class EngineFeed:
    """One engine's sockets and its rows, in order, as they become final.

    ``sockets`` go in the caller's poller; ``take(ready)`` reads what is
    ready and returns the rows released since (each list with its arrival
    time). The config, and so the rows, exist once the plugin's engine facts
    have arrived (``config``); ``engine`` is that record's ``engine`` part
    (its ``vllm_version``)."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        endpoints: EngineEndpoints,
        *,
        report: Report,
        hwm: int = 10_000,
        replay_timeout: float = 2.0,
        on_restart: Callable[[], None] | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.name = endpoints.name
        self.report = report
        self.hwm = hwm
        self.on_restart = on_restart
        self._topic = endpoints.topic.encode()
        where = f"--engine {self.name}: kv={endpoints.kv}"
        bind = binds(endpoints.kv)

        def make_sub() -> zmq.Socket[Any]:
            # A message above --max-record-bytes is refused from its size header.
            sock = bounded_socket(ctx, zmq.SUB)
            sock.setsockopt(zmq.RCVHWM, hwm)
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            try:
                if bind:
                    sock.bind(endpoints.kv)
                else:
                    sock.connect(endpoints.kv)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                raise ReplayError(f"{where}: cannot connect ({zmq_reason(exc)})") from None
            return sock

        # The recorder's rule for a dropped connection (an oversized message,
        # a publisher gone): said, counted, and made again.
        self.drops = DropWatch(
            make_sub, "kv", endpoints.kv, connect=not bind, report=report, going_on="watching"
        )
        self.lsub = LookupSubscriber(ctx, endpoints.lookups, report, hwm=hwm, going_on="watching")
        self.replay = (
            None
            if endpoints.replay is None
            else ReplayClient(ctx, endpoints.replay, self._topic, replay_timeout, report)
        )
        self.config: TraceConfig | None = None
        self.engine: dict[str, Any] = {}
        self.proc: StreamProcessor | None = None
        self.placer: LookupPlacer | None = None
        self._early: deque[tuple[list[bytes], float]] = deque()
        #: KV messages that came before the engine facts and did not fit.
        self.early_dropped = 0
        self._released: list[Released] = []
        self._arrival = 0.0
        self._restarts_seen = 0
        self.messages = 0

    @property
    def sub(self) -> zmq.Socket[Any]:
        """The KV-event socket (a new one after a dropped connection)."""
        return self.drops.sock

    @property
    def sockets(self) -> list[zmq.Socket[Any]]:
        return [self.sub, self.lsub.sock]

    @property
    def dropped_connections(self) -> int:
        """Connections of either socket dropped (and made again when they
        connect): an oversized message, or the peer went away."""
        return self.drops.dropped + self.lsub.drops.dropped

    def check_drops(self, poller: zmq.Poller) -> list[Released]:
        """``DropWatch.check`` for both sockets (a replaced one is
        re-registered in ``poller``); the rows of the messages the old
        sockets still held."""
        for frames in self.drops.check(poller):
            self._message(frames, time.time())
        if self.lsub.check_drops(poller):
            self._take_lookups()
        released, self._released = self._released, []
        return released

    # -- what the rows are made of

    def _sink(self, rows: list[Row]) -> None:
        self._released.append((rows, self._arrival))

    def _start(self, engine: dict[str, Any]) -> None:
        """The engine facts arrived: the stream can be made into rows."""
        self.config = plugin_config(engine, f"--engine {self.name}: lookups={self.lsub.endpoint}")
        self.engine = dict(engine.get("engine") or {})
        self.placer = LookupPlacer(self._sink)
        self.proc = StreamProcessor(
            self.config,
            self.placer,
            topic=self._topic,
            report=self.report,
            placer=self.placer,
            # A gap nobody answered is given up at once: a watch judges now.
            reorder_seconds=0.0,
            columnar=True,
        )
        if self.replay is not None:
            self.proc.catch_up(self.replay.fetch)
        while self._early:
            frames, ts = self._early.popleft()
            self._feed(frames, ts)

    @property
    def vllm_version(self) -> str | None:
        version = self.engine.get("vllm_version")
        return version if isinstance(version, str) else None

    # -- reading

    def _fill(self) -> Fill | None:
        return None if self.replay is None else self.replay.fetch

    def _feed(self, frames: list[bytes], recv_ts: float) -> None:
        assert self.proc is not None
        self._arrival = recv_ts
        reason = (
            "not in the publisher's replay buffer"
            if self.replay is not None
            else "no replay= endpoint to ask"
        )
        self.proc.feed(frames, origin="live", recv_ts=recv_ts, fill=self._fill(), gap_reason=reason)
        if len(self.proc.restarts) > self._restarts_seen:
            self._restarts_seen = len(self.proc.restarts)
            if self.on_restart is not None:
                self.on_restart()

    def _take_lookups(self) -> None:
        started = False
        for kind, item in self.lsub.receive(self.config):
            self._arrival = time.time()
            if kind == "engine":
                assert isinstance(item, dict)
                if self.config is None:
                    self._start(item)
                    started = True
                else:
                    self.engine = dict(item.get("engine") or {}) or self.engine
            elif self.placer is None:
                continue
            elif kind == "lookup":
                assert isinstance(item, PlacedLookup)
                self.placer.add([item])
            elif kind == "watermark":
                assert isinstance(item, tuple)
                self.placer.watermark(*item)
        if started:
            # The lookups held for a config are released by the next receive.
            self._take_lookups()

    def _message(self, frames: list[bytes], now: float) -> None:
        self.messages += 1
        if self.proc is None:
            if len(self._early) >= self.hwm:
                self._early.popleft()
                self.early_dropped += 1
            self._early.append((frames, now))
            return
        self._feed(frames, now)

    def take(self, ready: Collection[Any]) -> list[Released]:
        """Read what is ready on this engine's sockets; the rows released."""
        if self.lsub.sock in ready:
            self._take_lookups()
        if self.sub in ready:
            for _ in range(TAKE_PER_TURN):
                try:
                    frames = self.sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._message(frames, time.time())
        if self.placer is not None:
            # A recording lists them in its source; a watch, which runs for
            # days, keeps nothing per lookup.
            self.placer.not_admitted_seqs.clear()
        released, self._released = self._released, []
        return released

    def finish(self, *, drain: bool = True) -> list[Released]:
        """The end: what the sockets already hold is read (``drain``; see
        :func:`drain_feeds` for many engines at once), then what the stream and
        the placer still hold is released (lookups whose batch never came
        go last)."""
        if drain:
            for _, released in drain_feeds([self]):
                self._released.extend(released)
        if self.proc is not None and self.placer is not None:
            self._take_lookups()
            self.proc.finish()
            self.placer.finish()
        released, self._released = self._released, []
        return released

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
        self.drops.close()
        self.lsub.drops.close()

    # -- counts

    @property
    def gaps(self) -> list[dict[str, Any]]:
        return [] if self.proc is None else self.proc.gaps

    @property
    def restarts(self) -> int:
        return 0 if self.proc is None else len(self.proc.restarts)

    def source(self) -> dict[str, Any]:
        """The trace ``source`` entries of this engine's stream so far."""
        out: dict[str, Any] = {
            "tool": "replay watch",
            "engine_name": self.name,
            "endpoint": self.endpoints.kv,
            "replay_endpoint": self.endpoints.replay,
            "lookups_endpoint": self.endpoints.lookups,
            "cache": "gpu",
        }
        if self.vllm_version is not None:
            out["vllm_version"] = self.vllm_version
        if self.proc is not None:
            src = self.proc.source()
            out.update({k: src[k] for k in ("batches", "kv_events", "gaps", "restarts", "epochs")})
        out["lookup_messages_lost"] = self.lsub.lost
        return out


def drain_feeds(feeds: Sequence[EngineFeed]) -> Iterator[tuple[EngineFeed, list[Released]]]:
    """What is still on its way in to ``feeds`` (a watch that ran behind),
    read until all their sockets are quiet a moment, for at most a few
    seconds (engines that keep publishing do not hold the stop up); each
    feed's rows as they are released. One poller for all of them: a quiet
    moment each, in turn, was 200 s for 1,000 engines."""
    poller = zmq.Poller()
    by_socket: dict[Any, EngineFeed] = {}
    for feed in feeds:
        for sock in feed.sockets:
            poller.register(sock, zmq.POLLIN)
            by_socket[sock] = feed
    until = time.monotonic() + DRAIN_SECONDS
    while time.monotonic() < until:
        ready = dict(poller.poll(QUIET_MS))
        if not ready:
            return
        for feed in {by_socket[sock]: None for sock in ready}:
            yield feed, feed.take(ready)
