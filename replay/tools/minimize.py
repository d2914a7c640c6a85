"""Shrink a trace to a small one that still raises a flag on one request.

1. Cut what cannot matter: events after the target lookup, and from each
   store/remove the keys the lookup never asks about (other keys cannot
   change its answer); other lookups go too.
2. Delta debugging (ddmin) over the remaining events.
3. Shorten the lookup's hashes from the end while the flag still fires.
Every step must also keep the lookup's answer (flags, hit, every group's
load mask) under every policy a regression trace pins, in every cache the
configuration is valid for: the small trace pins what the original lookup
got, in both caches (``traces/build.py`` pins the same policies). The
result gets those ``replay.expect`` entries, ready to commit into
``traces/``. The flags are the caller's judgement (``judge``: the analyses'
``add_flags``): a tool sits below the analyses and never imports them.

:func:`shrink` is the reduction alone, under any predicate (the drift
check's ``vLLM and its policy still differ``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import polars as pl

from replay.base.errors import ConfigError, ReplayError
from replay.base.spec import TraceConfig
from replay.engine.replay import iter_events
from replay.engine.run import ReplayOptions, Variant, replay
from replay.format.schema import TRACE_COLUMNS
from replay.format.trace import TableReader, TraceReader
from replay.format.tracedir import TraceSource, open_trace
from replay.format.writer import events_table, write_trace
from replay.rules.coordinator import (
    CACHES,
    Coordinator,
    check_config,
    pinned_policies,
    resolve_cache,
)

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


def candidate(config: TraceConfig, rows: Sequence[Row]) -> TableReader:
    """The rows as a trace in memory: each shrinking step replays it as it
    would the file, with no file written or read."""
    return TableReader(events_table(renumbered(rows), config), config, name="<candidate>")


def renumbered(rows: Sequence[Row]) -> list[Row]:
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


#: One lookup's answer under one policy in one cache: its flags, its hit,
#: per group ``[mask blocks, loaded blocks]``, and each group's own hit.
Answer = tuple[tuple[str, ...], int, list[list[int]], list[int]]


def valid_caches(config: TraceConfig) -> list[str]:
    """The caches (of vLLM's two) whose checks this configuration passes."""
    out = []
    for cache in CACHES:
        try:
            check_config(config, cache)
        except ConfigError:
            continue
        out.append(cache)
    return out


def pinned_variants(config: TraceConfig, also: Sequence[str] = ()) -> list[Variant]:
    """The variants a regression trace pins: in every valid cache, the
    default release, the aliases and ``also``, where each answers (by the
    reference coordinator)."""
    out = []
    for cache in valid_caches(config):
        for policy in pinned_policies(cache, tuple(also)):
            try:
                Coordinator(config, policy, cache)
            except ConfigError:
                continue
            out.append(Variant(policy=policy, cache=cache))
    return out


def answers(
    config: TraceConfig,
    rows: Sequence[Row],
    request_id: str,
    variants: Sequence[Variant],
    judge: Judge,
) -> dict[Variant, Answer]:
    """The request's last lookup's answer per variant, one fold."""
    options = ReplayOptions(variants=tuple(variants))
    out: dict[Variant, Answer] = {}
    for result in replay(candidate(config, rows), options):
        res = judge(result.results, config)
        mine = res.filter(res["request_id"] == request_id)
        if mine.height == 0:
            out[result.variant] = ((), 0, [], [])
            continue
        masks = [
            [int(m), int(n)]
            for m, n in zip(mine["mask_blocks"][-1], mine["loaded_blocks"][-1], strict=True)
        ]
        out[result.variant] = (
            tuple(sorted(mine["flags"][-1])),
            int(mine["hit_tokens"][-1]),
            masks,
            [int(h) for h in mine["group_hit_tokens"][-1]],
        )
    return out


def shrink(
    config: TraceConfig,
    rows: Sequence[Row],
    t: int,
    still_fails: Callable[[list[Row]], bool],
) -> list[Row]:
    """The smallest rows (events, then the lookup ``rows[t]`` last) on which
    ``still_fails`` holds: unrelated keys and lookups cut, ddmin over the
    events, the lookup shortened from the end. ``still_fails(rows[: t +
    1])`` must hold."""
    target = rows[t]
    wanted = set(target["block_hashes"])
    events: list[Row] = []
    for r in rows[:t]:
        if r["kind"] in ("store", "remove"):
            keep = [h for h in r["block_hashes"] if h in wanted]
            if keep:
                events.append({**r, "block_hashes": keep})
        elif r["kind"] == "clear":
            events.append(r)
    if not still_fails([*events, target]):
        raise ReplayError("cutting unrelated events lost the difference (please report)")
    events = ddmin(events, lambda evs: still_fails([*evs, target]))
    # Shorten the lookup from the end while it still fails.
    hbs = config.hash_block_size
    n = len(target["block_hashes"])
    while n > 1:
        shorter = {
            **target,
            "block_hashes": target["block_hashes"][: n - 1],
            "max_length": min(target["max_length"], n * hbs - 1),
        }
        shorter["num_tokens"] = shorter["max_length"] + 1
        if not still_fails([*events, shorter]):
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
    return [*events, target]


def expect_entries(request_id: str, got: Mapping[Variant, Answer]) -> list[dict[str, Any]]:
    """The ``replay.expect`` entries of a small trace (one lookup): per
    variant (policy and cache), the request's flags, hit, load masks and
    group hits."""
    return [
        {
            "policy": variant.policy,
            "cache": variant.cache,
            "flags": {f: 1 for f in flags},
            "hits": {request_id: hit},
            "masks": {request_id: masks},
            "group_hit_tokens": group_hits,
        }
        for variant, (flags, hit, masks, group_hits) in got.items()
    ]


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
    """``cache`` (default: the trace's own) is where the flag must keep
    firing under ``policy``; the answers under every pinned policy in every
    valid cache must stay the original lookup's. ``seq`` picks the lookup
    when the request id occurs in several. The trace is read once; every
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
    shrinking = Variant(policy=policy, cache=resolve_cache(config, cache))
    variants = list(dict.fromkeys([*pinned_variants(config, (policy,)), shrinking]))

    def has_flag(flags: Sequence[str]) -> bool:
        return flag in flags if flag is not None else bool(flags)

    original = answers(config, rows[: t + 1], request_id, variants, judge)
    if not has_flag(original[shrinking][0]):
        what = f"{flag} flag" if flag else "flag"
        raise ReplayError(
            f"{reader.name}: request {request_id!r} raises no {what} under {policy}: "
            "nothing to minimize"
        )
    replays = 0
    kept_events = t

    def fails(candidate: list[Row]) -> bool:
        nonlocal replays, kept_events
        got = answers(config, candidate, request_id, variants, judge)
        failed = has_flag(got[shrinking][0]) and got == original
        replays += 1
        if failed:
            kept_events = min(kept_events, len(candidate) - 1)
        if progress is not None:
            progress(replays, kept_events, t)
        return failed

    try:
        final = shrink(config, rows, t, fails)
    except ReplayError as exc:
        raise ReplayError(f"{reader.name}: {exc}") from None
    expect = expect_entries(request_id, original)
    write_trace(
        out,
        config,
        renumbered(final),
        expect={
            "expect": expect,
            "minimized_from": os.path.basename(reader.name),
            "request_id": request_id,
        },
    )
    return {"events_before": len(rows), "events_after": len(final), "expect": expect}
