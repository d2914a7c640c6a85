"""The Prometheus face of a watch (``--metrics HOST:PORT``): its own
registry, served on ``/metrics`` by ``prometheus_client`` (the ``watch``
extra), every series labelled by engine. Names and labels are documented in
the README's "Watching a fleet"."""

from __future__ import annotations

import importlib
from typing import Any

from replay.base.errors import ReplayError
from replay.watch._counts import EngineCounts

EXTRA_INSTALL = "pip install 'cache-trace-replay[watch]'"

#: Event arrival -> verdict, in seconds: a watch that keeps up is in the
#: first buckets; one that falls behind climbs them.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``:PORT``: every interface); ``ReplayError`` when not."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ReplayError(f"--metrics {text!r}: expected HOST:PORT (a port 0-65535)")
    return (host.strip("[]") or "0.0.0.0"), int(port)


class Metrics:
    """The exporter: counters advanced by the difference since the last
    ``update``, so the plain counts stay the one source."""

    def __init__(self, address: str) -> None:
        try:
            prom: Any = importlib.import_module("prometheus_client")
        except ImportError:
            raise ReplayError(
                f"--metrics needs prometheus_client, which is not installed: {EXTRA_INSTALL}"
            ) from None
        host, port = parse_address(address)
        self.registry = prom.CollectorRegistry()
        r = self.registry
        e = ["engine"]
        self.lookups = prom.Counter("replay_watch_lookups", "Lookups judged", e, registry=r)
        self.prompt_tokens = prom.Counter(
            "replay_watch_prompt_tokens", "Tokens of the lookups judged", e, registry=r
        )
        self.hit_tokens = prom.Counter(
            "replay_watch_hit_tokens", "Hit tokens the policy gave the lookups", e, registry=r
        )
        self.flags = prom.Counter(
            "replay_watch_flags", "Flags raised", [*e, "flag", "severity"], registry=r
        )
        self.flagged = prom.Counter(
            "replay_watch_flagged_lookups",
            "Lookups with a flag, by their worst flag's severity",
            [*e, "severity"],
            registry=r,
        )
        self.mismatch = prom.Counter(
            "replay_watch_observed_mismatch",
            "Lookups whose served hit differs from the policy's",
            e,
            registry=r,
        )
        self.over = prom.Counter(
            "replay_watch_observed_over",
            "Lookups whose served hit is past the policy's (of the mismatches)",
            e,
            registry=r,
        )
        self.events = prom.Counter(
            "replay_watch_events", "Trace rows folded", [*e, "kind"], registry=r
        )
        self.gaps = prom.Counter(
            "replay_watch_event_gaps", "KV-event gaps no replay endpoint filled", e, registry=r
        )
        self.restarts = prom.Counter(
            "replay_watch_engine_restarts", "Engine restarts (the store reset)", e, registry=r
        )
        self.dropped = prom.Counter(
            "replay_watch_dropped_messages", "Messages lost before use", e, registry=r
        )
        self.dropped_connections = prom.Counter(
            "replay_watch_dropped_connections",
            "Connections dropped (a message above --max-record-bytes, or the publisher went "
            "away) and made again",
            e,
            registry=r,
        )
        self.lag = prom.Histogram(
            "replay_watch_lag_seconds",
            "From the arrival of the message that completes a lookup to its verdict",
            e,
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.store_keys = prom.Gauge(
            "replay_watch_store_keys", "Distinct hashes the engine's store holds", e, registry=r
        )
        self.info = prom.Gauge(
            "replay_watch_info",
            "The engine's vLLM release and the policy that judges it (value 1)",
            [*e, "vllm_version", "policy"],
            registry=r,
        )
        self._last: dict[str, dict[str, Any]] = {}
        try:
            self.server, self.thread = prom.start_http_server(port, addr=host, registry=r)
        except OSError as exc:
            raise ReplayError(
                f"--metrics {address}: cannot serve there ({exc.strerror or exc})"
            ) from None
        self.port = int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def engine_info(self, engine: str, vllm_version: str | None, policy: str) -> None:
        self.info.labels(engine, vllm_version or "unknown", policy).set(1)

    def observe_lags(self, engine: str, lags: list[float]) -> None:
        h = self.lag.labels(engine)
        for lag in lags:
            h.observe(lag)

    def update(self, engine: str, c: EngineCounts) -> None:
        last = self._last.setdefault(engine, {})

        def advance(metric: Any, key: str, value: int, *labels: str) -> None:
            delta = value - last.get(key, 0)
            if delta > 0:
                metric.labels(engine, *labels).inc(delta)
            elif key not in last:
                metric.labels(engine, *labels)  # the series exists from the start, at 0
            last[key] = value

        advance(self.lookups, "lookups", c.lookups)
        advance(self.prompt_tokens, "prompt_tokens", c.prompt_tokens)
        advance(self.hit_tokens, "hit_tokens", c.hit_tokens)
        advance(self.mismatch, "mismatch", c.observed_mismatch)
        advance(self.over, "over", c.observed_over)
        advance(self.gaps, "gaps", c.gaps)
        advance(self.restarts, "restarts", c.restarts)
        advance(self.dropped, "dropped", c.dropped)
        advance(self.dropped_connections, "dropped_connections", c.dropped_connections)
        for (flag, sev), n in c.flags.items():
            advance(self.flags, f"flag:{flag}", n, flag, sev)
        for sev, n in c.flagged_by_severity.items():
            advance(self.flagged, f"flagged:{sev}", n, sev)
        for kind, n in c.events.items():
            advance(self.events, f"events:{kind}", n, kind)
        self.store_keys.labels(engine).set(c.store_keys)
