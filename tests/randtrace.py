"""Random traces for property tests: valid configs of every kind, stores,
removes and clears between lookups, max_length anywhere in the legal range."""

from __future__ import annotations

import random
from typing import Any

from replay.coordinator import check_config
from replay.errors import ConfigError
from replay.spec import GroupKind, GroupSpec, TraceConfig
from tests.conftest import chain

KINDS = list(GroupKind)


def random_config(rng: random.Random) -> TraceConfig:
    while True:
        hbs = rng.choice([8, 16])
        n = rng.randint(1, 3)
        groups = []
        for _ in range(n):
            kind = rng.choice(KINDS)
            bs = hbs * rng.choice([1, 2, 4])
            groups.append(
                GroupSpec(
                    kind=kind,
                    block_size=bs,
                    sliding_window=rng.choice([1, 17, 32, 48, 100])
                    if kind is GroupKind.SLIDING_WINDOW
                    else None,
                    extra_retained_tokens=rng.choice([0, 0, 8])
                    if kind is GroupKind.SLIDING_WINDOW
                    else 0,
                    attention_chunk_size=rng.choice([32, 64, 96])
                    if kind is GroupKind.CHUNKED_LOCAL_ATTENTION
                    else None,
                    mamba_cache_mode="align" if kind is GroupKind.MAMBA else None,
                    is_eagle_group=rng.random() < 0.15,
                )
            )
        lcm = max(g.block_size for g in groups)
        try:
            config = TraceConfig(
                groups=tuple(groups),
                hash_block_size=hbs,
                scheduler_block_size=lcm * rng.choice([1, 1, 2]),
                use_eagle=rng.random() < 0.5,
                enable_partial_hash_hits=rng.random() < 0.3,
            )
            for cache in ("mooncake", "gpu"):
                check_config(config, cache)
        except ConfigError:
            continue
        return config


def random_rows(
    rng: random.Random, config: TraceConfig, n_requests: int = 12
) -> list[dict[str, Any]]:
    """A few prefix families; each request stores random subsets of its keys
    per group, then later requests look up extensions of those prefixes."""
    hbs = config.hash_block_size
    families = [chain(rng.randint(2, 14), f"fam{f}-{rng.random()}") for f in range(3)]
    rows: list[dict[str, Any]] = []
    seq = 0
    for r in range(n_requests):
        fam = rng.choice(families)
        n = rng.randint(0, len(fam))
        hashes = fam[:n]
        for gid in range(config.num_groups):
            if rng.random() < 0.8 and hashes:
                keep = [h for h in fam if rng.random() < 0.85]
                rows.append({"seq": seq, "kind": "store", "group_id": gid, "block_hashes": keep})
                seq += 1
            if rng.random() < 0.2 and hashes:
                gone = rng.sample(hashes, k=rng.randint(1, len(hashes)))
                rows.append({"seq": seq, "kind": "remove", "group_id": gid, "block_hashes": gone})
                seq += 1
        if rng.random() < 0.05:
            rows.append({"seq": seq, "kind": "clear", "group_id": rng.choice([None, 0])})
            seq += 1
        hi = (n + 1) * hbs - 1
        max_length = rng.choice([0, hi, n * hbs, max(0, n * hbs - 1), rng.randint(0, hi)])
        rows.append(
            {
                "seq": seq,
                "kind": "lookup",
                "request_id": f"req-{r}",
                "block_hashes": hashes,
                "max_length": max_length,
                "num_tokens": max_length + 1,
                "observed_hit_tokens": rng.choice([None, 0, max_length // hbs * hbs]),
            }
        )
        seq += rng.randint(1, 3)
    return rows
