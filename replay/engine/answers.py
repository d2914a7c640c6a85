"""Answering: each lookup's presence bytes through a coordinator, with the
facts its flags need, collected as results.

This is the one place a lookup is answered during a replay, whoever folded
the store: the serial replay (``replay.engine.replay``, the one-shard case of
``replay.engine.shard``), the sharded one and the Ray workers (``replay.engine.cluster``)
all hand ``Answers.add`` a batch's lookups with their presence bytes
(``present[g][u]``: group ``g`` held the key of hash unit ``u`` at that
seq). The reference coordinator consumes those bytes unchanged
(``Coordinator.lookup_present``); vLLM's asks membership per hash, answered
from the same bytes. Next to every answer go its facts
(``replay.rules.facts``): what each flag needs to know about the store the
lookup saw. The flags themselves are polars expressions over those columns
(``analysis/flags.py``): the replay never imports its judge.
"""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from replay.base.errors import ConfigError
from replay.base.spec import TraceConfig
from replay.format.schema import ANSWER_SCHEMA, RESULTS_SCHEMA, UNIT_PRESENT_FIELD
from replay.rules.compiled import answer_batch, lookup_tables, new_out, out_width
from replay.rules.compiled import supported as compiled_supported
from replay.rules.compiled.tables import (
    O_ABSENT,
    O_ATTENTION,
    O_EAGLE,
    O_GROUP_HIT,
    O_GROUP_STATE,
    O_GROUPS,
    O_HIT,
    O_LOADED,
    O_MASK,
    O_STATE,
    O_VERIFIED,
    O_WIDTH,
    LookupTables,
    ProbeStop,
    probe_stop,
)
from replay.rules.coordinator import (
    DEFAULT_COORDINATOR,
    Coordinator,
    LookupCoordinator,
    LookupOutcome,
    get_cache,
    get_coordinator,
    get_policy,
    resolve_cache,
)
from replay.rules.facts import FactRules, LookupFacts
from replay.rules.store import LookupEvent


def make_coordinator(
    config: TraceConfig,
    policy: str,
    coordinator: str,
    cache: str | None = None,
    *,
    path: str | os.PathLike[str] | None = None,
) -> LookupCoordinator:
    kind = get_coordinator(coordinator)  # the registry: unknown names fail here
    get_policy(policy)  # unknown names fail the same way for both backends
    cache = resolve_cache(config, cache)
    if kind.installed_vllm:
        from replay.adapters.vllm.backend import VllmCoordinator

        return VllmCoordinator(config, policy, cache)
    try:
        return Coordinator(config, policy, cache)
    except ConfigError as exc:
        # A trace valid for one cache may not be for the other.
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}replay.trace metadata: {exc}") from None


@dataclass(slots=True)
class Progress:
    """Events and lookups done so far; the CLI renders it."""

    total_events: int
    events: int = 0
    lookups: int = 0
    started: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    """One way to answer the lookups: a policy in a cache, by a coordinator."""

    policy: str
    cache: str
    coordinator: str = DEFAULT_COORDINATOR


@dataclass(slots=True, kw_only=True)
class ReplayResult:
    config: TraceConfig
    #: how the lookups were answered: the policy, the cache, the coordinator
    variant: Variant
    results: pl.DataFrame
    events: int
    events_by_kind: dict[str, int]
    seconds: float
    trace_path: str
    #: how the lookups were answered: ``compiled`` (``replay.rules.compiled``)
    #: or ``python: WHY`` (the reference coordinator's own code, or vLLM's)
    answered: str = "compiled"

    @property
    def policy(self) -> str:
        return self.variant.policy

    @property
    def cache(self) -> str:
        return self.variant.cache

    @property
    def coordinator(self) -> str:
        return self.variant.coordinator

    def metadata(self) -> dict[str, Any]:
        return {
            "version": 1,
            "coordinator": self.coordinator,
            "policy": self.policy,
            "policy_description": get_policy(self.policy).description,
            "cache": self.cache,
            "cache_description": get_cache(self.cache).description,
            "kv_cache_groups": [g.to_json() for g in self.config.groups],
            "trace_config": self.config.to_json(),
            "trace": os.path.basename(self.trace_path),
            "keys": "exact",
        }


#: The columns of a lookup row the results carry as they are.
LOOKUP_COLUMNS = ("seq", "request_id", "max_length", "num_tokens", "observed_hit_tokens", "ts")


@dataclass(frozen=True, slots=True)
class LookupBatch:
    """What a batch's lookups need once their presence is known."""

    #: Their ``LOOKUP_COLUMNS``: a polars frame from a trace's batch, an Arrow
    #: table from a live source's columns (``replay.format.columns``).
    rows: pl.DataFrame | pa.Table
    #: Hash units of each lookup.
    units: np.ndarray[Any, np.dtype[np.int64]]
    #: The shard of each lookup unit (lookups in order); None for one shard.
    shards: np.ndarray[Any, np.dtype[np.uint16]] | None
    events: int
    counts: dict[str, int]
    first_seq: int | None
    last_seq: int | None
    hash_entries: int
    #: The lookups' own hashes, for a coordinator that asks by hash (vLLM's).
    hashes: pa.Array | None = None

    @property
    def nbytes(self) -> int:
        rows = self.rows
        size = rows.nbytes if isinstance(rows, pa.Table) else rows.estimated_size()
        size = int(size + self.units.nbytes)
        size += int(self.hashes.nbytes) if self.hashes is not None else 0
        return size + (int(self.shards.nbytes) if self.shards is not None else 0)


class Outcomes:
    """The answers and facts of a variant's lookups, one row of the compiled
    fixed point's columns (``replay.rules.compiled.tables``, ``O_*``) per
    lookup, -1 where a value is None: the compiled path fills them a batch
    at a time, the Python reference one lookup at a time (8 bytes a number,
    no Python object kept per lookup)."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.width = out_width(num_groups)
        self.chunks: list[np.ndarray[Any, np.dtype[np.int64]]] = []
        self._rows = array("q")

    def add(self, res: LookupOutcome, facts: LookupFacts) -> None:
        """One lookup answered by a Python coordinator."""
        rows = self._rows
        state = res.mamba_state_tokens
        rows.extend(
            (
                res.hit_tokens,
                _or_none(facts.attention_tokens),
                res.verified_tokens,
                _or_none(state),
            )
        )
        for g, resumed, absent, eagle in zip(
            res.groups,
            facts.state_tokens,
            facts.first_absent_block,
            facts.eagle_unit_present,
            strict=True,
        ):
            rows.extend(
                (
                    g.mask_blocks,
                    _or_none(resumed),
                    _or_none(absent),
                    _or_none(eagle),
                    g.loaded_blocks,
                    g.hit_tokens,
                )
            )

    def add_rows(self, rows: np.ndarray[Any, np.dtype[np.int64]]) -> None:
        """A batch answered compiled (``answer_batch``'s rows)."""
        self._flush()
        self.chunks.append(rows)

    def _flush(self) -> None:
        if self._rows:
            rows = np.frombuffer(self._rows, dtype=np.int64).reshape(-1, self.width)
            self.chunks.append(rows.copy())
            self._rows = array("q")

    def table(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Every lookup's row, in seq order."""
        self._flush()
        if not self.chunks:
            return np.zeros((0, self.width), dtype=np.int64)
        return np.concatenate(self.chunks) if len(self.chunks) > 1 else self.chunks[0]


def _or_none(value: int | bool | None) -> int:
    return -1 if value is None else int(value)


#: One coordinator's answer to one lookup: presence bytes, max_length, (for
#: a coordinator that asks by hash) the lookup's hashes, and whether to
#: record its steps (``replay explain``).
#: A lookup explained: the event, the coordinator's answer with its steps,
#: and the answer's facts.
Explained = tuple[LookupEvent[bytes], LookupOutcome, LookupFacts]


class Answers:
    """The fixed point and the facts of every lookup, for each variant, from
    the same presence bytes. ``unit_present`` keeps those bytes for the
    results column of that name (the store state each lookup saw).

    With ``explain``, only the lookups it selects are answered, with the
    coordinator's steps, and kept in ``explained`` instead of the results."""

    def __init__(
        self,
        config: TraceConfig,
        variants: Sequence[Variant],
        *,
        unit_present: bool = False,
        where: str | os.PathLike[str] | None = None,
        explain: Callable[[LookupEvent[bytes]], bool] | None = None,
        compiled: bool = True,
    ) -> None:
        self.config = config
        self.variants = list(variants)
        self.coordinators = [
            make_coordinator(config, v.policy, v.coordinator, v.cache, path=where)
            for v in self.variants
        ]
        # Facts by the rules of the release that answered (its EAGLE groups,
        # alignment and partial hits), not 0.33.0's.
        self.facts = [FactRules(config, c.cache) for c in self.coordinators]
        #: Per variant, the compiled fixed point's tables, or None where the
        #: Python coordinator answers (``fallbacks`` says why).
        self.tables: list[LookupTables | None] = []
        self.fallbacks: list[str | None] = []
        for v, c in zip(self.variants, self.coordinators, strict=True):
            why = compiled_supported(v.coordinator) if compiled else "asked for the reference"
            if explain is not None:
                why = "replay explain shows the reference's steps"
            self.fallbacks.append(why)
            self.tables.append(lookup_tables(config, c.policy, c.cache) if why is None else None)
        self.outcomes = [Outcomes(config.num_groups) for _ in self.variants]
        self.explain = explain
        self.explained: list[Explained] = []
        self.needs_hashes = explain is not None or any(c.asks_by_hash for c in self.coordinators)
        self.unit_present = unit_present
        self._present: list[np.ndarray[Any, Any]] = []
        self._units: list[np.ndarray[Any, Any]] = []
        self.rows: list[pl.DataFrame | pa.Table] = []
        self.events = 0
        self.counts = {"store": 0, "remove": 0, "clear": 0, "lookup": 0}

    def probe_stop(self) -> ProbeStop | None:
        """Where the fold may stop probing a lookup's hash units
        (``replay.rules.compiled.tables.probe_stop``, the widest over the
        variants), or None when every unit's presence is needed: the
        ``unit_present`` column, a Python coordinator or an explanation
        reads them all."""
        if self.unit_present or self.explain is not None:
            return None
        stops = [probe_stop(t) if t is not None else None for t in self.tables]
        first = stops[0] if stops else None
        if first is None or any(s is None or s[:2] != first[:2] for s in stops):
            return None
        return first[0], first[1], max(s[2] for s in stops if s is not None)

    def add(self, lookups: LookupBatch, present: np.ndarray[Any, Any]) -> None:
        """Answer one batch's lookups, with their facts; ``present`` in the fold's
        layout (per lookup, per group, its units)."""
        num_groups = self.config.num_groups
        max_lengths = _max_lengths(lookups.rows)
        units = np.ascontiguousarray(lookups.units, dtype=np.int64)
        for tables, outcomes in zip(self.tables, self.outcomes, strict=True):
            if tables is None:
                continue
            out = new_out(len(units), num_groups)
            answer_batch(
                *tables.arrays(),
                np.ascontiguousarray(present).reshape(-1).view(np.uint8),
                units,
                max_lengths,
                out,
            )
            outcomes.add_rows(out)
        variants = [
            (c, r, o)
            for c, r, o, t in zip(
                self.coordinators, self.facts, self.outcomes, self.tables, strict=True
            )
            if t is None
        ]
        if variants:
            self._answer_python(lookups, present, max_lengths.tolist(), variants)
        if self.explain is None and len(lookups.rows):
            self.rows.append(lookups.rows)
            if self.unit_present:
                self._present.append(present)
                self._units.append(np.repeat(lookups.units, num_groups))
        self.events += lookups.events
        for name, count in lookups.counts.items():
            self.counts[name] += count

    def _answer_python(
        self,
        lookups: LookupBatch,
        present: np.ndarray[Any, Any],
        max_lengths: list[int],
        variants: list[tuple[LookupCoordinator, FactRules, Outcomes]],
    ) -> None:
        """The batch's lookups through the Python coordinators, one by one."""
        num_groups = self.config.num_groups
        buf = present.tobytes()
        sizes = lookups.units.tolist()
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(lookups.units * num_groups, out=offsets[1:])
        hashes: list[Any] = (
            lookups.hashes.to_pylist()
            if self.needs_hashes and lookups.hashes is not None
            else [None] * len(sizes)
        )
        explaining = self.explain is not None
        events = (
            _selected(lookups, hashes, self.explain)
            if self.explain is not None
            else [None] * len(sizes)
        )
        for o, n, max_length, hs, event in zip(
            offsets[:-1].tolist(), sizes, max_lengths, hashes, events, strict=True
        ):
            if explaining and event is None:
                continue
            present_g = [buf[o + g * n : o + (g + 1) * n] for g in range(num_groups)]
            for coordinator, rules, outcomes in variants:
                res = coordinator.answer(present_g, max_length, hs, explain=explaining)
                facts = rules.outcome_facts(present_g, res)
                if event is None:
                    outcomes.add(res, facts)
                else:
                    self.explained.append((event, res, facts))

    def frames(self) -> list[pl.DataFrame]:
        """The results of each variant, one row per lookup in seq order."""
        frames = [
            results_frame(self.rows, outcomes, v, rules.alignment)
            for v, outcomes, rules in zip(self.variants, self.outcomes, self.facts, strict=True)
        ]
        if not self.unit_present:
            return frames
        column = pl.Series(UNIT_PRESENT_FIELD.name, self._unit_present())
        return [f.with_columns(column) for f in frames]

    def take_frames(self) -> list[pl.DataFrame]:
        """The results answered since the last call, then forget them: a
        live replay (``replay.engine.live``) answers batch by batch and holds
        nothing per lookup once it is judged."""
        frames = self.frames()
        self.take_parts()
        return frames

    def take_parts(self) -> tuple[list[pl.DataFrame | pa.Table], list[Outcomes]]:
        """What ``take_frames`` makes its frames of (the lookups' rows, each
        variant's outcomes), then forget them: ``replay watch`` makes one
        results frame of many engines' parts (``results_frame`` takes them
        joined), not one an engine. Not with ``unit_present``."""
        parts = self.rows, self.outcomes
        self.rows = []
        self.outcomes = [Outcomes(self.config.num_groups) for _ in self.variants]
        self._present, self._units = [], []
        return parts

    def results(self, *, seconds: float, trace_path: str | os.PathLike[str]) -> list[ReplayResult]:
        """Each variant's ``ReplayResult``."""
        return results_of(
            self.config,
            self.variants,
            self.frames(),
            events=self.events,
            counts=self.counts,
            seconds=seconds,
            trace_path=trace_path,
            answered=["compiled" if why is None else f"python: {why}" for why in self.fallbacks],
        )

    def _unit_present(self) -> pa.Array:
        """list<list<bool>>: per lookup, per group_id, whether the group held
        a key for each of the lookup's hash units at that seq."""
        chunks, counts_list = self._present, self._units
        values = pa.array(
            np.concatenate(chunks).view(np.bool_) if chunks else np.zeros(0, np.bool_)
        )
        counts = np.concatenate(counts_list) if counts_list else np.zeros(0, np.int64)
        inner_offsets = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts, out=inner_offsets[1:])
        inner = pa.ListArray.from_arrays(pa.array(inner_offsets), values)
        outer_offsets = np.arange(0, len(counts) + 1, self.config.num_groups, dtype=np.int32)
        return pa.ListArray.from_arrays(pa.array(outer_offsets), inner)


def _selected(
    lookups: LookupBatch,
    hashes: list[Any],
    select: Callable[[LookupEvent[bytes]], bool],
) -> list[LookupEvent[bytes] | None]:
    """Each lookup as an event when ``select`` picks it, else None."""
    out: list[LookupEvent[bytes] | None] = []
    rows = lookups.rows
    frame = rows if isinstance(rows, pl.DataFrame) else pl.DataFrame(pl.from_arrow(rows))
    for row, hs in zip(frame.iter_rows(named=True), hashes, strict=True):
        event = LookupEvent(
            seq=row["seq"],
            request_id=row["request_id"],
            hashes=hs,
            max_length=row["max_length"],
            num_tokens=row["num_tokens"],
            observed_hit_tokens=row["observed_hit_tokens"],
        )
        out.append(event if select(event) else None)
    return out


def results_of(
    config: TraceConfig,
    variants: Sequence[Variant],
    frames: Sequence[pl.DataFrame],
    *,
    events: int,
    counts: dict[str, int],
    seconds: float,
    trace_path: str | os.PathLike[str],
    answered: Sequence[str] | None = None,
) -> list[ReplayResult]:
    """One result per variant, all of the same run (one fold, one pass);
    ``answered`` says how each variant's lookups were (compiled by default)."""
    of_run = partial(
        ReplayResult,
        config=config,
        events=events,
        seconds=seconds,
        trace_path=str(trace_path),
    )
    how = answered if answered is not None else ["compiled"] * len(variants)
    return [
        of_run(variant=v, results=frame, events_by_kind=dict(counts), answered=a)
        for v, frame, a in zip(variants, frames, how, strict=True)
    ]


def _max_lengths(rows: pl.DataFrame | pa.Table) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Each lookup's max_length (0 where null), contiguous int64."""
    if isinstance(rows, pa.Table):
        column = pc.fill_null(rows.column("max_length"), 0).to_numpy()
    else:
        column = rows["max_length"].fill_null(0).to_numpy()
    return np.ascontiguousarray(column, dtype=np.int64)


def _lookup_table(lookup_rows: Sequence[pl.DataFrame | pa.Table]) -> pa.Table:
    """The lookups' rows as one Arrow table: a live source's Arrow tables
    as they are (no polars round trip), a trace's frames as before."""
    if len(lookup_rows) == 1 and isinstance(lookup_rows[0], pa.Table):
        return lookup_rows[0]
    frames = [
        r if isinstance(r, pl.DataFrame) else pl.DataFrame(pl.from_arrow(r)) for r in lookup_rows
    ]
    return pl.concat(frames, rechunk=True).to_arrow()


def _dictionary(n: int, value: str) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int8)), _one_value(value))


@lru_cache(maxsize=256)
def _one_value(value: str) -> pa.Array:
    # Made once: a Python list converted by pyarrow tries to import dateutil
    # (a search of sys.path when it is not installed), per batch in replay watch.
    return pa.array([value])


def _nullable(values: np.ndarray[Any, Any], dtype: Any) -> pa.Array:
    """A fact column: -1 is None (its value 0, as the reference writes it)."""
    null = values < 0
    return pa.array(np.where(null, 0, values).astype(dtype), mask=null)


def _per_group(table: np.ndarray[Any, Any], column: int, dtype: Any, nullable: bool) -> pa.Array:
    """One per-group column, a list per lookup in group order."""
    n, groups = table.shape[0], (table.shape[1] - O_GROUPS) // O_WIDTH
    values = table[:, O_GROUPS + column :: O_WIDTH].reshape(-1)
    offsets = np.arange(0, n * groups + 1, groups, dtype=np.int32)
    array = _nullable(values, dtype) if nullable else pa.array(values.astype(dtype))
    return pa.ListArray.from_arrays(pa.array(offsets), array)


def results_frame(
    lookup_rows: list[pl.DataFrame | pa.Table],
    outcomes: Outcomes,
    variant: Variant,
    alignment: int,
) -> pl.DataFrame:
    """A variant's answers and facts, one row per lookup: the results but
    their flags (``ANSWER_SCHEMA``; ``replay.analysis.flags`` adds those)."""
    schema = {name: RESULTS_SCHEMA.field(name).type for name in RESULTS_SCHEMA.names}
    if lookup_rows:
        rows = _lookup_table(lookup_rows)
    else:
        rows = pa.table({n: pa.array([], schema[n]) for n in LOOKUP_COLUMNS})
    n = rows.num_rows
    table = outcomes.table()
    hit = pa.array(np.ascontiguousarray(table[:, O_HIT]))
    observed = rows.column("observed_hit_tokens")
    columns: dict[str, Any] = {
        "seq": rows.column("seq"),
        "request_id": rows.column("request_id"),
        "max_length": rows.column("max_length"),
        "hit_tokens": hit,
        "mask_blocks": _per_group(table, O_MASK, np.int32, False),
        "loaded_blocks": _per_group(table, O_LOADED, np.int32, False),
        "num_tokens": rows.column("num_tokens"),
        "group_hit_tokens": _per_group(table, O_GROUP_HIT, np.int64, False),
        "verified_tokens": pa.array(np.ascontiguousarray(table[:, O_VERIFIED])),
        "mamba_state_tokens": _nullable(table[:, O_STATE], np.int64),
        "observed_hit_tokens": observed,
        "observed_match": pc.equal(observed, hit),
        "ts": rows.column("ts"),
        "policy": _dictionary(n, variant.policy),
        "coordinator": _dictionary(n, variant.coordinator),
        "cache": _dictionary(n, variant.cache),
        "hit_alignment": pa.array(np.full(n, alignment, dtype=np.int64)),
        "group_state_tokens": _per_group(table, O_GROUP_STATE, np.int64, True),
        "attention_tokens": _nullable(table[:, O_ATTENTION], np.int64),
        "first_absent_block": _per_group(table, O_ABSENT, np.int32, True),
        "eagle_unit_present": _per_group(table, O_EAGLE, np.bool_, True),
    }
    answers = pa.table(
        {name: columns[name].cast(schema[name]) for name in ANSWER_SCHEMA.names},
        schema=ANSWER_SCHEMA,
    )
    results = pl.from_arrow(answers)
    assert isinstance(results, pl.DataFrame)
    return results
