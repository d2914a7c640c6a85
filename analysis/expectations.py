"""Regression traces: the expectations a trace carries, and checking them
against a replay through the reference coordinator or the installed vLLM.

A trace opts in with an Arrow metadata key ``replay.expect`` (JSON)::

    {"expect": [
        {"policy": "vllm-0.33", "cache": "gpu", "flags": {}},
        {"policy": "pre-49502", "cache": "mooncake", "flags": {"mamba_overrun": 1},
         "hits": {"req-43559": 64}}
    ]}

``flags`` is the exact count of flagged lookups per flag kind (``{}``: clean);
``hit_tokens`` the total hit over every lookup; ``group_hit_tokens`` per
group the total of that group's own finder hit; ``hits`` pins the replayed hit
of named requests (the last lookup of each); ``masks`` their load masks, per
group ``[mask blocks, loaded blocks]``; ``cache`` picks the cache that
answers (default: the trace's own). Any may be left out.

One engine for both faces, ``replay test`` and the pytest plugin: every
expectation of a trace is checked from one fold of its store. Under the
``vllm`` coordinator only the expectations whose policy answers as the
installed vLLM's release in their cache are checked
(``replay.adapters.vllm.backend.installed_policy``); the others are skipped
with the reason. An entry without ``policy`` is checked under the release
that recorded the trace (``source.vllm_version``), else the default.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.base.text import counted
from replay.format.schema import EXPECT_META_KEY
from replay.format.trace import TraceReader
from replay.rules.coordinator.kinds import DEFAULT_COORDINATOR, REFERENCE, get_coordinator

#: How many wrong requests a failure lists.
SHOWN = 10


def corpus_dir() -> Path:
    """The regression corpus shipped inside the package (``traces/`` in a
    checkout, ``replay/corpus`` once installed)."""
    return Path(str(resources.files("replay") / "corpus"))


def read_expectations(path: Path) -> list[dict[str, Any]] | None:
    """The trace's expectation entries; ``None`` when it carries none (or is
    not a Parquet file). A malformed entry list raises ``ReplayError``."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_schema(str(path)).metadata or {}
    except Exception:  # not a Parquet file: carries no expectation
        return None
    raw = meta.get(EXPECT_META_KEY)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ReplayError(f"{path}: replay.expect is not JSON ({exc})") from None
    entries = data.get("expect") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ReplayError(f"{path}: replay.expect must be an object with an 'expect' list")
    return entries


def expectation_traces(paths: Sequence[Path]) -> list[Path]:
    """Every trace file with expectations among ``paths`` (files, or
    directories searched recursively; results files are never traces). A
    named file without expectations, or a directory without any, is an
    error."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            inside = [
                p
                for p in sorted(path.rglob("*.parquet"))
                if not p.name.endswith(".results.parquet") and read_expectations(p) is not None
            ]
            if not inside:
                raise ReplayError(f"{path}: no trace with a replay.expect entry in this directory")
            found += inside
        elif path.exists():
            if read_expectations(path) is None:
                raise ReplayError(
                    f"{path}: not a trace with expectations (no replay.expect metadata entry)"
                )
            found.append(path)
        else:
            raise ReplayError(f"{path}: no such file or directory")
    return list(dict.fromkeys(found))


def entry_policy(entry: dict[str, Any], source: Mapping[str, Any] | None = None) -> str:
    """The policy an expectation is checked under: its own, else (the one
    rule of every command, ``choose_policies``) the release that recorded
    the trace (``source.vllm_version``), else the default."""
    from replay.rules.coordinator import choose_policies

    given = (str(entry["policy"]),) if entry.get("policy") is not None else ()
    return choose_policies(given, source=source).policies[0]


@dataclass
class Verdict:
    """One expectation of one trace, checked (or skipped)."""

    trace: Path
    entry: dict[str, Any]
    policy: str
    #: the cache that answered (the entry's, else the trace's own)
    cache: str
    #: what did not hold, one line each; empty when it holds
    problems: list[str] = field(default_factory=list)
    #: the explain text of the first lookups that differ
    explained: list[str] = field(default_factory=list)
    #: why it was not checked
    skipped: str | None = None
    #: lookups whose answer differs (pinned requests with another hit or
    #: mask, flagged lookups), the count a grouped failure adds up
    lookups: int = 0
    #: events in the trace: failures print smallest trace first
    events: int = 0
    #: the one-line cause of the first differing lookup, from the adapter
    #: that answered (e.g. which of vLLM's finder calls returned what);
    #: failures with the same cause are grouped under it. ``None``: no
    #: adapter said (the reference coordinator, or a cause not found).
    cause: str | None = None
    #: the ``replay explain`` commands of the first differing lookups, each
    #: runnable as printed (the trace's absolute path)
    commands: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.problems)


def compare(
    entry: dict[str, Any],
    result: Any,
    fail_on: str | Iterable[str] | None = None,
    ignore: str | Iterable[str] | None = None,
) -> tuple[list[str], list[str]]:
    """What of ``entry`` the replay ``result`` does not give, and the
    request ids of the lookups that differ, first first. ``ignore`` leaves
    flags out of the comparison on both sides; an entry without ``flags``
    fails when a flag ``fail_on`` selects fires (``replay check``'s choices,
    default: corruption)."""
    from replay.analysis.flags import flag_counts, result_flags, worst_first
    from replay.analysis.selection import failing, select_flags, selection_text
    from replay.tools.render import counts_text

    flags = result_flags(result)
    problems: list[str] = []
    res = result.results
    request_ids = res["request_id"].to_list()
    last = dict(zip(request_ids, res["hit_tokens"].to_list(), strict=True))
    wrong: list[str] = []
    differ: list[str] = []
    pinned = entry.get("hits") or {}
    for request_id, want_hit in pinned.items():
        if request_id not in last:
            wrong.append(f"request {request_id}: not in the trace")
        elif int(last[request_id]) != int(want_hit):
            wrong.append(
                f"request {request_id}: expected hit {want_hit}, replayed {last[request_id]}"
            )
            differ.append(str(request_id))
    masks = entry.get("masks") or {}
    if masks:
        got_masks = {
            rid: [[m, n] for m, n in zip(mb, lb, strict=True)]
            for rid, mb, lb in zip(
                request_ids,
                res["mask_blocks"].to_list(),
                res["loaded_blocks"].to_list(),
                strict=True,
            )
        }
        for request_id, want_masks in masks.items():
            got_mask = got_masks.get(request_id)
            if got_mask is not None and got_mask != want_masks:
                wrong.append(
                    f"request {request_id}: expected [mask, loaded] blocks per group "
                    f"{want_masks}, replayed {got_mask}"
                )
                differ.append(str(request_id))
    flagged: list[str] = []
    got = flag_counts(flags)
    if "flags" in entry:
        compared = select_flags("all", ignore)
        want = {k: int(v) for k, v in entry["flags"].items() if v and k in compared}
        got = {k: n for k, n in got.items() if k in compared}
        if got != want:
            problems.append(f"flags: expected {want or 'none'}, replayed {got or 'none'}")
            flagged = [str(r) for r in flags["request_id"].unique(maintain_order=True).to_list()]
    else:
        fails = failing(got, select_flags(fail_on, ignore))
        if fails:
            problems.append(
                f"flags: {counts_text(worst_first(fails))} ({selection_text(fail_on, ignore)})"
            )
            chosen = flags.filter(flags["flag"].is_in(list(fails)))
            flagged = [str(r) for r in chosen["request_id"].unique(maintain_order=True).to_list()]
    if "hit_tokens" in entry:
        got_total = int(res["hit_tokens"].sum() or 0)
        if got_total != int(entry["hit_tokens"]):
            problems.append(
                f"hit tokens: expected {entry['hit_tokens']} in all, replayed {got_total}"
            )
    if "group_hit_tokens" in entry:
        per_lookup = res["group_hit_tokens"].to_list()
        got_groups = [sum(col) for col in zip(*per_lookup, strict=True)] if per_lookup else []
        if got_groups != [int(v) for v in entry["group_hit_tokens"]]:
            problems.append(
                f"group hit tokens: expected {entry['group_hit_tokens']} per group, "
                f"replayed {got_groups}"
            )
    problems += wrong[:SHOWN]
    if len(wrong) > SHOWN:
        problems.append(f"... and {len(wrong) - SHOWN} more requests with another hit")
    # The first lookup that differs: a pinned request with another hit, in
    # trace order; else (only flags or totals moved) the first flagged one.
    order = {rid: i for i, rid in reversed(list(enumerate(request_ids)))}
    differ.sort(key=lambda rid: order.get(rid, len(order)))
    return problems, list(dict.fromkeys(differ + flagged))


def explain_text(
    reader: TraceReader,
    name: str,
    policy: str,
    cache: str,
    coordinator: str,
    request_ids: Sequence[str],
    *,
    cache_named: bool = True,
    commands: list[str] | None = None,
    causes: list[str] | None = None,
) -> list[str]:
    """``replay explain`` of each request (its last lookup). Under vLLM the
    reference's fixed point, step by step, comes first, then vLLM's own:
    each finder call it made, its hit and every group's mask; the first
    call whose answer differs (``finder_cause``) goes into ``causes``, one
    line per request. ``name`` is the trace as the printed commands name
    it; each command goes into ``commands`` too."""
    import shlex

    from replay.engine.replay import explain_lookups
    from replay.tools.render import explain_table

    wanted = set(request_ids)
    oracle = get_coordinator(coordinator).installed_vllm
    coordinators = [REFERENCE.name] + ([coordinator] if oracle else [])
    outcomes: dict[str, dict[str, Any]] = {}
    config = reader.config
    for coord in coordinators:
        config, found = explain_lookups(
            reader, lambda e: e.request_id in wanted, policy, coord, cache=cache
        )
        outcomes[coord] = {lookup.request_id: outcome for lookup, outcome, _ in found}
    out: list[str] = []
    for rid in dict.fromkeys(request_ids):
        if rid not in outcomes[REFERENCE.name]:
            continue
        command = f"replay explain {shlex.quote(name)} --request {shlex.quote(rid)}"
        command += f" --policy {policy}"
        if cache_named:
            command += f" --cache {cache}"
        if oracle:
            command += f" --coordinator {coordinator}"
        if commands is not None:
            commands.append(command)
        if oracle:
            reference = command.removesuffix(f" --coordinator {coordinator}")
            out += ["", f"{reference} (what policy {policy} computes, step by step):"]
            out.append(explain_table(config, outcomes[REFERENCE.name][rid]))
            if rid in outcomes[coordinator]:
                out += ["", f"{command} (what the installed vLLM answered):"]
                out.append(explain_table(config, outcomes[coordinator][rid]))
                cause = finder_cause(
                    policy, outcomes[REFERENCE.name][rid], outcomes[coordinator][rid]
                )
                if causes is not None and cause is not None:
                    causes.append(cause)
        else:
            out += ["", f"{command}:"]
            out.append(explain_table(config, outcomes[REFERENCE.name][rid]))
    return out


def finder_cause(policy: str, reference: Any, got: Any) -> str | None:
    """The first of vLLM's finder calls whose answer differs from the
    policy's, in one line naming vLLM's function (``got.steps`` are the
    calls vLLM's fixed point made, ``reference.steps`` the policy's, whose
    reuses of a full-attention hit call no finder); ``None`` when vLLM and
    the policy answer alike."""
    mine = [s for s in reference.steps if not s.reused]
    theirs = list(got.steps)
    for a, b in zip(mine, theirs, strict=False):
        if (a.spec_group, a.bound, a.drop) == (b.spec_group, b.bound, b.drop):
            if a.hit_tokens != b.hit_tokens:
                return (
                    f"{b.call} returned {b.hit_tokens:,}; {policy}'s {a.kind.value} finder "
                    f"returns {a.hit_tokens:,} with the same arguments"
                )
            continue
        return (
            f"vLLM's fixed point called {b.call} (spec group {b.spec_group}), which returned "
            f"{b.hit_tokens:,}; {policy}'s calls its {a.kind.value} finder (spec group "
            f"{a.spec_group}) with max_length={a.bound:,}, drop={a.drop}, which returns "
            f"{a.hit_tokens:,}"
        )
    if theirs and len(mine) != len(theirs):
        n = min(len(mine), len(theirs))
        then = (
            f"vLLM called {theirs[n].call}, which returned {theirs[n].hit_tokens:,}"
            if len(theirs) > n
            else f"{policy} calls its {mine[n].kind.value} finder with max_length={mine[n].bound:,}"
        )
        return (
            f"vLLM's fixed point made {len(theirs)} finder calls, {policy}'s {len(mine)}; "
            f"the first {n} agree, then {then}"
        )
    ours = (reference.hit_tokens, [g.mask() for g in reference.groups])
    if ours == (got.hit_tokens, [g.mask() for g in got.groups]):
        return None
    if not theirs:
        return (
            f"vLLM's coordinator answered hit {got.hit_tokens:,}, {policy}'s fixed point "
            f"{reference.hit_tokens:,} (vLLM calls a single group's finder directly: no "
            "call was recorded)"
        )
    return (
        f"every finder call agrees with {policy}'s; vLLM's answer differs after the fixed "
        f"point (hit {got.hit_tokens:,} against {reference.hit_tokens:,}, or a load mask): "
        "the final trim, or KVCacheManager.get_computed_blocks around it"
    )


def _vllm_raised(exc: Exception) -> str:
    where = ""
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if "/vllm/" in filename:
            where = f" ({filename.split('/vllm/', 1)[1]}:{tb.tb_lineno})"
        tb = tb.tb_next
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"vLLM raised {type(exc).__name__}{': ' + text if text else ''}{where}"


def check_trace(
    path: Path,
    coordinator: str = DEFAULT_COORDINATOR,
    caches: Iterable[str] | None = None,
    *,
    explained: int = 1,
    name: str | None = None,
    only: dict[str, Any] | None = None,
    fail_on: str | Iterable[str] | None = None,
    ignore: str | Iterable[str] | None = None,
) -> list[Verdict]:
    """Check every expectation of the trace at ``path`` whose cache is in
    ``caches`` (all when ``None``), from one fold of its store. Under
    ``vllm``, an expectation of another policy than the installed vLLM's is
    skipped, and vLLM raising during a replay fails the expectations it
    answers (the exception is the finding, not bad input). ``only``: check
    that one entry alone (the pytest plugin's item)."""
    from replay.engine.answers import Variant
    from replay.engine.run import ReplayOptions, replay
    from replay.format.tracedir import open_trace

    reader = open_trace(path)
    verdicts = planned_verdicts(path, reader.config, coordinator, caches, only)
    size = _events(reader)
    for v in verdicts:
        v.events = size
    todo = [v for v in verdicts if v.skipped is None]
    variants = list(
        dict.fromkeys(
            Variant(policy=v.policy, cache=v.cache, coordinator=coordinator) for v in todo
        )
    )
    if not variants:
        return verdicts
    try:
        results = replay(
            reader,
            ReplayOptions(
                variants=tuple(
                    Variant(policy=v.policy, cache=v.cache, coordinator=coordinator)
                    for v in variants
                )
            ),
        )
    except Exception as exc:
        if not get_coordinator(coordinator).installed_vllm or _is_setup_error(exc):
            raise
        for v in todo:
            v.problems = [_vllm_raised(exc)]
        return verdicts
    by_variant = dict(zip(variants, results, strict=True))
    # The printed commands run from anywhere: the trace's absolute path.
    shown = name or str(path.resolve())
    for v in todo:
        result = by_variant[Variant(policy=v.policy, cache=v.cache, coordinator=coordinator)]
        v.problems, differ = compare(v.entry, result, fail_on, ignore)
        v.lookups = max(len(differ), 1) if v.problems else 0  # a total moved: one at least
        if v.problems and differ and explained:
            causes: list[str] = []
            try:
                v.explained = explain_text(
                    reader,
                    shown,
                    v.policy,
                    v.cache,
                    coordinator,
                    differ[:explained],
                    cache_named=bool(v.entry.get("cache")),
                    commands=v.commands,
                    causes=causes,
                )
                v.cause = causes[0] if causes else None
            except Exception as exc:
                if not get_coordinator(coordinator).installed_vllm or _is_setup_error(exc):
                    raise
                v.explained = ["", f"(no explain: {_vllm_raised(exc)})"]
    return verdicts


def _events(reader: Any) -> int:
    """The trace's events (its rows), read from the footer."""
    rows = getattr(reader, "num_rows", 0)  # a method of a file, a property of a directory
    return int(rows() if callable(rows) else rows)


def planned_verdicts(
    path: Path,
    config: TraceConfig,
    coordinator: str,
    caches: Iterable[str] | None = None,
    only: dict[str, Any] | None = None,
) -> list[Verdict]:
    """The expectations of the trace at ``path`` to check (its entries, or
    ``only``), each with its policy and cache, and the reason when it is
    skipped: under ``vllm``, an expectation whose policy answers otherwise
    than the installed vLLM's release in its cache (an alias is checked in
    the cache where it means the installed release)."""
    from replay.rules.coordinator import POLICIES, resolve_cache, same_rules

    entries = read_expectations(path) if only is None else [only]
    if entries is None:
        raise ReplayError(
            f"{path}: not a trace with expectations (no replay.expect metadata entry)"
        )
    wanted_caches = None if caches is None else set(caches)
    match: str | None = None
    skip_reason = ""
    oracle = get_coordinator(coordinator).installed_vllm
    if oracle:
        from replay.adapters.vllm.backend import installed_policy

        match, skip_reason = installed_policy()
    verdicts: list[Verdict] = []
    for entry in entries:
        policy = entry_policy(entry, config.source)
        if policy not in POLICIES:
            raise ReplayError(
                f"{path}: replay.expect names policy {policy!r}; known: {', '.join(POLICIES)}"
            )
        try:
            cache = resolve_cache(config, entry.get("cache"))
        except ReplayError as exc:
            raise ReplayError(f"{path}: replay.expect: {exc}") from None
        if wanted_caches is not None and cache not in wanted_caches:
            continue
        verdict = Verdict(path, entry, policy, cache)
        if oracle and (match is None or not same_rules(policy, match, cache)):
            verdict.skipped = skip_reason.format(policy=policy, cache=cache)
        verdicts.append(verdict)
    return verdicts


def _is_setup_error(exc: Exception) -> bool:
    """The vLLM backend could not start (vLLM missing or its API moved): the
    environment's problem, reported as such, not a finding about vLLM."""
    from replay.adapters.vllm.backend import VllmUnavailable

    return isinstance(exc, VllmUnavailable)


@dataclass
class Run:
    """A ``replay test`` run: every verdict, and its time."""

    verdicts: list[Verdict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.failed]

    @property
    def checked(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.skipped is None]

    def to_json(self, coordinator: str) -> dict[str, Any]:
        """``replay test --json``'s body (``docs/json.md``; the CLI adds the
        ``version`` and ``command`` frame): the counts and every
        expectation's outcome, in the order the traces ran."""
        skipped = len(self.verdicts) - len(self.checked)
        return {
            "trace": None,
            "traces": list(dict.fromkeys(str(v.trace) for v in self.verdicts)),
            "coordinator": coordinator,
            "expectations_total": len(self.verdicts),
            "passed": len(self.checked) - len(self.failed),
            "failed": len(self.failed),
            "skipped": skipped,
            "seconds": round(self.seconds, 3),
            "expectations": [
                {
                    "trace": str(v.trace),
                    "policy": v.policy,
                    "cache": v.cache,
                    "coordinator": coordinator,
                    "status": _status(v),
                    "events": v.events,
                    "lookups": v.lookups,
                    "cause": v.cause,
                    "problems": v.problems,
                    "commands": v.commands,
                    "reason": v.skipped,
                }
                for v in self.verdicts
            ],
        }


def run_traces(
    paths: Sequence[Path],
    coordinator: str,
    caches: Iterable[str] | None,
    on_trace: Any = None,
    fail_on: str | Iterable[str] | None = None,
    ignore: str | Iterable[str] | None = None,
) -> Run:
    """Check every trace; ``on_trace(path, verdicts, seconds)`` after each."""
    run = Run()
    start = time.perf_counter()
    cache_list = None if caches is None else list(caches)
    for path in paths:
        t0 = time.perf_counter()
        verdicts = check_trace(path, coordinator, cache_list, fail_on=fail_on, ignore=ignore)
        run.verdicts += verdicts
        if on_trace is not None:
            on_trace(path, verdicts, time.perf_counter() - t0)
    run.seconds = time.perf_counter() - start
    return run


# --- the text of replay test -------------------------------------------------------------


def _verdict_word(v: Verdict) -> str:
    return {"skipped": "skipped", "failed": "FAILED", "passed": "ok"}[_status(v)]


def test_progress_line(
    done: int, total: int, path: Path, verdicts: Sequence[Verdict], seconds: float
) -> str:
    """``[3/12] issue-43559.parquet: vllm-0.33/gpu ok, ... (0.4 s)``."""
    checked = [v for v in verdicts if v.skipped is None]
    parts = [f"{v.policy}/{v.cache} {_verdict_word(v)}" for v in checked]
    skipped = len(verdicts) - len(checked)
    if skipped:
        parts.append(f"{skipped} skipped")
    return (
        f"[{done}/{total}] {path.name}: {', '.join(parts) or 'nothing to check'} ({seconds:.1f} s)"
    )


def _status(v: Verdict) -> str:
    return "skipped" if v.skipped is not None else ("failed" if v.failed else "passed")


def failure_block(v: Verdict) -> list[str]:
    """One failing expectation in full: the trace, policy and cache, the
    cause (the one line an adapter gives, when it gave one), what did not
    hold, and the explain text of the first lookup that differs."""
    return [
        f"FAILED {v.trace.name} under policy {v.policy} in the {v.cache} cache:",
        *([f"  cause: {v.cause}"] if v.cause else []),
        *(f"  {p}" for p in v.problems),
        *v.explained,
    ]


#: The lengths and spec groups in a cause line (not the digits of a name
#: such as ``vllm-0.33``).
_CAUSE_NUMBER = re.compile(r"(?<=[= ])\d+(?:,\d{3})*(?![\d.])")


def cause_shape(cause: str | None) -> str | None:
    """A cause with its numbers left out (``max_length=…``): the failures
    of one cause at other lengths, in other traces, are one group."""
    return None if cause is None else _CAUSE_NUMBER.sub("…", cause)


def failure_groups(failed: Sequence[Verdict]) -> list[list[Verdict]]:
    """Failing expectations grouped by what failed: the policy, the cache and
    the adapter's cause (without one, every failure of a policy in a cache
    is one group); each group smallest trace first, the group with the
    smallest trace first."""
    groups: dict[tuple[str, str, str | None], list[Verdict]] = {}
    for v in failed:
        groups.setdefault((v.policy, v.cache, cause_shape(v.cause)), []).append(v)
    ordered = [
        sorted(vs, key=lambda v: (v.events, v.trace.name, v.trace)) for vs in groups.values()
    ]
    return sorted(ordered, key=lambda vs: (vs[0].events, vs[0].trace.name, vs[0].policy))


def _lookups_text(n: int) -> str:
    return f"{n} lookup{'s' if n != 1 else ''}"


def test_failure_lines(failed: Sequence[Verdict]) -> list[str]:
    """The failures of a run, grouped by cause (``failure_groups``): per
    group one heading (``42 lookups in 9 traces ...``), the smallest trace
    in full (``failure_block``), then one line per other trace of the group
    with its first problem and a command that runs as printed."""
    out: list[str] = []
    for group in failure_groups(failed):
        first = group[0]
        lookups = sum(v.lookups for v in group)
        traces = len({v.trace for v in group})
        heading = (
            f"{_lookups_text(lookups)} in {traces} trace{'s' if traces != 1 else ''} "
            f"differ under policy {first.policy} in the {first.cache} cache"
        )
        shape = cause_shape(first.cause)
        out.append(heading + (f": {shape}" if shape else ""))
        out += [*failure_block(first), ""]
        if len(group) > 1:
            out.append(f"the other {len(group) - 1} of this group, smallest first:")
            for v in group[1:]:
                line = f"  {v.trace.name} ({v.events} events, {_lookups_text(v.lookups)}): "
                line += v.problems[0] if v.problems else "failed"
                out.append(line)
                if v.commands:
                    out.append(f"    {v.commands[0]}")
            out.append("")
    return out


def junit_xml(run: Run, coordinator: str) -> str:
    """``replay test --junit-xml``: one ``testcase`` per trace x policy x
    cache (``classname`` the trace, ``name`` policy and cache), a
    ``failure`` whose message is the first problem and whose text is the
    whole failure, a ``skipped`` with the reason."""
    import xml.etree.ElementTree as ET

    skipped = len(run.verdicts) - len(run.checked)
    suites = ET.Element("testsuites")
    suite = ET.SubElement(
        suites,
        "testsuite",
        name=f"replay test --coordinator {coordinator}",
        tests=str(len(run.verdicts)),
        failures=str(len(run.failed)),
        errors="0",
        skipped=str(skipped),
        time=f"{run.seconds:.3f}",
    )
    for v in run.verdicts:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=v.trace.stem,
            name=f"{v.trace.stem}[{v.policy}-{v.cache}]",
            file=str(v.trace),
        )
        if v.skipped is not None:
            ET.SubElement(case, "skipped", message=v.skipped)
        elif v.failed:
            message = (f"{v.cause}: " if v.cause else "") + v.problems[0]
            failure = ET.SubElement(case, "failure", message=message, type="ExpectationMismatch")
            failure.text = "\n".join(failure_block(v))
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, "unicode") + "\n"


def test_summary_line(run: Run, coordinator: str) -> str:
    checked = run.checked
    skipped = [v for v in run.verdicts if v.skipped is not None]
    traces = len({v.trace for v in run.verdicts})
    text = (
        f"{len(checked) - len(run.failed)} passed, {len(run.failed)} failed, "
        f"{len(skipped)} skipped: {counted(len(run.verdicts), 'expectation')} of "
        f"{counted(traces, 'trace')} "
        f"through the {coordinator} coordinator in {run.seconds:.1f} s"
    )
    # One reason per policy, naming every cache it was skipped in.
    caches: dict[str, set[str]] = {}
    for v in skipped:
        if v.skipped:
            base = v.skipped.replace(f" in the {v.cache} cache:", ":", 1)
            caches.setdefault(base, set()).update([v.cache] if base != v.skipped else [])
    reasons = []
    for base, where in sorted(caches.items()):
        if where:
            names = " and ".join(sorted(where))
            noun = "caches" if len(where) > 1 else "cache"
            base = base.replace(" is not checked:", f" is not checked in the {names} {noun}:", 1)
        reasons.append(base)
    if reasons:
        text += " (" + "; ".join(reasons) + ")"
    return text
