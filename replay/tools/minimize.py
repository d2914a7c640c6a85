"""Shrink a trace to a small one that still raises a flag on one request.

1. Cut what cannot matter: events after the target lookup, and from each
   store/remove the keys the lookup never asks about (other keys cannot
   change its answer); other lookups go too.
2. Delta debugging (ddmin) over the remaining events.
3. Shorten the lookup's hashes from the end while the flag still fires.
The result gets a ``replay.expect`` entry for every policy, ready to commit
into ``traces/``. The flags are the caller's judgement (``judge``: the
analyses' ``add_flags``): a tool sits below the analyses and never imports
them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import polars as pl

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.engine.replay import iter_events
from replay.engine.run import ReplayOptions, replay
from replay.format.schema import TRACE_COLUMNS
from replay.format.trace import TableReader, TraceReader
from replay.format.tracedir import TraceSource, open_trace
from replay.format.writer import events_table, write_trace
from replay.rules.coordinator import pinned_policies, resolve_cache

Row = dict[str, Any]

#: Adds ``flags`` to a results frame of a trace of that configuration
#: (``replay.analysis.flags.add_flags``).
Judge = Callable[[pl.DataFrame, TraceConfig], pl.DataFrame]


def _rows(reader: TraceReader) -> list[Row]:
    out = []
    for event, row in iter_events(reader):
        hashes = getattr(event, "hashes", None)
        out.append({**row, "block_hashes": list(hashes) if hashes is not None else None})
    return out


def _candidate(config: TraceConfig, rows: Sequence[Row]) -> TableReader:
    """The rows as a trace in memory: each shrinking step replays it as it
    would the file, with no file written or read."""
    return TableReader(events_table(_renumbered(rows), config), config, name="<candidate>")


def _request_answer(results: Any, request_id: str) -> tuple[set[str], int]:
    """The flags and the hit of the request's last lookup (none: no flags, 0)."""
    mine = results.filter(results["request_id"] == request_id)
    if mine.height == 0:
        return set(), 0
    return set(mine["flags"][-1]), int(mine["hit_tokens"][-1])


def _flags_of(
    config: TraceConfig,
    rows: Sequence[Row],
    request_id: str,
    policy: str,
    judge: Judge,
    cache: str | None = None,
) -> tuple[set[str], int]:
    options = ReplayOptions(policies=(policy,), caches=(cache,))
    (result,) = replay(_candidate(config, rows), options)
    return _request_answer(judge(result.results, config), request_id)


def _renumbered(rows: Sequence[Row]) -> list[Row]:
    return [{**{k: r.get(k) for k in TRACE_COLUMNS}, "seq": i} for i, r in enumerate(rows)]


def ddmin(items: list[Row], still_fails: Callable[[list[Row]], bool]) -> list[Row]:
    """Zeller's delta debugging: a 1-minimal subset that still fails."""
    n = 2
    while len(items) >= 2:
        size = max(1, len(items) // n)
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        reduced = False
        for i in range(len(chunks)):
            complement = [x for j, c in enumerate(chunks) if j != i for x in c]
            if still_fails(complement):
                items, n, reduced = complement, max(n - 1, 2), True
                break
        if not reduced:
            if n >= len(items):
                break
            n = min(len(items), n * 2)
    return items


def minimize(
    trace: TraceSource,
    request_id: str,
    out: str | os.PathLike[str],
    *,
    flag: str | None = None,
    policy: str = "pre-49502",
    cache: str | None = None,
    seq: int | None = None,
    judge: Judge,
    progress: Callable[[int, int, int], None] | None = None,
) -> dict[str, Any]:
    """``cache`` (default: the trace's own) answers every replay, and the
    expectations name it when it was asked for; ``seq`` picks the lookup when
    the request id occurs in several. The trace is read once; every
    shrinking step replays its rows in memory, and ``out`` is written once,
    at the end. ``progress(replays, events, of)`` is told after each
    shrinking replay how many replays ran and how many of the ``of`` events
    before the lookup are still kept."""
    from replay.tools.lookup_choice import choose_lookup

    reader = open_trace(trace)
    config = reader.config
    rows = _rows(reader)
    targets = {
        r["seq"]: i
        for i, r in enumerate(rows)
        if r["kind"] == "lookup" and r["request_id"] == request_id
    }
    t = targets[choose_lookup(reader.name, request_id, list(targets), seq)]
    wanted = set(rows[t]["block_hashes"])

    def has_flag(flags: set[str]) -> bool:
        return flag in flags if flag is not None else bool(flags)

    if not has_flag(_flags_of(config, rows[: t + 1], request_id, policy, judge, cache)[0]):
        what = f"{flag} flag" if flag else "flag"
        raise ReplayError(
            f"{reader.name}: request {request_id!r} raises no {what} under {policy}: "
            "nothing to minimize"
        )
    events: list[Row] = []
    for r in rows[:t]:
        if r["kind"] in ("store", "remove"):
            keep = [h for h in r["block_hashes"] if h in wanted]
            if keep:
                events.append({**r, "block_hashes": keep})
        elif r["kind"] == "clear":
            events.append(r)
    target = rows[t]
    replays = 0
    kept_events = len(events)

    def fails(evs: list[Row], tgt: Row = target) -> bool:
        nonlocal replays, kept_events
        failed = has_flag(_flags_of(config, [*evs, tgt], request_id, policy, judge, cache)[0])
        replays += 1
        if failed:
            kept_events = min(kept_events, len(evs))
        if progress is not None:
            progress(replays, kept_events, t)
        return failed

    if not fails(events):
        raise ReplayError(f"{reader.name}: cutting unrelated events lost the flag (please report)")
    events = ddmin(events, fails)
    # Shorten the lookup from the end while the flag holds.
    hbs = config.hash_block_size
    n = len(target["block_hashes"])
    while n > 1:
        shorter = {
            **target,
            "block_hashes": target["block_hashes"][: n - 1],
            "max_length": min(target["max_length"], n * hbs - 1),
        }
        shorter["num_tokens"] = shorter["max_length"] + 1
        if not fails(events, shorter):
            break
        target, n = shorter, n - 1
    kept = set(target["block_hashes"])
    events = [
        {**e, "block_hashes": [h for h in e["block_hashes"] if h in kept]}
        if e["kind"] in ("store", "remove")
        else e
        for e in events
    ]
    events = [e for e in events if e["kind"] == "clear" or e["block_hashes"]]
    final = [*events, target]
    # The expectations, from one fold of the final rows, of the policy it was
    # shrunk under, the default release and the aliases (the bugs' releases)
    # that have this cache; every other release is `replay bisect`'s.
    pinned = pinned_policies(resolve_cache(config, cache), (policy,))
    options = ReplayOptions(policies=pinned, caches=(cache,))
    expect = []
    for result in replay(_candidate(config, final), options):
        flags, hit = _request_answer(judge(result.results, config), request_id)
        counts = {f: 1 for f in sorted(flags)}
        entry: dict[str, Any] = {
            "policy": result.policy,
            "flags": counts,
            "hits": {request_id: hit},
        }
        if cache is not None:
            entry["cache"] = cache
        expect.append(entry)
    write_trace(
        out,
        config,
        _renumbered(final),
        expect={
            "expect": expect,
            "minimized_from": os.path.basename(reader.name),
            "request_id": request_id,
        },
    )
    return {"events_before": len(rows), "events_after": len(final), "expect": expect}
