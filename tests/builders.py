"""The tests' shared builders, in one place: hash chains, the #43559 rows,
configurations (fixed and random), random stores, lookups and prompts, and
the Hypothesis strategies. ``traces/build.py`` builds the committed
regression traces from the same chains and configurations."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import strategies as st

from replay.base.errors import ConfigError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.format.trace import TraceReader
from replay.rules.coordinator import check_config
from replay.rules.coordinator.hybrid import Contains
from replay.sources.archetypes import archetype_config

FULL = FA = GroupKind.FULL_ATTENTION
SWA = SW = GroupKind.SLIDING_WINDOW
CHUNKED = CL = GroupKind.CHUNKED_LOCAL_ATTENTION
MAMBA = MB = GroupKind.MAMBA
KINDS = tuple(GroupKind)


# --- seeded parametrizations: a few in `make test`, all in `make test-slow` --


def seeds(n: int, fast: int = 2, start: int = 0) -> list[Any]:
    """Seeds ``start .. start + n - 1`` for a random differential test: the
    first ``fast`` run in ``make test``, the others carry the ``slow`` marker
    (``make test-slow``), so every seed still runs in CI."""
    return [
        s if s < start + fast else pytest.param(s, marks=pytest.mark.slow)
        for s in range(start, start + n)
    ]


# --- hash chains, fixed configurations, the #43559 rows ----------------------


def chain(n: int, tag: str = "r") -> list[bytes]:
    """n chained 32-byte hashes: each names its whole prefix, as vLLM's do."""
    out, parent = [], tag.encode()
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "big")).digest()
        out.append(parent)
    return out


def full_mamba(
    block: int = 16,
    eagle: bool = True,
    *,
    names: tuple[str, str] = ("attn", "mamba"),
    source: dict[str, Any] | None = None,
) -> TraceConfig:
    """Full attention + Mamba (align), one block size, EAGLE on: #43559's model."""
    return TraceConfig(
        groups=(
            GroupSpec(kind=FULL, block_size=block, name=names[0]),
            GroupSpec(kind=MAMBA, block_size=block, mamba_cache_mode="align", name=names[1]),
        ),
        hash_block_size=block,
        scheduler_block_size=block,
        use_eagle=eagle,
        source=source,
    )


def issue_43559_rows(
    request_id: str = "req-43559", observed_hit_tokens: int | None = None
) -> list[dict[str, Any]]:
    """#43559: four blocks of both groups stored, lookup of the four hashes, max_length 64."""
    hs = chain(4, "43559")
    lookup: dict[str, Any] = {
        "kind": "lookup",
        "request_id": request_id,
        "block_hashes": hs,
        "max_length": 64,
        "num_tokens": 65,
    }
    if observed_hit_tokens is not None:
        lookup["observed_hit_tokens"] = observed_hit_tokens
    return [
        {"kind": "store", "group_id": 0, "block_hashes": hs},
        {"kind": "store", "group_id": 1, "block_hashes": hs},
        lookup,
    ]


# --- one group, by kind (the coordinator's rule tests) -----------------------


def fa(bs: int = 16, *, eagle: bool = False) -> GroupSpec:
    return GroupSpec(kind=FA, block_size=bs, is_eagle_group=eagle)


def sw(bs: int, window: int, *, extra: int = 0, eagle: bool = False) -> GroupSpec:
    return GroupSpec(
        kind=SW, block_size=bs, sliding_window=window, extra_retained_tokens=extra,
        is_eagle_group=eagle,
    )  # fmt: skip


def cl(bs: int, chunk: int) -> GroupSpec:
    return GroupSpec(kind=CL, block_size=bs, attention_chunk_size=chunk)


def mb(bs: int = 16, *, eagle: bool = False) -> GroupSpec:
    return GroupSpec(kind=MB, block_size=bs, mamba_cache_mode="align", is_eagle_group=eagle)


def config(
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


# --- random configurations for the differential tests ------------------------


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
        assert src.sliding_window is not None
        moved = rng.randint(1, src.extra_retained_tokens)
        g = replace(
            g,
            sliding_window=src.sliding_window + moved,
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
    return config(*groups, hbs=hbs, sbs=sbs, eagle=eagle, partial=partial, check=None)


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
    return config(*groups, hbs=hbs, sbs=sbs, eagle=use_eagle, partial=partial, check=None)


# --- random traces for the property tests -------------------------------------


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


# --- random prompts and archetypes for the what-if tests -----------------------


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


def lookup_rows(
    config: TraceConfig, prompts: list[list[int]], rng: random.Random | None = None
) -> list[dict[str, Any]]:
    """One lookup row per prompt (the what-if's requests); with ``rng``, a
    tenth of them asking for less than the whole prompt."""
    a = config.scheduler_block_size
    rows: list[dict[str, Any]] = [
        {
            "kind": "lookup",
            "request_id": f"r{i}",
            "block_hashes": unit_hashes(p, config.hash_block_size),
            "max_length": len(p)
            - 1
            - (rng.randrange(a) if rng is not None and rng.random() < 0.1 else 0),
            "num_tokens": len(p),
        }
        for i, p in enumerate(prompts)
    ]
    return [r for r in rows if r["max_length"] >= 0]


def unit_hashes(tokens: list[int], hash_block_size: int) -> list[bytes]:
    """One 8-byte hash per full ``hash_block_size`` tokens, chained over the prefix."""
    out: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - hash_block_size + 1, hash_block_size):
        chunk = b"".join(t.to_bytes(4, "big") for t in tokens[start : start + hash_block_size])
        parent = hashlib.sha256(parent + chunk).digest()[:8]
        out.append(parent)
    return out


ARCHETYPES_COVERED = ("full", "full+mamba", "full+swa", "full+swa+mamba", "swa+mamba")


def random_archetype_config(
    rng: random.Random, models: Sequence[str] = ARCHETYPES_COVERED
) -> TraceConfig:
    """An archetype the block-pool model covers (no chunked local, hash unit
    = block; one of ``models``), random sizes, EAGLE on or off, sometimes a
    flagged draft group."""
    model = rng.choice(list(models))
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


# --- Hypothesis strategies ----------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[TraceConfig, int, int, list[set[int]]]:
    hbs = draw(st.sampled_from([8, 16]))
    partial = draw(st.booleans())
    sizes = [b for b in (8, 16, 32, 64) if b % hbs == 0]
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(list(GroupKind)))
        bs = draw(st.sampled_from(sizes))
        eagle = draw(st.booleans()) and draw(st.booleans())
        if kind is SW:
            window = draw(st.integers(1, 4 * bs))
            extra = draw(st.sampled_from([0, 0, 1, bs]))
            groups.append(sw(bs, window, extra=extra, eagle=eagle))
        elif kind is CL:
            groups.append(cl(hbs if partial else bs, draw(st.sampled_from([bs, 2 * bs, 24]))))
        elif kind is MB:
            groups.append(mb(bs, eagle=eagle))
        else:
            groups.append(fa(bs, eagle=eagle))
    lcm = math.lcm(*(g.block_size for g in groups))
    try:
        cfg = config(
            *groups,
            hbs=hbs,
            sbs=lcm * draw(st.sampled_from([1, 1, 2])),
            eagle=draw(st.booleans()),
            partial=partial,
        )
    except ConfigError:  # chunked local with EAGLE: drop the chunked groups
        kept = [g for g in groups if g.kind is not CL] or [fa(hbs)]
        cfg = config(*kept, hbs=hbs, partial=partial)
    units = draw(st.integers(0, 20))
    present = [
        set(draw(st.lists(st.integers(0, max(units - 1, 0)), max_size=units)))
        | set(range(draw(st.integers(0, units))))
        for _ in cfg.groups
    ]
    max_length = draw(st.integers(0, (units + 1) * hbs - 1))
    return cfg, units, max_length, present


def hand_fold(
    rows: Iterable[dict[str, Any]], num_groups: int
) -> Iterator[tuple[int, dict[str, Any], list[set[bytes]]]]:
    """Each lookup row, with its index and the store as it stands then (a
    set of keys per group), folded by hand: the plain restatement a test
    checks the compiled fold against. The sets are live: read them before
    taking the next lookup."""
    present: list[set[bytes]] = [set() for _ in range(num_groups)]
    for i, r in enumerate(rows):
        if r["kind"] == "store":
            present[r["group_id"]].update(r["block_hashes"])
        elif r["kind"] == "remove":
            present[r["group_id"]].difference_update(r["block_hashes"])
        elif r["kind"] == "clear":
            for g, keys in enumerate(present):
                if r["group_id"] in (None, g):
                    keys.clear()
        elif r["kind"] == "lookup":
            yield i, r, present


def hand_folded_lookups(reader: TraceReader) -> Iterator[tuple[dict[str, Any], Contains]]:
    """Each lookup row of a trace with a membership test per group (live,
    as in ``hand_fold``)."""
    rows = reader.read_frame().iter_rows(named=True)
    for _, r, present in hand_fold(rows, reader.config.num_groups):
        yield r, [keys.__contains__ for keys in present]


# --- the one replay call, flagged, as most tests want it ---------------------


def replay_trace(
    trace: Any,
    *,
    policy: str = "vllm-0.33",
    coordinator: str = "reference",
    cache: str | None = None,
    unit_present: bool = False,
    progress: Any = None,
    progress_every: float = 0.2,
) -> Any:
    """One variant of ``trace`` through ``replay.engine.run.replay``, with
    its flags (``replay.analysis.flags.flag_results``)."""
    from replay.analysis.flags import flag_results
    from replay.engine.run import ReplayOptions, replay

    options = ReplayOptions(
        policies=(policy,),
        caches=(cache,),
        coordinator=coordinator,
        unit_present=unit_present,
        progress=progress,
        progress_every=progress_every,
    )
    (result,) = flag_results(replay(trace, options))
    return result


def replay_sharded(
    trace: Any,
    *,
    policies: Sequence[str],
    caches: Sequence[str | None] = (None,),
    coordinator: str = "reference",
    unit_present: bool = False,
    shards: int = 1,
) -> Any:
    """Every policy in every cache with ``shards`` key shards, flagged."""
    from replay.analysis.flags import flag_results
    from replay.engine.run import ReplayOptions, replay

    options = ReplayOptions(
        policies=tuple(policies),
        caches=tuple(caches),
        coordinator=coordinator,
        unit_present=unit_present,
        shards=shards,
    )
    return flag_results(replay(trace, options))


# --- random lookup scenarios (the mutants' judge and the corpus's source) ----


@dataclass(frozen=True)
class Scenario:
    """One random configuration and its lookups: before each, the store as
    it stands (one set of present hash units per group); both of vLLM's
    caches that accept the configuration answer every lookup."""

    index: int
    config: TraceConfig
    caches: tuple[str, ...]
    steps: tuple[tuple[tuple[frozenset[bytes], ...], tuple[bytes, ...], int], ...]


def random_scenarios(seed: int, count: int, lookups: int = 8) -> Iterator[Scenario]:
    """``count`` seeded scenarios, the differential tests' generator: random
    hybrid configurations and, every other one, configurations with equal
    specs flagged differently for EAGLE; stores, removes and clears between
    lookups. The stream never depends on an answer, so scenario ``k`` of a
    seed is always the same."""
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


def answerable(config: TraceConfig, policy: str, cache: str) -> bool:
    """Whether ``policy`` answers this configuration in ``cache`` (the cache
    existed in its releases, and they take the configuration)."""
    from replay.rules.coordinator import Coordinator

    try:
        Coordinator(config, policy, cache)
    except ConfigError:
        return False
    return True
