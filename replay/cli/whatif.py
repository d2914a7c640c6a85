"""``replay whatif``: click only, over ``replay.whatif.sweep``."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path

import click

from replay.cli.common import command, fail
from replay.cli.options import (
    SIZE_LIMIT,
    count_option,
    output_option,
    parse_bytes,
    parse_count,
    parse_list,
)
from replay.cli.options import retention_interval as parse_retention
from replay.cli.progress import Bar, progress_bar
from replay.rules.coordinator import CACHES, DEFAULT_POLICY, POLICIES
from replay.tools.render import sweep_lines

#: The largest cache a what-if run simulates, in blocks (a capacity beyond
#: what the trace's requests can fill is simulated at what they can fill).
MAX_CAPACITY_BLOCKS = 1 << 40


def _capacities(text: str) -> list[int]:
    return parse_list(
        text,
        "--capacity-blocks",
        lambda t, o: parse_count(t, o, least=1, most=MAX_CAPACITY_BLOCKS),
    )


def _byte_list(text: str, option: str) -> list[int]:
    return parse_list(text, option, lambda t, o: parse_bytes(t, o))


def _names(values: tuple[str, ...]) -> list[str]:
    from replay.rules.blockpool import EVICTIONS


    out: list[str] = []
    for value in values:
        for name in value.split(","):
            name = name.strip()
            if name not in EVICTIONS:
                raise fail(
                    f"--eviction: unknown policy {name!r}, expected one of {', '.join(EVICTIONS)}"
                )
            if name not in out:
                out.append(name)
    return out


def _sweep_progress(bar: Bar) -> Callable[[int, int], None]:
    def show(done: int, total: int) -> None:
        bar.count(done, total, f"{done}/{total} runs  {bar.elapsed():,.1f} s")

    return show


@command(
    "whatif",
    short_help="Hit ratios of TRACE's requests under other cache sizes and eviction policies.",
)
@click.argument("trace", type=click.Path(path_type=Path))
@click.option(
    "--capacity-blocks",
    default=None,
    help="Cache sizes to try, in blocks, comma-separated (gpu: vLLM's num_gpu_blocks "
    "less its null block, shared by every group).",
)
@click.option(
    "--capacity-bytes",
    default=None,
    help="Cache sizes in bytes, comma-separated (64GiB, 500GB); needs --page-bytes.",
)
@click.option(
    "--page-bytes",
    default=None,
    help="Bytes of one block of each group (one size, or one per group, comma-separated); "
    "default: the trace's source.page_bytes.",
)
@click.option(
    "--eviction",
    "evictions",
    multiple=True,
    default=("lru",),
    show_default=True,
    help="Eviction policies, repeated or comma-separated: lru (gpu: vLLM's own free-queue "
    "order), fifo, lfu, belady (offline: evicts the key whose next use is furthest ahead; "
    "the optimum for independent keys, a near-upper bound for prefix chains).",
)
@click.option(
    "--cache",
    type=click.Choice(list(CACHES)),
    default=None,
    help="gpu: vLLM's engine block pool; mooncake: a capacity-bounded external store. "
    "Default: the trace's source.cache, else mooncake.",
)
@click.option(
    "--policy",
    type=click.Choice(list(POLICIES)),
    default=DEFAULT_POLICY,
    show_default=True,
    help="Coordinator semantics that compute each hit.",
)
@click.option(
    "--retention-interval",
    default="0",
    show_default=True,
    help="vLLM's prefix_cache_retention_interval: 0, a multiple of the scheduler block "
    "size, or none (dense).",
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
@count_option("--jobs", least=1, most=1024, help="Runs in parallel (default: the number of cores).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no table.")
def whatif(
    trace: Path,
    capacity_blocks: str | None,
    capacity_bytes: str | None,
    page_bytes: str | None,
    evictions: tuple[str, ...],
    cache: str | None,
    policy: str,
    retention_interval: str,
    max_num_batched_tokens: int,
    output: Path,
    emit_traces: Path | None,
    jobs: int | None,
    quiet: bool,
) -> None:
    """Re-simulate TRACE's requests against a cache of other sizes and
    eviction policies, with vLLM 0.33's exact hybrid semantics: the trace's
    store/remove/clear rows are dropped; each lookup, in seq order, gets its
    hit from the simulated cache, then leaves behind the stores vLLM would
    make for that hit, evicting per the policy. Requests run one at a time
    (no concurrency model), prefill only. Writes one row per (capacity,
    eviction) to OUTPUT; `replay report OUTPUT` charts it."""
    from replay.engine.answers import resolve_cache
    from replay.format.paths import check_outputs, staged_outputs
    from replay.whatif.requests import load_requests
    from replay.whatif.sizes import blocks_for_bytes, page_sizes
    from replay.whatif.sweep import RunSpec, emit_path, sweep, write_sweep

    if (capacity_blocks is None) == (capacity_bytes is None):
        raise fail("give exactly one of --capacity-blocks and --capacity-bytes")
    check_outputs({"-o": output}, [trace], directories={"--emit-traces": emit_traces})
    # Every number is parsed before any work: a typo costs no sweep.
    blocks = _capacities(capacity_blocks) if capacity_blocks is not None else None
    byte_sizes = (
        _byte_list(capacity_bytes, "--capacity-bytes") if capacity_bytes is not None else None
    )
    given_pages = _byte_list(page_bytes, "--page-bytes") if page_bytes is not None else None
    names = _names(evictions)
    retention = parse_retention(retention_interval)
    requests = load_requests(trace)
    config = requests.config
    cache_name = resolve_cache(config, cache)
    sizes: list[tuple[int, int | None]] = []
    pages: tuple[int, ...] | None = None
    if byte_sizes is not None:
        pages = page_sizes(config, given_pages)
        sizes = [(blocks_for_bytes(b, pages), b) for b in byte_sizes]
    elif blocks is not None:
        sizes = [(n, None) for n in blocks]
    run = functools.partial(
        RunSpec,
        cache=cache_name,
        policy=policy,
        retention_interval=retention,
        max_num_batched_tokens=max_num_batched_tokens,
        page_bytes=pages,
    )
    specs = [run(eviction=e, capacity_blocks=n, capacity_bytes=b) for n, b in sizes for e in names]
    # The emitted traces and the sweep file appear together or not at all.
    with staged_outputs() as stage:
        if emit_traces is not None:
            staging = stage.directory(emit_traces, "--emit-traces")
            specs = [dataclasses.replace(spec, emit=emit_path(staging, spec)) for spec in specs]
        started = time.perf_counter()
        with progress_bar(quiet) as bar:
            rows = sweep(
                requests,
                specs,
                jobs=jobs or os.cpu_count() or 1,
                progress=None if bar is None else _sweep_progress(bar),
            )
        from analysis.flags import sweep_flag_counts

        rows = sweep_flag_counts(rows, config)
        seconds = time.perf_counter() - started
        meta = {
            "version": 1,
            "trace": trace.name,
            "trace_config": config.to_json(),
            "cache": cache_name,
            "policy": policy,
            "retention_interval": retention,
            "max_num_batched_tokens": max_num_batched_tokens,
            "page_bytes": list(pages) if pages else None,
            "seconds": seconds,
        }
        write_sweep(stage.file(output), rows, meta)
    if quiet:
        return
    for line in sweep_lines(trace, len(requests), meta, rows):
        click.echo(line)
    click.echo(f"wrote {output} ({len(rows)} runs in {seconds:.1f} s)")
