"""``replay diff``, ``replay bisect`` and ``replay report``: click only, over
``replay.analysis.diff``, ``replay.analysis.bisect`` and ``replay.analysis.report``."""

from __future__ import annotations

from pathlib import Path

import click

from replay.base.errors import worded
from replay.cli.common import FLAGS, command, fail, note_at_end
from replay.cli.options import (
    cache_option,
    chosen_policies,
    coordinator_option,
    count_option,
    output_option,
    policy_options,
)
from replay.cli.progress import progress_bar
from replay.rules.coordinator.policy import recorded_release


@command("diff")
@click.argument("inputs", nargs=-1, required=True, type=click.Path(path_type=Path))
@policy_options(
    "of each side: with a trace, give it twice, side A then side B "
    "(e.g. --policy vllm-0.33 --policy pre-49502)",
    multiple=True,
    results=True,
    described=False,
)
@coordinator_option("With a trace: once for both sides, or twice (A, B)", multiple=True)
@cache_option(
    "With a trace: once for both sides, or twice (e.g. --cache mooncake --cache gpu: "
    "where the Mooncake mirror drifts from the engine)",
    multiple=True,
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (every lookup).")
@output_option(
    "Write the diff: d.parquet the changed lookups (summary in metadata 'replay.diff'), "
    "d.md Markdown for a pull request, d.html one page (the extension names the format)."
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["parquet", "md", "html"]),
    default=None,
    help="The -o file's format; its extension must agree. Default: from the extension.",
)
@count_option("--limit", default=20, help="Changed lookups to print.")
def diff(
    inputs: tuple[Path, ...],
    policies: tuple[str, ...],
    vllm_versions: tuple[str, ...],
    coordinators: tuple[str, ...],
    caches: tuple[str, ...],
    as_json: bool,
    output: Path | None,
    fmt: str | None,
    limit: int,
) -> None:
    """Lookups whose hit differs between two replays of one trace.

    \b
      replay diff TRACE --policy A --policy B   replay the trace under both
      replay diff TRACE --cache mooncake --cache gpu
                                                the Mooncake mirror against the engine
      replay diff RESULTS_A RESULTS_B           two results files of the same trace
      replay diff RESULTS --policy A --policy B the trace the results lead to

    Prints the tokens B gains or loses per lookup and in total, grouped by
    what explains each change: a flag on one side only, else the KV-cache
    group whose own hit moved; between two caches, also the cache rule behind
    each change. Exit status 0 (a report), 2 on bad input.
    """
    from replay.analysis.diff import diff_inputs, write_diff
    from replay.analysis.diff_text import render_text
    from replay.format.paths import NAMES, PARQUET, TEXT_REPORT, check_outputs, output_format

    check_outputs({"-o": output}, list(inputs), text=fmt in ("md", "html"))
    fmt = output_format("-o", output, {**PARQUET, **TEXT_REPORT}, given=fmt, default="parquet")
    if len(inputs) == 1:  # a results file replays the trace it leads to
        from replay.format.link import trace_of

        trace, info = trace_of(inputs[0])
        inputs = (trace,)
        own = None if info is None else str(info.get("policy"))
        policies = chosen_policies(
            trace, policies, vllm_versions, results_policy=own, most=2, alias_notes=False
        )
    elif vllm_versions:
        raise fail("--vllm replays a trace; two results files are compared as they are")
    with progress_bar(as_json) as bar:
        result = diff_inputs(
            list(inputs),
            policies,
            coordinators,
            caches,
            progress=None if bar is None else bar.replay,
        )
    if output is not None and fmt == "parquet":
        write_diff(result, output)
    elif output is not None:
        from replay.analysis.diff_text import render_html, render_markdown
        from replay.format.paths import write_text

        render = render_markdown if fmt == "md" else render_html
        target = write_text(output, render(result, limit=max(limit, 0)), what="a diff")
        if target.kind == "stdout":  # standard output holds the diff alone
            return
    if as_json:
        from replay.cli import payloads

        payloads.echo(
            "diff",
            payloads.diff(
                result, [str(p) for p in inputs], None if output is None else str(output)
            ),
        )
        return
    click.echo(render_text(result, limit=max(limit, 0)))
    if output is not None and fmt == "parquet":
        click.echo(f"wrote {result.changed} changed lookups to {output}")
    elif output is not None:
        click.echo(f"wrote the diff ({NAMES[fmt]}) to {output}")


@command("bisect")
@click.argument("trace", type=click.Path(path_type=Path))
@click.option("--request", "request_id", default=None, help="Only this request's lookups.")
@click.option("--from", "first", metavar="VERSION", default=None, help="Oldest vLLM release.")
@click.option("--to", "last", metavar="VERSION", default=None, help="Newest vLLM release.")
@cache_option("A cache to bisect (repeatable)", multiple=True, default="Default: gpu and mooncake.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (every lookup).")
@count_option(
    "--limit", default=20, help="Rows (lookups that change identically) to print per cache."
)
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

    Prints a Markdown table per cache (--json: every lookup and release),
    the column of the release that recorded the trace (its
    source.vllm_version) marked (trace).
    A cache a release did not have is listed with the reason. Exit status 0
    (a report), 2 on bad input.
    """
    from replay.analysis.bisect import bisect as run_bisect
    from replay.analysis.bisect import markdown

    report = run_bisect(
        trace,
        caches=tuple(dict.fromkeys(caches)) or ("gpu", "mooncake"),
        first=first,
        last=last,
        request_id=request_id,
    )
    for part in report["caches"]:  # the library's reasons, in this command's words
        part["not_modelled"] = {p: worded(t, FLAGS) for p, t in part["not_modelled"].items()}
    recorded = recorded_release({"vllm_version": report["trace_vllm_version"]})
    if recorded is not None:
        note_at_end(f"{recorded[1]}; its column is marked (trace)")
    if as_json:
        from replay.cli import payloads

        payloads.echo("bisect", report)
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
    from replay.analysis.report import build_report, default_report_path, write_report
    from replay.format.paths import TEXT_REPORT, check_input, check_outputs, output_format
    from replay.format.sweepfile import is_sweep_file

    if output is not None:  # an input given as the output is said first
        check_outputs({"-o": output}, [results, trace], text=True)
    check_input(results, "a results or sweep file")  # a missing input is said first
    sweep = is_sweep_file(results)
    fmt = output_format("-o", output, TEXT_REPORT, given=fmt, default=fmt or "html")
    out = output or default_report_path(results, fmt)
    if sweep:
        from replay.analysis.report import write_sweep_report

        check_outputs({"-o": out}, [results], text=True)
        target = write_sweep_report(results, out, fmt)
        if target.kind != "stdout":
            click.echo(f"wrote {out}")
        return

    check_outputs({"-o": out}, [results, trace], text=True)
    with progress_bar() as bar:
        data = build_report(
            results,
            trace=trace,
            examples=max(examples, 0),
            progress=None if bar is None else bar.replay,
        )
    check_outputs({"-o": out}, [results, data.trace_path], text=True)
    target = write_report(data, out, fmt)
    note = f" ({data.trace_note})" if data.trace_note else ""
    if target.kind != "stdout":
        click.echo(f"wrote {out}{note}")
    elif note:  # standard output holds the report alone
        click.echo(f"report{note}", err=True)
