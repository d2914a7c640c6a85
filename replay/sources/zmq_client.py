"""The ZMQ clients of the recorder: the DEALER of vLLM's replay protocol and
the SUB of the vLLM plugin's lookup stream (the KV-event SUB socket itself is
``replay.sources.record``'s). Needs pyzmq, the ``record`` extra."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from replay.base.errors import ReplayError
from replay.base.limits import RECORD_BYTES
from replay.base.spec import TraceConfig
from replay.base.text import counted
from replay.sources.lookup_wire import decode_message
from replay.sources.plugin_log import PlacedLookup, parse_plugin_lookup
from replay.sources.stream import NO_ANSWER
from replay.sources.values import Report

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def zmq_reason(exc: zmq.ZMQError) -> str:
    # pyzmq appends "(addr=...)" to strerror; the address is already in the message.
    return zmq.strerror(exc.errno) if exc.errno is not None else str(exc)


def bounded_socket(ctx: zmq.Context[Any], kind: int) -> zmq.Socket[Any]:
    """A socket this package reads: no linger, no receive high-water mark
    (the recorder drains it every loop), and ``zmq.MAXMSGSIZE`` from
    ``--max-record-bytes``, so a message above the limit is refused by
    libzmq from its size header, before it is received, and costs no memory
    (libzmq drops the connection that sent it: see :class:`DropWatch`)."""
    sock: zmq.Socket[Any] = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, RECORD_BYTES.value())
    return sock


class DropWatch:
    """The connections a socket lost, counted and said, and made again.

    libzmq answers a message above ``zmq.MAXMSGSIZE`` by dropping the
    connection it came on, and the connecting side of a connection dropped
    that way never reconnects (libzmq 4.3 treats it as a protocol error):
    a recorder that connected would hear nothing more. A monitor socket
    reports each disconnection; a connecting socket is then replaced by a
    new one, made by ``make`` (connecting the old one again can trip an
    assertion inside libzmq 4.3.5 when the dropped message was multipart).
    The event does not say why (an oversized message, or the peer went
    away), so the line says both. ``sock`` is the socket to read."""

    def __init__(
        self,
        make: Callable[[], zmq.Socket[Any]],
        option: str,
        endpoint: str,
        *,
        connect: bool,
        report: Report,
        going_on: str = "recording",
    ) -> None:
        self.make, self.option, self.endpoint = make, option, endpoint
        #: What goes on after the drop (the line's end): ``recording``, ``watching``.
        self.going_on = going_on
        self.connect, self.report = connect, report
        self.dropped = 0
        self.sock = make()
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def check(self, poller: zmq.Poller | None = None) -> list[list[bytes]]:
        """Take the disconnections reported since the last call. When
        ``sock`` is replaced (and, in ``poller``, re-registered), the whole
        messages the old one still held are returned, to be read as if
        received; else none."""
        seen = 0
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            seen += 1
            self.dropped += 1
            again = "; connecting again" if self.connect else ""
            self.report(
                f"{self.option} {self.endpoint}: connection dropped ({self.dropped} so far): a "
                f"message above --max-record-bytes ({RECORD_BYTES.value():,} bytes), or the "
                f"peer closed it{again}; still {self.going_on}"
            )
        if not (seen and self.connect):
            return []
        old = self.sock
        held: list[list[bytes]] = []
        while True:
            try:
                held.append(old.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        if poller is not None:
            poller.unregister(old)
        self.close()
        self.sock = self.make()
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        if poller is not None:
            poller.register(self.sock, zmq.POLLIN)
        return held

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)


class ReplayClient:
    """The DEALER side of vLLM's replay protocol."""

    def __init__(
        self, ctx: zmq.Context[Any], endpoint: str, topic: bytes, timeout: float, report: Report
    ) -> None:
        self.ctx, self.endpoint, self.topic = ctx, endpoint, topic
        self.timeout, self.report = timeout, report
        self.requests = self.timeouts = self.bad_replies = 0
        self._sock: zmq.Socket[Any] | None = None

    def _socket(self) -> zmq.Socket[Any]:
        if self._sock is None:
            sock = bounded_socket(self.ctx, zmq.DEALER)
            try:
                sock.connect(self.endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                raise ReplayError(
                    f"--replay-endpoint {self.endpoint}: cannot connect ({zmq_reason(exc)})"
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


def binds(endpoint: str) -> bool:
    """vLLM's publisher rule, seen from the other end: a publisher endpoint
    with ``*`` or ``::`` binds, so the recorder connects to it; given such an
    endpoint itself (``tcp://*:5557``), the recorder binds and vLLM's
    publisher, configured with this host's address, connects."""
    return "*" in endpoint or "::" in endpoint


class LookupSubscriber:
    """The SUB side of the vLLM plugin's lookup stream (``replay.adapters.vllm.plugin``):
    engine facts, lookups and watermarks, with lost messages reported."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        endpoint: str,
        report: Report,
        *,
        hwm: int = 0,
        going_on: str = "recording",
    ) -> None:
        from replay.adapters.vllm.wire import TOPIC

        self.endpoint = endpoint
        self.report = report

        def make() -> zmq.Socket[Any]:
            sock = bounded_socket(ctx, zmq.SUB)
            # 0: unbounded (a recording keeps everything); ``replay watch`` bounds
            # it, so a watch that falls behind drops (counted) instead of growing.
            sock.setsockopt(zmq.RCVHWM, hwm)
            sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                raise ReplayError(
                    f"--lookups {endpoint}: cannot connect ({zmq_reason(exc)})"
                ) from None
            return sock

        self.drops = DropWatch(
            make, "--lookups", endpoint, connect=True, report=report, going_on=going_on
        )
        self._pending: list[list[bytes]] = []  # read from a socket since replaced
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
            if self._pending:
                frames = self._pending.pop(0)
            else:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return
            try:
                if len(frames) != 3 or len(frames[1]) != 8:
                    raise ValueError("expected 3 frames (topic, seq, payload)")
                seq = int.from_bytes(frames[1], "big")
                payload = decode_message(frames[2])
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
                    f"lookups: {counted(seq - self._next, 'message')} from the plugin lost "
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
            if self.check_drops() or self.sock.poll(100):
                for kind, item in self.receive(None):
                    if kind == "engine":
                        assert isinstance(item, dict)
                        return item
        return None

    def check_drops(self, poller: zmq.Poller | None = None) -> bool:
        """``DropWatch.check``; True when messages wait to be received."""
        self._pending.extend(self.drops.check(poller))
        return bool(self._pending)

    @property
    def sock(self) -> zmq.Socket[Any]:
        """The socket to read (a new one after a dropped connection)."""
        return self.drops.sock

    def source(self) -> dict[str, Any]:
        counts = {
            "messages": self.messages,
            "lost_messages": self.lost,
            "malformed": self.malformed,
            "dropped_connections": self.drops.dropped,
        }
        return {"endpoint": self.endpoint, **counts}
