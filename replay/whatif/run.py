"""The one what-if call: a trace's requests re-simulated against caches of
other sizes and eviction orders, beside the one replay call
(``replay.engine.run.replay``).

Every face calls ``whatif``: ``replay whatif`` and any Python caller. Its
options are one frozen dataclass (``WhatifOptions``); a refusal is a
``ReplayError``. It turns the capacities into blocks, samples the sessions,
sizes the unbounded run whose hit ratio is the ceiling, builds the sweep's
metadata, runs the sweep (``replay.whatif.sweep``) and writes the sweep
file (``replay.format.sweepfile``), the finished runs alone when a signal
ends it. The flags are the analyses' to count (``WhatifOptions.count_flags``)."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import Any

from replay.base.errors import Interrupted, ReplayError
from replay.base.units import Capacity
from replay.format.paths import PARQUET, check_outputs, staged_outputs
from replay.format.sweepfile import PERCENTILE_COLUMNS
from replay.rules.coordinator import resolve_cache
from replay.whatif.options import WhatifOptions
from replay.whatif.requests import Requests, load_requests
from replay.whatif.sizes import block_bytes, page_sizes
from replay.whatif.sweep import RunSpec, Sweep, emit_path, sweep

__all__ = ["Sweep", "WhatifOptions", "whatif"]


def run_sizes(
    capacities: tuple[Capacity, ...],
    cache: str,
    pages: tuple[int, ...] | None,
    working_set: int,
) -> list[tuple[int, int | None]]:
    """Each capacity as (blocks, bytes): its bytes when given in bytes (the
    mooncake store counts each key's own page against them), else the
    blocks' nominal bytes at the largest page, when the pages are known."""
    unit = capacities[0].unit
    if unit == "bytes" and pages is None:
        raise ReplayError(
            f"capacity {capacities[0].text!r}: bytes need the groups' page sizes, which the "
            "trace does not record: give `page_bytes` (e.g. 2MiB, or one per group: "
            "2MiB,512KiB) or `model_config` config.json"
        )
    cost = block_bytes(pages) if pages is not None else None
    sizes: list[tuple[int, int | None]] = []
    for c in capacities:
        n = c.blocks(block_bytes=cost, working_set=working_set)
        if unit == "bytes" and cache == "mooncake":
            sizes.append((n, c.bytes))
        else:
            sizes.append((n, c.bytes if c.bytes is not None else (n * cost if cost else None)))
    return sizes


def scaled(n: int, b: int | None, scale: float) -> tuple[int, int | None]:
    """A capacity of the full trace as the sample of ``scale`` of its
    sessions simulates it (spatial sampling)."""
    if scale == 1.0:
        return n, b
    return max(1, round(n * scale)), None if b is None else max(1, round(b * scale))


def unbounded_blocks(requests: Requests) -> int:
    """A cache that never evicts: every distinct block, room for the
    longest request twice, and a margin (the ceiling run checks it evicted
    nothing)."""
    return requests.working_set_blocks() + 2 * requests.max_request_blocks() + 64


def whatif(trace: str | os.PathLike[str], options: WhatifOptions) -> Sweep:
    """Simulate the requests of ``trace`` under every capacity and eviction
    order of ``options``: one row per run, in order, and the unbounded
    cache's ceiling in the metadata; with ``options.output``, the sweep file
    written there (and with ``emit_traces``, each run as a trace), both or
    neither. A signal or an error mid-sweep writes the runs that finished to
    ``output``, marked partial (``on_partial`` hears of it), and goes on."""
    o = options
    if not o.capacities:
        raise ReplayError("no capacity to simulate")
    if o.output is not None:
        check_outputs(
            {"output": o.output},
            [trace],
            directories={"emit_traces": o.emit_traces},
            formats={"output": PARQUET},
        )
    requests = load_requests(trace)
    config = requests.config
    cache = resolve_cache(config, o.cache)
    found = page_sizes(
        config, o.page_bytes, None if o.model_config is None else os.fspath(o.model_config)
    )
    pages, page_source = found if found is not None else (None, None)
    unit = o.capacities[0].unit
    working_set = requests.working_set_blocks()
    sizes = run_sizes(o.capacities, cache, pages, working_set)
    run = functools.partial(
        RunSpec,
        cache=cache,
        policy=o.policy,
        retention_interval=o.retention_interval,
        max_num_batched_tokens=o.max_num_batched_tokens,
        page_bytes=pages if unit == "bytes" else None,
    )
    sample_info: dict[str, object] | None = None
    scale = 1.0
    if o.sample is not None:
        requests, sample_info = requests.sample(o.sample)
        scale = o.sample
        sample_info["capacities"] = (
            f"each run simulates {o.sample:g} x its capacity on the sampled sessions "
            "(spatial sampling); rows give the full trace's capacity"
        )
    specs = [
        run(eviction=e, capacity_blocks=sim_n, capacity_bytes=sim_b)
        for n, b in sizes
        for e in o.evictions
        for sim_n, sim_b in [scaled(n, b, scale)]
    ]
    given = [(n, b) for n, b in sizes for _ in o.evictions]
    cost = block_bytes(pages) if pages is not None else None
    meta: dict[str, Any] = {
        "version": 1,
        "trace": Path(trace).name,
        "trace_config": config.to_json(),
        "cache": cache,
        "policy": o.policy,
        "vllm_version": o.vllm_version,
        "retention_interval": o.retention_interval,
        "max_num_batched_tokens": o.max_num_batched_tokens,
        "page_bytes": list(pages) if pages else None,
        "page_bytes_source": page_source,
        "block_bytes": cost,
        "capacity_unit": unit,
        "capacities": [c.text for c in o.capacities],
        "working_set_blocks": working_set,
        "sample": sample_info,
        "ceiling": None,
        "partial": False,
    }
    rows: dict[int, dict[str, Any]] = {}

    def finished() -> Sweep:
        return Sweep([rows[k] for k in sorted(rows)], meta, len(requests), len(specs))

    # The emitted traces and the sweep file appear together or not at all; a
    # signal publishes the finished runs (marked partial) with their traces
    # (the README's one rule, "Outputs on a signal").
    with staged_outputs() as stage:
        if o.emit_traces is not None:
            staging = stage.directory(o.emit_traces, "emit_traces")
            specs = [dataclasses.replace(spec, emit=emit_path(staging, spec)) for spec in specs]
        # The unbounded ceiling: a cache that never evicts (checked below).
        ceiling_spec = run(
            eviction="lru",
            capacity_blocks=unbounded_blocks(requests),
            capacity_bytes=None,
            page_bytes=None,
        )
        started = time.perf_counter()

        def keep(k: int, row: dict[str, Any]) -> None:
            if k < len(specs):
                n, b = given[k]
                if o.count_flags is not None:
                    # The run's facts judged: one count per flag kind.
                    row = o.count_flags([row], config)[0]
                rows[k] = {**row, "capacity_blocks": n, "capacity_bytes": b}
            else:
                meta["ceiling"] = {
                    c: row[c]
                    for c in ("capacity_blocks", "hit_ratio", "hit_tokens", "evicted_blocks")
                } | {p: row[p] for p in PERCENTILE_COLUMNS}

        try:
            sweep(
                requests,
                [*specs, ceiling_spec],
                jobs=o.jobs,
                progress=o.progress,
                on_row=keep,
            )
        except (KeyboardInterrupt, Interrupted):
            # A signal mid-sweep: the finished runs, marked partial, and the
            # traces exactly those runs emitted, published together; an
            # unfinished run's trace (or a killed worker's temporary file)
            # never. An error publishes nothing.
            if rows and o.output is not None:
                meta["partial"] = True
                meta["seconds"] = time.perf_counter() - started
                partial = finished()
                partial.write(stage.file(o.output))
                if o.emit_traces is not None:
                    done = {Path(str(specs[k].emit)).name for k in rows}
                    for entry in staging.iterdir():
                        if entry.name not in done:
                            entry.unlink(missing_ok=True)
                stage.publish()
                if o.on_partial is not None:
                    o.on_partial(partial)
            raise
        ceiling = meta["ceiling"]
        if ceiling is not None and ceiling["evicted_blocks"]:
            meta["ceiling"] = None  # not unbounded after all: say nothing rather than a bound
        meta["seconds"] = time.perf_counter() - started
        result = finished()
        if o.output is not None:
            result.write(stage.file(o.output))
    return result
