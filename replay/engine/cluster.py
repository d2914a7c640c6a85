"""The key-sharded replay on Ray: a local Ray, or an existing cluster (issue 13).

Per file of the trace (a directory's files, or the one file), a task reads
and validates it and splits it into the K shards' pieces
(``replay.engine.shard.scatter``); K long-lived actors, one per shard, each fold
their pieces in file order into their own compiled table and return the
presence bytes of every lookup's units in their shard; a task per file then
gathers those bytes and runs the fixed point and the flags for every
variant. Files overlap: one is read while the one before it folds and the
one before that is answered. The driver keeps a bounded window of files in
flight and concatenates the answers in file order, so the results are those
of ``replay run`` row for row.

A shard's table lives only in its actor: if the actor dies its keys are
gone, so the replay stops with an error and writes nothing, never a shorter
results file. Tasks (read, answer) hold no state and Ray retries them when
their worker dies.

Ray is an extra (``pip install 'cache-trace-replay[ray]'``): it is imported
only here, and only when asked for.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay.base.errors import ReplayError, TraceError
from replay.base.spec import TraceConfig
from replay.engine.answers import Answers, LookupBatch, Progress, ReplayResult, Variant, results_of
from replay.engine.options import ReplayOptions
from replay.engine.shard import (
    MAX_SHARDS,
    ShardFold,
    ShardPiece,
    gather,
    scatter,
)
from replay.format.trace import TraceReader
from replay.format.tracedir import open_trace

INSTALL_HINT = "pip install 'cache-trace-replay[ray]'"
#: The namespace of the shard actors, so a test or an operator can find them.
NAMESPACE = "cache-trace-replay"


class ClusterError(ReplayError):
    """The cluster could not finish the replay (a worker died, no Ray)."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ClusterError(f"`workers` and `ray_address` need Ray: {INSTALL_HINT}") from None
    return ray


def _scatter_file(path: str, shards: int, skip: int = 0) -> tuple[Any, ...]:
    """Read one file (but its first ``skip`` rows: a segment's snapshot the
    directory skips); each shard's pieces, then the lookups, then what the
    driver checks and counts (bytes shipped, the file's seq range)."""
    per_shard: list[list[ShardPiece]] = [[] for _ in range(shards)]
    lookups: list[LookupBatch] = []
    facts: dict[str, Any] = {
        "pieces": 0,
        "lookups": 0,
        "hash_entries": 0,
        "first_seq": None,
        "last_seq": None,
    }
    reader = TraceReader(path)
    reader.skip_rows = skip
    for batch in reader.iter_batches(prefetch=True):
        pieces, lb = scatter(batch, shards)
        for k, piece in enumerate(pieces):
            per_shard[k].append(piece)
            facts["pieces"] += piece.nbytes
        lookups.append(lb)
        facts["lookups"] += lb.nbytes
        facts["hash_entries"] += lb.hash_entries
        if lb.first_seq is not None:
            facts["first_seq"] = lb.first_seq if facts["first_seq"] is None else facts["first_seq"]
            facts["last_seq"] = lb.last_seq
    return (*per_shard, lookups, facts)


class _Shard:
    """One shard's store, kept across the whole trace."""

    def __init__(self, num_groups: int) -> None:
        self.state = ShardFold(num_groups)

    def fold(self, pieces: list[ShardPiece]) -> list[np.ndarray[Any, Any]]:
        return [self.state.fold(p) for p in pieces]

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())


def _answer_file(
    config: TraceConfig,
    variants: list[Variant],
    lookups: list[LookupBatch],
    *presences: list[np.ndarray[Any, Any]],
) -> tuple[list[pl.DataFrame], int, dict[str, int], int]:
    answers = Answers(config, variants)
    presence_bytes = 0
    for i, lb in enumerate(lookups):
        parts = [p[i] for p in presences]
        presence_bytes += sum(int(p.nbytes) for p in parts)
        answers.add(lb, gather(lb, parts, config.num_groups))
    return answers.frames(), answers.events, answers.counts, presence_bytes


class ShardPool:
    """K shard actors spread over the cluster's nodes (Ray's default
    placement may put them all on one), for one trace's replay."""

    def __init__(self, ray: Any, num_groups: int, shards: int) -> None:
        if not 1 <= shards <= MAX_SHARDS:
            raise ReplayError(f"{shards} shards: expected 1 to {MAX_SHARDS}")
        self.ray = ray
        self.run_id = uuid.uuid4().hex[:12]
        # Zero CPUs: a shard is busy only while it folds, and the read and
        # answer tasks must still get the cluster's CPUs.
        actor = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(_Shard)
        self.actors = [
            actor.options(
                name=f"shard-{self.run_id}-{k}",
                namespace=NAMESPACE,
                scheduling_strategy=strategy,
            ).remote(num_groups)
            for k, strategy in enumerate(_round_robin(ray, shards))
        ]

    @property
    def shards(self) -> int:
        return len(self.actors)

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)


def _round_robin(ray: Any, count: int) -> list[Any]:
    """Where each of ``count`` actors goes: the nodes with CPUs in turn.
    SPREAD alone is a preference, and so is soft affinity: both put
    zero-CPU actors on one node at times. A node that is gone before its
    shard starts fails the run (reported, like a shard that dies later)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(
        n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0
    )
    if not nodes:
        return ["SPREAD"] * count
    return [
        NodeAffinitySchedulingStrategy(node_id=nodes[k % len(nodes)], soft=False)
        for k in range(count)
    ]


def _cluster_errors(ray: Any) -> tuple[type[BaseException], ...]:
    # Every failure Ray reports (a dead worker or node, a lost object, an
    # actor that cannot be placed, a task's own error) ends the run alike.
    return (ray.exceptions.RayError,)


def replay_on_ray(
    path: str | os.PathLike[str],
    options: ReplayOptions,
    *,
    pool: ShardPool | None = None,
) -> list[ReplayResult]:
    """Replay ``path`` (a trace directory or file) on Ray, one results frame
    per variant (``ReplayOptions.variants_for``), identical to the serial
    replay's; ``replay.engine.run.replay`` calls it.

    Ray is the one this process is connected to, else a cluster at
    ``options.ray_address`` (``auto``: the one ``ray start`` runs here), else
    a local one with ``options.workers`` CPUs. Shards: ``workers``, else the
    cluster's CPUs. ``options.stats``, when given, receives the bytes
    shipped. ``pool``: shard actors to reuse (they are kept)."""
    workers, address = options.workers, options.ray_address
    progress, stats = options.progress, options.stats
    reader = open_trace(path)  # metadata, schemas and seq order, before Ray starts
    config = reader.config
    variants = options.variants_for(config)
    # Absolute: a worker's directory is not the driver's (nor its node).
    parts = getattr(reader, "files", [reader])
    files = [(f.path.resolve(), f.num_rows) for f in parts]
    # A segment's snapshot rows the directory skips (replay.format.segments).
    skips = {f.path.resolve(): f.skip_rows for f in parts if f.skip_rows}
    ray = import_ray()
    started_here = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {
            "include_dashboard": False,
            "logging_level": logging.ERROR,
            "log_to_driver": False,
        }
        if address is not None and address != "auto":
            _probe(address)
        try:
            if address is not None:
                ray.init(address=address, **kwargs)
            else:
                # "local": never join a cluster a stale ray_current_cluster names.
                ray.init(address="local", num_cpus=workers or 1, **kwargs)
        except Exception as exc:  # Ray raises several types for one refusal
            text = str(exc).strip()
            where = f"`ray_address` {address}" if address is not None else f"`workers` {workers}"
            raise ClusterError(
                f"{where}: cannot start or reach Ray ({type(exc).__name__}: "
                f"{text.splitlines()[0] if text else 'no detail'})"
            ) from None
        started_here = True
    try:
        shards = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        own_pool = pool is None
        pool = pool or ShardPool(ray, config.num_groups, shards)
        try:
            return _run(
                ray, pool, config, variants, files, reader.num_rows, progress, stats, path, skips
            )
        finally:
            if own_pool:
                pool.close()
    finally:
        if started_here:
            ray.shutdown()


def _probe(address: str) -> None:
    """Fail in seconds, not minutes, when nothing listens at HOST:PORT (Ray
    itself retries a dead address for minutes)."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"`ray_address` {address}: expected auto or HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise ClusterError(
            f"`ray_address` {address}: no Ray there ({exc.strerror or exc}); start one with "
            "`ray start --head` or give its address"
        ) from None


def _run(
    ray: Any,
    pool: ShardPool,
    config: TraceConfig,
    variants: list[Variant],
    files: list[tuple[Path, int]],
    total_events: int,
    progress: Callable[[Progress], None] | None,
    stats: dict[str, Any] | None,
    path: str | os.PathLike[str],
    skips: dict[Path, int],
) -> list[ReplayResult]:
    shards = pool.shards
    scatter_task = ray.remote(num_returns=shards + 2, max_retries=3)(_scatter_file)
    answer_task = ray.remote(max_retries=3)(_answer_file)
    window = max(2, 2 * shards)
    config_ref = ray.put(config)
    # Per file in flight: its path and rows, its shards' folds, its answer,
    # its facts, and whether its rows count as folded yet (the progress).
    pending: list[tuple[Path, int, list[Any], Any, Any, list[bool]]] = []
    done: list[tuple[list[pl.DataFrame], int, dict[str, int], int]] = []
    sizes: list[dict[str, Any]] = []
    last: tuple[Path, int] | None = None
    state = Progress(total_events=total_events)
    started = time.perf_counter()
    errors = _cluster_errors(ray)
    todo: Iterator[tuple[Path, int]] = iter(files)

    def submit(file: Path, rows: int) -> None:
        refs = scatter_task.options(scheduling_strategy="SPREAD").remote(
            str(file), shards, skips.get(file, 0)
        )
        folded = [a.fold.remote(refs[k]) for k, a in enumerate(pool.actors)]
        answer = answer_task.options(scheduling_strategy="SPREAD").remote(
            config_ref, variants, refs[shards], *folded
        )
        pending.append((file, rows, folded, answer, refs[shards + 1], [False]))

    def count_folded(entry: tuple[Path, int, list[Any], Any, Any, list[bool]]) -> None:
        # Events are done once every shard has folded them, wherever it runs.
        _, rows, folded, _, _, counted = entry
        if not counted[0] and len(ray.wait(folded, num_returns=len(folded), timeout=0)[0]) == len(
            folded
        ):
            counted[0] = True
            state.events += rows

    try:
        for file, rows in todo:
            submit(file, rows)
            if len(pending) >= window:
                break
        while pending:
            file, _, _, answer, size_ref, counted = pending[0]
            ready, _ = ray.wait([answer], timeout=0.2)
            for entry in pending:
                count_folded(entry)
            if progress is not None:
                progress(state)
            if not ready:
                continue
            pending.pop(0)
            out = ray.get(answer)
            done.append(out)
            facts = ray.get(size_ref)
            sizes.append(facts)
            if facts["first_seq"] is not None:
                # Files without seq statistics in their footer are checked here.
                if last is not None and facts["first_seq"] <= last[1]:
                    raise TraceError(
                        f"{file}: seq {facts['first_seq']}: seq not strictly increasing "
                        f"(comes after seq {last[1]} of {last[0].name})"
                    )
                last = (file, facts["last_seq"])
            if not counted[0]:
                counted[0] = True
                state.events += out[1]
            state.lookups += out[2]["lookup"]
            nxt = next(todo, None)
            if nxt is not None:
                submit(*nxt)
    except errors as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ReplayError):
            raise cause from None  # bad input found by a task: its one-line error
        why = cause if isinstance(cause, BaseException) else exc
        if isinstance(why, ray.exceptions.RayActorError):
            what = f"a shard's worker died, and its keys with it ({type(why).__name__})"
        else:
            text = str(why).strip()
            what = f"{type(why).__name__}: {text.splitlines()[0] if text else 'no detail'}"
        raise ClusterError(
            f"{path}: the replay on Ray failed ({what}); no results written"
        ) from None
    if progress is not None:
        progress(state)
    seconds = time.perf_counter() - started
    counts = {"store": 0, "remove": 0, "clear": 0, "lookup": 0}
    for _, _, c, _ in done:
        for name, n in c.items():
            counts[name] += n
    frames = [
        pl.concat([d[0][i] for d in done], rechunk=True) if done else pl.DataFrame()
        for i in range(len(variants))
    ]
    if stats is not None:
        stats["pieces_bytes"] = sum(s["pieces"] for s in sizes)
        stats["lookups_bytes"] = sum(s["lookups"] for s in sizes)
        stats["presence_bytes"] = sum(d[3] for d in done)
        stats["hash_entries"] = sum(s["hash_entries"] for s in sizes)
        stats["shards"] = shards
        stats["files"] = len(files)
    return results_of(
        config,
        variants,
        frames,
        events=sum(d[1] for d in done),
        counts=counts,
        seconds=seconds,
        trace_path=path,
    )
