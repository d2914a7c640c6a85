"""``replay test``: the regression traces as a test run, against this
project's coordinator or the installed vLLM's own (a vLLM developer's
guard on their branch). Exit 0 when every expectation holds, 1 when any
fails, 2 on bad input (or when nothing could be checked)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from replay.cli.common import command, fail
from replay.cli.options import FAIL_ON, IGNORE
from replay.rules.coordinator import CACHES, COORDINATORS


@command("test")
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path), metavar="[PATH]...")
@click.option(
    "--coordinator",
    type=click.Choice(list(COORDINATORS)),
    default="reference",
    show_default=True,
    help="reference: this project's coordinator (every policy's expectations); vllm: the "
    "vLLM installed in this environment (only the expectations of the policy that models it).",
)
@click.option(
    "--cache",
    "caches",
    type=click.Choice(list(CACHES)),
    multiple=True,
    help="Check only the expectations of this cache (repeatable) [default: both].",
)
@FAIL_ON
@IGNORE
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object: every expectation's outcome and the counts.",
)
def test(
    paths: tuple[Path, ...],
    coordinator: str,
    caches: tuple[str, ...],
    fail_on: tuple[str, ...],
    ignore: tuple[str, ...],
    as_json: bool,
) -> None:
    """Check every expectation of the regression traces at PATH (files or
    directories; default: the corpus shipped with this package).

    A failure prints, per failing trace, the expectation, what came instead
    and the explain table of the first lookup that differs. One progress
    line per trace goes to stderr.
    """
    from replay.analysis.expectations import (
        Verdict,
        corpus_dir,
        expectation_traces,
        run_traces,
        test_failure_lines,
        test_progress_line,
        test_summary_line,
    )

    traces = expectation_traces(list(paths) or [corpus_dir()])
    total = len(traces)
    done = [0]

    def progress(path: Path, verdicts: list[Verdict], seconds: float) -> None:
        done[0] += 1
        click.echo(test_progress_line(done[0], total, path, verdicts, seconds), err=True)

    from replay.analysis.selection import select_flags

    select_flags(fail_on, ignore)  # an unknown name: one line before any replay
    run = run_traces(
        traces, coordinator, caches or None, on_trace=progress, fail_on=fail_on, ignore=ignore
    )
    if as_json:
        click.echo(json.dumps(run.to_json(coordinator)))
    else:
        for line in test_failure_lines(run.failed):
            click.echo(line)
        click.echo(test_summary_line(run, coordinator))
    if not run.checked:
        raise fail(
            "no expectation was checked: "
            + (run.verdicts[0].skipped if run.verdicts and run.verdicts[0].skipped else "none")
        )
    if run.failed:
        sys.exit(1)
