"""``replay diff``, ``replay bisect`` and ``replay report``: click only, over
``analysis.diff``, ``analysis.bisect`` and ``analysis.report``."""

from __future__ import annotations

import json
from pathlib import Path

import click

from replay.cli.common import command
from replay.cli.options import count_option, output_option, repeated_choice
from replay.engine.answers import COORDINATORS
from replay.rules.coordinator import CACHES, POLICIES


@command("diff")
@click.argument("inputs", nargs=-1, required=True, type=click.Path(path_type=Path))
@repeated_choice(
    "--policy",
    "policies",
    POLICIES,
    "With a trace: give twice, side A then side B (e.g. --policy vllm-0.33 --policy pre-49502).",
)
@repeated_choice(
    "--coordinator",
    "coordinators",
    COORDINATORS,
    "With a trace: once for both sides, or twice (A, B). Default: reference.",
)
@repeated_choice(
    "--cache",
    "caches",
    CACHES,
    "With a trace: once for both sides, or twice (e.g. --cache mooncake --cache gpu: "
    "where the Mooncake mirror drifts from the engine). Default: the trace's source.cache.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (every lookup).")
@output_option("Write the changed lookups as Parquet (summary in metadata 'replay.diff').")
@count_option("--limit", default=20, help="Changed lookups to print.")
def diff(
    inputs: tuple[Path, ...],
    policies: tuple[str, ...],
    coordinators: tuple[str, ...],
    caches: tuple[str, ...],
    as_json: bool,
    output: Path | None,
    limit: int,
) -> None:
    """Lookups whose hit differs between two replays of one trace.

    \b
      replay diff TRACE --policy A --policy B   replay the trace under both
      replay diff TRACE --cache mooncake --cache gpu
                                                the Mooncake mirror against the engine
      replay diff RESULTS_A RESULTS_B           two results files of the same trace

    Prints the tokens B gains or loses per lookup and in total, grouped by
    what explains each change: a flag on one side only, else the KV-cache
    group whose own hit moved; between two caches, also the cache rule behind
    each change. Exit status 0 (a report), 2 on bad input.
    """
    from analysis.diff import diff_inputs, write_diff
    from analysis.diff_text import render_text
    from replay.format.paths import check_outputs

    check_outputs({"-o": output}, list(inputs))
    result = diff_inputs(list(inputs), policies, coordinators, caches)
    if output is not None:
        write_diff(result, output)
    if as_json:
        payload = result.to_json()
        if output is not None:
            payload["output"] = str(output)
        click.echo(json.dumps(payload, indent=2, default=str))
        return
    click.echo(render_text(result, limit=max(limit, 0)))
    if output is not None:
        click.echo(f"wrote {result.changed} changed lookups to {output}")


@command("bisect")
@click.argument("trace", type=click.Path(path_type=Path))
@click.option("--request", "request_id", default=None, help="Only this request's lookups.")
@click.option("--from", "first", metavar="VERSION", default=None, help="Oldest vLLM release.")
@click.option("--to", "last", metavar="VERSION", default=None, help="Newest vLLM release.")
@repeated_choice(
    "--cache", "caches", CACHES, "A cache to bisect (repeatable). Default: gpu and mooncake."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (every lookup).")
@count_option("--limit", default=20, help="Changing lookups to print per cache.")
def bisect(
    trace: Path,
    request_id: str | None,
    first: str | None,
    last: str | None,
    caches: tuple[str, ...],
    as_json: bool,
    limit: int,
) -> None:
    """Every modelled vLLM release's answer for each lookup of TRACE, from one
    fold of the store, and the releases at which a lookup's hit, load masks
    or flags change.

    \b
      replay bisect TRACE                          every release, both caches
      replay bisect TRACE --request ID --from 0.22.0 --to 0.28.0

    Prints a Markdown table per cache (--json: every lookup and release).
    A cache a release did not have is listed with the reason. Exit status 0
    (a report), 2 on bad input.
    """
    from analysis.bisect import bisect as run_bisect
    from analysis.bisect import markdown

    report = run_bisect(
        trace,
        caches=tuple(dict.fromkeys(caches)) or ("gpu", "mooncake"),
        first=first,
        last=last,
        request_id=request_id,
    )
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
        return
    for line in markdown(report, limit=max(limit, 0)):
        click.echo(line)


@command("report")
@click.argument("results", type=click.Path(path_type=Path))
@output_option("Report file (default: NAME.report.html or .md beside the results).")
@click.option(
    "--trace",
    type=click.Path(path_type=Path),
    default=None,
    help="The trace the results came from (default: the trace named in the results' "
    "metadata, next to the results file). Needed for the explain tables.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["html", "md"]),
    default=None,
    help="html: one self-contained page with charts; md: a summary for a pull request. "
    "Default: from the -o extension (.md is Markdown), else html.",
)
@count_option("--examples", default=3, help="Flagged lookups shown (and explained) per flag kind.")
def report(
    results: Path, output: Path | None, trace: Path | None, fmt: str | None, examples: int
) -> None:
    """Write a report of a RESULTS file: hit ratio over time, hit lengths,
    tokens loaded per group, flags with examples and their explain tables,
    and the configuration. `-o -` prints it on standard output. Of a what-if
    SWEEP file (replay whatif): hit ratio against capacity per eviction
    policy, and the table (-o x.md: Markdown)."""
    from analysis.report import build_report, default_report_path, write_report
    from replay.format.paths import check_outputs
    from replay.format.sweepfile import is_sweep_file

    if fmt is None:
        fmt = (
            "md" if output is not None and output.suffix.lower() in (".md", ".markdown") else "html"
        )
    out = output or default_report_path(results, fmt)
    if is_sweep_file(results):
        from analysis.report import write_sweep_report

        check_outputs({"-o": out}, [results], text=True)
        target = write_sweep_report(results, out, fmt)
        if target.kind != "stdout":
            click.echo(f"wrote {out}")
        return

    check_outputs({"-o": out}, [results, trace], text=True)
    data = build_report(results, trace=trace, examples=max(examples, 0))
    check_outputs({"-o": out}, [results, data.trace_path], text=True)
    target = write_report(data, out, fmt)
    note = f" ({data.trace_note})" if data.trace_note else ""
    if target.kind != "stdout":
        click.echo(f"wrote {out}{note}")
    elif note:  # standard output holds the report alone
        click.echo(f"report{note}", err=True)
