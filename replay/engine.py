"""Replay: stream a trace in ``seq`` order, fold the store, run every lookup
through a coordinator against the state at that point, and collect results.

Keys. By default each block hash is replaced by a 64-bit fingerprint
(polars' seeded hash of the bytes) before it enters the store or a lookup:
Python sets of small ints are several times faster and smaller than sets of
32-byte ``bytes``. Two distinct hashes sharing a fingerprint would make one
look present for the other; among n distinct hashes the chance is about
n^2 / 2^65 (about 1e-6 for 5.7M hashes). ``exact=True`` keys the store by
the raw bytes instead (and the vLLM coordinator always does), at a cost in
speed; ``tests/test_engine.py`` pins that both give identical results.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import polars as pl
import pyarrow as pa

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
from replay.spec import TraceConfig
from replay.store import ClearEvent, LookupEvent, RemoveEvent, Store, StoreEvent, fold
from replay.trace import RESULTS_SCHEMA, open_trace, write_results

FINGERPRINT_SEED = 0x5EED_CAFE
COORDINATORS = ("reference", "vllm")


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


def flat_keys(hashes: pa.Array, exact: bool) -> tuple[list[int], list[Any]]:
    """A batch's ``block_hashes`` as one flat list of keys and row offsets
    (row ``i`` owns ``keys[offsets[i]:offsets[i + 1]]``). One flat list beats a
    list per row: slicing it is C-speed and no nested lists are built."""
    offsets = hashes.offsets.to_numpy()
    offsets = (offsets - offsets[0]).tolist()
    values = hashes.flatten()
    if exact:
        return offsets, values.to_pylist()
    series = pl.Series(values=values)
    return offsets, series.hash(FINGERPRINT_SEED).to_numpy().tolist()


Event = StoreEvent[Hashable] | RemoveEvent[Hashable] | ClearEvent | LookupEvent[Hashable]


def iter_events(
    path: str | os.PathLike[str], *, exact: bool = True
) -> Iterator[tuple[Event, dict[str, Any]]]:
    """Typed events of a trace in seq order (with the raw row for extra fields)."""
    reader = open_trace(path)
    for batch in reader.iter_batches():
        offsets, keys = flat_keys(batch.hashes, exact)
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
    exact_keys: bool
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
            "keys": "exact" if self.exact_keys else f"fingerprint64(seed={FINGERPRINT_SEED})",
        }


def replay_trace(
    path: str | os.PathLike[str],
    *,
    policy: str = DEFAULT_POLICY,
    coordinator: str = "reference",
    cache: str | None = None,
    exact: bool = False,
    progress: Callable[[Progress], None] | None = None,
    progress_every: float = 0.2,
) -> ReplayResult:
    """Replay every lookup of the trace and flag each answer in the same
    pass (``analysis/flags.py``); see the module docstring for keys.
    ``cache`` picks which of vLLM's caches answers (``resolve_cache``)."""
    reader = open_trace(path)
    config = reader.config
    cache = resolve_cache(config, cache)
    coord = make_coordinator(config, policy, coordinator, cache, path=path)
    checker = FlagChecker(config, cache)
    exact = exact or coordinator == "vllm"
    store: Store[Hashable] = Store(config.num_groups)

    contains = [s.__contains__ for s in store.present]

    # The reference coordinator reads the probe bytes directly; vLLM's asks
    # (group, hash) membership of the store.
    reference = coord if isinstance(coord, Coordinator) else None
    bits = bytearray()
    bit_chunks: list[np.ndarray[Any, Any]] = []
    unit_counts: list[int] = []
    out: dict[str, list[Any]] = {name: [] for name in RESULTS_SCHEMA.names}
    counts = {"store": 0, "remove": 0, "clear": 0, "lookup": 0}
    state = Progress(total_events=reader.num_rows)
    last_report = time.perf_counter()
    started = time.perf_counter()
    for batch in reader.iter_batches(prefetch=True):
        frame = batch.frame
        offsets, keys = flat_keys(batch.hashes, exact)
        cols = {
            name: frame[name].to_list()
            for name in (
                "seq",
                "kind",
                "group_id",
                "request_id",
                "max_length",
                "num_tokens",
                "observed_hit_tokens",
            )
        }
        ts = frame["ts"].to_list()
        for i, kind in enumerate(cols["kind"]):
            counts[kind] += 1
            if kind == "store":
                store.store(cols["group_id"][i], keys[offsets[i] : offsets[i + 1]])
            elif kind == "remove":
                store.remove(cols["group_id"][i], keys[offsets[i] : offsets[i + 1]])
            elif kind == "clear":
                store.clear(cols["group_id"][i])
            else:
                hashes = keys[offsets[i] : offsets[i + 1]]
                max_length = cols["max_length"][i]
                # Probe the store once per group for every hash unit: these
                # bits are the store state the lookup saw (kept in the
                # results for the analyses) and the finders then scan plain
                # lists instead of probing a large set again.
                probes = [bytes(map(c, hashes)) for c in contains]
                for p in probes:
                    bits += p
                    unit_counts.append(len(p))
                if reference is not None:
                    res = reference.lookup_present(probes, max_length)
                else:
                    res = coord.lookup(hashes, max_length, contains)
                groups = res.groups
                observed = cols["observed_hit_tokens"][i]
                out["seq"].append(cols["seq"][i])
                out["request_id"].append(cols["request_id"][i])
                out["max_length"].append(max_length)
                out["hit_tokens"].append(res.hit_tokens)
                out["mask_blocks"].append([g.mask_blocks for g in groups])
                out["loaded_blocks"].append([g.loaded_blocks for g in groups])
                out["num_tokens"].append(cols["num_tokens"][i])
                out["group_hit_tokens"].append([g.hit_tokens for g in groups])
                out["verified_tokens"].append(res.verified_tokens)
                out["mamba_state_tokens"].append(res.mamba_state_tokens)
                out["observed_hit_tokens"].append(observed)
                out["observed_match"].append(
                    None if observed is None else observed == res.hit_tokens
                )
                out["ts"].append(ts[i])
                flags = checker.check_outcome(probes, max_length, res, observed)
                out["flags"].append(flag_names(flags))
                out["flag_details"].append(flag_rows(flags))
                out["policy"].append(policy)
                out["coordinator"].append(coord.name)
                out["cache"].append(cache)
        if bits:
            bit_chunks.append(np.frombuffer(bytes(bits), dtype=np.bool_))
            bits.clear()
        state.events += frame.height
        state.lookups = counts["lookup"]
        if progress is not None and time.perf_counter() - last_report >= progress_every:
            progress(state)
            last_report = time.perf_counter()
    if progress is not None:
        progress(state)
    seconds = time.perf_counter() - started
    table = pa.table(out, schema=RESULTS_SCHEMA)
    table = table.append_column(
        "unit_present", _unit_present(bit_chunks, unit_counts, config.num_groups)
    )
    results = pl.from_arrow(table)
    assert isinstance(results, pl.DataFrame)
    return ReplayResult(
        config=config,
        policy=policy,
        coordinator=coord.name,
        cache=cache,
        results=results,
        events=state.events,
        events_by_kind=counts,
        seconds=seconds,
        exact_keys=exact,
        trace_path=str(path),
    )


def _unit_present(
    chunks: list[np.ndarray[Any, Any]], unit_counts: list[int], num_groups: int
) -> pa.Array:
    """list<list<bool>>: per lookup, per group_id, whether the group held a key
    for each of the lookup's hash units at that seq."""
    values = pa.array(np.concatenate(chunks) if chunks else np.zeros(0, np.bool_))
    inner_offsets = np.zeros(len(unit_counts) + 1, dtype=np.int32)
    np.cumsum(unit_counts, out=inner_offsets[1:])
    inner = pa.ListArray.from_arrays(pa.array(inner_offsets), values)
    outer_offsets = np.arange(0, len(unit_counts) + 1, num_groups, dtype=np.int32)
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
    events = (event for event, _ in iter_events(path, exact=True))
    return config, fold(config.num_groups, events, before=before_seq)  # type: ignore[arg-type]


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
    for event, _ in iter_events(path, exact=True):
        if until_seq is not None and event.seq > until_seq:
            break
        if isinstance(event, LookupEvent):
            store.observe(event.seq)
            if select(event):  # type: ignore[arg-type]
                outcome = coord.lookup(event.hashes, event.max_length, contains, explain=True)
                present = [bytes(map(c, event.hashes)) for c in contains]
                flags = checker.check_outcome(
                    present, event.max_length, outcome, event.observed_hit_tokens
                )
                found.append((event, outcome, flags))  # type: ignore[arg-type]
        else:
            store.apply(event)  # type: ignore[arg-type]
    return config, found
