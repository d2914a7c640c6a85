"""``replay whatif``: click only, over ``replay.whatif.sweep``."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from replay.base.units import MAX_POINTS, Capacity, log_spaced, parse_capacities, parse_capacity
from replay.cli.common import command, fail
from replay.cli.options import (
    RETENTION_HELP,
    SIZE_LIMIT,
    chosen_policies,
    count_option,
    fraction_type,
    optional_retention,
    output_option,
    release_retention,
)
from replay.cli.progress import Bar, progress_bar
from replay.rules.coordinator import CACHES, DEFAULT_POLICY, POLICIES
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
    short_help="Hit ratios of TRACE's requests under other cache sizes and eviction policies.",
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
    default=None,
    help=f"The vLLM release policy: the semantics that compute each hit, and the "
    f"stores each request leaves behind [default: the trace's recorded release, "
    f"else {DEFAULT_POLICY}].",
)
@click.option(
    "--vllm",
    "vllm_version",
    metavar="VERSION",
    default=None,
    help="Simulate this vLLM release (e.g. 0.26.0): its policy's hits and stores.",
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
    vllm_version: str | None,
    retention_interval: int | str | None,
    max_num_batched_tokens: int,
    output: Path,
    emit_traces: Path | None,
    sample: float | None,
    jobs: int | None,
    quiet: bool,
) -> None:
    """Re-simulate TRACE's requests against a cache of other sizes and
    eviction policies, with the exact hybrid semantics of the chosen vLLM release
    (--vllm/--policy, else the trace's recorded release, else 0.33): the trace's
    store/remove/clear rows are dropped; each lookup, in seq order, gets its
    hit from the simulated cache, then leaves behind the stores vLLM would
    make for that hit, evicting per the policy. Requests run one at a time
    (no concurrency model), prefill only. Writes one row per (capacity,
    eviction) to OUTPUT with the hit ratio, hit tokens, evictions and the
    per-request hit-ratio percentiles and its method (gpu LRU capacities
    come from one stack-distance pass where that is exact, one-pass, else
    per-capacity) and simulator (compiled, or the Python model where the
    kernels do not cover the configuration), and the unbounded cache's ceiling in its metadata; `replay report OUTPUT` charts it. SIGINT or SIGTERM
    writes the runs that finished (marked partial)."""
    from analysis.flags import sweep_flag_counts
    from replay.format.paths import PARQUET, check_outputs, staged_outputs
    from replay.format.sweepfile import PERCENTILE_COLUMNS, write_sweep
    from replay.rules.coordinator import resolve_cache
    from replay.whatif.requests import load_requests
    from replay.whatif.sizes import block_bytes, page_sizes
    from replay.whatif.sweep import RunSpec, emit_path, sweep

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
    (policy,) = chosen_policies(
        trace, (policy,) if policy else (), (vllm_version,) if vllm_version else ()
    )
    retention = release_retention(retention_interval, policy)
    requests = load_requests(trace)
    config = requests.config
    cache_name = resolve_cache(config, cache)
    found = page_sizes(config, page_bytes, None if model_config is None else str(model_config))
    pages, page_source = found if found is not None else (None, None)
    unit = capacities[0].unit
    if unit == "bytes" and pages is None:
        raise fail(
            f"capacity {capacities[0].text!r}: bytes need the groups' page sizes, which the "
            "trace does not record: give --page-bytes (e.g. 2MiB, or one per group: "
            "2MiB,512KiB) or --model-config config.json"
        )
    working_set = requests.working_set_blocks()
    cost = block_bytes(pages) if pages is not None else None
    sizes: list[tuple[int, int | None]] = []
    for c in capacities:
        n = c.blocks(block_bytes=cost, working_set=working_set)
        if unit == "bytes" and cache_name == "mooncake":
            sizes.append((n, c.bytes))
        else:
            sizes.append((n, c.bytes if c.bytes is not None else (n * cost if cost else None)))
    run = functools.partial(
        RunSpec,
        cache=cache_name,
        policy=policy,
        retention_interval=retention,
        max_num_batched_tokens=max_num_batched_tokens,
        page_bytes=pages if unit == "bytes" else None,
    )
    sample_info: dict[str, object] | None = None
    scale = 1.0
    if sample is not None:
        requests, sample_info = requests.sample(sample)
        scale = sample
        sample_info["capacities"] = (
            f"each run simulates {sample:g} x its capacity on the sampled sessions "
            "(spatial sampling); rows give the full trace's capacity"
        )

    def simulated(n: int, b: int | None) -> tuple[int, int | None]:
        if scale == 1.0:
            return n, b
        return max(1, round(n * scale)), None if b is None else max(1, round(b * scale))

    specs = [
        run(eviction=e, capacity_blocks=sim_n, capacity_bytes=sim_b)
        for n, b in sizes
        for e in names
        for sim_n, sim_b in [simulated(n, b)]
    ]
    given = [(n, b) for n, b in sizes for _ in names]
    # The emitted traces and the sweep file appear together or not at all
    # (a signal mid-sweep still writes the finished runs, marked partial).
    with staged_outputs() as stage:
        if emit_traces is not None:
            staging = stage.directory(emit_traces, "--emit-traces")
            specs = [dataclasses.replace(spec, emit=emit_path(staging, spec)) for spec in specs]
        # The unbounded ceiling: a cache that never evicts (checked below).
        room = requests.working_set_blocks() + 2 * requests.max_request_blocks() + 64
        ceiling_spec = run(
            eviction="lru", capacity_blocks=room, capacity_bytes=None, page_bytes=None
        )
        started = time.perf_counter()
        rows: dict[int, dict[str, Any]] = {}
        meta: dict[str, Any] = {
            "version": 1,
            "trace": trace.name,
            "trace_config": config.to_json(),
            "cache": cache_name,
            "policy": policy,
            "vllm_version": vllm_version,
            "retention_interval": retention,
            "max_num_batched_tokens": max_num_batched_tokens,
            "page_bytes": list(pages) if pages else None,
            "page_bytes_source": page_source,
            "block_bytes": cost,
            "capacity_unit": unit,
            "capacities": [c.text for c in capacities],
            "working_set_blocks": working_set,
            "sample": sample_info,
            "ceiling": None,
            "partial": False,
        }

        def keep(k: int, row: dict[str, Any]) -> None:
            if k < len(specs):
                n, b = given[k]
                # The run's facts judged: one count per flag kind.
                counted = sweep_flag_counts([row], config)[0]
                rows[k] = {**counted, "capacity_blocks": n, "capacity_bytes": b}
            else:
                meta["ceiling"] = {
                    c: row[c]
                    for c in ("capacity_blocks", "hit_ratio", "hit_tokens", "evicted_blocks")
                } | {p: row[p] for p in PERCENTILE_COLUMNS}

        def finished_rows() -> list[dict[str, Any]]:
            return [rows[k] for k in sorted(rows)]

        try:
            with progress_bar(quiet) as bar:
                sweep(
                    requests,
                    [*specs, ceiling_spec],
                    jobs=jobs or os.cpu_count() or 1,
                    progress=None if bar is None else _sweep_progress(bar),
                    on_row=keep,
                )
        except BaseException:
            # A signal (or an error) mid-sweep: keep the runs that finished.
            if rows:
                meta["partial"] = True
                meta["seconds"] = time.perf_counter() - started
                write_sweep(output, finished_rows(), meta)
                click.echo(
                    f"wrote {output}: partial, {len(rows)} of {len(specs)} runs finished", err=True
                )
            raise
        ceiling = meta["ceiling"]
        if ceiling is not None and ceiling["evicted_blocks"]:
            meta["ceiling"] = None  # not unbounded after all: say nothing rather than a bound
        seconds = time.perf_counter() - started
        meta["seconds"] = seconds
        out_rows = finished_rows()
        write_sweep(stage.file(output), out_rows, meta)
    if quiet:
        return
    for line in sweep_lines(trace, len(requests), meta, out_rows):
        click.echo(line)
    click.echo(f"wrote {output} ({len(out_rows)} runs in {seconds:.1f} s)")
