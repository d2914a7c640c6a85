"""The compiled gpu what-if (``replay.whatif.kernel``) against the Python
block-pool model it ports (``replay.blockpool.GpuCache``, itself checked
against vLLM's ``KVCacheManager`` in ``test_whatif_vllm.py``): random
configurations, prompts, budgets, retention settings, policies, capacities
and evictions; every request's hit, every flag count and the evicted blocks
must be equal."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from replay.base.errors import ReplayError
from replay.format.writer import write_trace
from replay.rules.coordinator import POLICIES
from replay.rules.store_rules import StorePolicy
from replay.whatif.kernel import supported
from replay.whatif.requests import load_requests
from replay.whatif.sweep import RunSpec, simulate
from tests.builders import random_archetype_config, random_prompts, unit_hashes

EVICTIONS = ("lru", "fifo", "lfu", "belady")


def _trace(tmp: Path, rng: random.Random, count: int) -> tuple[Path, int]:
    config = random_archetype_config(rng)
    a = config.scheduler_block_size
    prompts = random_prompts(rng, a, count)
    rows: list[dict[str, Any]] = [
        {
            "kind": "lookup",
            "request_id": f"r{i}",
            "block_hashes": unit_hashes(p, config.hash_block_size),
            "max_length": len(p) - 1 - (rng.randrange(a) if rng.random() < 0.1 else 0),
            "num_tokens": len(p),
        }
        for i, p in enumerate(prompts)
    ]
    rows = [r for r in rows if r["max_length"] >= 0]
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
        for _ in range(3):
            spec = RunSpec(
                cache="gpu",
                eviction=rng.choice(EVICTIONS),
                capacity_blocks=rng.randrange(max(1, largest // 3), largest * 5),
                policy=rng.choice(list(POLICIES)),
                retention_interval=rng.choice((0, None, 2 * a)) if sparse else 0,
                max_num_batched_tokens=a * rng.choice((1, 2, 3, 8, 64)),
            )
            try:
                StorePolicy(
                    cache="gpu",
                    retention_interval=spec.retention_interval,
                    max_num_batched_tokens=spec.max_num_batched_tokens,
                )
            except ReplayError:
                continue
            mine = simulate(requests, spec)
            theirs = simulate(requests, spec, compiled=False)
            assert mine["_hits"].tolist() == theirs["_hits"].tolist(), (config.to_json(), spec)
            for column in theirs:
                if column not in ("seconds", "_hits"):
                    assert mine[column] == theirs[column], (column, config.to_json(), spec)
            checked += 1
            evicted += theirs["evicted_blocks"]
    assert checked >= 10
