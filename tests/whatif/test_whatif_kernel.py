"""The compiled gpu what-if (``replay.whatif.kernel``) against the Python
block-pool model it ports (``replay.rules.blockpool.GpuCache``, itself checked
against vLLM's ``KVCacheManager`` in ``test_whatif_vllm.py``): random
configurations, prompts, budgets, retention settings, policies, capacities
and evictions; every request's hit, every lookup's facts and the evicted blocks
must be equal."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest

from replay.base.errors import ReplayError
from replay.format.writer import write_trace
from replay.rules.coordinator import POLICIES
from replay.rules.coordinator.stores import policy_stores
from replay.rules.store_rules import StoreRules
from replay.whatif.kernel import supported
from replay.whatif.requests import load_requests
from replay.whatif.sweep import RunSpec, runs_compiled, simulate
from tests.builders import lookup_rows, random_archetype_config, random_prompts, unit_hashes

EVICTIONS = ("lru", "fifo", "lfu", "belady")

#: The policies whose GPU block pool the model covers (vLLM 0.24 on: unhashed
#: blocks freed to the front of the queue).
POOLED = [p for p in POLICIES if policy_stores(p).free_order == "unhashed-front"]


def _trace(tmp: Path, rng: random.Random, count: int) -> tuple[Path, int]:
    config = random_archetype_config(rng, lookahead=True)
    a = config.scheduler_block_size
    prompts = random_prompts(rng, a, count)
    rows = lookup_rows(config, prompts, rng)
    longest = max(len(p) for p in prompts) // config.groups[0].block_size + 1
    return write_trace(tmp / "t.parquet", config, rows), longest * config.num_groups


@pytest.mark.parametrize("seed", range(12))
def test_compiled_runs_equal_the_python_model(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    checked = evicted = 0
    for k in range(5):
        (tmp_path / str(k)).mkdir()
        trace, largest = _trace(tmp_path / str(k), rng, 60)
        requests = load_requests(trace)
        config = requests.config
        assert supported(config, "gpu") is None
        a = config.scheduler_block_size
        sparse = config.num_groups > 1
        runs = 0
        for _ in range(12):
            if runs == 3:
                break
            spec = RunSpec(
                cache="gpu",
                eviction=rng.choice(EVICTIONS),
                capacity_blocks=rng.randrange(max(1, largest // 3), largest * 5),
                policy=rng.choice(POOLED),
                retention_interval=rng.choice((0, None, 2 * a)) if sparse else 0,
                max_num_batched_tokens=a * rng.choice((1, 2, 3, 8, 64)),
            )
            try:
                # A retention the policy's release could not be given is skipped.
                StoreRules(config, spec.store_settings())
            except ReplayError:
                continue
            mine = simulate(requests, spec)
            theirs = simulate(requests, spec, compiled=False)
            assert mine["_hits"].tolist() == theirs["_hits"].tolist(), (config.to_json(), spec)
            # Every lookup's facts (what the flags are judged from), column by column.
            assert mine["facts"].equals(theirs["facts"]), (config.to_json(), spec)
            for column in theirs:
                if column not in ("seconds", "simulator", "_hits", "facts"):
                    assert mine[column] == theirs[column], (column, config.to_json(), spec)
            compiled = "compiled" if runs_compiled(requests, spec) else "python"
            assert (mine["simulator"], theirs["simulator"]) == (compiled, "python")
            checked += 1
            runs += 1
            evicted += theirs["evicted_blocks"]
    assert checked >= 10


def _breaks(model: str, seeds: int, tmp: Path) -> tuple[int, int]:
    from replay.sources.archetypes import archetype_config

    broken = checked = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        config = archetype_config(model, 16, 16, rng.random() < 0.5)
        prompts = random_prompts(rng, 16, 80)
        rows: list[dict[str, Any]] = [
            {
                "kind": "lookup",
                "request_id": f"r{i}",
                "block_hashes": unit_hashes(p, 16),
                "max_length": len(p) - 1,
                "num_tokens": len(p),
            }
            for i, p in enumerate(prompts)
        ]
        requests = load_requests(write_trace(tmp / f"{model}-{seed}.parquet", config, rows))
        longest = max(len(p) for p in prompts) // 16 + 1
        runs = [
            simulate(requests, RunSpec(cache="gpu", eviction="lru", capacity_blocks=c))["_hits"]
            for c in range(longest, longest * config.num_groups * 8, 3)
        ]
        checked += 1
        broken += any(
            bool(((small >= 0) & (big >= 0) & (big < small)).any())
            for small, big in itertools.pairwise(runs)
        )
    return broken, checked


def test_no_single_pass_over_capacities_can_be_exact_for_hybrid_models(tmp_path: Path) -> None:
    """A stack algorithm (every capacity's hits from one pass of stack
    distances) needs each request's hit to grow with the capacity. In a
    hybrid pool it does not: a larger pool keeps other blocks, the fixed
    point settles elsewhere, the request stores other states. So the sweep
    runs every capacity (compiled); a single full-attention group keeps the
    order on these streams, the necessary condition, and the one pass is
    built for it where it is exact (``replay.whatif.stack``,
    ``tests/whatif/test_whatif_stack.py``)."""
    for model in ("full+mamba", "full+swa"):
        broken, checked = _breaks(model, 8, tmp_path)
        assert broken > 0, model
    broken, checked = _breaks("full", 8, tmp_path)
    assert broken == 0 and checked == 8


def _pooled_trace(tmp: Path, rng: random.Random, count: int) -> tuple[Path, int]:
    """Prompts whose units come from a small pool of hashes, unchained: a
    hash repeats inside a prompt and across prompts at other depths (the
    compiled belady re-files a key twice in one prompt)."""
    config = random_archetype_config(rng)
    a = config.scheduler_block_size
    pool = [rng.randbytes(8) for _ in range(24)]
    rows: list[dict[str, Any]] = []
    previous: list[bytes] = []
    for i in range(count):
        units = rng.randrange(1, 30)
        keep = previous[: rng.randrange(len(previous) + 1)] if rng.random() < 0.7 else []
        hashes = (keep + [rng.choice(pool) for _ in range(units)])[:units]
        previous = hashes
        n = units * config.hash_block_size + rng.randrange(config.hash_block_size)
        rows.append(
            {
                "kind": "lookup",
                "request_id": f"r{i}",
                "block_hashes": hashes,
                "max_length": n - 1 - (rng.randrange(a) if rng.random() < 0.1 else 0),
                "num_tokens": n,
            }
        )
    rows = [r for r in rows if r["max_length"] >= 0]
    return write_trace(tmp / "t.parquet", config, rows), 31 * config.num_groups


@pytest.mark.parametrize("seed", range(16))
def test_every_eviction_order_equals_the_python_model(seed: int, tmp_path: Path) -> None:
    """Every eviction order at a pool that evicts much and one that evicts
    a little, on the same stream: chained prompts (even seeds) or prompts
    over a small pool of hashes, repeated inside a prompt (odd seeds)."""
    rng = random.Random(1000 + seed)
    pooled = seed % 2 == 1
    trace, largest = (_pooled_trace if pooled else _trace)(tmp_path, rng, 50)
    requests = load_requests(trace)
    if pooled:
        units = [requests.unit_ids(i) for i in range(len(requests))]
        assert any(len(set(u)) < len(u) for u in units)
    evicted = 0
    for capacity in (max(2, largest // 2), largest * 2):
        for eviction in EVICTIONS:
            spec = RunSpec(cache="gpu", eviction=eviction, capacity_blocks=capacity)
            mine = simulate(requests, spec)
            theirs = simulate(requests, spec, compiled=False)
            assert mine["_hits"].tolist() == theirs["_hits"].tolist(), (eviction, capacity)
            assert mine["facts"].equals(theirs["facts"]), (eviction, capacity)
            assert (mine["simulator"], theirs["simulator"]) == ("compiled", "python")
            for column in theirs:
                if column not in ("seconds", "simulator", "_hits", "facts"):
                    assert mine[column] == theirs[column], (column, eviction, capacity)
            evicted += theirs["evicted_blocks"]
    assert evicted > 0
