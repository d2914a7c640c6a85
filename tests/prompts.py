"""Random prompt streams and model configurations for the what-if tests."""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace

from replay.sources.archetypes import archetype_config
from replay.spec import TraceConfig


def random_prompts(rng: random.Random, block: int, count: int) -> list[list[int]]:
    """Prompts sharing prefixes with recent ones (resends, extensions,
    branches), some block-aligned."""
    fresh = iter(range(10**6, 10**9))
    out: list[list[int]] = []
    for _ in range(count):
        n = rng.randrange(2, 30 * block)
        if rng.random() < 0.25:
            n = max(block, n // block * block)
        base: list[int] = []
        if out and rng.random() < 0.8:
            parent = rng.choice(out[-12:])
            base = parent[: rng.randrange(0, len(parent) + 1)]
        prompt = (base + [next(fresh) for _ in range(max(0, n - len(base)))])[:n]
        if out and rng.random() < 0.15:
            prompt = list(rng.choice(out[-12:]))
        out.append(prompt)
    return out


def unit_hashes(tokens: list[int], hash_block_size: int) -> list[bytes]:
    """One 8-byte hash per full ``hash_block_size`` tokens, chained over the prefix."""
    out: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - hash_block_size + 1, hash_block_size):
        chunk = b"".join(t.to_bytes(4, "big") for t in tokens[start : start + hash_block_size])
        parent = hashlib.sha256(parent + chunk).digest()[:8]
        out.append(parent)
    return out


def random_config(rng: random.Random) -> TraceConfig:
    """An archetype the block-pool model covers (no chunked local, hash unit
    = block), random sizes, EAGLE on or off, sometimes a flagged draft group."""
    model = rng.choice(["full", "full+mamba", "full+swa", "full+swa+mamba", "swa+mamba"])
    bs = rng.choice((16, 32))
    config = archetype_config(
        model,
        bs,
        bs,
        rng.random() < 0.6,
        sliding_window=rng.choice((bs + 1, 2 * bs, 3 * bs - 5, 100, 256)),
        extra_retained_tokens=rng.choice((0, 0, bs // 2)),
    )
    if config.num_groups > 1 and rng.random() < 0.3:
        groups = list(config.groups)
        gid = rng.randrange(len(groups))
        groups[gid] = replace(groups[gid], is_eagle_group=True)
        config = replace(config, groups=tuple(groups))
    return config
