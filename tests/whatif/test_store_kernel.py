"""The compiled store rules (``replay.whatif.store_kernel``) against the
Python ones they port (``replay.rules.store_rules.StoreRules``), request by
request: random configurations the what-if's pool compiles (EAGLE, flagged
draft groups, lookahead hashes), prompts, hits, shared-prefix junctions,
budgets and retentions; every chunk end and every stored block must be
equal. The end-to-end runs (``test_whatif_kernel.py``) see a difference
only where a later hit reads it; this sees every one."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from replay.base.errors import ReplayError
from replay.rules.store_rules import StoreRules, StoreSettings
from replay.whatif import store_kernel
from replay.whatif.kernel import supported
from replay.whatif.kernel_config import compile_config
from tests.builders import random_archetype_config

POLICIES = ("vllm-0.33", "vllm-0.34")


@pytest.mark.parametrize("seed", range(4))
def test_compiled_stores_equal_the_store_rules(seed: int) -> None:
    rng = random.Random(seed)
    seen: Counter[str] = Counter()
    for _ in range(40):
        config = random_archetype_config(rng, lookahead=True)
        assert supported(config, "gpu") is None
        a = config.scheduler_block_size
        settings = StoreSettings(
            cache="gpu",
            policy=rng.choice(POLICIES),
            retention_interval=rng.choice((0, None, 2 * a)) if config.num_groups > 1 else 0,
            max_num_batched_tokens=a * rng.choice((1, 2, 3, 8, 64)),
        )
        try:
            rules = StoreRules(config, settings)
        except ReplayError:
            continue  # a retention the release refuses
        kernel = compile_config(config, settings.policy, settings, "lru", 1, 1)
        ends = np.zeros(4096, dtype=np.int64)
        bounds = np.zeros(8, dtype=np.int64)
        for _ in range(60):
            n = rng.randrange(1, 40 * a)
            hashed = config.hashed_units(n) * config.hash_block_size
            hit = min(rng.randrange(0, n) // a * a, hashed // a * a)
            junction = 0
            if rules.uses_junction and rng.random() < 0.3 and hit + a < n:
                junction = rng.randrange(hit + a, n + 1) // a * a
            want_ends = rules.chunk_ends(n, hit, junction)
            want = rules.stores(num_tokens=n, hit_tokens=hit, junction_tokens=junction)
            count = store_kernel.chunk_ends(kernel.params, n, hit, junction, ends)
            stored = np.zeros((config.num_groups, n // 16 + 2), dtype=np.int64)
            store_kernel.stores(
                kernel.params, kernel.groups, n, hit, junction, hashed, ends, count, stored, 1,
                bounds,
            )  # fmt: skip
            why = (config.to_json(), settings, n, hit, junction)
            assert ends[:count].tolist() == want_ends, why
            got = [np.flatnonzero(stored[g]).tolist() for g in range(config.num_groups)]
            assert got == [[int(b) for b in s] for s in want], why
            seen["lookahead"] += config.num_hash_lookahead_tokens > 0
            seen["junction"] += junction > 0
            seen["mamba"] += rules.has_mamba
    assert min(seen.values()) >= 100, seen
