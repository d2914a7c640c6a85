"""Replay: stream a trace in ``seq`` order, fold the store, run every lookup
through a coordinator against the state at that point, and collect results.

Keys are always the whole hash bytes. The fold runs in compiled code
(``replay.kernels``): each batch's ``block_hashes`` are viewed as words in
place (``replay.trace.hash_words``), stores, removes and clears update one
open-addressing table, and every lookup gets its presence bytes per group
(``present[g][u]``: group ``g`` held the key of hash unit ``u`` at that seq).
The Python coordinator consumes those bytes unchanged
(``Coordinator.lookup_present``); vLLM's asks membership per hash, answered
from the same bytes. No Python object is made per stored hash.
"""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from analysis.flags import Flag, FlagChecker, flag_names, flag_rows, flags_table
from replay.coordinator import (
    DEFAULT_POLICY,
    Coordinator,
    LookupOutcome,
    get_cache,
    get_policy,
    trace_cache,
)
from replay.errors import ConfigError, ReplayError
from replay.kernels import CLEAR, LOOKUP, REMOVE, STORE, KeyTable
from replay.spec import TraceConfig
from replay.store import ClearEvent, LookupEvent, RemoveEvent, Store, StoreEvent, fold
from replay.trace import (
    RESULTS_SCHEMA,
    UNIT_PRESENT_FIELD,
    TraceBatch,
    hash_words,
    open_trace,
    prefetched,
    write_results,
)

COORDINATORS = ("reference", "vllm")
KIND_CODES = {"store": STORE, "remove": REMOVE, "clear": CLEAR, "lookup": LOOKUP}


class LookupCoordinator(Protocol):
    name: str

    def lookup(
        self,
        hashes: Sequence[Hashable],
        max_length: int,
        contains: Sequence[Callable[[Hashable], bool]],
        *,
        explain: bool = False,
    ) -> LookupOutcome: ...


def resolve_cache(config: TraceConfig, cache: str | None) -> str:
    """The cache that answers: the one asked for, else the one the trace's
    events describe (``source.cache``), else the Mooncake store."""
    return get_cache(cache).name if cache is not None else trace_cache(config.source)


def make_coordinator(
    config: TraceConfig,
    policy: str,
    coordinator: str,
    cache: str | None = None,
    *,
    path: str | os.PathLike[str] | None = None,
) -> LookupCoordinator:
    get_policy(policy)  # unknown names fail the same way for both backends
    cache = resolve_cache(config, cache)
    if coordinator == "reference":
        try:
            return Coordinator(config, policy, cache)
        except ConfigError as exc:
            # A trace valid for one cache may not be for the other.
            where = f"{path}: " if path is not None else ""
            raise ConfigError(f"{where}replay.trace metadata: {exc}") from None
    if coordinator == "vllm":
        from replay.backends.vllm import VllmCoordinator

        return VllmCoordinator(config, policy, cache)
    raise ReplayError(
        f"unknown coordinator {coordinator!r}, expected one of {', '.join(COORDINATORS)}"
    )


Event = StoreEvent[bytes] | RemoveEvent[bytes] | ClearEvent | LookupEvent[bytes]


def iter_events(path: str | os.PathLike[str]) -> Iterator[tuple[Event, dict[str, Any]]]:
    """Typed events of a trace in seq order, hashes as bytes (with the raw row
    for extra fields). One Python object per hash: for explain, state and
    minimize, never the replay's hot path."""
    reader = open_trace(path)
    for batch in reader.iter_batches():
        offsets = batch.hashes.offsets.to_numpy()
        offsets = (offsets - offsets[0]).tolist()
        keys = batch.hashes.flatten().to_pylist()
        rows = batch.frame.to_dicts()
        for i, row in enumerate(rows):
            yield _event(row, keys[offsets[i] : offsets[i + 1]]), row


def _event(row: dict[str, Any], hashes: list[Any]) -> Event:
    kind, seq = row["kind"], row["seq"]
    if kind == "store":
        return StoreEvent(seq=seq, group_id=row["group_id"], hashes=hashes)
    if kind == "remove":
        return RemoveEvent(seq=seq, group_id=row["group_id"], hashes=hashes)
    if kind == "clear":
        return ClearEvent(seq=seq, group_id=row["group_id"])
    return LookupEvent(
        seq=seq,
        request_id=row["request_id"],
        hashes=hashes,
        max_length=row["max_length"],
        num_tokens=row["num_tokens"],
        observed_hit_tokens=row["observed_hit_tokens"],
    )


@dataclass(slots=True)
class Progress:
    """Events and lookups done so far; the CLI renders it."""

    total_events: int
    events: int = 0
    lookups: int = 0
    started: float = field(default_factory=time.perf_counter)


@dataclass(slots=True, kw_only=True)
class ReplayResult:
    config: TraceConfig
    policy: str
    coordinator: str
    cache: str
    results: pl.DataFrame
    events: int
    events_by_kind: dict[str, int]
    seconds: float
    trace_path: str

    def flags(self) -> pl.DataFrame:
        """One row per (lookup, flag), with the numbers that prove it."""
        return flags_table(self.results)

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


class _Outcomes:
    """The coordinator's answers, one entry per lookup, as flat typed arrays
    (8 bytes a number, no Python object kept per lookup)."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.hit = array("q")
        self.verified = array("q")
        self.state = array("q")
        self.has_state = array("b")
        self.mask = array("i")
        self.loaded = array("i")
        self.group_hit = array("q")
        # Most lookups carry no flag: only the flagged ones are kept, by index.
        self.flagged: list[tuple[int, list[str], list[dict[str, Any]]]] = []

    def add(self, res: LookupOutcome, flags: Sequence[Flag]) -> None:
        if flags:
            self.flagged.append((len(self.hit), flag_names(flags), flag_rows(flags)))
        self.hit.append(res.hit_tokens)
        self.verified.append(res.verified_tokens)
        state = res.mamba_state_tokens
        self.state.append(0 if state is None else state)
        self.has_state.append(state is not None)
        for g in res.groups:
            self.mask.append(g.mask_blocks)
            self.loaded.append(g.loaded_blocks)
            self.group_hit.append(g.hit_tokens)

    def per_group(self, values: array[int], dtype: Any) -> pa.Array:
        n = len(self.hit)
        offsets = np.arange(0, n * self.num_groups + 1, self.num_groups, dtype=np.int32)
        return pa.ListArray.from_arrays(
            pa.array(offsets), pa.array(np.frombuffer(values, dtype=dtype))
        )

    def flag_columns(self, names_type: pa.DataType, rows_type: pa.DataType) -> list[pa.Array]:
        """``flags`` and ``flag_details``: empty lists but for flagged lookups."""
        n = len(self.hit)
        columns = []
        parts: list[tuple[list[tuple[int, list[Any]]], pa.DataType]] = [
            ([(i, names) for i, names, _ in self.flagged], names_type),
            ([(i, rows) for i, _, rows in self.flagged], rows_type),
        ]
        for entries, typ in parts:
            lengths = np.zeros(n, dtype=np.int32)
            values: list[Any] = []
            for i, items in entries:
                lengths[i] = len(items)
                values.extend(items)
            offsets = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(lengths, out=offsets[1:])
            columns.append(
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, typ.value_type))
            )
        return columns


#: The columns of a lookup row the results carry as they are.
_LOOKUP_COLUMNS = ("seq", "request_id", "max_length", "num_tokens", "observed_hit_tokens", "ts")


def _vllm_contains(
    hashes: Sequence[bytes], present: Sequence[bytes]
) -> list[Callable[[Hashable], bool]]:
    """Per-group membership for one lookup, from its presence bytes: vLLM's
    pool only asks about the request's own hashes."""
    unit = {h: u for u, h in enumerate(hashes)}
    return [lambda h, p=p: p[unit[h]] == 1 for p in present]  # type: ignore[misc]


def replay_trace(
    path: str | os.PathLike[str],
    *,
    policy: str = DEFAULT_POLICY,
    coordinator: str = "reference",
    cache: str | None = None,
    unit_present: bool = False,
    progress: Callable[[Progress], None] | None = None,
    progress_every: float = 0.2,
) -> ReplayResult:
    """Replay every lookup of the trace and flag each answer in the same
    pass (``analysis/flags.py``, from the presence bytes the lookup saw).
    ``cache`` picks which of vLLM's caches answers (``resolve_cache``);
    ``unit_present`` adds the store state each lookup saw as a column."""
    reader = open_trace(path)
    config = reader.config
    cache = resolve_cache(config, cache)
    coord = make_coordinator(config, policy, coordinator, cache, path=path)
    checker = FlagChecker(config, cache)
    num_groups = config.num_groups
    table = KeyTable(num_groups)
    reference = coord if isinstance(coord, Coordinator) else None
    outcomes = _Outcomes(num_groups)
    lookup_rows: list[pl.DataFrame] = []
    bit_chunks: list[np.ndarray[Any, Any]] = []
    unit_counts: list[np.ndarray[Any, Any]] = []
    counts = {"store": 0, "remove": 0, "clear": 0, "lookup": 0}
    state = Progress(total_events=reader.num_rows)
    last_report = time.perf_counter()
    started = time.perf_counter()
    # Three stages on their own threads: read and validate, fold (compiled,
    # no GIL), and here the coordinator, so a batch folds while the one
    # before it is being looked up.
    folded = prefetched(_folded(reader.iter_batches(prefetch=True), table))
    for batch, kinds, out, out_offsets, n_units in folded:
        frame = batch.frame
        is_lookup = kinds == LOOKUP
        rows = np.flatnonzero(is_lookup)
        buf = out.tobytes()
        starts = out_offsets[rows].tolist()
        sizes = n_units[rows].tolist()
        max_lengths = frame["max_length"].fill_null(0).to_numpy()[rows].tolist()
        observed = frame["observed_hit_tokens"].gather(rows).to_list()
        hashes = (
            batch.hashes.take(pa.array(rows)).to_pylist()
            if reference is None
            else [None] * len(starts)
        )
        for o, n, max_length, seen, hs in zip(
            starts, sizes, max_lengths, observed, hashes, strict=True
        ):
            present = [buf[o + g * n : o + (g + 1) * n] for g in range(num_groups)]
            if reference is not None:
                res = reference.lookup_present(present, max_length)
            else:
                res = coord.lookup(hs, max_length, _vllm_contains(hs, present))
            outcomes.add(res, checker.check_outcome(present, max_length, res, seen))
        if rows.size:
            lookup_rows.append(frame.filter(pl.Series(is_lookup)).select(_LOOKUP_COLUMNS))
            if unit_present:
                bit_chunks.append(out)
                unit_counts.append(np.repeat(n_units[rows], num_groups))
        for name, n in frame.group_by("kind").len().iter_rows():
            counts[name] += n
        state.events += frame.height
        state.lookups = counts["lookup"]
        if progress is not None and time.perf_counter() - last_report >= progress_every:
            progress(state)
            last_report = time.perf_counter()
    if progress is not None:
        progress(state)
    seconds = time.perf_counter() - started
    results = _results_frame(lookup_rows, outcomes, policy, coord.name, cache)
    if unit_present:
        column = _unit_present(bit_chunks, unit_counts, num_groups)
        results = results.with_columns(pl.Series(UNIT_PRESENT_FIELD.name, column))
    return ReplayResult(
        config=config,
        policy=policy,
        coordinator=coord.name,
        cache=cache,
        results=results,
        events=state.events,
        events_by_kind=counts,
        seconds=seconds,
        trace_path=str(path),
    )


def _folded(
    batches: Iterator[TraceBatch], table: KeyTable
) -> Iterator[
    tuple[
        TraceBatch,
        np.ndarray[Any, Any],
        np.ndarray[Any, Any],
        np.ndarray[Any, Any],
        np.ndarray[Any, Any],
    ]
]:
    for batch in batches:
        kinds = batch.frame["kind"].replace_strict(KIND_CODES, return_dtype=pl.Int8).to_numpy()
        yield (batch, kinds, *fold_rows(table, batch.frame, batch.hashes, kinds))


def fold_rows(
    table: KeyTable, frame: pl.DataFrame, hashes: pa.Array, kinds: np.ndarray[Any, Any]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Fold one validated batch into ``table`` (``kinds`` as kernel codes).
    Returns the lookups' presence bytes, each row's offset into them (lookup
    rows: ``num_groups`` runs of the row's unit count) and the unit counts."""
    gids = _readonly(frame["group_id"].fill_null(-1).to_numpy())
    words = hash_words(hashes)
    n_units = np.diff(words.row_offsets)
    out_offsets = np.zeros(kinds.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.where(kinds == LOOKUP, n_units * table.num_groups, 0), out=out_offsets[1:])
    out = np.zeros(int(out_offsets[-1]), dtype=np.uint8)
    table.fold(_readonly(kinds), gids, words, out, out_offsets)
    return out, out_offsets, n_units


def _readonly(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # One array type for the kernel (numba compiles read-only and writable
    # arrays separately), whatever the producer handed over.
    a = np.ascontiguousarray(a)
    a.flags.writeable = False
    return a


def _dictionary(n: int, value: str) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int8)), pa.array([value]))


def _results_frame(
    lookup_rows: list[pl.DataFrame],
    outcomes: _Outcomes,
    policy: str,
    coordinator: str,
    cache: str,
) -> pl.DataFrame:
    schema = {name: RESULTS_SCHEMA.field(name).type for name in RESULTS_SCHEMA.names}
    if lookup_rows:
        rows = pl.concat(lookup_rows, rechunk=True).to_arrow()
    else:
        rows = pa.table({n: pa.array([], schema[n]) for n in _LOOKUP_COLUMNS})
    n = rows.num_rows
    hit = pa.array(np.frombuffer(outcomes.hit, dtype=np.int64))
    observed = rows.column("observed_hit_tokens")
    has_state = np.frombuffer(outcomes.has_state, dtype=np.bool_)
    columns: dict[str, Any] = {
        "seq": rows.column("seq"),
        "request_id": rows.column("request_id"),
        "max_length": rows.column("max_length"),
        "hit_tokens": hit,
        "mask_blocks": outcomes.per_group(outcomes.mask, np.int32),
        "loaded_blocks": outcomes.per_group(outcomes.loaded, np.int32),
        "num_tokens": rows.column("num_tokens"),
        "group_hit_tokens": outcomes.per_group(outcomes.group_hit, np.int64),
        "verified_tokens": pa.array(np.frombuffer(outcomes.verified, dtype=np.int64)),
        "mamba_state_tokens": pa.array(
            np.frombuffer(outcomes.state, dtype=np.int64), mask=~has_state
        ),
        "observed_hit_tokens": observed,
        "observed_match": pc.equal(observed, hit),
        "ts": rows.column("ts"),
        "policy": _dictionary(n, policy),
        "coordinator": _dictionary(n, coordinator),
        "cache": _dictionary(n, cache),
    }
    columns["flags"], columns["flag_details"] = outcomes.flag_columns(
        schema["flags"], schema["flag_details"]
    )
    table = pa.table(
        {name: columns[name].cast(schema[name]) for name in RESULTS_SCHEMA.names},
        schema=RESULTS_SCHEMA,
    )
    results = pl.from_arrow(table)
    assert isinstance(results, pl.DataFrame)
    return results


def _unit_present(
    chunks: list[np.ndarray[Any, Any]], unit_counts: list[np.ndarray[Any, Any]], num_groups: int
) -> pa.Array:
    """list<list<bool>>: per lookup, per group_id, whether the group held a key
    for each of the lookup's hash units at that seq."""
    values = pa.array(np.concatenate(chunks).view(np.bool_) if chunks else np.zeros(0, np.bool_))
    counts = np.concatenate(unit_counts) if unit_counts else np.zeros(0, np.int64)
    inner_offsets = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=inner_offsets[1:])
    inner = pa.ListArray.from_arrays(pa.array(inner_offsets), values)
    outer_offsets = np.arange(0, len(counts) + 1, num_groups, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(outer_offsets), inner)


def default_results_path(trace: str | os.PathLike[str]) -> Path:
    p = Path(trace)
    name = p.name.removesuffix(".parquet")
    return p.with_name(f"{name}.results.parquet")


def save_results(result: ReplayResult, out: str | os.PathLike[str]) -> Path:
    return write_results(out, result.results.to_arrow(), result.metadata())


def state_at(
    path: str | os.PathLike[str], before_seq: int | None
) -> tuple[TraceConfig, Store[bytes]]:
    """The store as a lookup at ``before_seq`` sees it: every cache event with a
    smaller seq folded in, keyed by the exact hash bytes."""
    config = open_trace(path).config
    events = (event for event, _ in iter_events(path))
    return config, fold(config.num_groups, events, before=before_seq)


def explain_lookups(
    path: str | os.PathLike[str],
    select: Callable[[LookupEvent[bytes]], bool],
    policy: str,
    coordinator: str = "reference",
    *,
    cache: str | None = None,
    until_seq: int | None = None,
) -> tuple[TraceConfig, list[tuple[LookupEvent[bytes], LookupOutcome, list[Flag]]]]:
    """Every selected lookup with the coordinator's steps and its flags, in
    one pass: the store is folded once and each lookup explained where it
    stands."""
    config = open_trace(path).config
    cache = resolve_cache(config, cache)
    coord = make_coordinator(config, policy, coordinator, cache, path=path)
    checker = FlagChecker(config, cache)
    store: Store[bytes] = Store(config.num_groups)
    contains = [s.__contains__ for s in store.present]
    found: list[tuple[LookupEvent[bytes], LookupOutcome, list[Flag]]] = []
    for event, _ in iter_events(path):
        if until_seq is not None and event.seq > until_seq:
            break
        if isinstance(event, LookupEvent):
            store.observe(event.seq)
            if select(event):
                outcome = coord.lookup(event.hashes, event.max_length, contains, explain=True)
                present = [bytes(map(c, event.hashes)) for c in contains]
                flags = checker.check_outcome(
                    present, event.max_length, outcome, event.observed_hit_tokens
                )
                found.append((event, outcome, flags))
        else:
            store.apply(event)
    return config, found
