"""What-if sweeps: a trace's request stream re-simulated against another cache.

The trace's ``store`` / ``remove`` / ``clear`` rows are dropped; its lookups,
in ``seq`` order, are the requests. For each, the hit is computed against
the simulated cache by the project's exact coordinator, then the request
leaves behind what vLLM 0.33 would store for that hit (``replay.rules.store_rules``),
evicting in the run's eviction order when the cache is full. One request at a time: no
concurrency model.

* ``gpu``: vLLM's engine block pool (``replay.rules.blockpool.GpuCache``): N
  allocatable blocks shared by every group, admission and eviction exactly as
  vLLM does them under ``lru``; ``fifo``, ``lfu`` and ``belady`` pick another
  cached block to evict from the same pool.
* ``mooncake``: a capacity-bounded external store of keys: a hit refreshes
  the keys the lookup loads, a store adds the keys of the request's stores,
  and while the store is over capacity the eviction order's victim goes.

``belady`` evicts the key whose next use (the next request whose prompt
holds its hash) is furthest, deepest first among equals. That is the
offline optimum for independent keys; a prefix hit also needs every key
before it, so here it is a strong offline reference, not a proven bound
(``tests/whatif/test_whatif.py`` checks it never loses to ``lru`` for full
attention on random streams).

Each run can be written as a trace (``emit``): its lookups and the key
appearances and disappearances in order, which ``replay run`` replays to the
same hits."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl
import pyarrow as pa

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.format.sweepfile import (
    COMPILED,
    ONE_PASS,
    PER_CAPACITY,
    PERCENTILE_COLUMNS,
    PYTHON,
    sweep_frame,
    write_sweep,
)
from replay.format.writer import TraceWriter
from replay.rules.blockpool import GpuCache
from replay.rules.coordinator import (
    DEFAULT_POLICY,
    Coordinator,
    LookupOutcome,
    get_cache,
    get_policy,
)
from replay.rules.coordinator.finders import block_view
from replay.rules.eviction import EVICTIONS, EvictionOrder
from replay.rules.facts import FactRules, LookupFacts
from replay.rules.mooncake_store import MooncakeCache
from replay.rules.store_rules import StoreRules, StoreSettings, lookup_junction
from replay.whatif import kernel as whatif_kernel
from replay.whatif import mooncake_kernel
from replay.whatif import stack as whatif_stack
from replay.whatif.requests import Requests


def hit_ratio_percentiles(
    hits: npt.NDArray[np.int64], num_tokens: npt.NDArray[np.int64]
) -> dict[str, float]:
    """Per request, hit tokens over prompt tokens (a request not admitted or
    preempted hit nothing): its 50th, 90th and 99th percentiles (the lower
    of two neighbours: a value some request had)."""
    if hits.size == 0:
        return dict.fromkeys(PERCENTILE_COLUMNS, 0.0)
    ratios = np.where(hits > 0, hits, 0) / np.maximum(num_tokens, 1)
    values = np.percentile(ratios, [50, 90, 99], method="lower")
    return {c: float(v) for c, v in zip(PERCENTILE_COLUMNS, values, strict=True)}


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpec:
    cache: str
    eviction: str
    capacity_blocks: int
    capacity_bytes: int | None = None
    policy: str = DEFAULT_POLICY
    retention_interval: int | None = 0
    max_num_batched_tokens: int = 8192
    #: per group, bytes of one block (mooncake with a byte capacity)
    page_bytes: tuple[int, ...] | None = None
    emit: str | None = None

    def store_settings(self) -> StoreSettings:
        return StoreSettings(
            retention_interval=self.retention_interval,
            max_num_batched_tokens=self.max_num_batched_tokens,
            cache=self.cache,
            policy=self.policy,
        )

    def label(self) -> str:
        return f"{self.cache}-{self.eviction}-{self.capacity_blocks}"


class _Log:
    """The emitted trace's rows: each lookup, then the key changes its
    request caused (seq is the row's position)."""

    def __init__(self, requests: Requests) -> None:
        self.requests = requests
        self.rows: list[dict[str, Any]] = []
        self.request_id: str | None = None
        self._mark = 0

    def begin(self, i: int) -> None:
        self.request_id = self.requests.request_id[i]
        self._mark = len(self.rows)

    def lookup(self, i: int, hit: int) -> None:
        """The request's lookup row, before the key changes it caused."""
        r = self.requests
        self.rows.insert(
            self._mark,
            {
                "ts": r.ts[i],
                "kind": "lookup",
                "request_id": r.request_id[i],
                "block_hashes": r.digests.take(
                    pa.array(r.unit_ids(i), type=pa.int64())
                ).to_pylist(),
                "max_length": r.max_length[i],
                "num_tokens": r.num_tokens[i],
                "observed_hit_tokens": hit,
            },
        )

    def key(self, kind: str, group_id: int, key: Hashable) -> None:
        digest = self.requests.digests[key].as_py()
        last = self.rows[-1] if len(self.rows) > self._mark else None
        if last is not None and last["kind"] == kind and last["group_id"] == group_id:
            last["block_hashes"].append(digest)
            return
        self.rows.append(
            {
                "kind": kind,
                "group_id": group_id,
                "block_hashes": [digest],
                "request_id": self.request_id,
            }
        )

    def write(self, path: str, config: TraceConfig) -> None:
        with TraceWriter(path, config) as writer:
            for k in range(0, len(self.rows), 4096):
                chunk = self.rows[k : k + 4096]
                writer.write_rows([{"seq": k + n, **row} for n, row in enumerate(chunk)])


def simulate(
    requests: Requests,
    spec: RunSpec,
    *,
    compiled: bool = True,
    control: npt.NDArray[np.int64] | None = None,
) -> dict[str, Any]:
    """One run of the sweep: its row (``replay.format.sweepfile.SWEEP_SCHEMA``), under
    ``facts`` every lookup's answer and facts as results columns (the
    analyses count the flags from them: the what-if never imports its
    judge) and under ``_hits`` per request its hit tokens (-1 not admitted,
    -2 preempted); with ``spec.emit``, the run written there as a trace.
    The gpu cache runs compiled (``replay.whatif.kernel``) unless
    ``compiled`` is False, a trace is emitted or the configuration is one
    it does not cover."""
    started = time.perf_counter()
    config = requests.config
    if compiled and runs_compiled(requests, spec):
        return _simulate_compiled(requests, spec, started, control)
    log = _Log(requests) if spec.emit else None
    on_key = log.key if log is not None else None
    fact_rules = FactRules(config, spec.cache)
    facts = _Facts()
    hit_tokens = prompt_tokens = not_admitted = preempted = 0
    hbs = config.hash_block_size
    per_request = np.zeros(len(requests), dtype=np.int64)

    def next_use(key: Hashable, now: int) -> int:
        return requests.next_use(key, now)

    gpu: GpuCache | None = None
    store: MooncakeCache | None = None
    if spec.cache == "gpu":
        gpu = GpuCache(
            config,
            min(spec.capacity_blocks, requests.useful_blocks()),
            policy=spec.policy,
            eviction=spec.eviction,
            store_settings=spec.store_settings(),
            next_use=next_use if spec.eviction == "belady" else None,
            on_key=on_key,
        )
    elif spec.cache == "mooncake":
        groups = config.num_groups

        def item_next_use(item: int, now: int) -> int:
            return requests.next_use(item // groups, now)

        order = EvictionOrder(
            spec.eviction,
            item_next_use if spec.eviction == "belady" else None,
            newest_first=spec.eviction == "belady",
        )
        if spec.capacity_bytes is not None:
            assert spec.page_bytes is not None
            capacity, costs = spec.capacity_bytes, spec.page_bytes
        else:
            capacity, costs = spec.capacity_blocks, (1,) * groups
        store = MooncakeCache(groups, order, capacity, costs, on_key)
        rules = StoreRules(config, spec.store_settings())
        coordinator = Coordinator(config, spec.policy, "mooncake")
    else:
        raise ReplayError(f"unknown cache {spec.cache!r}, expected one of gpu, mooncake")

    for i in range(len(requests)):
        units = requests.unit_ids(i)
        n, max_length = requests.num_tokens[i], requests.max_length[i]
        prompt_tokens += n
        if log is not None:
            log.begin(i)
        if gpu is not None:
            result = gpu.request(units, n, max_length, now=i)
            present, outcome = result.present, result.outcome
            if log is not None:
                log.lookup(i, outcome.hit_tokens)
            if not result.admitted:
                not_admitted += 1
                per_request[i] = whatif_kernel.NOT_ADMITTED
            elif not result.completed:
                preempted += 1
                per_request[i] = whatif_kernel.PREEMPTED
            else:
                hit_tokens += result.hit_tokens
                per_request[i] = result.hit_tokens
        else:
            assert store is not None
            store.order.now = i
            present = [bytes(u in keys for u in units) for keys in store.present]
            if spec.eviction == "belady":
                for gid, g in enumerate(config.groups):
                    for key in block_view(units, hbs, g.block_size):  # type: ignore[arg-type]
                        if key in store.present[gid]:
                            store.order.refile(store.item(gid, key))
            outcome = coordinator.lookup_present(present, max_length, explain=rules.uses_junction)
            hit = outcome.hit_tokens
            if log is not None:
                log.lookup(i, hit)
            hit_tokens += hit
            per_request[i] = hit
            for gid, (g, go) in enumerate(zip(config.groups, outcome.groups, strict=True)):
                view = block_view(units, hbs, g.block_size)  # type: ignore[arg-type]
                for j in range(go.mask_blocks - go.loaded_blocks, go.mask_blocks):
                    store.touch(gid, view[j])
            junction = (
                lookup_junction(coordinator, present, max_length, outcome)
                if rules.uses_junction
                else 0
            )
            stores = rules.stores(num_tokens=n, hit_tokens=hit, junction_tokens=junction)
            for gid, (g, blocks) in enumerate(zip(config.groups, stores, strict=True)):
                view = block_view(units, hbs, g.block_size)  # type: ignore[arg-type]
                # A block the lookup carried no hash for is never stored
                # (as in the compiled kernel): a trace's lookup may carry
                # fewer hashes than its prompt has full blocks.
                for j in blocks:
                    if j < len(view):
                        store.put(gid, view[int(j)])
        facts.add(max_length, outcome, fact_rules.outcome_facts(present, outcome))

    evicted = gpu.pool.evicted_blocks if gpu is not None else store.evicted  # type: ignore[union-attr]
    if log is not None and spec.emit is not None:
        source = {
            "importer": "replay whatif",
            "trace": os.path.basename(requests.path),
            "cache": spec.cache,
            "eviction": spec.eviction,
            "capacity_blocks": spec.capacity_blocks,
            "capacity_bytes": spec.capacity_bytes,
            "policy": spec.policy,
            "retention_interval": spec.retention_interval,
            "max_num_batched_tokens": spec.max_num_batched_tokens,
        }
        log.write(spec.emit, TraceConfig.from_json({**config.to_json(), "source": source}))
    return _row(
        requests,
        spec,
        per_request,
        prompt_tokens=prompt_tokens,
        hit_tokens=hit_tokens,
        evicted=evicted,
        not_admitted=not_admitted,
        preempted=preempted,
        started=started,
        facts=facts.frame(fact_rules.alignment),
    )


def _row(
    requests: Requests,
    spec: RunSpec,
    hits: npt.NDArray[np.int64],
    *,
    prompt_tokens: int,
    hit_tokens: int,
    evicted: int,
    not_admitted: int,
    preempted: int,
    started: float,
    facts: pl.DataFrame,
    method: str = PER_CAPACITY,
    simulator: str = PYTHON,
) -> dict[str, Any]:
    """One run's row of the sweep (the Python model's, the kernel's and the
    one pass's alike)."""
    return {
        "capacity_blocks": spec.capacity_blocks,
        "capacity_bytes": spec.capacity_bytes,
        "eviction": spec.eviction,
        "cache": spec.cache,
        "policy": spec.policy,
        "lookups": len(requests),
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit_tokens,
        "hit_ratio": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "evicted_blocks": evicted,
        "not_admitted": not_admitted,
        "preempted": preempted,
        "seconds": time.perf_counter() - started,
        **hit_ratio_percentiles(hits, requests.arrays()[2]),
        "method": method,
        "simulator": simulator,
        "facts": facts,
        "_hits": hits,
    }


class _Facts:
    """The answers and facts of a run's lookups, as results columns."""

    def __init__(self) -> None:
        self.columns: dict[str, list[Any]] = {
            name: []
            for name in (
                "max_length",
                "hit_tokens",
                "mask_blocks",
                "group_state_tokens",
                "attention_tokens",
                "first_absent_block",
                "eagle_unit_present",
            )
        }

    def add(self, max_length: int, outcome: LookupOutcome, facts: LookupFacts) -> None:
        c = self.columns
        c["max_length"].append(max_length)
        c["hit_tokens"].append(outcome.hit_tokens)
        c["mask_blocks"].append([g.mask_blocks for g in outcome.groups])
        c["group_state_tokens"].append(facts.state_tokens)
        c["attention_tokens"].append(facts.attention_tokens)
        c["first_absent_block"].append(facts.first_absent_block)
        c["eagle_unit_present"].append(facts.eagle_unit_present)

    def frame(self, alignment: int) -> pl.DataFrame:
        n = len(self.columns["hit_tokens"])
        return pl.DataFrame(
            {
                **self.columns,
                "observed_hit_tokens": [None] * n,
                "hit_alignment": [alignment] * n,
            },
            schema={
                "max_length": pl.Int64,
                "hit_tokens": pl.Int64,
                "mask_blocks": pl.List(pl.Int32),
                "group_state_tokens": pl.List(pl.Int64),
                "attention_tokens": pl.Int64,
                "first_absent_block": pl.List(pl.Int32),
                "eagle_unit_present": pl.List(pl.Boolean),
                "observed_hit_tokens": pl.Int64,
                "hit_alignment": pl.Int64,
            },
        )


class Stopped(Exception):
    """A compiled run was asked to stop before its last request."""


def runs_compiled(requests: Requests, spec: RunSpec) -> bool:
    """Whether ``simulate`` runs ``spec`` compiled (the gpu block pool,
    ``replay.whatif.kernel``, or the Mooncake store, ``replay.whatif.mooncake_kernel``)."""
    if spec.emit is not None:
        return False
    if spec.cache == "mooncake":
        return mooncake_kernel.supported(requests.config, spec.policy) is None
    return (
        spec.cache == "gpu" and whatif_kernel.supported(requests.config, "gpu", spec.policy) is None
    )


def run_hits(
    requests: Requests, spec: RunSpec, control: npt.NDArray[np.int64] | None = None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int]:
    """The compiled gpu run: per request its hit tokens (or
    ``whatif_kernel.NOT_ADMITTED`` / ``PREEMPTED``), its facts (the
    kernel's ``FACT_*`` columns) and the evicted cached blocks."""
    config = requests.config
    k = whatif_kernel.compile_config(
        config,
        spec.policy,
        spec.store_settings(),
        spec.eviction,
        # A pool its requests cannot fill never evicts: simulated at what they fill.
        min(spec.capacity_blocks, requests.useful_blocks()),
        len(requests.digests),
    )
    future = requests.next_uses() if spec.eviction == "belady" else np.zeros(1, dtype=np.int64)
    hits = np.zeros(len(requests), dtype=np.int64)
    width = whatif_kernel.FACT_GROUPS + whatif_kernel.FACT_WIDTH * config.num_groups
    facts = np.zeros((len(requests), width), dtype=np.int64)
    stats = np.zeros(2, dtype=np.int64)
    arrays = requests.arrays()
    if control is None:
        control = np.zeros(2, dtype=np.int64)
    bad = whatif_kernel.run_gpu(*k.arrays(), *arrays, future, hits, facts, stats, control)
    if bad == whatif_kernel.STOPPED:
        raise Stopped
    if bad >= 0:
        raise ReplayError(f"cannot get the free blocks for seq {requests.seq[bad]}'s prefill")
    return hits, facts, int(stats[0])


def facts_frame(requests: Requests, facts: npt.NDArray[np.int64], alignment: int) -> pl.DataFrame:
    """The kernel's facts as the results columns ``_Facts.frame`` writes."""
    groups = requests.config.num_groups
    n = len(requests)

    def column(g: int, k: int, dtype: Any) -> pl.Expr:
        values = facts[:, whatif_kernel.FACT_GROUPS + whatif_kernel.FACT_WIDTH * g + k]
        s = pl.Series(f"g{g}_{k}", values)
        return pl.when(s >= 0).then(s).otherwise(None).cast(dtype)

    def per_group(k: int, dtype: Any) -> pl.Expr:
        return pl.concat_list([column(g, k, dtype) for g in range(groups)])

    attention = pl.Series(facts[:, whatif_kernel.FACT_ATTENTION])
    base = pl.DataFrame(
        {
            "max_length": np.asarray(requests.max_length, dtype=np.int64),
            "hit_tokens": facts[:, whatif_kernel.FACT_HIT],
        }
    )
    return base.select(
        "max_length",
        "hit_tokens",
        per_group(0, pl.Int32).alias("mask_blocks"),
        per_group(1, pl.Int64).alias("group_state_tokens"),
        pl.when(pl.lit(attention) >= 0)
        .then(pl.lit(attention))
        .otherwise(None)
        .cast(pl.Int64)
        .alias("attention_tokens"),
        per_group(2, pl.Int32).alias("first_absent_block"),
        per_group(3, pl.Int8).cast(pl.List(pl.Boolean)).alias("eagle_unit_present"),
        pl.lit(None, dtype=pl.Int64).alias("observed_hit_tokens"),
        pl.lit(alignment, dtype=pl.Int64).alias("hit_alignment"),
    ).head(n)


def _simulate_compiled(
    requests: Requests,
    spec: RunSpec,
    started: float,
    control: npt.NDArray[np.int64] | None = None,
) -> dict[str, Any]:
    if spec.cache == "mooncake":
        if spec.capacity_bytes is not None:
            assert spec.page_bytes is not None
            capacity, costs = spec.capacity_bytes, spec.page_bytes
        else:
            capacity, costs = spec.capacity_blocks, (1,) * requests.config.num_groups
        run = mooncake_kernel.run_store(
            requests, spec.policy, spec.store_settings(), spec.eviction, capacity, costs, control
        )
        if run is None:
            raise Stopped
        hits, facts, evicted = run
    else:
        hits, facts, evicted = run_hits(requests, spec, control)
    served = hits >= 0
    prompt_tokens = int(requests.arrays()[2].sum())
    hit_tokens = int(hits[served].sum())
    alignment = FactRules(requests.config, spec.cache).alignment
    return _row(
        requests,
        spec,
        hits,
        prompt_tokens=prompt_tokens,
        hit_tokens=hit_tokens,
        evicted=evicted,
        not_admitted=int((hits == whatif_kernel.NOT_ADMITTED).sum()),
        preempted=int((hits == whatif_kernel.PREEMPTED).sum()),
        started=started,
        facts=facts_frame(requests, facts, alignment),
        simulator=COMPILED,
    )


#: A worker's copy of the sweep's requests, sent once when it starts.
_LOADED: Requests | None = None


def _load(requests: Requests) -> None:
    global _LOADED
    # The parent decides when a sweep ends: a Ctrl-C sent to the terminal's
    # process group, or a hang-up, must not end a worker with a traceback.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    _LOADED = requests


def _run_loaded(spec: RunSpec) -> dict[str, Any]:
    if _LOADED is None:
        raise RuntimeError("a what-if worker ran before its requests were loaded")
    return simulate(_LOADED, spec)


def check_specs(requests: Requests, specs: Sequence[RunSpec]) -> None:
    """Refuse what a run would only find out after minutes."""
    config = requests.config
    for spec in specs:
        get_policy(spec.policy)
        if spec.eviction not in EVICTIONS:
            raise ReplayError(
                f"unknown eviction {spec.eviction!r}, expected one of {', '.join(EVICTIONS)}"
            )
        get_cache(spec.cache)
        if spec.capacity_blocks < 1:
            raise ReplayError(f"capacity must be at least one block, got {spec.capacity_blocks}")
        try:
            StoreRules(config, spec.store_settings())
            if spec.cache == "gpu":
                GpuCache(config, 1, policy=spec.policy, store_settings=spec.store_settings())
            else:
                Coordinator(config, spec.policy, "mooncake")
        except ReplayError as exc:
            # What the trace's configuration cannot do here: name the trace.
            raise ReplayError(f"{requests.path}: {exc}") from None


#: ``progress(requests_done, requests_total, runs_done, runs_total)``
SweepProgress = Callable[[int, int, int, int], None]


def sweep(
    requests: Requests,
    specs: Sequence[RunSpec],
    *,
    jobs: int = 1,
    progress: SweepProgress | None = None,
    on_row: Callable[[int, dict[str, Any]], None] | None = None,
    poll: float = 0.2,
) -> list[dict[str, Any]]:
    """Every run, in ``specs`` order: the LRU gpu capacities the one pass
    answers exactly from it (``_sweep_one_pass``), the others each simulated
    (``_sweep_runs``)."""
    check_specs(requests, specs)
    if len(one_pass_specs(requests, specs)) >= 2:
        return _sweep_one_pass(
            requests, specs, jobs=jobs, progress=progress, on_row=on_row, poll=poll
        )
    return _sweep_runs(requests, specs, jobs=jobs, progress=progress, on_row=on_row, poll=poll)


def _sweep_runs(
    requests: Requests,
    specs: Sequence[RunSpec],
    *,
    jobs: int = 1,
    progress: SweepProgress | None = None,
    on_row: Callable[[int, dict[str, Any]], None] | None = None,
    poll: float = 0.2,
) -> list[dict[str, Any]]:
    """Every run, in ``specs`` order. Compiled runs go ``jobs`` at a time on
    threads (the kernel holds no GIL), reporting each request done; the
    others in ``jobs`` worker processes, each sent the requests once
    (spawned, not forked: a fork of a process whose Arrow or numba threads
    hold a lock can hang the child). ``on_row(k, row)`` hears of each run
    as it finishes; on a signal (any ``BaseException``) the compiled runs
    still going are stopped at their next request and the exception goes on,
    so a caller can keep the runs ``on_row`` heard of."""
    rows: list[dict[str, Any] | None] = [None] * len(specs)
    jobs = max(1, min(jobs, len(specs)))
    n = len(requests)
    total = n * len(specs)

    def finished(k: int, row: dict[str, Any]) -> None:
        rows[k] = row
        if on_row is not None:
            on_row(k, row)

    if any(spec.eviction == "belady" for spec in specs):
        requests.next_uses()  # once, before the runs share it
    if all(runs_compiled(requests, spec) for spec in specs):
        # Plain threads and a sleeping main thread: a signal raised in the
        # main thread never interrupts a lock that a worker needs next.
        controls = [np.zeros(2, dtype=np.int64) for _ in specs]
        todo = list(range(len(specs)))[::-1]
        results: dict[int, dict[str, Any]] = {}
        errors: list[BaseException] = []
        lock = threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    if not todo or errors:
                        return
                    k = todo.pop()
                try:
                    row = simulate(requests, specs[k], control=controls[k])
                except Stopped:
                    return
                except BaseException as exc:  # handed to the main thread
                    with lock:
                        errors.append(exc)
                    return
                with lock:
                    results[k] = row

        threads = [threading.Thread(target=work, daemon=True) for _ in range(jobs)]
        reported: set[int] = set()
        try:
            for t in threads:
                t.start()
            while True:
                alive = any(t.is_alive() for t in threads)
                with lock:
                    ready = [k for k in results if k not in reported]
                for k in sorted(ready):
                    reported.add(k)
                    finished(k, results[k])
                if errors:
                    raise errors[0]
                if progress is not None:
                    progress(sum(int(c[0]) for c in controls), total, len(reported), len(specs))
                if not alive:
                    break
                time.sleep(poll)
        except BaseException:
            for control in controls:
                control[1] = 1
            with lock:
                todo.clear()
            for t in threads:
                t.join()
            raise
        return [r for r in rows if r is not None]
    if progress is not None:
        progress(0, total, 0, len(specs))
    done_runs = 0
    if jobs == 1:
        for k, spec in enumerate(specs):
            finished(k, simulate(requests, spec))
            done_runs += 1
            if progress is not None:
                progress(done_runs * n, total, done_runs, len(specs))
    else:
        pool = ProcessPoolExecutor(
            max_workers=jobs,
            mp_context=get_context("spawn"),
            initializer=_load,
            initargs=(requests,),
        )
        try:
            futures = {pool.submit(_run_loaded, spec): k for k, spec in enumerate(specs)}
            for future in as_completed(futures):
                finished(futures[future], future.result())
                done_runs += 1
                if progress is not None:
                    progress(done_runs * n, total, done_runs, len(specs))
        except BaseException:
            # An error or a signal: the workers end now, quietly, before the
            # caller removes what they were writing.
            _stop_workers(pool)
            raise
        pool.shutdown(wait=True)
    return [r for r in rows if r is not None]


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        with contextlib.suppress(Exception):
            proc.kill()
    for proc in processes:
        with contextlib.suppress(Exception):
            proc.join(timeout=5)


@dataclass(frozen=True, slots=True)
class Sweep:
    """A sweep's runs, one row per (capacity, eviction) in the order asked,
    and its settings (the sweep file's metadata: ``ceiling``, ``sample``,
    ``partial``...)."""

    rows: list[dict[str, Any]]
    metadata: dict[str, Any]
    #: The requests simulated (the sample's, with ``sample``).
    requests: int
    #: The runs asked for (more than ``rows`` when the sweep is partial).
    runs: int

    @property
    def partial(self) -> bool:
        return bool(self.metadata["partial"])

    def frame(self) -> pl.DataFrame:
        """The sweep file's frame (``replay.format.sweepfile.SWEEP_SCHEMA``)."""
        return sweep_frame(self.rows)

    def write(self, path: str | os.PathLike[str]) -> Path:
        return write_sweep(path, self.rows, self.metadata)


def emit_path(directory: str | os.PathLike[str], spec: RunSpec) -> str:
    return str(Path(directory) / f"whatif-{spec.label()}.parquet")


# ---------------------------------------------------------------- one pass (issue 24 item 2)


def one_pass_specs(requests: Requests, specs: Sequence[RunSpec]) -> list[int]:
    """The runs the one pass may answer: LRU on the gpu cache, compiled, no
    emitted trace, a configuration in ``replay.whatif.stack``'s exact class
    (the pass then checks the stream at each capacity)."""
    config = requests.config
    return [
        k
        for k, spec in enumerate(specs)
        if spec.eviction == "lru"
        and spec.cache == "gpu"
        and runs_compiled(requests, spec)
        and whatif_stack.exact_config(config, spec.policy) is None
    ]


def _sweep_one_pass(
    requests: Requests,
    specs: Sequence[RunSpec],
    *,
    jobs: int,
    progress: SweepProgress | None,
    on_row: Callable[[int, dict[str, Any]], None] | None,
    poll: float,
) -> list[dict[str, Any]]:
    """The one pass over the capacities ``one_pass_specs`` picks (on a
    thread, the main thread sleeping: a signal stops it at its next
    request), its rows for the capacities it answered exactly (``method``
    one-pass), then every other run simulated on its own (per-capacity)."""
    covered = one_pass_specs(requests, specs)
    n, total = len(requests), len(requests) * len(specs)
    useful = requests.useful_blocks()
    control = np.zeros(2, dtype=np.int64)
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["run"] = whatif_stack.run_stack(
                requests, [min(specs[k].capacity_blocks, useful) for k in covered], control
            )
        except BaseException as exc:  # handed to the main thread
            box["error"] = exc

    started = time.perf_counter()
    thread = threading.Thread(target=work, daemon=True)
    try:
        thread.start()
        while thread.is_alive():
            if progress is not None:
                progress(int(control[0]) * len(covered), total, 0, len(specs))
            time.sleep(poll)
    except BaseException:
        control[1] = 1
        thread.join()
        raise
    thread.join()
    if "error" in box:
        raise box["error"]
    run: whatif_stack.StackRun = box["run"]
    seconds = time.perf_counter() - started
    rows: dict[int, dict[str, Any]] = {}
    prompt_tokens = int(requests.arrays()[2].sum())
    config = requests.config
    alignment = FactRules(config, "gpu").alignment
    for j, k in enumerate(covered):
        if run.why[j, 0] != whatif_stack.EXACT:
            continue
        hits = run.hits[j]
        row = _row(
            requests,
            specs[k],
            hits,
            prompt_tokens=prompt_tokens,
            hit_tokens=int(hits.sum()),
            evicted=int(run.evicted[j]),
            not_admitted=0,
            preempted=0,
            started=started,
            facts=facts_frame(
                requests, whatif_stack.facts_of(hits, config.groups[0].block_size), alignment
            ),
            method=ONE_PASS,
            simulator=COMPILED,
        )
        # The pass's time, shared by every row it answered.
        row["seconds"] = seconds
        rows[k] = row
        if on_row is not None:
            on_row(k, row)
    rest = [k for k in range(len(specs)) if k not in rows]
    done = len(rows)

    def rest_progress(d: int, _t: int, r: int, _a: int) -> None:
        if progress is not None:
            progress(done * n + d, total, done + r, len(specs))

    def rest_row(j: int, row: dict[str, Any]) -> None:
        rows[rest[j]] = row
        if on_row is not None:
            on_row(rest[j], row)

    if rest:
        _sweep_runs(
            requests,
            [specs[k] for k in rest],
            jobs=jobs,
            progress=rest_progress,
            on_row=rest_row,
            poll=poll,
        )
    elif progress is not None:
        progress(total, total, len(specs), len(specs))
    return [rows[k] for k in sorted(rows)]
