"""The ZMQ clients of the recorder: the DEALER of vLLM's replay protocol and
the SUB of the vLLM plugin's lookup stream (the KV-event SUB socket itself is
``replay.sources.record``'s). Needs pyzmq, the ``record`` extra."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.sources.plugin_log import PlacedLookup, parse_plugin_lookup
from replay.sources.stream import NO_ANSWER
from replay.sources.values import Report

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def zmq_reason(exc: zmq.ZMQError) -> str:
    # pyzmq appends "(addr=...)" to strerror; the address is already in the message.
    return zmq.strerror(exc.errno) if exc.errno is not None else str(exc)


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
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
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

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, report: Report) -> None:
        from replay.adapters.vllm.wire import TOPIC

        self.endpoint = endpoint
        self.report = report
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        try:
            self.sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ReplayError(f"--lookups {endpoint}: cannot connect ({zmq_reason(exc)})") from None
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
        counts = {
            "messages": self.messages,
            "lost_messages": self.lost,
            "malformed": self.malformed,
        }
        return {"endpoint": self.endpoint, **counts}
