"""The vLLM plugin's lookup log (``replay.adapters.vllm.plugin``), and the placer that
puts each of its lookups at its exact place among the KV events."""

from __future__ import annotations

import heapq
import json
import os
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replay.base.errors import ConfigError, ReplayError
from replay.base.limits import bounded_lines
from replay.base.spec import TraceConfig
from replay.sources.lookup_log import LookupRecord, parse_lookup
from replay.sources.values import Report, Row, msgpack_type

if TYPE_CHECKING:  # kv_rows needs msgspec (the record extra); the plugin's log does not
    from replay.sources.kv_rows import Span

PLUGIN_RECORD_TYPES = ("engine", "lookup")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacedLookup:
    """A lookup the vLLM plugin (``replay.adapters.vllm.plugin``) recorded, with its
    exact place: before the ``position``-th event of KV-event batch ``batch``
    of the engine ``instance``."""

    instance: str
    n: int
    batch: int
    position: int
    admitted: bool | None
    record: LookupRecord

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.batch, self.position, self.n)


def _plugin_int(obj: Mapping[str, Any], name: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"field {name!r}: expected an integer >= 0, got {value!r}")
    return value


def parse_plugin_lookup(obj: Mapping[str, Any], line: int, config: TraceConfig) -> PlacedLookup:
    """One ``lookup`` record of the plugin; ``ValueError`` says what is wrong."""
    instance = obj.get("instance")
    if not isinstance(instance, str):
        raise ValueError(f"field 'instance': expected a string, got {msgpack_type(instance)}")
    admitted = obj.get("admitted")
    if admitted is not None and not isinstance(admitted, bool):
        raise ValueError(f"field 'admitted': expected a boolean, got {msgpack_type(admitted)}")
    return PlacedLookup(
        instance=instance,
        n=_plugin_int(obj, "n"),
        batch=_plugin_int(obj, "batch"),
        position=_plugin_int(obj, "position"),
        admitted=admitted,
        record=parse_lookup(obj, line, config),
    )


def plugin_config(engine: Mapping[str, Any], where: str) -> TraceConfig:
    """The trace config of an ``engine`` record (the engine's own view)."""
    try:
        return TraceConfig.from_json(engine.get("config"))
    except ConfigError as exc:
        raise ReplayError(f"{where}: engine record: {exc}") from None


def is_plugin_log(path: str | os.PathLike[str]) -> bool:
    """Whether a lookup file was written by the plugin (its first object has a
    ``type`` of ``engine`` or ``lookup``) rather than being a lookup log.
    Lines are read as the readers read them (bounded)."""
    with open(path, "rb") as fh:
        for _line, raw in bounded_lines(fh, path):
            if raw.strip():
                try:
                    obj = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                    return False
                return isinstance(obj, dict) and obj.get("type") in PLUGIN_RECORD_TYPES
    return False


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginLog:
    engines: list[dict[str, Any]]
    lookups: list[PlacedLookup]
    config: TraceConfig


def read_plugin_log(path: str | os.PathLike[str], config: TraceConfig | None) -> PluginLog:
    """The plugin's file (``REPLAY_LOOKUPS=PATH``). Without ``config`` the
    first engine record's config is used. A line cut short by a killed
    engine at the very end is ignored; anywhere else it is an error."""
    p = Path(path)
    if not p.exists():
        raise ReplayError(f"{p}: no such file (expected the vLLM plugin's lookup file)")
    objs: list[tuple[int, dict[str, Any]]] = []
    with open(p, "rb") as fh:
        # Line by line, each bounded (replay.base.limits): a file of one
        # endless line is refused once the limit is read, never held whole.
        for line, raw in bounded_lines(fh, p):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                if not raw.endswith(b"\n"):
                    break  # the last line, cut short (no newline yet)
                raise ReplayError(f"{p}: line {line}: not valid JSON ({exc})") from None
            except RecursionError:
                raise ReplayError(f"{p}: line {line}: JSON nested too deeply") from None
            if not isinstance(obj, dict) or obj.get("type") not in PLUGIN_RECORD_TYPES:
                raise ReplayError(
                    f"{p}: line {line}: expected a plugin record (a JSON object with "
                    f"'type' engine or lookup)"
                )
            objs.append((line, obj))
    engines = [(line, obj) for line, obj in objs if obj["type"] == "engine"]
    if config is None:
        if not engines:
            raise ReplayError(
                f"{p}: no engine record (the plugin writes one when the scheduler starts); "
                "pass --config"
            )
        config = plugin_config(engines[0][1], f"{p}: line {engines[0][0]}")
    lookups = []
    for line, obj in objs:
        if obj["type"] != "lookup":
            continue
        try:
            lookups.append(parse_plugin_lookup(obj, line, config))
        except ValueError as exc:
            raise ReplayError(f"{p}: line {line}: {exc}") from None
    return PluginLog(engines=[obj for _, obj in engines], lookups=lookups, config=config)


_NOT_ADMITTED = "__not_admitted"


class LookupPlacer:
    """Puts each plugin lookup at its exact place among the KV events.

    Batches (their rows, one list per event) come in stream order; a batch is
    held until the lookups for it are known complete (``watermark``: the
    plugin has published at least that many batches since, so every lookup
    that precedes them was sent), then written with each lookup before the
    event at its position. Lookups of a batch that never came (a step with no
    events, or a gap) go before the next batch. Engine instances pair with
    the stream's epochs in order (a restarted engine is a new instance and a
    new epoch). ``seq`` is renumbered from 0.
    """

    def __init__(self, sink: Callable[[list[Row]], None], *, complete: bool = False) -> None:
        self.sink = sink
        self.complete = complete
        self.next_seq = 0
        self.instances: list[str] = []
        self.watermarks: dict[str, int] = {}
        self._lookups: dict[str, list[tuple[tuple[int, int, int], PlacedLookup]]] = {}
        self._pending: deque[tuple[int | None, int, list[list[Row]] | list[Span]]] = deque()
        #: The epochs of the pending batches, counted (a later one pending
        #: is asked per batch: no scan of a long backlog).
        self._pending_epochs: Counter[int] = Counter()
        self.placed = 0
        self.admitted = 0
        self.not_admitted = 0
        self.late = 0
        # The trace has no column for it: the lookups the scheduler did not
        # admit in their step (allocation failed) are listed in the source.
        self.not_admitted_seqs: list[int] = []
        self._released: dict[int, int] = {}

    def _instance(self, name: str) -> int:
        if name not in self._lookups:
            self.instances.append(name)
            self._lookups[name] = []
        return self.instances.index(name)

    def add(self, lookups: Iterable[PlacedLookup]) -> None:
        for lk in lookups:
            epoch = self._instance(lk.instance)
            if lk.batch < self._released.get(epoch, 0):
                # Its batch is already written: as close as it can go now.
                self.late += 1
                self._write([self._lookup_row(lk)])
                continue
            # (batch, position, n) is unique per instance: the lookup itself
            # is never compared.
            heapq.heappush(self._lookups[lk.instance], (lk.order, lk))

    def watermark(self, instance: str, batches: int) -> None:
        self._instance(instance)
        self.watermarks[instance] = max(self.watermarks.get(instance, 0), batches)
        self.drain()

    def batch(self, epoch: int, seq: int, per_event: list[list[Row]] | list[Span]) -> None:
        """A batch's rows: a list per event, or ``Span`` s (from
        ``EventConverter.convert_columns``)."""
        self._pending.append((epoch, seq, per_event))
        self._pending_epochs[epoch] += 1
        self.drain()

    def __call__(self, rows: list[Row]) -> None:
        """Rows outside any batch (a restart's clear), kept in stream order."""
        self._pending.append((None, 0, [rows]))
        self.drain()

    def _ready(self, epoch: int, seq: int) -> bool:
        if self.complete:
            return True
        if epoch + 1 < len(self.instances) or any(e > epoch for e in self._pending_epochs):
            return True  # a later engine runs: this one sends nothing more
        if epoch >= len(self.instances):
            return False
        return self.watermarks.get(self.instances[epoch], 0) > seq

    def drain(self) -> None:
        while self._pending:
            epoch, seq, per_event = self._pending[0]
            if epoch is not None and not self._ready(epoch, seq):
                return
            self._pending.popleft()
            if epoch is not None:
                self._pending_epochs[epoch] -= 1
                if not self._pending_epochs[epoch]:
                    del self._pending_epochs[epoch]
            if epoch is None:
                rows = per_event[0]
                assert isinstance(rows, list)
                self._write(rows)
            else:
                self._release(epoch, seq, per_event)

    def _take(self, epoch: int, upto: tuple[int, int]) -> list[PlacedLookup]:
        if epoch >= len(self.instances):
            return []
        heap = self._lookups[self.instances[epoch]]
        taken = []
        while heap and heap[0][0][:2] < upto:
            taken.append(heapq.heappop(heap)[1])
        return taken

    def _ahead(self, epoch: int, upto: tuple[int, int]) -> bool:
        """Whether a lookup placed before ``upto`` is still held."""
        if epoch >= len(self.instances):
            return False
        heap = self._lookups[self.instances[epoch]]
        return bool(heap) and heap[0][0][:2] < upto

    def _release(self, epoch: int, seq: int, per_event: list[list[Row]] | list[Span]) -> None:
        out: list[Row] = []
        entries: Sequence[list[Row] | Span] = per_event
        for i, rows in enumerate(entries):
            if not isinstance(rows, list):
                span = rows
                out.extend(self._lookup_row(lk) for lk in self._take(epoch, (seq, span.first + 1)))
                if span.last == span.first or not self._ahead(epoch, (seq, span.last + 1)):
                    out.extend(span.rows)
                    continue
                # A lookup among the span's events: its rows event by event.
                for j, event_rows in enumerate(span.per_event(), start=span.first):
                    out.extend(self._lookup_row(lk) for lk in self._take(epoch, (seq, j + 1)))
                    out.extend(event_rows)
                continue
            out.extend(self._lookup_row(lk) for lk in self._take(epoch, (seq, i + 1)))
            out.extend(rows)
        # Lookups after the batch's last event (none, when the plugin and the
        # stream agree: their events would be in this batch).
        out.extend(self._lookup_row(lk) for lk in self._take(epoch, (seq + 1, 0)))
        self._released[epoch] = seq + 1
        self._write(out)

    def _lookup_row(self, lk: PlacedLookup) -> Row:
        self.placed += 1
        if lk.admitted is True:
            self.admitted += 1
        elif lk.admitted is False:
            self.not_admitted += 1
        return {**lk.record.row(0), _NOT_ADMITTED: lk.admitted is False}

    def _write(self, rows: list[Row]) -> None:
        if not rows:
            return
        out = []
        for row in rows:
            if row.pop(_NOT_ADMITTED, False):
                self.not_admitted_seqs.append(self.next_seq)
            out.append({**row, "seq": self.next_seq})
            self.next_seq += 1
        self.sink(out)

    def finish(self) -> None:
        """End of the stream: everything held is written, lookups of batches
        that never came last."""
        self.complete = True
        self.drain()
        for epoch in range(len(self.instances)):
            rest = self._take(epoch, (1 << 62, 0))
            self._write([self._lookup_row(lk) for lk in rest])

    def source(self) -> dict[str, Any]:
        counts = {
            "count": self.placed,
            "admitted": self.admitted,
            "not_admitted": self.not_admitted,
        }
        return {
            **counts,
            "late": self.late,
            "not_admitted_seqs": list(self.not_admitted_seqs),
            "engine_instances": list(self.instances),
            "placed_by": "KV-event batch and position (the vLLM plugin)",
        }


def check_engine(engine: dict[str, Any], config: TraceConfig, where: str, report: Report) -> None:
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


def plugin_source(
    placer: LookupPlacer, engines: list[dict[str, Any]], origin: dict[str, Any]
) -> dict[str, Any]:
    """The ``source`` entries of a trace whose lookups came from the plugin."""
    versions = {(e.get("engine") or {}).get("vllm_version") for e in engines} - {None}
    return {
        "lookups": {**placer.source(), **origin},
        "engine": [{"instance": e.get("instance"), **(e.get("engine") or {})} for e in engines],
        "cache": "gpu",
        # The running vLLM's release (one, unless the engines ran different ones).
        **({"vllm_version": versions.pop()} if len(versions) == 1 else {}),
    }
