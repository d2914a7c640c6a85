"""``replay run``, ``replay check``, ``replay explain`` and ``replay
minimize``: the commands that replay a trace through the coordinator and
read its flags. Checks that find a problem exit 1."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import click

from replay.base.text import counted
from replay.cli.common import command, fail
from replay.cli.options import (
    TRACE,
    cache_option,
    chosen_policies,
    coordinator_option,
    count_option,
    integer_type,
    output_option,
    policy_options,
    selection_options,
)
from replay.cli.progress import Bar, progress_bar
from replay.cli.scale import RAY, WORKERS, results_paths
from replay.rules.coordinator import (
    DEFAULT_POLICY,
)
from replay.tools.render import (
    check_lines,
    config_lines,
    explain_header,
    explain_table,
    minimize_lines,
    run_summary_lines,
)

COORDINATOR = coordinator_option()
SEQ = click.option(
    "--seq",
    type=integer_type(),
    default=None,
    help="The seq of the lookup, when the request_id occurs in several.",
)


@command()
@TRACE
@output_option(
    "Results file (default: NAME.results.parquet beside the trace). With several "
    "--policy, each policy's name goes before the suffix."
)
@policy_options(
    "whose semantics answer each lookup; repeat it for one results file per policy from one fold",
    multiple=True,
)
@cache_option("Repeat it for one results file per cache from the same fold", multiple=True)
@COORDINATOR
@WORKERS
@RAY
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary text.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.option(
    "--unit-present",
    is_flag=True,
    help="Also write, per lookup and group, which hash units the store held (the raw store "
    "state each lookup saw; larger results).",
)
@count_option("--examples", default=5, help="Flagged lookups to show.")
def run(
    trace: Path,
    output: Path | None,
    policies: tuple[str, ...],
    caches: tuple[str, ...],
    vllm_versions: tuple[str, ...],
    coordinator: str,
    workers: int | None,
    ray_address: str | None,
    quiet: bool,
    as_json: bool,
    unit_present: bool,
    examples: int,
) -> None:
    """Replay TRACE (a trace file or directory) through the coordinator and
    write the results file.

    Exit status 0 whatever the flags (use `replay check` to fail on them), 2 on bad input.
    """
    from replay.analysis.flags import (
        flag_counts,
        flag_examples,
        flag_results,
        flags_table,
        severity,
        worst_first,
    )
    from replay.analysis.summary import run_summary
    from replay.engine.run import ReplayOptions, replay
    from replay.format.link import save_results
    from replay.format.paths import PARQUET, check_outputs, output_format, staged_outputs
    from replay.tools.render import counts_text

    policies = chosen_policies(
        trace, dict.fromkeys(policies), dict.fromkeys(vllm_versions), quiet=quiet, most=None
    )
    used: tuple[str | None, ...] = tuple(dict.fromkeys(caches)) or (None,)
    outs = results_paths(trace, output, policies, used)
    check_outputs({"-o" if len(outs) == 1 else f"-o ({out.name})": out for out in outs}, [trace])
    if output is not None:  # the name the user gave; each variant's name keeps its suffix
        output_format("-o", output, PARQUET, default="parquet")
    with progress_bar(quiet or as_json) as bar:
        options = ReplayOptions(
            policies=policies,
            caches=used,
            coordinator=coordinator,
            unit_present=unit_present,
            workers=workers,
            ray_address=ray_address,
            progress=None if bar is None else bar.replay,
        )
        results = flag_results(replay(trace, options))
    summaries = []
    # Several results files appear together or not at all (one is atomic itself).
    with staged_outputs() as stage:
        for result, out in zip(results, outs, strict=True):
            flags = flags_table(result.results)
            save_results(result, stage.file(out) if len(outs) > 1 else out)
            summary = run_summary(result, flag_counts(flags))
            summary["results"] = str(out)
            summary["examples"] = flag_examples(flags, examples)
            summaries.append(summary)
    if as_json:
        from replay.cli import payloads

        payloads.echo(
            "run",
            {
                "trace": str(trace),
                "variants": [
                    payloads.variant(
                        s["policy"],
                        s["cache"],
                        s["coordinator"],
                        results=s["results"],
                        **{
                            k: v
                            for k, v in s.items()
                            if k
                            not in (
                                "trace",
                                "policy",
                                "cache",
                                "coordinator",
                                "results",
                                "examples",
                            )
                        }
                        | {
                            "flags": payloads.flag_list(s["flags"]),
                            "flagged": [
                                e | {"severity": severity(e["flag"])} for e in s["examples"]
                            ],
                        },
                    )
                    for s in summaries
                ],
            },
        )
        return
    if quiet:
        return
    for summary in summaries:
        for line in run_summary_lines(summary, counts_text(worst_first(summary["flags"]))):
            click.echo(line)


TRACE_OR_RESULTS = click.argument("trace", metavar="TRACE|RESULTS", type=click.Path(path_type=Path))


def _followed(
    path: Path,
    policy: str | None,
    vllm: tuple[str, ...],
    cache: str | None,
    *,
    alias_notes: bool = True,
) -> tuple[Path, str, str | None]:
    """A trace as it is; a results file: the trace it leads to, and its
    policy and cache unless the options name others. The policy is chosen
    by the one rule (``chosen_policies``); ``alias_notes=False`` where the
    output names an alias's release itself."""
    from replay.format.link import trace_of
    from replay.format.results import results_cache

    trace, info = trace_of(path)
    own = None if info is None else str(info.get("policy", DEFAULT_POLICY))
    (chosen,) = chosen_policies(
        trace, (policy,) if policy else (), vllm, results_policy=own, alias_notes=alias_notes
    )
    return trace, chosen, cache or (None if info is None else results_cache(info))


@command()
@TRACE_OR_RESULTS
@click.option("--request", "request_id", required=True, help="The request_id of a lookup.")
@SEQ
@policy_options("whose semantics explain the lookup", results=True)
@cache_option()
@COORDINATOR
def explain(
    trace: Path,
    request_id: str,
    seq: int | None,
    policy: str | None,
    vllm_versions: tuple[str, ...],
    cache: str | None,
    coordinator: str,
) -> None:
    """Show how the coordinator decided one request's hit, step by step, and
    the lookup's flags. Given a RESULTS file, explains in its trace (which
    the results lead to) under its policy and cache."""
    from replay.analysis.flags import lookup_flags
    from replay.engine.replay import explain_lookups
    from replay.rules.coordinator import resolve_cache
    from replay.tools.lookup_choice import choose_lookup
    from replay.tools.render import flag_lines

    trace, policy, cache = _followed(trace, policy, vllm_versions, cache, alias_notes=False)

    config, found = explain_lookups(
        trace, lambda e: e.request_id == request_id, policy, coordinator, cache=cache
    )
    chosen = choose_lookup(trace, request_id, [lk.seq for lk, _, _ in found], seq)
    used = resolve_cache(config, cache)
    for lookup, outcome, facts in found:
        if lookup.seq != chosen:
            continue
        flags = lookup_flags(
            config, used, outcome, facts, lookup.max_length, lookup.observed_hit_tokens
        )
        click.echo(explain_header(config, lookup, policy, used))
        for line in config_lines(config, used):
            click.echo(line)
        click.echo("")
        click.echo(explain_table(config, outcome))
        click.echo("")
        click.echo(flag_lines(flags))
        click.echo("")


@command()
@click.argument("path", type=click.Path(path_type=Path))
@policy_options("whose semantics the flags are checked under (a trace is replayed)", results=True)
@cache_option()
@COORDINATOR
@selection_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: flags and counts.")
@count_option("--examples", default=10, help="Flagged lookups to list.")
def check(
    path: Path,
    policy: str | None,
    vllm_versions: tuple[str, ...],
    cache: str | None,
    coordinator: str,
    fail_on: tuple[str, ...],
    ignore: tuple[str, ...],
    as_json: bool,
    examples: int,
) -> None:
    """Exit 1 when a lookup of PATH has a flag that --fail-on selects (by
    default a corruption: mamba_overrun, missing_block), 0 otherwise, 2 on bad
    input.

    PATH is a trace (replayed now, under --policy) or a results file of
    `replay run` (checked as it is, against its trace). Every flag is
    listed with its severity, worst first.
    """
    from replay.analysis.check import check_path
    from replay.analysis.flags import flag_counts, flag_examples, worst_first
    from replay.analysis.selection import failing, select_flags, selection_text
    from replay.format.results import is_results_file, results_info
    from replay.tools.render import counts_text

    selected = select_flags(fail_on, ignore)
    chosen = selection_text(fail_on, ignore)
    # A results file: its own policy (another one given is refused); a trace:
    # the one rule.
    own = str(results_info(path).get("policy")) if is_results_file(path) else None
    (asked,) = chosen_policies(
        None if own else path, (policy,) if policy else (), vllm_versions, results_policy=own
    )
    with progress_bar(as_json) as bar:
        flags, policy_used = check_path(
            path,
            policy=asked,
            coordinator=coordinator,
            cache=cache,
            progress=None if bar is None else bar.replay,
        )
    counts = flag_counts(flags)
    fails = failing(counts, selected)
    if as_json:
        from replay.format.results import results_cache
        from replay.format.tracedir import open_trace
        from replay.rules.coordinator import resolve_cache

        if is_results_file(path):
            info = results_info(path)
            where = {"trace": info.get("trace"), "results": str(path)}
            cache_used, coordinator_used = results_cache(info), str(info.get("coordinator"))
        else:
            where = {"trace": str(path), "results": None}
            cache_used = resolve_cache(open_trace(path).config, cache)
            coordinator_used = coordinator
        from replay.cli import payloads

        payloads.echo(
            "check",
            {
                **where,
                "fail_on": sorted(selected),
                "failed": bool(fails),
                "variants": [
                    payloads.variant(
                        policy_used,
                        cache_used,
                        coordinator_used,
                        flagged_lookups=int(flags["seq"].n_unique()) if counts else 0,
                        flags=payloads.flag_list(counts, selected),
                        flagged=payloads.flag_rows(flags),
                    )
                ],
            },
        )
    else:
        lookups = flags["seq"].n_unique() if counts else 0
        failed = flags.filter(flags["flag"].is_in(list(fails)))["seq"].n_unique() if fails else 0
        verdict = (
            f"fail ({chosen}): {counted(failed, 'lookup')} with {counts_text(worst_first(fails))}"
            if fails
            else f"pass ({chosen}): no flag it selects"
        )
        for line in check_lines(
            path,
            policy_used,
            counts_text(worst_first(counts)),
            lookups,
            flag_examples(flags, examples),
            verdict,
        ):
            click.echo(line)
    if fails:
        sys.exit(1)


def _shrinking(bar: Bar) -> Callable[[int, int, int], None]:
    """``replay minimize``'s line: replays so far and the events still kept
    (the number of replays a shrink takes is not known in advance: no ETA)."""

    def show(replays: int, kept: int, of: int) -> None:
        bar.status(
            f"shrinking: {replays:,} replays, {of:,} -> {kept:,} events  {bar.elapsed():,.1f} s"
        )

    return show


@command()
@TRACE_OR_RESULTS
@click.option(
    "--request", "request_id", required=True, help="The request_id whose lookup is flagged."
)
@SEQ
@click.option(
    "--flag",
    default=None,
    metavar="FLAG",
    help="Keep this flag, e.g. mamba_overrun (`replay check --help` names them all; default: "
    "any flag).",
)
@policy_options("under which the flag fires", results=True, described=False)
@cache_option()
@output_option("The small trace to write.", required=True)
def minimize(
    trace: Path,
    request_id: str,
    seq: int | None,
    flag: str | None,
    policy: str | None,
    vllm_versions: tuple[str, ...],
    cache: str | None,
    output: Path,
) -> None:
    """Shrink TRACE to a small trace on which REQUEST still raises the flag,
    with its expectation (per policy) in the metadata: ready for traces/.
    Given a RESULTS file, shrinks its trace under its policy and cache."""
    from replay.analysis.flags import FLAG_KINDS, add_flags
    from replay.format.paths import PARQUET, check_outputs
    from replay.tools.minimize import minimize as run_minimize

    if flag is not None and flag not in FLAG_KINDS:
        raise fail(f"--flag: unknown flag {flag!r}, expected one of {', '.join(FLAG_KINDS)}")

    given = trace
    trace, policy, cache = _followed(trace, policy, vllm_versions, cache)
    check_outputs({"-o": output}, [given, trace], formats={"-o": PARQUET})
    with progress_bar() as bar:
        info = run_minimize(
            trace,
            request_id,
            output,
            flag=flag,
            policy=policy,
            cache=cache,
            seq=seq,
            judge=add_flags,
            progress=None if bar is None else _shrinking(bar),
        )
    for line in minimize_lines(trace, output, info, request_id):
        click.echo(line)
