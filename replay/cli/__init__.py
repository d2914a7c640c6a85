"""The ``replay`` command line: click only. Each command parses options, calls
the library and prints; library errors (``ReplayError``) become one line on
stderr and exit status 2. Checks that find a problem exit 1."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from analysis.flags import FLAG_KINDS, flag_lines
from replay import __version__
from replay.answers import COORDINATORS, Progress, resolve_cache
from replay.cli.common import command_guard, fail, run_main
from replay.cli.scale import RAY, WORKERS, replay_for_run, results_paths
from replay.coordinator import CACHES, DEFAULT_POLICY, POLICIES
from replay.engine import explain_lookups, save_results, state_at
from replay.render import config_lines, explain_header, explain_table, group_label
from replay.summary import run_summary, trace_info


class ReplayGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        with command_guard():
            return super().invoke(ctx)


def _given(name: str) -> bool:
    """Whether the user gave option ``name`` (not its default)."""
    source = click.get_current_context().get_parameter_source(name)
    return source not in (None, click.core.ParameterSource.DEFAULT)


TRACE = click.argument("trace", type=click.Path(path_type=Path))
POLICY = click.option(
    "--policy",
    type=click.Choice(list(POLICIES)),
    default=DEFAULT_POLICY,
    show_default=True,
    help="Coordinator semantics: "
    + "; ".join(f"{p.name}: {p.description}" for p in POLICIES.values()),
)
CACHE = click.option(
    "--cache",
    type=click.Choice(list(CACHES)),
    default=None,
    help="Which vLLM cache answers: "
    + "; ".join(f"{c.name}: {c.description}" for c in CACHES.values())
    + ". Default: the trace's source.cache (recorded KV events: gpu), else mooncake.",
)
COORDINATOR = click.option(
    "--coordinator",
    type=click.Choice(list(COORDINATORS)),
    default="reference",
    show_default=True,
    help="reference: this project's coordinator; vllm: the vLLM installed in this environment.",
)


@click.group(cls=ReplayGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="replay")
def cli() -> None:
    """Replay KV-cache block events through vLLM's hybrid prefix-cache
    coordinator and flag every lookup whose hit is wrong.

    A trace is a Parquet event log (store / remove / clear / lookup rows,
    format v1). `replay run TRACE` replays it and writes a results file;
    `replay check` exits 1 when any lookup is flagged (for CI); `replay
    explain` shows how one request's hit was decided.
    """


@cli.command()
@TRACE
def validate(trace: Path) -> None:
    """Check TRACE against format v1; print ok and the counts, or the first problem."""
    info = trace_info(trace)
    k = info["events_by_kind"]
    click.echo(
        f"ok: {trace}: {info['events']} events (store {k['store']}, remove {k['remove']}, "
        f"clear {k['clear']}, lookup {k['lookup']}), {len(info['config']['kv_cache_groups'])} "
        f"KV-cache groups"
    )


@cli.command()
@TRACE
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def info(trace: Path, as_json: bool) -> None:
    """KV-cache groups and config, event counts, time span, distinct keys, lookups."""
    data = trace_info(trace)
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    from replay.spec import TraceConfig

    config = TraceConfig.from_json(data["config"])
    click.echo(f"trace: {trace}")
    # The cache the trace's events describe, which replays answer by default.
    for line in config_lines(config, resolve_cache(config, None)):
        click.echo(line)
    k = data["events_by_kind"]
    click.echo(
        f"events: {data['events']} (store {k['store']}, remove {k['remove']}, clear {k['clear']}, "
        f"lookup {k['lookup']}), seq {data['seq_range'][0]}..{data['seq_range'][1]}"
    )
    span = data["time_span"]
    if span["seconds"] is not None:
        click.echo(f"time: {span['first']} .. {span['last']} ({span['seconds']:.1f} s)")
    else:
        click.echo("time: no timestamps")
    click.echo(f"hash entries: {data['hash_entries']}")
    for gid, n in enumerate(data["distinct_keys_per_group"]):
        click.echo(f"distinct keys stored, group {group_label(config, gid)}: {n}")
    click.echo(
        f"lookups: {data['lookups']}, prompt tokens {data['lookup_prompt_tokens']}, "
        f"max_length tokens {data['lookup_max_length_tokens']}"
    )


@cli.command()
@TRACE
@click.option(
    "--at",
    "at",
    type=int,
    default=None,
    help="A seq: the state a lookup at SEQ sees (every event before it). Default: the end of the trace.",
)
@click.option("--group", "group", type=int, default=None, help="Only this group_id.")
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="Write the keys as Parquet (group_id int32, hash binary).",
)
@click.option(
    "--show",
    type=click.IntRange(min=0),
    default=5,
    show_default=True,
    help="Keys to print per group.",
)
def state(trace: Path, at: int | None, group: int | None, output: Path | None, show: int) -> None:
    """Present (group_id, hash) keys at a point of the log."""
    from replay.paths import check_outputs

    check_outputs({"-o": output}, [trace])
    config, store = state_at(trace, at)
    if group is not None and not 0 <= group < config.num_groups:
        raise fail(f"--group {group}: the trace has groups 0..{config.num_groups - 1}")
    groups = [group] if group is not None else list(range(config.num_groups))
    where = f"before seq {at}" if at is not None else "at the end of the trace"
    click.echo(f"state {where}: {trace}")
    for gid in groups:
        keys = sorted(store.keys(gid))
        click.echo(f"group {group_label(config, gid)}: {len(keys)} keys")
        for key in keys[:show]:
            click.echo(f"  {key.hex()}")
        if len(keys) > show:
            click.echo(f"  … {len(keys) - show} more")
    if output is not None:
        from replay.trace import write_keys

        n = write_keys(output, [(gid, sorted(store.keys(gid))) for gid in groups])
        click.echo(f"wrote {n} keys to {output}")


class _Bar:
    """A one-line progress display on a terminal's stderr."""

    def __init__(self) -> None:
        self.shown = False

    def __call__(self, p: Progress) -> None:
        import time

        elapsed = max(time.perf_counter() - p.started, 1e-9)
        pct = 100.0 * p.events / p.total_events if p.total_events else 100.0
        width = 24
        done = int(width * pct / 100)
        line = (
            f"\r[{'#' * done}{'.' * (width - done)}] {pct:5.1f}%  {p.events}/{p.total_events} events "
            f"{p.events / elapsed:,.0f}/s  {p.lookups} lookups {p.lookups / elapsed:,.0f}/s"
        )
        sys.stderr.write(line)
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _progress(quiet: bool) -> _Bar | None:
    if quiet or not sys.stderr.isatty():
        return None
    return _Bar()


@cli.command()
@TRACE
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="Results file (default: NAME.results.parquet beside the trace). With several "
    "--policy, each policy's name goes before the suffix.",
)
@click.option(
    "--policy",
    "policies",
    type=click.Choice(list(POLICIES)),
    multiple=True,
    help=f"Coordinator semantics (default {DEFAULT_POLICY}); repeat it for one results file "
    "per policy from one fold: "
    + "; ".join(f"{p.name}: {p.description}" for p in POLICIES.values()),
)
@click.option(
    "--cache",
    "caches",
    type=click.Choice(list(CACHES)),
    multiple=True,
    help="Which vLLM cache answers (default: the trace's source.cache, else mooncake); "
    "repeat it for one results file per cache from the same fold.",
)
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
@click.option(
    "--examples",
    type=click.IntRange(min=0),
    default=5,
    show_default=True,
    help="Flagged lookups to show.",
)
def run(
    trace: Path,
    output: Path | None,
    policies: tuple[str, ...],
    caches: tuple[str, ...],
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
    from analysis.flags import flag_counts, flag_examples
    from replay.paths import check_outputs

    policies = tuple(dict.fromkeys(policies)) or (DEFAULT_POLICY,)
    used: tuple[str | None, ...] = tuple(dict.fromkeys(caches)) or (None,)
    outs = results_paths(trace, output, policies, used)
    check_outputs({"-o" if len(outs) == 1 else f"-o ({out.name})": out for out in outs}, [trace])
    bar = _progress(quiet or as_json)
    try:
        results = replay_for_run(
            trace,
            policies=policies,
            caches=used,
            coordinator=coordinator,
            unit_present=unit_present,
            workers=workers,
            ray_address=ray_address,
            progress=bar,
        )
    finally:
        if bar is not None:
            bar.close()
    summaries = []
    for result, out in zip(results, outs, strict=True):
        flags = result.flags()
        save_results(result, out)
        counts = flag_counts(flags)
        summary = run_summary(result, counts)
        summary["results"] = str(out)
        summary["examples"] = flag_examples(flags, examples)
        summaries.append(summary)
    if as_json:
        click.echo(
            json.dumps(summaries[0] if len(summaries) == 1 else summaries, indent=2, default=str)
        )
        return
    if quiet:
        return
    for summary in summaries:
        _print_summary(summary)
        if summary["flags"]:
            click.echo("flagged lookups (first examples):")
            for ex in summary["examples"]:
                click.echo("  " + ex["text"])
        click.echo(f"results: {summary['results']}")


def _print_summary(s: dict[str, Any]) -> None:
    k = s["events_by_kind"]
    click.echo(
        f"replayed {s['events']} events (store {k['store']}, remove {k['remove']}, clear {k['clear']}, lookup {k['lookup']}) with {s['coordinator']} coordinator, policy {s['policy']}, {s['cache']} cache"
    )
    click.echo(f"lookups: {s['lookups']} ({s['lookups_with_hit']} with a hit)")
    click.echo(
        f"prompt tokens: {s['prompt_tokens']}, hit tokens: {s['hit_tokens']} (hit ratio {100 * s['hit_ratio']:.2f}%)"
    )
    for g in s["groups"]:
        click.echo(
            f"  group {g['group_id']} {g['kind']} block={g['block_size']}: loaded {g['loaded_blocks']} blocks ({g['loaded_tokens']} tokens), skipped {g['skipped_blocks']}"
        )
    if s["observed"]["lookups"]:
        click.echo(
            f"observed hits: {s['observed']['lookups']} reported, {s['observed']['mismatches']} differ from the replay"
        )
    click.echo(
        f"time: {s['seconds']:.2f} s ({s['events_per_second'] or 0:,} events/s, {s['lookups_per_second'] or 0:,} lookups/s)"
    )
    if s["flags"]:
        click.echo("flags: " + ", ".join(f"{name} {n}" for name, n in sorted(s["flags"].items())))
    else:
        click.echo("flags: none")


SEQ = click.option(
    "--seq",
    type=int,
    default=None,
    help="The seq of the lookup, when the request_id occurs in several.",
)


@cli.command()
@TRACE
@click.option("--request", "request_id", required=True, help="The request_id of a lookup.")
@SEQ
@POLICY
@CACHE
@COORDINATOR
def explain(
    trace: Path,
    request_id: str,
    seq: int | None,
    policy: str,
    cache: str | None,
    coordinator: str,
) -> None:
    """Show how the coordinator decided one request's hit, step by step, and
    the lookup's flags."""
    from replay.lookup_choice import choose_lookup

    config, found = explain_lookups(
        trace, lambda e: e.request_id == request_id, policy, coordinator, cache=cache
    )
    chosen = choose_lookup(trace, request_id, [lk.seq for lk, _, _ in found], seq)
    used = resolve_cache(config, cache)
    for lookup, outcome, flags in found:
        if lookup.seq != chosen:
            continue
        click.echo(explain_header(config, lookup, policy, used))
        for line in config_lines(config, used):
            click.echo(line)
        click.echo("")
        click.echo(explain_table(config, outcome))
        click.echo("")
        click.echo(flag_lines(flags))
        click.echo("")


@cli.command()
@click.argument("path", type=click.Path(path_type=Path))
@POLICY
@CACHE
@COORDINATOR
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: flags and counts.")
@click.option(
    "--examples",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="Flagged lookups to list.",
)
def check(
    path: Path,
    policy: str,
    cache: str | None,
    coordinator: str,
    as_json: bool,
    examples: int,
) -> None:
    """Exit 1 when any lookup of PATH is flagged, 0 when clean, 2 on bad input.

    PATH is a trace (replayed now, under --policy) or a results file of
    `replay run` (checked as it is, against its trace).
    """
    from analysis.flags import check_path, flag_counts, flag_examples

    flags, policy_used = check_path(
        path,
        policy=policy if _given("policy") else None,
        coordinator=coordinator,
        cache=cache,
    )
    counts = flag_counts(flags)
    if as_json:
        rows = flags.to_dicts()
        click.echo(
            json.dumps(
                {"path": str(path), "policy": policy_used, "flags": rows, "counts": counts},
                default=str,
            )
        )
    else:
        if counts:
            lookups = flags["seq"].n_unique()
            kinds = ", ".join(f"{k} {v}" for k, v in counts.items())
            click.echo(f"{path}: {lookups} flagged lookup(s) under {policy_used} ({kinds})")
            for ex in flag_examples(flags, examples):
                click.echo("  " + ex["text"])
        else:
            click.echo(f"{path}: clean under {policy_used} (no flags)")
    if counts:
        sys.exit(1)


@cli.command()
@TRACE
@click.option(
    "--request", "request_id", required=True, help="The request_id whose lookup is flagged."
)
@SEQ
@click.option(
    "--flag",
    type=click.Choice(list(FLAG_KINDS)),
    default=None,
    help="Keep this flag (default: any flag).",
)
@click.option(
    "--policy",
    type=click.Choice(list(POLICIES)),
    default="pre-49502",
    show_default=True,
    help="Policy under which the flag fires.",
)
@CACHE
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    required=True,
    help="The small trace to write.",
)
def minimize(
    trace: Path,
    request_id: str,
    seq: int | None,
    flag: str | None,
    policy: str,
    cache: str | None,
    output: Path,
) -> None:
    """Shrink TRACE to a small trace on which REQUEST still raises the flag,
    with its expectation (per policy) in the metadata: ready for traces/."""
    from replay.minimize import minimize as run_minimize
    from replay.paths import check_outputs

    check_outputs({"-o": output}, [trace])
    info = run_minimize(trace, request_id, output, flag=flag, policy=policy, cache=cache, seq=seq)
    click.echo(
        f"{trace}: {info['events_before']} events -> {output}: {info['events_after']} events"
    )
    for e in info["expect"]:
        flags = ", ".join(e["flags"]) or "no flags"
        click.echo(f"  {e['policy']}: {flags}; hit {e['hits'][request_id]}")


def _register() -> None:
    from replay.cli.analysis import diff, report
    from replay.cli.scale import cat, split
    from replay.cli.sources import ingest, record
    from replay.cli.synth import bailian, mooncake, synth
    from replay.cli.whatif import whatif

    cli.add_command(diff)
    cli.add_command(split)
    cli.add_command(cat)
    cli.add_command(report)
    cli.add_command(synth)
    cli.add_command(record)
    ingest.add_command(mooncake)
    ingest.add_command(bailian)
    cli.add_command(ingest)
    cli.add_command(whatif)


_register()


def main() -> None:
    """The ``replay`` console script and ``python -m replay``."""
    run_main(cli, "replay")


if __name__ == "__main__":
    main()
