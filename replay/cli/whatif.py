"""``replay whatif``: click only, over ``replay.whatif``. ``replay.cli``
registers it on the group."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from replay.answers import resolve_cache
from replay.blockpool import EVICTIONS
from replay.cli.common import fail, handles_user_errors
from replay.cli.common import retention_interval as parse_retention
from replay.coordinator import CACHES, DEFAULT_POLICY, POLICIES
from replay.whatif import (
    RunSpec,
    blocks_for_bytes,
    emit_path,
    load_requests,
    page_sizes,
    parse_bytes,
    sweep,
    write_sweep,
)


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


class _SweepBar:
    """Progress over the runs: a bar on a terminal, else a line per run."""

    def __init__(self, tty: bool) -> None:
        self.started = time.perf_counter()
        self.shown = False
        self.tty = tty

    def __call__(self, done: int, total: int) -> None:
        if not self.tty:
            if done:
                elapsed = time.perf_counter() - self.started
                sys.stderr.write(f"{done}/{total} runs done, {elapsed:,.1f} s\n")
                sys.stderr.flush()
            return
        width = 24
        filled = width * done // max(total, 1)
        elapsed = time.perf_counter() - self.started
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} runs  {elapsed:,.1f} s"
        )
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown and self.tty:
            sys.stderr.write("\n")


@click.command("whatif")
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
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    default=8192,
    show_default=True,
    help="The scheduler's token budget per step (the longest prefill chunk).",
)
@click.option(
    "-o", "--output", type=click.Path(path_type=Path), required=True, help="SWEEP.parquet to write."
)
@click.option(
    "--emit-traces",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Also write each run as a trace in this directory (replay run replays it to the "
    "same hits).",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    help="Runs in parallel (default: the number of cores).",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no table.")
@handles_user_errors
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
    if capacity_blocks is not None:
        sizes = [(n, None) for n in _int_list(capacity_blocks, "--capacity-blocks")]
    else:
        assert capacity_bytes is not None
        pages = page_sizes(config, page_bytes)
        for part in capacity_bytes.split(","):
            size = parse_bytes(part)
            sizes.append((blocks_for_bytes(size, pages), size))
    if emit_traces is not None:
        if emit_traces.exists() and not emit_traces.is_dir():
            raise fail(f"{emit_traces}: not a directory")
        emit_traces.mkdir(parents=True, exist_ok=True)
    specs: list[RunSpec] = []
    for n_blocks, b in sizes:
        for name in names:
            spec = RunSpec(
                cache=cache_name,
                eviction=name,
                capacity_blocks=n_blocks,
                capacity_bytes=b,
                policy=policy,
                retention_interval=retention,
                max_num_batched_tokens=max_num_batched_tokens,
                page_bytes=pages,
            )
            if emit_traces is not None:
                spec = RunSpec(
                    **{f: getattr(spec, f) for f in RunSpec.__dataclass_fields__ if f != "emit"},
                    emit=emit_path(emit_traces, spec),
                )
            specs.append(spec)
    bar = None if quiet else _SweepBar(sys.stderr.isatty())
    started = time.perf_counter()
    try:
        rows = sweep(requests, specs, jobs=jobs or os.cpu_count() or 1, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - started
    write_sweep(
        output,
        rows,
        {
            "version": 1,
            "trace": trace.name,
            "trace_config": config.to_json(),
            "cache": cache_name,
            "policy": policy,
            "retention_interval": retention,
            "max_num_batched_tokens": max_num_batched_tokens,
            "page_bytes": list(pages) if pages else None,
            "seconds": seconds,
        },
    )
    if quiet:
        return
    click.echo(f"{trace}: {len(requests)} lookups, {cache_name} cache, policy {policy}")
    click.echo(
        f"{'capacity':>12} {'eviction':8} {'hit ratio':>9} {'hit tokens':>14} {'evicted':>10}"
    )
    for r in rows:
        click.echo(
            f"{r['capacity_blocks']:>12,} {r['eviction']:8} {r['hit_ratio']:>9.4f} "
            f"{r['hit_tokens']:>14,} {r['evicted_blocks']:>10,}"
        )
    click.echo(f"wrote {output} ({len(rows)} runs in {seconds:.1f} s)")
