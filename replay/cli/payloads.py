"""The one JSON shape of each command's ``--json`` (documented in
``docs/json.md``): an object with ``version`` (:data:`JSON_VERSION`, raised
when a key changes meaning or goes) and ``command``; ``trace`` for a trace's
path and ``results`` for a results file's, wherever they occur; the replays
as a list ``variants`` (one entry per policy and cache, even when there is
one), each naming its ``policy``, ``cache`` and ``coordinator``; flags as a
list of ``{flag, severity, lookups}`` worst first; flagged lookups as rows;
counts and ratios as numbers (ratios from 0 to 1).

Imported by the commands when they run (it reads polars frames), never by
``replay --help``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import click
import polars as pl

from replay.analysis.flags import by_severity, severity

JSON_VERSION = 1


def echo(command: str, body: Mapping[str, Any]) -> None:
    """Print ``body`` as the command's one JSON object."""
    payload = {"version": JSON_VERSION, "command": command, **body}
    click.echo(json.dumps(payload, indent=2, default=str))


def flag_list(
    counts: Mapping[str, int], selected: frozenset[str] | None = None
) -> list[dict[str, Any]]:
    """Lookups per flag, worst first; with a ``--fail-on`` selection, whether
    each one fails."""
    out = []
    for f in by_severity(list(counts)):
        row: dict[str, Any] = {"flag": f, "severity": severity(f), "lookups": int(counts[f])}
        if selected is not None:
            row["fails"] = f in selected
        out.append(row)
    return out


def flag_rows(flags: pl.DataFrame) -> list[dict[str, Any]]:
    """Flagged lookups, one row per (lookup, flag), each with its severity."""
    return [{**r, "severity": severity(str(r["flag"]))} for r in flags.to_dicts()]


def variant(policy: str, cache: str, coordinator: str, **rest: Any) -> dict[str, Any]:
    """One replay's entry of ``variants``: who answered, then its figures."""
    return {"policy": policy, "cache": cache, "coordinator": coordinator, **rest}


def info(data: Mapping[str, Any]) -> dict[str, Any]:
    """``replay info``: ``replay.analysis.summary.trace_info`` under the shared keys."""
    renamed = {
        "path": "trace",
        "lookup_prompt_tokens": "prompt_tokens",
        "lookup_max_length_tokens": "max_length_tokens",
    }
    return {renamed.get(k, k): v for k, v in data.items()}


def diff(result: Any, inputs: list[str], output: str | None) -> dict[str, Any]:
    """``replay diff``: the two sides as ``variants`` (A then B), the totals,
    the reasons (a flag's with its severity) and every changed lookup."""
    summary = result.summary()
    sides = []
    for side, hits in ((result.a, summary["hit_tokens_a"]), (result.b, summary["hit_tokens_b"])):
        from_results = len(inputs) == 2
        sides.append(
            variant(
                side.policy,
                side.cache,
                side.coordinator,
                label=side.label,
                results=side.source if from_results else None,
                hit_tokens=hits,
            )
        )
    reasons = [
        {**r, "severity": severity(str(r["reason"])) if r["reason_kind"] == "flag" else None}
        for r in result.reasons.to_dicts()
    ]
    skip = ("trace", "a", "b", "hit_tokens_a", "hit_tokens_b")
    return {
        "trace": inputs[0] if len(inputs) == 1 else summary["trace"],
        "output": output,
        "variants": sides,
        **{k: v for k, v in summary.items() if k not in skip},
        "reasons": reasons,
        "changed_lookups": result.lookups.to_dicts(),
    }
