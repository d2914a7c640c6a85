"""``replay watch``: every lookup of a running fleet judged as it happens.

Each engine (``replay.sources.live.EngineFeed``: its KV events, the vLLM
plugin's lookups, its replay endpoint) gives rows in their exact order; its
store is folded and each lookup answered by the one replay
(``replay.engine.live.LiveFold``) under the policy of the vLLM release the
engine reports (``--policy`` overrides), then judged by the flags of
``replay check`` (``replay.analysis.flags``), the observed hit against the
policy's among them. The verdicts become counters (the status line, the
Prometheus exporter), one JSON line per flagged lookup (``--flags-out``),
and the rows go to a rolling trace (``-o DIR``: one trace directory per
engine, cut into segments) that ``replay run``/``explain``/``report`` read.

Nothing grows with the time it runs: the stores are bounded by the
engines' caches, the sockets by their high-water marks, and nothing is kept
per lookup once it is judged.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import IO, Any

import numpy as np
import polars as pl
import zmq

from replay.analysis.flags import Layout, add_flags, by_severity, severity
from replay.analysis.summary import prompt_tokens_expr
from replay.base.errors import ReplayError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.engine.answers import Variant
from replay.engine.live import LiveAnswers, LiveFold, live_results
from replay.format.hashwords import PackedHashes
from replay.rules.coordinator import DEFAULT_POLICY, choose_policies
from replay.sources.kv_columns import decode_columns, payload_digest
from replay.sources.kv_copies import CopyCounts
from replay.sources.kv_rows import EventConverter
from replay.sources.live import EngineEndpoints, EngineFeed, Released, drain_feeds
from replay.sources.lookup_wire import hex_hashes
from replay.sources.values import Report, Row
from replay.watch._counts import EngineCounts
from replay.watch._metrics import Metrics
from replay.watch._rolling import RollingTrace

#: How often the counters behind the metrics are brought up to date.
REFRESH_SECONDS = 0.5
#: How often every engine's connections are asked whether they dropped.
DROPS_SECONDS = 0.2
#: ZMQ sockets and open files one engine takes (its KV and lookup SUB
#: sockets, each watched by a monitor pair, a replay DEALER; each socket's
#: signal, the connections): about 6 files measured, 7 sockets.
SOCKETS_PER_ENGINE = 8
FILES_PER_ENGINE = 8
#: The status line's lag percentiles: over at most this many latest lags.
STATUS_LAGS = 100_000
#: The cyclic collector's thresholds while a watch runs (``_quiet_gc``).
GC_THRESHOLDS = (100_000, 50, 1000)


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchOptions:
    engines: tuple[EngineEndpoints, ...]
    #: None: each engine's own release (its plugin's ``vllm_version``).
    policy: str | None = None
    output: Path | None = None
    #: Close a segment of ``output`` after this long or this many rows.
    segment_seconds: float | None = 600.0
    segment_events: int | None = None
    flags_out: Path | None = None
    metrics: str | None = None
    duration: float | None = None
    status_every: float = 5.0
    #: Receive high-water mark of every SUB socket (messages).
    hwm: int = 10_000
    replay_timeout: float = 2.0

    def __post_init__(self) -> None:
        if not self.engines:
            raise ReplayError("no --engine to watch")
        names = [e.name for e in self.engines]
        for name in names:
            if names.count(name) > 1:
                raise ReplayError(f"--engine name={name}: two engines have that name")
            if not name or name in (".", "..") or "/" in name or name.startswith("."):
                raise ReplayError(
                    f"--engine name={name!r}: expected a plain name (it names the engine's "
                    "trace directory)"
                )


@dataclass(slots=True)
class EngineWatch:
    """One engine: its feed, its store once its config is known, its counts."""

    feed: EngineFeed
    counts: EngineCounts = field(default_factory=EngineCounts)
    fold: LiveFold | None = None
    trace: RollingTrace | None = None
    trace_dir: Path | None = None
    policy_note: str = ""

    @property
    def name(self) -> str:
        return self.feed.name


@dataclass(frozen=True, slots=True)
class Answered:
    """One engine's answers of one turn, waiting for their results frame
    and flags (one of each for every engine of one layout)."""

    ew: EngineWatch
    answers: LiveAnswers
    #: When the message that released each lookup arrived.
    arrivals: list[float]
    #: A lookup's seq -> its segment and its seq there.
    where: dict[int, tuple[Path, int]]


#: The column that tells the engines apart while their answers are flagged together.
_ENGINE = "__engine"


#: A judged batch's sums, in one select: prompt, policy hit and observed
#: hit tokens, observed mismatches and overruns, flagged lookups.
_OBSERVED, _HIT = pl.col("observed_hit_tokens"), pl.col("hit_tokens")
_VERDICT_SUMS = (
    prompt_tokens_expr().sum().alias("prompt"),
    _HIT.sum().alias("hit"),
    _OBSERVED.fill_null(0).sum().alias("observed"),
    (_OBSERVED != _HIT).fill_null(False).sum().alias("mismatch"),
    (_OBSERVED > _HIT).fill_null(False).sum().alias("over"),
    (pl.col("flags").list.len() > 0).sum().alias("flagged"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchSummary:
    #: The rolling trace's directory (``-o``), or None.
    trace: str | None
    seconds: float
    stop_reason: str
    engines: dict[str, dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        """``replay watch --json`` (docs/json.md)."""
        return {
            "version": 1,
            "command": "watch",
            "trace": self.trace,
            "seconds": round(self.seconds, 3),
            "stop_reason": self.stop_reason,
            "engines": self.engines,
        }


class Watch:
    """The service. ``run`` loops until ``stop`` is set or ``duration``
    passes, then closes every segment and returns the counts."""

    def __init__(
        self,
        options: WatchOptions,
        *,
        stop: threading.Event | None = None,
        report: Report,
        status: Report | None = None,
    ) -> None:
        self.options = options
        self.stop = stop or threading.Event()
        self.report = report
        self.status = status
        self.ctx: zmq.Context[Any] = zmq.Context()
        # ZMQ's default of 1,023 sockets a context held about 150 engines.
        sockets = SOCKETS_PER_ENGINE * len(options.engines) + 16
        self.ctx.set(zmq.MAX_SOCKETS, max(self.ctx.get(zmq.MAX_SOCKETS), sockets))
        self.engines: list[EngineWatch] = []
        self.metrics: Metrics | None = None
        self._flags_fh: IO[str] | None = None
        self._answered: list[Answered] = []
        self.started = time.time()

    # -- judging

    def _begin(self, ew: EngineWatch) -> None:
        """The engine's facts arrived: its store, policy and trace."""
        feed = ew.feed
        assert feed.config is not None
        given = (self.options.policy,) if self.options.policy else ()
        chosen = choose_policies(given, source=feed.config.source)
        (policy,) = chosen.policies
        ew.fold = LiveFold(feed.config, policy, cache="gpu", name=f"engine {ew.name}")
        ew.policy_note = "; ".join(chosen.notes)
        self.report(
            f"{ew.name}: vLLM {feed.vllm_version or '?'}, judged under policy {policy}"
            + (f" ({ew.policy_note})" if ew.policy_note else "")
        )
        if self.metrics is not None:
            self.metrics.engine_info(ew.name, feed.vllm_version, policy)
        out = self.options.output
        if out is not None:
            if not out.exists():
                out.mkdir()
            ew.trace_dir = out / ew.name
            ew.trace = RollingTrace(
                ew.trace_dir,
                feed.config,
                segment_seconds=self.options.segment_seconds,
                segment_events=self.options.segment_events,
            )
            ew.trace.set_source(feed.source())

    def _judge(self, ew: EngineWatch, released: list[Released]) -> None:
        if not released:
            return
        if ew.fold is None:
            self._begin(ew)
        assert ew.fold is not None
        rows: list[Row] = []
        arrivals: list[float] = []
        for batch, arrival in released:
            rows.extend(batch)
            arrivals.extend(arrival for row in batch if row.get("kind") == "lookup")
        # The rows go to the trace first: a flagged lookup's line names the
        # segment that holds it, and its seq there.
        where: dict[int, tuple[Path, int]] = {}
        if ew.trace is not None:
            ew.trace.set_source(ew.feed.source())
            placed = ew.trace.write(rows)
            where = {
                int(row["seq"]): at
                for row, at in zip(rows, placed, strict=True)
                if row.get("kind") == "lookup"
            }
        before = dict(ew.fold.events)
        answers = ew.fold.answer(rows)
        c = ew.counts
        for kind, n in ew.fold.events.items():
            c.events[kind] += n - before.get(kind, 0)
        c.store_keys = ew.fold.store_keys
        if answers.lookups:
            self._answered.append(Answered(ew, answers, arrivals, where))

    def _judge_answered(self) -> None:
        """Judge the answers of this turn: every engine's of one group
        layout in one results frame (one per release's policy among them)
        and one add_flags call (their fixed costs are per call, not per
        lookup: a fleet of one model pays them once a turn, not once an
        engine), then count each engine's verdicts."""
        answered, self._answered = self._answered, []
        by_layout: dict[Layout, list[Answered]] = {}
        for a in answered:
            assert a.ew.feed.config is not None
            by_layout.setdefault(Layout.of(a.ew.feed.config), []).append(a)
        for group in by_layout.values():
            config = group[0].ew.feed.config
            assert config is not None
            by_variant: dict[tuple[Variant, int], list[Answered]] = {}
            for a in group:
                by_variant.setdefault((a.answers.variant, a.answers.alignment), []).append(a)
            order = [a for same in by_variant.values() for a in same]
            frames = [live_results([a.answers for a in same]) for same in by_variant.values()]
            results = frames[0] if len(frames) == 1 else pl.concat(frames, how="vertical_relaxed")
            if len(order) > 1:
                engine = np.repeat(
                    np.arange(len(order), dtype=np.int32), [a.answers.lookups for a in order]
                )
                results = results.with_columns(pl.Series(_ENGINE, engine))
            self._verdicts(order, add_flags(results, config))

    def _verdicts(self, order: list[Answered], judged: pl.DataFrame) -> None:
        """Count the verdicts of ``judged``: the lookups of the engines of
        ``order``, each one's in turn (the ``_ENGINE`` column numbers them
        when there are several), their sums in one polars call, not one an
        engine (a fleet's turn brings a small batch from each)."""
        now = time.time()
        sizes = [a.answers.lookups for a in order]
        if len(order) == 1:
            sums = [judged.select(_VERDICT_SUMS).row(0)]
        else:
            per = judged.group_by(_ENGINE).agg(_VERDICT_SUMS).sort(_ENGINE)
            sums = [row[1:] for row in per.iter_rows()]
        # From when the engine made the lookup (its ``ts``) or, when that
        # clock is ahead of ours, from when its message arrived here: so the
        # time a backlog waits in the sockets counts.
        stamped = judged["ts"].dt.epoch("us").to_numpy().astype(np.float64) / 1e6
        at = 0
        for answered, n, (prompt, hit, observed, mismatch, over, _flagged) in zip(
            order, sizes, sums, strict=True
        ):
            ew = answered.ew
            arrivals = np.asarray(answered.arrivals, dtype=np.float64)
            lags = np.maximum(0.0, now - np.fmin(arrivals, stamped[at : at + n]))
            at += n
            c = ew.counts
            c.lags.extend(lags)
            if self.metrics is not None:
                self.metrics.observe_lags(ew.name, lags.tolist())
            c.lookups += n
            c.prompt_tokens += int(prompt or 0)
            c.hit_tokens += int(hit or 0)
            c.observed_hit_tokens += int(observed or 0)
            c.observed_mismatch += int(mismatch or 0)
            c.observed_over += int(over or 0)
        if not any(row[-1] for row in sums):
            return
        flagged_rows = judged.filter(pl.col("flags").list.len() > 0)
        for row in flagged_rows.iter_rows(named=True):
            answered = order[row.get(_ENGINE) or 0]
            ew, c = answered.ew, answered.ew.counts
            names = by_severity(row["flags"])
            for name in names:
                c.flags[(name, severity(name))] += 1
            worst = severity(names[0])
            c.flagged_lookups += 1
            c.flagged_by_severity[worst] += 1
            if self._flags_fh is not None:
                self._flag_line(ew, row, names, answered.where.get(int(row["seq"])))

    def _flag_line(
        self,
        ew: EngineWatch,
        row: dict[str, Any],
        names: list[str],
        at: tuple[Path, int] | None,
    ) -> None:
        assert self._flags_fh is not None and ew.fold is not None
        record: dict[str, Any] = {
            "engine": ew.name,
            "request_id": row["request_id"],
            "seq": row["seq"],
            "ts": row["ts"].isoformat() if row["ts"] is not None else None,
            # When the verdict was given (the lookup's ``ts`` is the engine's).
            "judged_at": datetime.now(tz=UTC).isoformat(),
            "policy": ew.fold.policy,
            "vllm_version": ew.feed.vllm_version,
            "flags": names,
            "severities": [severity(n) for n in names],
            "hit_tokens": row["hit_tokens"],
            "observed_hit_tokens": row["observed_hit_tokens"],
            "max_length": row["max_length"],
            "num_tokens": row["num_tokens"],
            "flag_details": [
                {k: v for k, v in d.items() if v is not None} for d in row["flag_details"]
            ],
            # The segment that replays this lookup alone (readable once it
            # closes), and the lookup's seq in it and in the engine's directory.
            "segment": None if at is None else str(at[0]),
            "trace_seq": None if at is None else at[1],
            "explain": None
            if at is None
            else (
                f"replay explain {_shell(str(at[0]))} --request {_shell(row['request_id'])} "
                f"--seq {at[1]} --policy {ew.fold.policy}"
            ),
        }
        self._flags_fh.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._flags_fh.flush()

    # -- the loop

    def _status_line(self, last: dict[str, int], seconds: float) -> str:
        total = sum(ew.counts.lookups for ew in self.engines)
        rate = (total - last.get("lookups", 0)) / seconds if seconds > 0 else 0.0
        last["lookups"] = total
        flagged = sum(ew.counts.flagged_lookups for ew in self.engines)
        mism = sum(ew.counts.observed_mismatch for ew in self.engines)
        gaps = sum(ew.counts.gaps for ew in self.engines)
        restarts = sum(ew.counts.restarts for ew in self.engines)
        drops = sum(ew.counts.dropped_connections for ew in self.engines)
        # Each engine's latest lags (read from the end: a window holds
        # LAG_WINDOW), at most STATUS_LAGS of them in all: a copy of every
        # window was most of a second a status line at 1,000 engines.
        recent = max(1, min(1000, STATUS_LAGS // max(1, len(self.engines))))
        lags = np.concatenate(
            [ew.counts.lags.latest(recent) for ew in self.engines] or [np.empty(0)]
        )
        lag = "lag -"
        if lags.shape[0]:
            n = lags.shape[0]
            at50, at99 = n // 2, min(n - 1, math.ceil(0.99 * n) - 1)
            p50, p99 = np.partition(lags, (at50, at99))[[at50, at99]].tolist()
            lag = f"lag p50 {p50 * 1000:.0f} ms p99 {p99 * 1000:.0f} ms"
        heard = sum(ew.fold is not None for ew in self.engines)
        return (
            f"watch: {heard}/{len(self.engines)} engines, {total:,} lookups ({rate:,.0f}/s), "
            f"{flagged:,} flagged, {mism:,} observed mismatches, {lag}, {gaps} gaps, "
            f"{restarts} restarts" + (f", {drops} dropped connections" if drops else "")
        )

    def _refresh(self, ew: EngineWatch) -> None:
        feed, c = ew.feed, ew.counts
        c.gaps = len(feed.gaps)
        c.missing_batches = sum(int(g["count"]) for g in feed.gaps)
        c.restarts = feed.restarts
        c.dropped = feed.lsub.lost + feed.early_dropped + c.missing_batches
        c.dropped_connections = feed.dropped_connections
        if self.metrics is not None:
            self.metrics.update(ew.name, c)

    def _say(self, name: str, message: str) -> None:
        self.report(f"{name}: {message}")

    def _restarted(self, name: str) -> None:
        self.report(f"{name}: engine restart (its event seq started over): its store is reset")

    def run(self) -> WatchSummary:
        opts = self.options
        reason = "stopped"
        stack = contextlib.ExitStack()
        try:
            # Before the first engine speaks (and before the metrics say the
            # watch is up): the compiled fold loaded, polars warm, so the
            # first verdicts are not late by a start-up.
            _warm_up()
            stack.enter_context(_quiet_gc())
            if opts.metrics is not None:
                self.metrics = Metrics(opts.metrics)
                self.report(f"metrics on http://{opts.metrics}/metrics")
            if opts.flags_out is not None:
                self._flags_fh = open(opts.flags_out, "x", encoding="utf-8")  # noqa: SIM115
            for spec in opts.engines:
                feed = EngineFeed(
                    self.ctx,
                    spec,
                    report=partial(self._say, spec.name),
                    hwm=opts.hwm,
                    replay_timeout=opts.replay_timeout,
                    on_restart=partial(self._restarted, spec.name),
                )
                self.engines.append(EngineWatch(feed))
            poller = zmq.Poller()
            by_socket: dict[Any, list[EngineWatch]] = {}
            for ew in self.engines:
                for sock in ew.feed.sockets:
                    poller.register(sock, zmq.POLLIN)
                    by_socket.setdefault(sock, []).append(ew)
            deadline = None if opts.duration is None else time.monotonic() + opts.duration
            last_status = last_refresh = last_drops = time.monotonic()
            status_state: dict[str, int] = {}
            try:
                while True:
                    if self.stop.is_set():
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
                    if ready:
                        for ew in self.engines:
                            if any(s in ready for s in ew.feed.sockets):
                                self._judge(ew, ew.feed.take(ready))
                    # A dropped connection (an oversized message, a publisher
                    # gone): said, counted, and a new socket takes over. Asked
                    # of every engine's monitors a few times a second, not
                    # each turn (at 1,000 engines, most of an idle watch's CPU).
                    if time.monotonic() - last_drops >= DROPS_SECONDS:
                        for ew in self.engines:
                            self._judge(ew, ew.feed.check_drops(poller))
                        last_drops = time.monotonic()
                    self._judge_answered()
                    for ew in self.engines:
                        if ew.trace is not None:
                            ew.trace.tick()
                    now = time.monotonic()
                    if now - last_refresh >= REFRESH_SECONDS:
                        for ew in self.engines:
                            self._refresh(ew)
                        last_refresh = now
                    if now - last_status >= opts.status_every:
                        if self.status is not None:
                            self.status(self._status_line(status_state, now - last_status))
                        last_status = now
            except KeyboardInterrupt:
                reason = "signal"
            by_feed = {id(ew.feed): ew for ew in self.engines}
            for feed, released in drain_feeds([ew.feed for ew in self.engines]):
                self._judge(by_feed[id(feed)], released)
                self._judge_answered()
            for ew in self.engines:
                self._judge(ew, ew.feed.finish(drain=False))
                self._judge_answered()
                self._refresh(ew)
                if ew.trace is not None:
                    ew.trace.set_source({**ew.feed.source(), "stop_reason": reason})
                    ew.trace.close()
                    ew.trace = None
            return WatchSummary(
                trace=None if opts.output is None else str(opts.output),
                seconds=time.time() - self.started,
                stop_reason=reason,
                engines={ew.name: self._engine_summary(ew) for ew in self.engines},
            )
        finally:
            for ew in self.engines:
                if ew.trace is not None:
                    # An error: the segments closed so far stay (each a valid
                    # trace); the open one's temporary file goes.
                    ew.trace.abort()
                ew.feed.close()
            if self._flags_fh is not None:
                self._flags_fh.close()
            if self.metrics is not None:
                self.metrics.close()
            self.ctx.destroy(linger=0)
            stack.close()

    def _engine_summary(self, ew: EngineWatch) -> dict[str, Any]:
        return {
            "vllm_version": ew.feed.vllm_version,
            "policy": None if ew.fold is None else ew.fold.policy,
            "trace": None if ew.trace_dir is None else str(ew.trace_dir),
            **ew.counts.to_json(),
        }


def _warm_up() -> None:
    """Stores (enough to grow the table), a remove and lookups, answered and
    judged: what the first real ones would otherwise pay (loading the
    compiled fold and answers, polars' first plans) while verdicts wait."""
    config = TraceConfig(
        groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),),
        hash_block_size=16,
        scheduler_block_size=16,
    )
    ts = datetime.now(tz=UTC)
    # As a live source gives them (``PackedHashes``: the fold's words are then
    # read-only, a type of their own to the compiled fold).
    data = b"".join(i.to_bytes(8, "big") for i in range(1, 2049))
    fold = LiveFold(config, DEFAULT_POLICY, cache="gpu")
    rows: list[Row] = []
    for i in range(0, 2048, 64):
        keys = PackedHashes(data[8 * i : 8 * (i + 64)], 8)
        rows.append({"kind": "store", "group_id": 0, "block_hashes": keys})
        rows.append({"kind": "lookup", "block_hashes": keys, "request_id": "warm-up",
                     "max_length": 1024, "num_tokens": 1025, "observed_hit_tokens": 1024})  # fmt: skip
    rows.append({"kind": "remove", "group_id": 0, "block_hashes": PackedHashes(data[:512], 8)})
    rows.append({"kind": "lookup", "block_hashes": PackedHashes(data[:16], 8),
                 "request_id": "warm-up", "max_length": 32, "num_tokens": 33,
                 "observed_hit_tokens": 32})  # fmt: skip
    frame = fold.feed([{"seq": i, "ts": ts, **row} for i, row in enumerate(rows)])
    add_flags(frame, config)
    # The compiled reading of vLLM's batches, their digest, checks and runs,
    # and the copy counts, grown past their first table (loaded from
    # numba's cache, or compiled, here rather than at the first batch or
    # the first growth).
    import msgspec

    events = [
        {"type": t, "block_hashes": [7], "group_idx": 0} for t in ("BlockStored", "BlockRemoved")
    ]
    body = msgspec.msgpack.encode([0, events, None])
    cols = decode_columns(body)
    assert cols is not None, "the warm-up batch is one the columns read"
    payload_digest(body)
    EventConverter(config).convert_columns(cols)
    copies = CopyCounts()
    many = np.arange(1, CopyCounts.FIRST_SLOTS + 1, dtype=np.uint64)  # past half: it grows
    copies.add_ints(many)
    copies.remove_ints(many)
    # The compiled reading of the plugin's hex hashes.
    # (called, not asserted: ``python -O`` drops an assert and its call)
    hex_hashes(b'["0001020304050607", "08090a0b0c0d0e0f"]')


@contextlib.contextmanager
def _quiet_gc() -> Iterator[None]:
    """The cyclic garbage collector, seldom: a watch makes a row, a dict and
    arrays for every event and lookup of every engine, nearly all freed by
    their counts at once (cycles are rare), so the default collection every
    700 new objects, and every full one walking the modules, numba's and
    polars' objects loaded at start (frozen here), was a tenth of a fleet
    watch's CPU. Restored when the watch ends (it may run in a caller's
    process)."""
    before = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def _open_files(engines: int) -> None:
    """Raise this process's limit of open files (up to its hard limit) to
    what ``engines`` engines take (each about FILES_PER_ENGINE: its sockets'
    signals and connections), or say in one line that it cannot."""
    import resource

    need = FILES_PER_ENGINE * engines + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ReplayError(
            f"{engines:,} --engine need about {need:,} open files, above this process's "
            f"hard limit of {hard:,} (`ulimit -Hn`): raise it, or split the engines over "
            "several watches"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _shell(text: str) -> str:
    """``text`` as one shell word."""
    import shlex

    return shlex.quote(text)


def watch(
    options: WatchOptions,
    *,
    stop: threading.Event | None = None,
    report: Report,
    status: Report | None = None,
) -> WatchSummary:
    """Watch until ``stop`` (or ``options.duration``); the counts."""
    if options.flags_out is not None and os.path.lexists(options.flags_out):
        raise ReplayError(f"--flags-out {options.flags_out}: already exists (not overwritten)")
    _open_files(len(options.engines))
    return Watch(options, stop=stop, report=report, status=status).run()
