"""The compiled Mooncake what-if (``replay.whatif.mooncake_kernel``) against
the Python model it ports (the ``mooncake`` branch of
``replay.whatif.sweep.simulate``): random full-attention and full + Mamba
traces, with and without EAGLE (and flagged draft groups), every policy the
kernel takes, capacities from one entry to unbounded, in entries and in
bytes, under every eviction order; every field of every row, every
request's hit and every lookup's facts must be equal."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.format.writer import write_trace
from replay.rules.coordinator import POLICIES
from replay.rules.store_rules import StoreRules, StoreSettings
from replay.sources.archetypes import archetype_config
from replay.whatif import mooncake_kernel
from replay.whatif.requests import Requests, load_requests
from replay.whatif.sweep import RunSpec, runs_compiled, simulate, sweep
from tests.builders import full_mamba, lookup_rows, random_archetype_config, random_prompts

EVICTIONS = ("lru", "fifo", "lfu", "belady")


def _requests(tmp: Path, rng: random.Random, count: int, lookahead: bool = False) -> Requests:
    config = random_archetype_config(rng, ("full", "full+mamba", "full+mamba"), lookahead=lookahead)
    rows = lookup_rows(config, random_prompts(rng, config.scheduler_block_size, count), rng)
    return load_requests(write_trace(tmp / "t.parquet", config, rows))


def _capacity(rng: random.Random, working_set: int) -> int:
    return rng.choice(
        (
            1,
            rng.randrange(1, 8),
            rng.randrange(1, max(2, working_set // 4)),
            rng.randrange(max(1, working_set // 4), working_set + 2),
            10**15,
        )
    )


def _assert_same(mine: dict[str, Any], theirs: dict[str, Any], why: Any) -> None:
    assert mine["_hits"].tolist() == theirs["_hits"].tolist(), why
    assert mine["facts"].equals(theirs["facts"]), why
    for column in theirs:
        if column not in ("seconds", "simulator", "_hits", "facts"):
            assert mine[column] == theirs[column], (column, why)
    assert (mine["simulator"], theirs["simulator"]) == ("compiled", "python"), why
    assert set(mine) == set(theirs), why


def _stores(config: TraceConfig, policy: str) -> bool:
    """Whether the release's Mooncake store exists for ``config``."""
    try:
        StoreRules(config, StoreSettings(cache="mooncake", policy=policy))
    except ReplayError:
        return False
    return True


@pytest.mark.parametrize("seed", range(8))
def test_compiled_mooncake_runs_equal_the_python_model(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    checked = evicted = 0
    for k in range(4):
        (tmp_path / str(k)).mkdir()
        requests = _requests(tmp_path / str(k), rng, 50, lookahead=True)
        config = requests.config
        assert mooncake_kernel.supported(config) is None, config.to_json()
        a = config.scheduler_block_size
        sparse = config.num_groups > 1
        working = requests.working_set_blocks()
        # Lookahead hashes reach the Mooncake store from vLLM 0.34.0 only.
        policies = [
            p
            for p in POLICIES
            if mooncake_kernel.supported(config, p) is None and _stores(config, p)
        ]
        for eviction in EVICTIONS:
            in_bytes = rng.random() < 0.3
            pages = tuple(rng.choice((1, 3, 100)) for _ in config.groups)
            capacity = _capacity(rng, working)
            spec = RunSpec(
                cache="mooncake",
                eviction=eviction,
                capacity_blocks=capacity,
                capacity_bytes=capacity * rng.choice((1, 50, 100)) if in_bytes else None,
                page_bytes=pages if in_bytes else None,
                policy=rng.choice(policies),
                retention_interval=rng.choice((0, None, 2 * a)) if sparse else 0,
                max_num_batched_tokens=a * rng.choice((1, 2, 3, 8, 64)),
            )
            try:
                StoreSettings(
                    cache="mooncake",
                    retention_interval=spec.retention_interval,
                    max_num_batched_tokens=spec.max_num_batched_tokens,
                )
            except ReplayError:
                continue
            assert runs_compiled(requests, spec)
            mine = simulate(requests, spec)
            theirs = simulate(requests, spec, compiled=False)
            _assert_same(mine, theirs, (config.to_json(), spec))
            checked += 1
            evicted += theirs["evicted_blocks"]
    assert checked >= 12 and evicted > 0


def test_sweep_runs_mooncake_compiled_and_the_rest_in_python(tmp_path: Path) -> None:
    """A sweep over a supported trace runs its Mooncake runs compiled, to the
    Python model's rows; a sliding-window trace falls back to the model."""
    rng = random.Random(7)
    requests = _requests(tmp_path, rng, 40)
    specs = [
        RunSpec(cache="mooncake", eviction=e, capacity_blocks=c)
        for e in EVICTIONS
        for c in (4, 40, 10**9)
    ]
    rows = sweep(requests, specs, jobs=2)
    for spec, row in zip(specs, rows, strict=True):
        _assert_same(row, simulate(requests, spec, compiled=False), spec)
    swa = archetype_config("full+swa", 16, 16, False, sliding_window=32)
    assert mooncake_kernel.supported(swa) == "sliding_window groups"
    prompts = random_prompts(rng, swa.scheduler_block_size, 12)
    trace = write_trace(tmp_path / "swa.parquet", swa, lookup_rows(swa, prompts))
    rows = sweep(load_requests(trace), specs[:2])
    assert [r["simulator"] for r in rows] == ["python", "python"]
    assert [r["method"] for r in rows] == ["per-capacity", "per-capacity"]


def test_the_lookahead_rule_is_compiled_only_where_it_is_the_newest_mirrors() -> None:
    """Without lookahead hashes 0.33.0's and 0.34.0's mirrors answer alike:
    both compiled; with them the kernel's EAGLE groups are 0.34.0's, so
    vllm-0.33 runs the Python model."""
    config = full_mamba()
    ahead = replace(config, num_hash_lookahead_tokens=4)
    assert [mooncake_kernel.supported(config, p) for p in ("vllm-0.33", "vllm-0.34")] == [
        None,
        None,
    ]
    assert mooncake_kernel.supported(ahead, "vllm-0.34") is None
    assert mooncake_kernel.supported(ahead, "vllm-0.33") == "policy vllm-0.33's mirror rules"


@pytest.mark.parametrize("seed", range(3))
def test_lookups_with_fewer_hashes_than_their_prompt(seed: int, tmp_path: Path) -> None:
    """A recorded lookup may carry fewer block hashes than its prompt has
    full blocks (the store then has no key for the rest): the Python model
    stores only the keyed blocks, as the compiled kernel does, instead of
    failing with an IndexError traceback (corpus traces of the shape before
    request-shaped lookups did, on every eviction order)."""
    rng = random.Random(seed)
    config = full_mamba()
    hbs = config.hash_block_size
    prompts = [p[: max(hbs, len(p) // hbs * hbs)] for p in random_prompts(rng, hbs, 60)]
    rows = lookup_rows(config, prompts, rng)
    cut = 0
    for row in rows:
        # The last full unit's hash left out, as a request with lookahead
        # tokens carries it (the most a trace may leave out).
        kept = len(row["block_hashes"]) - 1
        if kept >= 0 and row["num_tokens"] <= (kept + 1) * hbs and rng.random() < 0.5:
            row["block_hashes"] = row["block_hashes"][:kept]
            row["max_length"] = min(row["max_length"], kept * hbs + rng.randrange(hbs))
            cut += 1
    requests = load_requests(write_trace(tmp_path / "t.parquet", config, rows))
    assert cut >= 20
    for eviction in EVICTIONS:
        spec = RunSpec(cache="mooncake", eviction=eviction, capacity_blocks=rng.randrange(4, 64))
        assert runs_compiled(requests, spec)
        mine = simulate(requests, spec)
        theirs = simulate(requests, spec, compiled=False)
        _assert_same(mine, theirs, (seed, spec))
