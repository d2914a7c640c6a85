"""`replay bisect`: every modelled vLLM release's answer for each lookup of a
trace, from one fold, and the releases at which a lookup's hit, load masks or
flags change.

Every modelled release is answered (``--from``/``--to`` narrow the range);
the release that recorded the trace (``source.vllm_version``) is named in
``trace_release`` and its column is marked ``(trace)``.

One fold of the store answers every release policy in both caches (a cache
a release did not have, or a configuration a release refuses, is listed with
the reason instead). A lookup *changes* at a release when its hit, any
group's load mask (skipped, loaded blocks) or its flags differ from the
release before it in the same cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.analysis.flags import flag_results
from replay.base.errors import ConfigError, ReplayError
from replay.base.text import counted
from replay.engine.options import ReplayOptions
from replay.engine.run import Variant, replay
from replay.format.tracedir import open_trace
from replay.rules.coordinator import RELEASES, Coordinator, Policy
from replay.rules.coordinator.policy import recorded_release, version_key


def releases_between(first: str | None, last: str | None) -> list[Policy]:
    """The release policies whose range meets ``[first, last]`` (versions)."""
    oldest, newest = RELEASES[0].first, RELEASES[-1].last
    for option, version in (("--from", first), ("--to", last)):
        if version is None:
            continue
        try:
            key = version_key(version)
        except ReplayError as exc:
            raise ReplayError(f"{option}: {exc}") from None
        if not version_key(oldest) <= key <= version_key(newest):
            raise ReplayError(
                f"{option} {version} is outside the modelled vLLM releases, {oldest} to {newest}"
            )
    lo = version_key(first) if first else (0, 0, 0)
    hi = version_key(last) if last else (1 << 30, 0, 0)
    if lo > hi:
        raise ReplayError(f"`first` {first} is after `last` {last}")
    chosen = [p for p in RELEASES if version_key(p.last) >= lo and version_key(p.first) <= hi]
    if not chosen:
        raise ReplayError(
            f"no modelled vLLM release between {first or 'the oldest'} and {last or 'the newest'}"
        )
    return chosen


@dataclass(frozen=True, slots=True)
class Answer:
    hit_tokens: int
    #: per group: (skipped blocks, loaded blocks)
    masks: tuple[tuple[int, int], ...]
    flags: tuple[str, ...]

    def as_json(self) -> dict[str, Any]:
        return {"hit_tokens": self.hit_tokens, "masks": self.masks, "flags": self.flags}

    def cell(self) -> str:
        masks = " ".join(f"{s}+{n}" for s, n in self.masks)
        flags = f" {','.join(self.flags)}" if self.flags else ""
        return f"{self.hit_tokens:,} [{masks}]{flags}"


def _change(before: Answer, after: Answer) -> list[str]:
    what = []
    if before.hit_tokens != after.hit_tokens:
        what.append(f"hit {before.hit_tokens:,} -> {after.hit_tokens:,}")
    if before.masks != after.masks:
        what.append(
            "masks "
            + " ".join(f"{s}+{n}" for s, n in before.masks)
            + " -> "
            + " ".join(f"{s}+{n}" for s, n in after.masks)
        )
    gone = [f"-{f}" for f in before.flags if f not in after.flags]
    new = [f"+{f}" for f in after.flags if f not in before.flags]
    if gone or new:
        what.append("flags " + " ".join(gone + new))
    return what


def bisect(
    trace: Path,
    *,
    caches: Sequence[str] = ("gpu", "mooncake"),
    first: str | None = None,
    last: str | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """Every release's answers and the changes, as one JSON-able object."""
    reader = open_trace(trace)
    config = reader.config
    recorded = recorded_release(config.source)
    releases = releases_between(first, last)
    variants: list[Variant] = []
    skipped: dict[str, dict[str, str]] = {c: {} for c in caches}
    for cache in caches:
        for policy in releases:
            try:
                Coordinator(config, policy, cache)
            except ConfigError as exc:
                skipped[cache][policy.name] = str(exc)
                continue
            variants.append(Variant(policy=policy.name, cache=cache))
    options = ReplayOptions(variants=tuple(variants))
    results = flag_results(replay(reader, options)) if variants else []
    by_variant: dict[tuple[str, str], list[Answer]] = {}
    keys: list[tuple[int, str]] = []
    for result in results:
        frame = result.results
        if request_id is not None:
            frame = frame.filter(frame["request_id"] == request_id)
        keys = list(zip(frame["seq"].to_list(), frame["request_id"].to_list(), strict=True))
        by_variant[(result.cache, result.policy)] = [
            Answer(
                hit,
                tuple((m - n, n) for m, n in zip(masks, loaded, strict=True)),
                tuple(flags),
            )
            for hit, masks, loaded, flags in zip(
                frame["hit_tokens"].to_list(),
                frame["mask_blocks"].to_list(),
                frame["loaded_blocks"].to_list(),
                frame["flags"].to_list(),
                strict=True,
            )
        ]
    if request_id is not None and variants and not keys:
        from replay.tools.lookup_choice import nearest_requests

        raise ReplayError(
            f"{trace}: no lookup with request_id {request_id!r}"
            + nearest_requests(trace, request_id)
        )
    out_caches = []
    for cache in caches:
        modelled = [p for p in releases if (cache, p.name) in by_variant]
        lookups = []
        for i, (seq, rid) in enumerate(keys):
            answers = {p.name: by_variant[(cache, p.name)][i] for p in modelled}
            changes = []
            for older, newer in itertools.pairwise(modelled):
                what = _change(answers[older.name], answers[newer.name])
                if what:
                    changes.append({"policy": newer.name, "release": newer.first, "changes": what})
            lookups.append(
                {
                    "seq": seq,
                    "request_id": rid,
                    "answers": {name: a.as_json() for name, a in answers.items()},
                    "cells": {name: a.cell() for name, a in answers.items()},
                    "changes": changes,
                }
            )
        out_caches.append(
            {
                "cache": cache,
                "releases": [
                    {"policy": p.name, "first": p.first, "last": p.last, "prs": p.prs}
                    for p in modelled
                ],
                "not_modelled": skipped[cache],
                "lookups": lookups,
                "changing_lookups": sum(1 for lk in lookups if lk["changes"]),
            }
        )
    return {
        "trace": str(trace),
        "request_id": request_id,
        "trace_vllm_version": (config.source or {}).get("vllm_version") if recorded else None,
        "trace_release": None if recorded is None else recorded[0].name,
        "caches": out_caches,
    }


def _shape(lookup: dict[str, Any]) -> tuple[Any, ...]:
    """How a lookup's answer changes, whatever its length: at which releases,
    by how many hit tokens, skipped and loaded blocks per group, which flags."""
    answers = list(lookup["answers"].values())
    names = list(lookup["answers"])
    shape = []
    for i, (before, after) in enumerate(itertools.pairwise(answers)):
        if before == after:
            continue
        masks = tuple(
            (s1 - s0, n1 - n0)
            for (s0, n0), (s1, n1) in zip(before["masks"], after["masks"], strict=True)
        )
        flags = (
            tuple(f for f in before["flags"] if f not in after["flags"]),
            tuple(f for f in after["flags"] if f not in before["flags"]),
        )
        shape.append((names[i + 1], after["hit_tokens"] - before["hit_tokens"], masks, flags))
    return tuple(shape)


def _groups(lookups: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The changing lookups, those that change identically (at the same
    releases, by the same hit and blocks, the same flags) together, in the
    order of each group's first."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for lk in lookups:
        if lk["changes"]:
            groups.setdefault(_shape(lk), []).append(lk)
    return list(groups.values())


def markdown(report: dict[str, Any], *, limit: int | None = None) -> list[str]:
    """Per cache: a table of the lookups that change (every release's hit,
    masks as skipped+loaded per group, flags), one row for the lookups that
    change identically with their count and the first as the example, then
    where each row changes."""
    answered = {cache["cache"] for cache in report["caches"]}
    lines = [f"# replay bisect {report['trace']}", ""]
    for cache in report["caches"]:
        releases = cache["releases"]
        lines.append(f"## {cache['cache']} cache")
        lines.append("")
        for name, why in cache["not_modelled"].items():
            # The advice to bisect the gpu cache, when it is bisected above.
            if "gpu" in answered:
                why = why.removesuffix("; use --cache gpu")
            lines.append(f"- {name}: not answered: {why}")
        if cache["not_modelled"]:
            lines.append("")
        groups = _groups(cache["lookups"])
        n, k = len(cache["lookups"]), sum(map(len, groups))
        lines.append(
            f"{counted(n, 'lookup')}, {k:,} changing between "
            f"{releases[0]['first'] if releases else '-'} and "
            f"{releases[-1]['last'] if releases else '-'}"
            + (f" in {counted(len(groups), 'pattern')}" if groups else "")
            + " (cells: hit [skipped+loaded blocks per group] flags)"
        )
        lines.append("")
        if not groups:
            continue
        shown = groups if limit is None else groups[:limit]
        names = [r["policy"] for r in releases]
        own = report.get("trace_release")
        heads = [f"{n} (trace)" if n == own else n for n in names]
        lines.append("| lookups | seq | request | " + " | ".join(heads) + " |")
        lines.append("|---|---|---|" + "---|" * len(names))
        for group in shown:
            lk = group[0]
            cells = " | ".join(lk["cells"][n] for n in names)
            lines.append(f"| {len(group):,} | {lk['seq']} | {lk['request_id']} | {cells} |")
        lines.append("")
        for group in shown:
            lk = group[0]
            which = f"seq {lk['seq']} ({lk['request_id']})"
            if len(group) > 1:
                which = f"{counted(len(group), 'lookup')} like {which}"
            steps = "; ".join(
                f"at {c['policy']} (vLLM {c['release']}): {', '.join(c['changes'])}"
                for c in lk["changes"]
            )
            lines.append(f"- {which}: {steps}")
        if len(shown) < len(groups):
            lines.append(f"- ... {counted(len(groups) - len(shown), 'more pattern')} (--limit)")
        lines.append("")
    return lines
