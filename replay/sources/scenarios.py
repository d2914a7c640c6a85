"""Random lookup scenarios: seeded KV-cache configurations (every group
kind, one to four groups, merged equal specs, draft groups sharing the
target's spec, per-group EAGLE flags with EAGLE on and off, sliding windows
with ``extra_retained_tokens``, partial hits declared or not) and, per
configuration, a request's hash chain looked up several times with random
stores, removes and clears (evictions) between the lookups, in both of
vLLM's caches where the configuration is valid.

The generator of the differential tests (``tests/``), of the corpus's
random traces (``traces/build.py``), of the mutants' judge and of ``replay
test --random`` (the drift check): the stream never depends on an answer,
so scenario ``k`` of a seed is always the same.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from replay.base.errors import ConfigError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.rules.coordinator import check_config

FA = GroupKind.FULL_ATTENTION
SW = GroupKind.SLIDING_WINDOW
CL = GroupKind.CHUNKED_LOCAL_ATTENTION
MB = GroupKind.MAMBA
KINDS = tuple(GroupKind)


def make_config(
    *groups: GroupSpec,
    hbs: int = 16,
    sbs: int | None = None,
    eagle: bool = False,
    partial: bool = False,
    check: str | None = "mooncake",
) -> TraceConfig:
    """A configuration of ``groups`` (the scheduler block defaults to the LCM
    of the block sizes), checked for the ``check`` cache unless None."""
    cfg = TraceConfig(
        groups=groups,
        hash_block_size=hbs,
        scheduler_block_size=sbs or math.lcm(*(g.block_size for g in groups)),
        use_eagle=eagle,
        enable_partial_hash_hits=partial,
    )
    if check is not None:
        check_config(cfg, check)
    return cfg


def random_group(rng: random.Random, kind: GroupKind, bs: int, name: str) -> GroupSpec:
    if kind is SW:
        window = rng.choice(
            [1, 2, bs - 1, bs, bs + 1, 2 * bs, 2 * bs + 1, 3 * bs - 1, rng.randint(1, 4 * bs)]
        )
        extra = rng.choice([0, 0, 0, 1, bs // 2, bs, rng.randint(0, 2 * bs)])
        return GroupSpec(
            kind=kind, block_size=bs, sliding_window=max(1, window),
            extra_retained_tokens=extra, name=name,
        )  # fmt: skip
    if kind is CL:
        chunk = rng.choice([bs, 2 * bs, 4 * bs, 3 * bs, bs + bs // 2, rng.randint(1, 5 * bs)])
        return GroupSpec(kind=kind, block_size=bs, attention_chunk_size=chunk, name=name)
    if kind is MB:
        return GroupSpec(kind=kind, block_size=bs, mamba_cache_mode="align", name=name)
    return GroupSpec(kind=kind, block_size=bs, name=name)


def equal_spec(rng: random.Random, src: GroupSpec, name: str) -> GroupSpec:
    """A group whose spec equals ``src``'s, so vLLM merges the two."""
    g = replace(src, name=name, is_eagle_group=rng.random() < 0.3)
    if src.kind is SW and src.extra_retained_tokens and rng.random() < 0.5:
        # Same coverage window, split differently: one spec for the Mooncake
        # mirror (its ``_coverage_spec``), two for the engine.
        window = src.sliding_window or 0
        moved = rng.randint(1, src.extra_retained_tokens)
        g = replace(
            g,
            sliding_window=window + moved,
            extra_retained_tokens=src.extra_retained_tokens - moved,
        )
    return g


def random_hybrid_config(rng: random.Random) -> TraceConfig:
    """A random configuration; may raise ``ConfigError`` (counted, skipped)."""
    hbs = rng.choice([8, 16])
    sbs = rng.choice([s for s in (16, 32, 64, 128) if s >= hbs])
    partial = rng.random() < 0.45
    alignment = hbs if partial else sbs
    sizes = [b for b in (8, 16, 32, 64, 128) if b % hbs == 0 and sbs % b == 0]
    n = rng.choice([1, 1, 2, 2, 2, 3, 3, 4])
    groups: list[GroupSpec] = []
    for i in range(n):
        if groups and rng.random() < 0.25:
            groups.append(equal_spec(rng, rng.choice(groups), f"g{i}"))
            continue
        if groups and rng.random() < 0.2:
            # An EAGLE draft group with the target's full-attention spec.
            target = next((g for g in groups if g.kind is FA), None)
            if target is not None:
                groups.append(replace(target, name=f"draft{i}", is_eagle_group=True))
                continue
        kind = rng.choice(KINDS)
        bs = rng.choice(sizes)
        if kind is CL and rng.random() < 0.9:
            bs = alignment  # vLLM's rule; the rest probe the rejection
        g = random_group(rng, kind, bs, f"g{i}")
        groups.append(replace(g, is_eagle_group=rng.random() < 0.15))
    eagle = rng.random() < 0.5
    if n == 1 and rng.random() < 0.7:
        hbs = groups[0].block_size  # the engine's unitary coordinator needs it
    if any(g.kind is CL for g in groups) and rng.random() < 0.9:
        eagle = False
        groups = [replace(g, is_eagle_group=False) for g in groups]
    # The scheduler block is the LCM of the block sizes or a multiple of it.
    lcm = math.lcm(*(g.block_size for g in groups))
    sbs = lcm * rng.choice([1, 1, 1, 2]) if rng.random() < 0.5 else sbs
    return make_config(*groups, hbs=hbs, sbs=sbs, eagle=eagle, partial=partial, check=None)


def random_chain(rng: random.Random, config: TraceConfig, most: int) -> list[bytes]:
    """A request's hashes: up to ``most`` units and six scheduler blocks."""
    top = min(most, 6 * config.scheduler_block_size // config.hash_block_size)
    return [rng.randbytes(32) for _ in range(rng.randint(0, top))]


def mutate_store(rng: random.Random, store: list[set[bytes]], chain: Sequence[bytes]) -> None:
    """One store / remove / clear over a random subset of the request's keys."""
    n = len(chain)
    targets = range(len(store)) if rng.random() < 0.4 else [rng.randrange(len(store))]
    op = rng.random()
    for g in targets:
        keys = store[g]
        if op < 0.35:  # a request stored its prefix
            keys.update(chain[: rng.randint(0, n)])
        elif op < 0.55:
            keys.update(h for h in chain if rng.random() < 0.5)
        elif op < 0.75:
            keys.difference_update([h for h in chain if rng.random() < 0.3])
        elif op < 0.9 and n:
            keys.discard(chain[rng.randrange(n)])
        elif op < 0.95:
            keys.update(chain)
        else:
            keys.clear()


def random_max_length(rng: random.Random, config: TraceConfig, units: int) -> int:
    """Bounds people and vLLM's scheduler use: 0, multiples, non-multiples,
    up to the validity limit ``(units + 1) * hash_block_size - 1``."""
    hbs = config.hash_block_size
    limit = (units + 1) * hbs
    step = rng.choice([hbs, config.scheduler_block_size, rng.choice(config.groups).block_size, 1])
    pick = rng.random()
    if pick < 0.08:
        return 0
    if pick < 0.2:
        return limit - 1
    if pick < 0.35:
        return units * hbs
    if pick < 0.7:
        return rng.randrange(0, limit, step)
    return rng.randrange(limit)


def prompt_hashes(chain: Sequence[bytes], max_length: int, config: TraceConfig) -> list[bytes]:
    """The block hashes a vLLM request of ``max_length + 1`` tokens carries:
    one per whole hash unit of the prompt less its lookahead tokens
    (``Request`` hashes ``(num_tokens - num_hash_lookahead_tokens) //
    hash_block_size`` units), taken from ``chain``, the request's content.
    A prompt one unit longer than the chain ends in a unit of fresh content
    (a hash no store holds, derived from the chain, so the stream of random
    draws is the same). vLLM's Mooncake store worker asks the store only
    within the aligned prompt, so a lookup with more hashes than this is one
    no request makes."""
    units = config.hashed_units(max_length + 1)
    out = list(chain[:units])
    while len(out) < units:
        out.append(hashlib.blake2b(b"".join(out[-1:]), digest_size=32, person=b"fresh").digest())
    return out


def _flagged_twins(rng: random.Random, bs: int) -> list[GroupSpec]:
    """Two groups of one spec, one flagged EAGLE: sliding window over half
    the time (the case issue 14 names), else any kind."""
    kind = SW if rng.random() < 0.5 else rng.choice(KINDS)
    src = replace(random_group(rng, kind, bs, "twin0"), is_eagle_group=False)
    twin = replace(equal_spec(rng, src, "twin1"), is_eagle_group=True)
    pair = [src, twin]
    rng.shuffle(pair)
    return pair


def random_eagle_config(rng: random.Random, *, partial: bool | None = None) -> TraceConfig:
    """Two to four groups, at least two of equal spec flagged differently (a
    third of the time exactly two equal sliding-window groups beside other
    kinds); EAGLE on or off, chunked local attention among the kinds, partial
    hits a quarter of the time unless ``partial`` says. May raise
    ``ConfigError`` (the caller skips it)."""
    hbs = rng.choice([8, 16])
    sbs = rng.choice([s for s in (16, 32, 64) if s >= hbs])
    if partial is None:
        partial = rng.random() < 0.25
    sizes = [b for b in (8, 16, 32, 64) if b % hbs == 0 and sbs % b == 0]
    alignment = hbs if partial else sbs
    headline = rng.random() < 1 / 3
    bs = rng.choice(sizes)
    if headline:
        window = rng.choice([1, bs, bs + 1, 2 * bs, 3 * bs - 1, rng.randint(1, 4 * bs)])
        extra = rng.choice([0, 0, bs // 2, bs])
        swa = GroupSpec(
            kind=SW, block_size=bs, sliding_window=window, extra_retained_tokens=extra, name="swa0"
        )
        groups = [swa, replace(swa, name="swa1", is_eagle_group=True)]
        rng.shuffle(groups)
    else:
        groups = _flagged_twins(rng, alignment if rng.random() < 0.1 else bs)
    n = rng.randint(2, 4)
    while len(groups) < n:
        name = f"g{len(groups)}"
        if not headline and rng.random() < 0.35:
            groups.append(equal_spec(rng, rng.choice(groups), name))
            continue
        kind = rng.choice(KINDS)
        if headline and rng.random() < 0.5:
            kind = rng.choice([GroupKind.FULL_ATTENTION, MB])
        size = rng.choice(sizes)
        if kind is CL and rng.random() < 0.9:
            size = alignment  # vLLM's rule; the rest probe the rejection
        groups.append(
            replace(random_group(rng, kind, size, name), is_eagle_group=rng.random() < 0.25)
        )
    # Chunked local groups carry an EAGLE drop only sometimes (vLLM refuses it).
    if any(g.kind is CL for g in groups) and rng.random() < 0.7:
        groups = [replace(g, is_eagle_group=False) if g.kind is CL else g for g in groups]
    rng.shuffle(groups)
    use_eagle = rng.random() < 0.5
    if any(g.kind is CL for g in groups) and rng.random() < 0.7:
        use_eagle = False
    # Every size divides sbs, so it is a valid scheduler block.
    return make_config(*groups, hbs=hbs, sbs=sbs, eagle=use_eagle, partial=partial, check=None)


@dataclass(frozen=True)
class Scenario:
    """One random configuration and its lookups: before each, the store as
    it stands (one set of present hash units per group); both of vLLM's
    caches that accept the configuration answer every lookup."""

    index: int
    config: TraceConfig
    caches: tuple[str, ...]
    steps: tuple[tuple[tuple[frozenset[bytes], ...], tuple[bytes, ...], int], ...]


def random_scenarios(
    seed: int, count: int, lookups: int = 8, *, request_hashes: bool = True
) -> Iterator[Scenario]:
    """``count`` seeded scenarios, the differential tests' generator: random
    hybrid configurations and, every other one, configurations with equal
    specs flagged differently for EAGLE; stores, removes and clears between
    lookups. The stream never depends on an answer, so scenario ``k`` of a
    seed is always the same. Each lookup carries its request's own hashes
    (``prompt_hashes``); with ``request_hashes`` off, the drawn prefix of the
    chain as it is (more hashes than the prompt, or fewer: the first
    generator's lookups, kept for a corpus trace that needs them)."""
    rng = random.Random(seed)
    index = 0
    while index < count:
        try:
            config = random_hybrid_config(rng) if index % 2 == 0 else random_eagle_config(rng)
        except ConfigError:
            continue
        caches = []
        for cache in ("gpu", "mooncake"):
            try:
                check_config(config, cache)
                caches.append(cache)
            except ConfigError:
                pass
        if not caches:
            continue
        chain = random_chain(rng, config, 48)
        store: list[set[bytes]] = [set() for _ in config.groups]
        steps = []
        for _ in range(lookups):
            for _ in range(rng.randint(1, 3)):
                mutate_store(rng, store, chain)
            hashes = chain if rng.random() < 0.7 else chain[: rng.randint(0, len(chain))]
            max_length = random_max_length(rng, config, len(hashes))
            if request_hashes:
                # The request's own hashes (the bound was drawn for the prefix).
                hashes = prompt_hashes(chain, max_length, config)
            steps.append((tuple(frozenset(s) for s in store), tuple(hashes), max_length))
        yield Scenario(index, config, tuple(caches), tuple(steps))
        index += 1


def scenario_rows(scenario: Scenario) -> list[dict[str, Any]]:
    """The scenario as trace rows: before each lookup, the removes and stores
    that turn the previous store into the one the lookup sees."""
    rows: list[dict[str, Any]] = []
    before: list[frozenset[bytes]] = [frozenset() for _ in scenario.config.groups]
    for n, (store, hashes, max_length) in enumerate(scenario.steps):
        for gid, (old, new) in enumerate(zip(before, store, strict=True)):
            if old - new:
                rows.append({"kind": "remove", "group_id": gid, "block_hashes": sorted(old - new)})
            if new - old:
                rows.append({"kind": "store", "group_id": gid, "block_hashes": sorted(new - old)})
        rows.append(
            {
                "kind": "lookup",
                "request_id": f"s{scenario.index}-l{n}",
                "block_hashes": list(hashes),
                "max_length": max_length,
                "num_tokens": max_length + 1,
            }
        )
        before = list(store)
    return rows
