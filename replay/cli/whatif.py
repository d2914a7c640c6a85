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
from replay.cli.options import count_option, output_option
from replay.cli.options import retention_interval as parse_retention
from replay.cli.progress import Bar, progress_bar
from replay.engine.answers import resolve_cache
from replay.rules.blockpool import EVICTIONS
from replay.rules.coordinator import CACHES, DEFAULT_POLICY, POLICIES
from replay.tools.render import sweep_lines
from replay.whatif.requests import load_requests
from replay.whatif.sizes import blocks_for_bytes, page_sizes, parse_bytes
from replay.whatif.sweep import RunSpec, emit_path, sweep, write_sweep


def _int_list(text: str, option: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise fail(f"{option}: expected positive integers separated by commas, got {part!r}")
        out.append(int(part))
    return out


def _names(values: tuple[str, ...]) -> list[str]:
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
@count_option("--jobs", least=1, help="Runs in parallel (default: the number of cores).")
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
    if (capacity_blocks is None) == (capacity_bytes is None):
        raise fail("give exactly one of --capacity-blocks and --capacity-bytes")
    if output.resolve() == trace.resolve():
        raise fail(f"{output}: is the input trace; choose another output")
    names = _names(evictions)
    retention = parse_retention(retention_interval)
    requests = load_requests(trace)
    config = requests.config
    cache_name = resolve_cache(config, cache)
    sizes: list[tuple[int, int | None]] = []
    pages: tuple[int, ...] | None = None
    if capacity_bytes is not None:
        pages = page_sizes(config, page_bytes)
        sizes = [
            (blocks_for_bytes(b, pages), b) for b in map(parse_bytes, capacity_bytes.split(","))
        ]
    elif capacity_blocks is not None:
        sizes = [(n, None) for n in _int_list(capacity_blocks, "--capacity-blocks")]
    if emit_traces is not None:
        if emit_traces.exists() and not emit_traces.is_dir():
            raise fail(f"{emit_traces}: not a directory")
        emit_traces.mkdir(parents=True, exist_ok=True)
    run = functools.partial(
        RunSpec,
        cache=cache_name,
        policy=policy,
        retention_interval=retention,
        max_num_batched_tokens=max_num_batched_tokens,
        page_bytes=pages,
    )
    specs = [run(eviction=e, capacity_blocks=n, capacity_bytes=b) for n, b in sizes for e in names]
    if emit_traces is not None:
        specs = [dataclasses.replace(spec, emit=emit_path(emit_traces, spec)) for spec in specs]
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
    write_sweep(output, rows, meta)
    if quiet:
        return
    for line in sweep_lines(trace, len(requests), meta, rows):
        click.echo(line)
    click.echo(f"wrote {output} ({len(rows)} runs in {seconds:.1f} s)")
