"""``replay whatif``: click only, over the one what-if call (``replay.whatif.run.whatif``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import click

from replay.base.text import counted
from replay.base.units import MAX_POINTS, Capacity, log_spaced, parse_capacities, parse_capacity
from replay.cli.common import command, fail
from replay.cli.options import (
    RETENTION_HELP,
    SIZE_LIMIT,
    cache_option,
    chosen_policies,
    count_option,
    fraction_type,
    optional_retention,
    output_option,
    policy_options,
    release_retention,
)
from replay.cli.progress import Bar, progress_bar
from replay.tools.render import sweep_lines


def _capacities(
    capacity: str | None,
    capacity_blocks: str | None,
    capacity_bytes: str | None,
    points: int | None,
    low: str | None,
    high: str | None,
) -> list[Capacity]:
    """The sizes asked for, in the one unit they were given in."""
    ranged = points is not None or low is not None or high is not None
    given = [capacity, capacity_blocks, capacity_bytes]
    if sum(g is not None for g in given) + ranged != 1:
        raise fail(
            "give exactly one of --capacity, --capacity-blocks, --capacity-bytes and "
            "--points/--min/--max"
        )
    if ranged:
        if points is None or low is None or high is None:
            raise fail("--points, --min and --max go together")
        return log_spaced(parse_capacity(low, "--min"), parse_capacity(high, "--max"), points)
    if capacity is not None:
        return parse_capacities(capacity)
    if capacity_blocks is not None:
        out = parse_capacities(capacity_blocks, "--capacity-blocks")
        unit = "blocks"
    else:
        assert capacity_bytes is not None
        out = parse_capacities(
            ",".join(
                p if p.strip()[-1:] in "bB" else p.strip() + "B"
                for p in capacity_bytes.split(",")
                if p.strip()
            ),
            "--capacity-bytes",
        )
        unit = "bytes"
    bad = next((c for c in out if c.unit != unit), None)
    if bad is not None:
        option = "--capacity-blocks" if unit == "blocks" else "--capacity-bytes"
        raise fail(f"{option}: {bad.text!r} is not in {unit} (--capacity takes any unit)")
    return out


def _names(values: tuple[str, ...]) -> list[str]:
    from replay.rules.eviction import EVICTIONS

    out: list[str] = []
    for value in values:
        for name in value.split(","):
            name = name.strip()
            if name not in EVICTIONS:
                raise fail(
                    f"--eviction: unknown eviction order {name!r}, expected one of {', '.join(EVICTIONS)}"
                )
            if name not in out:
                out.append(name)
    return out


def _sweep_progress(bar: Bar) -> Callable[[int, int, int, int], None]:
    """Requests done across the whole sweep, the runs finished, and the time
    left at the rate so far."""

    def show(done: int, total: int, runs: int, all_runs: int) -> None:
        elapsed = bar.elapsed()
        eta = f"ETA {elapsed * (total - done) / done:,.0f} s" if done else "ETA ?"
        bar.count(
            done,
            total,
            f"{done:,}/{total:,} requests  {runs}/{all_runs} runs  {elapsed:,.1f} s  {eta}",
        )

    return show


@command(
    "whatif",
    short_help="Hit ratios of TRACE's requests under other cache sizes and eviction orders.",
)
@click.argument("trace", type=click.Path(path_type=Path))
@click.option(
    "--capacity",
    "capacity",
    default=None,
    help="Cache sizes to try, comma-separated, all in one unit: blocks (4096, 10k, 2M; gpu: "
    "vLLM's num_gpu_blocks less its null block, shared by every group), bytes (8GiB, 500GB) "
    "or a percentage of the trace's working set (10%,50%: of the distinct blocks its lookups "
    "name).",
)
@click.option(
    "--capacity-blocks", default=None, help="Cache sizes in blocks (--capacity in blocks)."
)
@click.option("--capacity-bytes", default=None, help="Cache sizes in bytes (--capacity in bytes).")
@count_option(
    "--points",
    least=2,
    most=MAX_POINTS,
    help="With --min and --max: this many capacities, log-spaced, both ends included.",
)
@click.option(
    "--min", "low", default=None, help="The smallest capacity of --points (10k, 1GiB, 1%)."
)
@click.option("--max", "high", default=None, help="The largest capacity of --points.")
@click.option(
    "--page-bytes",
    default=None,
    help="Bytes of one block of each group (one size, or one per group, comma-separated); "
    "default: the trace's source.page_bytes (the vLLM plugin records them).",
)
@click.option(
    "--model-config",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="A Hugging Face config.json to size one block from (K and V of every attention "
    "layer), instead of --page-bytes.",
)
@click.option(
    "--eviction",
    "evictions",
    multiple=True,
    default=("lru",),
    show_default=True,
    help="Eviction orders, repeated or comma-separated: lru (gpu: vLLM's own free-queue "
    "order), fifo, lfu, belady (offline: evicts the key whose next use is furthest ahead; "
    "the optimum for independent keys, a near-upper bound for prefix chains).",
)
@cache_option(
    "Simulated at each capacity: gpu as vLLM's engine block pool, mooncake as a "
    "capacity-bounded external store"
)
@policy_options(
    "whose semantics compute each hit and the stores each request leaves behind",
    described=False,
)
@click.option(
    "--retention-interval",
    default=None,
    metavar="N|none",
    callback=optional_retention,
    help=RETENTION_HELP,
)
@count_option(
    "--max-num-batched-tokens",
    default=8192,
    least=1,
    most=SIZE_LIMIT,
    help="The scheduler's token budget per step (the longest prefill chunk).",
)
@output_option("SWEEP.parquet to write.", required=True)
@click.option(
    "--emit-traces",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Also write each run as a trace in this directory (replay run replays it to the "
    "same hits).",
)
@click.option(
    "--sample",
    type=fraction_type(),
    default=None,
    help="Replay this fraction of the sessions (a deterministic sample: a session is kept "
    "by a digest of its first own hash) against the same fraction of each capacity; the "
    "sweep file says so.",
)
@count_option("--jobs", least=1, most=1024, help="Runs in parallel (default: the number of cores).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no table.")
def whatif(
    trace: Path,
    capacity: str | None,
    capacity_blocks: str | None,
    capacity_bytes: str | None,
    points: int | None,
    low: str | None,
    high: str | None,
    page_bytes: str | None,
    model_config: Path | None,
    evictions: tuple[str, ...],
    cache: str | None,
    policy: str | None,
    vllm_versions: tuple[str, ...],
    retention_interval: int | str | None,
    max_num_batched_tokens: int,
    output: Path,
    emit_traces: Path | None,
    sample: float | None,
    jobs: int | None,
    quiet: bool,
) -> None:
    """Re-simulate TRACE's requests against a cache of other sizes and
    eviction orders, with the exact hybrid semantics of the chosen vLLM release
    (--vllm/--policy, else the trace's recorded release, else 0.33): the trace's
    store/remove/clear rows are dropped; each lookup, in seq order, gets its
    hit from the simulated cache, then leaves behind the stores vLLM would
    make for that hit, evicting in the eviction order. Requests run one at a time
    (no concurrency model), prefill only. Writes one row per (capacity,
    eviction) to OUTPUT with the hit ratio, hit tokens, evictions and the
    per-request hit-ratio percentiles and its method (gpu LRU capacities
    come from one stack-distance pass where that is exact, one-pass, else
    per-capacity) and simulator (compiled, or the Python model where the
    kernels do not cover the configuration), and the unbounded cache's ceiling in its metadata; `replay report OUTPUT` charts it. SIGINT, SIGTERM
    or SIGHUP writes the runs that finished (marked partial) and, with
    --emit-traces, the traces of exactly those runs, together."""
    from replay.analysis.flags import sweep_flag_counts
    from replay.format.paths import PARQUET, check_outputs
    from replay.whatif.run import Sweep, WhatifOptions
    from replay.whatif.run import whatif as simulate

    # Every number is parsed and every output checked before any work.
    capacities = _capacities(capacity, capacity_blocks, capacity_bytes, points, low, high)
    check_outputs(
        {"-o": output},
        [trace],
        directories={"--emit-traces": emit_traces},
        formats={"-o": PARQUET},
    )
    names = _names(evictions)
    # The one policy rule of every command that reads a trace: --policy, else
    # --vllm, else the release that recorded the trace, else the default.
    (policy,) = chosen_policies(trace, (policy,) if policy else (), vllm_versions)
    partial: list[Sweep] = []
    try:
        with progress_bar(quiet) as bar:
            result = simulate(
                trace,
                WhatifOptions(
                    capacities=tuple(capacities),
                    evictions=tuple(names),
                    cache=cache,
                    policy=policy,
                    vllm_version=next(iter(vllm_versions), None),
                    retention_interval=release_retention(retention_interval, policy),
                    max_num_batched_tokens=max_num_batched_tokens,
                    page_bytes=page_bytes,
                    model_config=model_config,
                    sample=sample,
                    jobs=jobs or os.cpu_count() or 1,
                    output=output,
                    emit_traces=emit_traces,
                    count_flags=sweep_flag_counts,
                    progress=None if bar is None else _sweep_progress(bar),
                    on_partial=partial.append,
                ),
            )
    except BaseException:
        emitted = f" and their traces in {emit_traces}" if emit_traces is not None else ""
        for p in partial:
            click.echo(
                f"wrote {output}{emitted}: partial, {len(p.rows):,} of {counted(p.runs, 'run')} "
                "finished",
                err=True,
            )
        raise
    if quiet:
        return
    for line in sweep_lines(trace, result.requests, result.metadata, result.rows):
        click.echo(line)
    click.echo(
        f"wrote {output} ({counted(len(result.rows), 'run')} in {result.metadata['seconds']:.1f} s)"
    )
