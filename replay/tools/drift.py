"""The drift check (``replay test --coordinator vllm --random N``): random
lookup scenarios (``replay.sources.scenarios``: every group kind, EAGLE on
and off, partial hits, stores, removes and clears between lookups, both
caches) answered by the installed vLLM and by the policy that models it,
lookup by lookup: the hit, every group's load mask, every group's own hit
and the Mamba resume position must agree.

On the first scenario that differs, the differing lookup is shrunk
(``replay.tools.minimize.shrink``: the smallest events and lookup on which
vLLM and the policy still differ) and written as a regression trace: its
``replay.expect`` pins the policy's answers in every valid cache (what
``replay test --coordinator vllm`` then checks, and fails on this vLLM), and
``replay.drift`` keeps vLLM's answer beside them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from replay.base.errors import ConfigError
from replay.base.spec import TraceConfig
from replay.engine.run import ReplayOptions, Variant, replay
from replay.format.writer import write_trace
from replay.rules.coordinator import Coordinator
from replay.rules.coordinator.kinds import REFERENCE, VLLM
from replay.sources.scenarios import Scenario, random_scenarios, scenario_rows
from replay.tools.minimize import (
    Judge,
    Row,
    answers,
    candidate,
    expect_entries,
    pinned_variants,
    renumbered,
    shrink,
)

#: The columns of a results frame both answers must agree on.
COMPARED = ("hit_tokens", "mask_blocks", "loaded_blocks", "group_hit_tokens", "mamba_state_tokens")


@dataclass
class Difference:
    """The first lookup where vLLM and its policy differ."""

    scenario: int
    cache: str
    request_id: str
    #: the policy's answer and vLLM's, per compared column (or vLLM's error)
    policy_answer: dict[str, Any]
    vllm_answer: dict[str, Any]
    #: the events of the smallest differing trace, and of the scenario
    events_before: int = 0
    events_after: int = 0
    written: str | None = None


@dataclass
class DriftReport:
    policy: str
    seed: int
    scenarios: int = 0
    lookups: int = 0
    agreed: int = 0
    #: per cache: lookups answered and agreed
    per_cache: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0
    differences: int = 0
    first: Difference | None = None
    #: configuration x cache pairs the policy answers but this vLLM's API
    #: cannot say (a spec field of a later release): skipped, not compared
    inexpressible: int = 0


def _answer_rows(result: Any) -> dict[str, dict[str, Any]]:
    """Per request id (each scenario lookup has its own), the compared
    columns as plain values."""
    res = result.results
    columns = {c: res[c].to_list() for c in COMPARED if c in res.columns}
    return {
        str(rid): {c: values[i] for c, values in columns.items()}
        for i, rid in enumerate(res["request_id"].to_list())
    }


def _vllm_error(exc: Exception) -> dict[str, Any]:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return {"error": f"{type(exc).__name__}{': ' + text if text else ''}"}


def _compare(
    config: TraceConfig, rows: Sequence[Row], policy: str, cache: str
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]] | None, Exception | None]:
    """Both answers of every lookup of ``rows`` in ``cache``, from one fold;
    vLLM raising is its answer (``None`` and the exception)."""
    from replay.adapters.vllm.backend import VllmUnavailable

    variants = (
        Variant(policy=policy, cache=cache, coordinator=REFERENCE.name),
        Variant(policy=policy, cache=cache, coordinator=VLLM.name),
    )
    try:
        ref, got = replay(candidate(config, rows), ReplayOptions(variants=variants))
    except VllmUnavailable:
        raise  # vLLM missing or its API moved: the environment's problem
    except Exception as exc:
        (ref,) = replay(candidate(config, rows), ReplayOptions(variants=variants[:1]))
        return _answer_rows(ref), None, exc
    return _answer_rows(ref), _answer_rows(got), None


def _differs(
    request_id: str,
    ref: dict[str, dict[str, Any]],
    got: dict[str, dict[str, Any]] | None,
) -> bool:
    return got is None or ref.get(request_id) != got.get(request_id)


def check_drift(
    count: int,
    seed: int,
    policy: str,
    *,
    judge: Judge,
    output: Callable[[Difference], str | os.PathLike[str]],
    version: str,
    progress: Callable[[int, int], None] | None = None,
) -> DriftReport:
    """Answer ``count`` scenarios of ``seed`` through the installed vLLM and
    ``policy``; shrink the first difference and write it where ``output``
    says (called once, with the difference)."""
    from replay.adapters.vllm.backend import VllmCannotExpress, VllmCoordinator

    report = DriftReport(policy=policy, seed=seed)
    start = time.perf_counter()
    scenario: Scenario
    for scenario in random_scenarios(seed, count):
        report.scenarios += 1
        rows = scenario_rows(scenario)
        # The trace's own cache is one the configuration is valid for (the
        # reader checks a trace's configuration for its own cache).
        config = replace(
            scenario.config,
            source={"tool": "replay test --random", "seed": seed, "cache": scenario.caches[0]},
        )
        for cache in scenario.caches:
            try:
                Coordinator(config, policy, cache)
            except ConfigError:
                continue  # the policy's releases refuse it in this cache
            try:
                VllmCoordinator(config, policy, cache)
            except VllmCannotExpress:
                # e.g. extra_retained_tokens before 0.28.0: no answer of
                # vLLM's to compare, not a difference.
                report.inexpressible += 1
                continue
            ref, got, error = _compare(config, rows, policy, cache)
            agreed = [rid for rid in ref if not _differs(rid, ref, got)]
            counts = report.per_cache.setdefault(cache, [0, 0])
            counts[0] += len(ref)
            counts[1] += len(agreed)
            report.lookups += len(ref)
            report.agreed += len(agreed)
            if len(agreed) == len(ref):
                continue
            report.differences += 1
            if report.first is None:
                first = next(rid for rid in ref if _differs(rid, ref, got))
                report.first = _shrunk(
                    scenario,
                    config,
                    rows,
                    cache,
                    first,
                    policy,
                    judge,
                    error,
                    output,
                    version,
                    seed,
                )
        if progress is not None:
            progress(report.scenarios, count)
    report.seconds = time.perf_counter() - start
    return report


def _shrunk(
    scenario: Scenario,
    config: TraceConfig,
    rows: list[Row],
    cache: str,
    request_id: str,
    policy: str,
    judge: Judge,
    error: Exception | None,
    output: Callable[[Difference], str | os.PathLike[str]],
    version: str,
    seed: int,
) -> Difference:
    t = next(i for i, r in enumerate(rows) if r.get("request_id") == request_id)

    def still_differs(candidate: list[Row]) -> bool:
        ref, got, _ = _compare(config, candidate, policy, cache)
        return _differs(request_id, ref, got)

    small = shrink(config, rows[: t + 1], t, still_differs)
    ref, got, error = _compare(config, small, policy, cache)
    diff = Difference(
        scenario=scenario.index,
        cache=cache,
        request_id=request_id,
        policy_answer=ref.get(request_id, {}),
        vllm_answer=(got or {}).get(request_id, {}) if error is None else _vllm_error(error),
        events_before=len(rows),
        events_after=len(small),
    )
    pinned = pinned_variants(config, (policy,))
    expect = expect_entries(request_id, answers(config, small, request_id, pinned, judge))
    path = output(diff)
    write_trace(
        path,
        config,
        renumbered(small),
        expect={
            "expect": expect,
            "request_id": request_id,
            "drift": {
                "seed": seed,
                "scenario": scenario.index,
                "cache": cache,
                "policy": policy,
                "policy_answer": diff.policy_answer,
                "vllm": version,
                "vllm_answer": diff.vllm_answer,
            },
        },
    )
    diff.written = os.fspath(path)
    return diff
