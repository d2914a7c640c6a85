"""Commands and options for traces beyond one file and one process:
``replay split`` / ``replay cat`` convert between a trace file and a trace
directory, and ``replay run --workers N`` / ``--ray ADDRESS`` replay on Ray
with the store sharded by key (``replay.engine.run.replay`` chooses
``replay.engine.cluster`` when asked)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from replay.base.text import counted
from replay.cli.common import command
from replay.cli.options import TRACE, count_option, count_type, output_option

if TYPE_CHECKING:
    pass


@command()
@TRACE
@output_option("The new directory to write (absent or empty).", required=True)
@count_option(
    "--files",
    least=1,
    required=True,
    help="How many files: equal rows give or take one (one file a row when there are fewer rows).",
)
def split(trace: Path, output: Path, files: int) -> None:
    """Write TRACE as a trace directory of FILES files, in seq order."""
    from replay.format.tracedir import split_trace

    n = split_trace(trace, output, files)
    click.echo(f"{trace} -> {output}: {counted(n, 'file')}")


@command()
@TRACE
@output_option("The one trace file to write.", required=True)
def cat(trace: Path, output: Path) -> None:
    """Write every event of a trace directory (or file) TRACE into one file."""
    from replay.format.tracedir import cat_trace

    n = cat_trace(trace, output)
    click.echo(f"{trace} -> {output}: {counted(n, 'event')}")


WORKERS = click.option(
    "--workers",
    type=count_type(1, 4096),
    default=None,
    help="Replay on Ray with the store split into this many key shards (a local Ray "
    "with this many CPUs, unless --ray names a cluster). Needs the ray extra.",
)
RAY = click.option(
    "--ray",
    "ray_address",
    default=None,
    metavar="auto|HOST:PORT",
    help="Replay on an existing Ray cluster (auto: the one `ray start` runs here); one "
    "shard per CPU unless --workers says how many.",
)


def results_paths(
    trace: Path,
    output: Path | None,
    policies: Sequence[str],
    caches: Sequence[str | None] = (None,),
) -> list[Path]:
    """Where each variant's results go, policy by policy then cache by cache:
    the one path for one variant, else the varying names before the suffix
    (``t.results.parquet`` -> ``t.pre-49502.results.parquet``, or
    ``t.pre-49502.gpu.results.parquet`` with several of both)."""
    from replay.engine.replay import default_results_path

    base = output or default_results_path(trace)
    labels = [
        ".".join([p] * (len(policies) > 1) + [str(c)] * (len(caches) > 1))
        for p in policies
        for c in caches
    ]
    if len(labels) == 1:
        return [base]
    name = base.name
    stem = name.removesuffix(".parquet")
    tail = ".parquet" if stem != name else ""
    if stem.endswith(".results"):
        stem, tail = stem.removesuffix(".results"), ".results" + tail
    return [base.with_name(f"{stem}.{label}{tail}") for label in labels]
