"""Random prompt streams for the what-if tests: prompts that share prefixes
with recent ones (resends, extensions, branches), some block-aligned."""

from __future__ import annotations

import hashlib
import random


def random_prompts(rng: random.Random, block: int, count: int) -> list[list[int]]:
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
