"""``replay test``: the regression traces as a test run, against this
project's coordinator or the installed vLLM's own (a vLLM developer's
guard on their branch). Exit 0 when every expectation holds, 1 when any
fails, 2 on bad input (or when nothing could be checked)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from replay.cli.common import command, fail, note_at_end
from replay.cli.options import (
    FAIL_ON,
    IGNORE,
    cache_option,
    coordinator_option,
    output_option,
)
from replay.rules.coordinator import POLICY_ENV, get_policy
from replay.rules.coordinator.kinds import VLLM, get_coordinator


@command("test")
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path), metavar="[PATH]...")
@coordinator_option(
    "The reference checks every policy's expectations; vllm only those of the policy that "
    "models the installed version"
)
@cache_option(
    "Check only the expectations of this cache (repeatable)",
    multiple=True,
    default="Default: both.",
)
@click.option(
    "--policy",
    "vllm_policy",
    metavar="POLICY",
    help="With --coordinator vllm: check the installed vLLM as this policy (its "
    "expectations), whatever its version says; the same as REPLAY_POLICY=POLICY "
    "[default: the policy that models the installed version, the newest for a version "
    "no policy models yet].",
)
@FAIL_ON
@IGNORE
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object (docs/json.md): every expectation's outcome and the counts.",
)
@click.option(
    "--junit-xml",
    "junit",
    type=click.Path(path_type=Path),
    metavar="PATH",
    help="Also write a JUnit XML report: one test case per trace x policy x cache, the "
    "failure text as its message (for CI).",
)
@click.option(
    "--random",
    "random_count",
    type=int,
    default=None,
    metavar="N",
    help="The drift check (with --coordinator vllm): answer N random configurations through "
    "the installed vLLM and the policy that models it, print the agreement; on a difference "
    "write the smallest differing trace (-o) and exit 1.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="The random configurations' seed."
)
@output_option(
    "With --random: where the smallest differing trace goes "
    "[default: ./drift-vllm-VERSION-seed-S.parquet].",
)
def test(
    paths: tuple[Path, ...],
    coordinator: str,
    caches: tuple[str, ...],
    vllm_policy: str | None,
    fail_on: tuple[str, ...],
    ignore: tuple[str, ...],
    as_json: bool,
    junit: Path | None,
    random_count: int | None,
    seed: int,
    output: Path | None,
) -> None:
    """Check every expectation of the regression traces at PATH (files or
    directories; default: the corpus shipped with this package).

    Failures are grouped by what failed (policy, cache and the cause the
    vLLM adapter names), smallest trace first: per group the smallest
    failing trace in full (the expectation, what came instead, the explain
    table of the first lookup that differs, commands that run as printed),
    then one line per other trace. One progress line per trace goes to
    stderr.
    """
    from replay.analysis.expectations import (
        Verdict,
        corpus_dir,
        expectation_traces,
        junit_xml,
        run_traces,
        test_failure_lines,
        test_progress_line,
        test_summary_line,
    )

    if vllm_policy is not None:
        if not get_coordinator(coordinator).installed_vllm:
            raise fail(
                "--policy chooses the policy the installed vLLM is checked as: "
                "give --coordinator vllm"
            )
        get_policy(vllm_policy)  # an unknown name: one line before any replay
        # The one rule (``version_policy``) reads it, in every process that answers.
        os.environ[POLICY_ENV] = vllm_policy
    if random_count is not None:
        _drift_refusals(random_count, coordinator, paths, caches, junit, output)
    if get_coordinator(coordinator).installed_vllm:
        from replay.adapters.vllm.backend import installed_version_policy

        assumed = installed_version_policy()
        if assumed.note:
            note_at_end(assumed.note)
    if random_count is not None:
        _drift(random_count, seed, coordinator, paths, caches, junit, output, as_json)
        return
    if output is not None:
        raise fail("-o: only with --random (the drift check writes a trace)")
    traces = expectation_traces(list(paths) or [corpus_dir()])
    if junit is not None:
        from replay.format.paths import JUNIT, check_outputs

        check_outputs({"--junit-xml": junit}, traces, text=True, formats={"--junit-xml": JUNIT})
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
    if junit is not None:
        from replay.format.paths import write_text

        write_text(junit, junit_xml(run, coordinator), what="JUnit XML")
    if as_json:
        from replay.cli.payloads import echo

        echo("test", run.to_json(coordinator))
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


def _drift_refusals(
    count: int,
    coordinator: str,
    paths: tuple[Path, ...],
    caches: tuple[str, ...],
    junit: Path | None,
    output: Path | None,
) -> None:
    """The drift check's options, each refused in one line before vLLM is
    imported (a mistyped option is the user's first problem to hear of)."""
    from replay.format.paths import PARQUET, check_outputs

    if not get_coordinator(coordinator).installed_vllm:
        raise fail("--random: the drift check compares the installed vLLM, give --coordinator vllm")
    if count < 1:
        raise fail(f"--random {count}: expected at least 1 configuration")
    for given, what in ((paths, "PATH"), (caches, "--cache"), (junit, "--junit-xml")):
        if given:
            raise fail(f"--random: {what} is not taken (the drift check answers both caches)")
    if output is not None:
        check_outputs({"-o": output}, [], formats={"-o": PARQUET})


def _drift(
    count: int,
    seed: int,
    coordinator: str,
    paths: tuple[Path, ...],
    caches: tuple[str, ...],
    junit: Path | None,
    output: Path | None,
    as_json: bool,
) -> None:
    """``replay test --coordinator vllm --random N``: the drift check (its
    options already checked by ``_drift_refusals``)."""
    from replay.adapters.vllm.backend import installed_policy, installed_vllm_version
    from replay.analysis.flags import add_flags
    from replay.cli.progress import progress_bar
    from replay.format.paths import PARQUET, check_outputs
    from replay.tools.drift import Difference, check_drift
    from replay.tools.render import drift_lines

    version = installed_vllm_version()
    policy, _ = installed_policy()
    if policy is None:
        raise fail(f"--random: no policy of this project models the installed vLLM {version}")

    def where(diff: Difference) -> Path:
        path = output or Path(f"drift-vllm-{version}-seed-{seed}.parquet")
        if output is None:
            check_outputs({"-o": path}, [], formats={"-o": PARQUET})
        return path.resolve()

    with progress_bar() as bar:

        def progress(done: int, total: int) -> None:
            if bar is not None:
                bar.count(done, total, f"{done:,}/{total:,} configurations")

        report = check_drift(
            count,
            seed,
            policy,
            judge=add_flags,
            output=where,
            version=version,
            progress=progress,
        )
    if as_json:
        from dataclasses import asdict

        from replay.cli.payloads import echo

        first = asdict(report.first) if report.first is not None else None
        echo(
            "test",
            {
                "trace": first["written"] if first else None,
                "coordinator": VLLM.name,
                "vllm": version,
                **{k: v for k, v in asdict(report).items() if k != "first"},
                "seconds": round(report.seconds, 3),
                "first": first,
            },
        )
    else:
        for line in drift_lines(report, version):
            click.echo(line)
    if report.first is not None:
        sys.exit(1)
    if not report.lookups:
        # Nothing checked is never a pass (every configuration refused by
        # the policy or beyond what this vLLM's API can state).
        raise fail(
            f"no lookup was compared: of {report.scenarios:,} random configurations, the policy "
            f"refused or vLLM {version} cannot state every one; give a larger --random"
        )
