"""Replay's Python-object views of a trace: its events in ``seq`` order
(``iter_events``), the store as a lookup sees it (``state_at``) and the
lookups explained step by step (``explain_lookups``). The replay itself is
``replay.engine.run.replay``.

Keys are always the whole hash bytes. The fold runs in compiled code
(``replay.engine.kernels``, through ``replay.engine.shard``): each batch's
``block_hashes`` are viewed as words in place (``replay.format.hashwords.hash_words``),
stores, removes and clears update one open-addressing table, and every
lookup gets its presence bytes per group, answered (with its facts) by
``replay.engine.answers``, the one loop every replay shares. No Python object
is made per stored hash.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.engine.answers import Answers, Progress, Variant
from replay.engine.shard import replay_answers
from replay.format.tracedir import TraceSource, open_trace
from replay.rules.coordinator import DEFAULT_COORDINATOR, LookupOutcome, resolve_cache
from replay.rules.facts import LookupFacts
from replay.rules.store import ClearEvent, LookupEvent, RemoveEvent, Store, StoreEvent, fold

Event = StoreEvent[bytes] | RemoveEvent[bytes] | ClearEvent | LookupEvent[bytes]


def iter_events(trace: TraceSource) -> Iterator[tuple[Event, dict[str, Any]]]:
    """Typed events of a trace in seq order, hashes as bytes (with the raw row
    for extra fields). One Python object per hash: for explain, state and
    minimize, never the replay's hot path."""
    reader = open_trace(trace)
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


def default_results_path(trace: str | os.PathLike[str]) -> Path:
    """``NAME.results.parquet`` beside the trace (a directory: beside it,
    ``.`` and ``..`` by their real names)."""
    p = Path(trace)
    if p.name in ("", ".", ".."):
        p = Path(os.path.realpath(p))
    if not p.name:
        raise ReplayError(f"{trace}: has no name to derive the results file's from; give -o")
    name = p.name.removesuffix(".parquet")
    return p.with_name(f"{name}.results.parquet")


def state_at(trace: TraceSource, before_seq: int | None) -> tuple[TraceConfig, Store[bytes]]:
    """The store as a lookup at ``before_seq`` sees it: every cache event with a
    smaller seq folded in, keyed by the exact hash bytes."""
    reader = open_trace(trace)
    span: dict[str, int] = {}  # the first seq read and the last

    def events() -> Iterator[Event]:
        for event, _ in iter_events(reader):
            span.setdefault("first", event.seq)
            span["last"] = event.seq
            yield event

    store = fold(reader.config.num_groups, events(), before=before_seq)
    if before_seq is not None and span and not span["first"] <= before_seq <= span["last"]:
        if before_seq < span["first"]:  # the fold stopped at the first event
            span["last"] = int(reader.read_frame(["seq"])["seq"].max())  # type: ignore[arg-type]
        raise ReplayError(
            f"{reader.name}: seq {before_seq} is outside the trace, whose seqs are "
            f"{span['first']}..{span['last']}"
        )
    return reader.config, store


def explain_lookups(
    path: TraceSource,
    select: Callable[[LookupEvent[bytes]], bool],
    policy: str,
    coordinator: str = DEFAULT_COORDINATOR,
    *,
    cache: str | None = None,
    until_seq: int | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> tuple[TraceConfig, list[tuple[LookupEvent[bytes], LookupOutcome, LookupFacts]]]:
    """Every selected lookup with the coordinator's steps and its facts, in
    one pass: the store is folded once and each lookup explained where it
    stands."""
    reader = open_trace(path)
    config = reader.config
    variant = Variant(policy=policy, cache=resolve_cache(config, cache), coordinator=coordinator)

    def wanted(event: LookupEvent[bytes]) -> bool:
        return (until_seq is None or event.seq <= until_seq) and select(event)

    answers = Answers(config, [variant], where=reader.name, explain=wanted)
    replay_answers(reader, answers, until_seq=until_seq, progress=progress)
    return config, answers.explained
