"""The tests' shared builders, in one place: hash chains, the #43559 rows,
configurations (fixed and random), random stores, lookups and prompts, and
the Hypothesis strategies. ``traces/build.py`` builds the committed
regression traces from the same chains and configurations."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st

from replay.base.errors import ConfigError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.format.trace import TraceReader
from replay.rules.coordinator import check_config
from replay.rules.coordinator.hybrid import Contains
from replay.sources.archetypes import archetype_config
from replay.sources.scenarios import (
    Scenario,
    equal_spec,
    mutate_store,
    prompt_hashes,
    random_chain,
    random_eagle_config,
    random_group,
    random_hybrid_config,
    random_max_length,
    random_scenarios,
    scenario_rows,
)
from replay.sources.scenarios import (
    make_config as config,
)

__all__ = [
    "Scenario",
    "config",
    "equal_spec",
    "mutate_store",
    "prompt_hashes",
    "random_chain",
    "random_eagle_config",
    "random_group",
    "random_hybrid_config",
    "random_max_length",
    "random_scenarios",
    "scenario_rows",
]

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


# --- random configurations for the differential tests ------------------------
# (replay.sources.scenarios: the package's drift check uses them too)


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
    rng: random.Random,
    config: TraceConfig,
    n_requests: int = 12,
    *,
    request_shaped: bool = False,
) -> list[dict[str, Any]]:
    """A few prefix families; each request stores random subsets of its keys
    per group, then later requests look up extensions of those prefixes.
    ``request_shaped``: no lookup's prompt has a full block past its hashes
    (as a vLLM request's; the Mooncake store worker's aligned lookup of such
    a prompt indexes past them), the same draws otherwise."""
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
        hi = (n + 1) * hbs - (2 if request_shaped else 1)
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
            "block_hashes": unit_hashes(
                p, config.hash_block_size, config.num_hash_lookahead_tokens
            ),
            "max_length": len(p)
            - 1
            - (rng.randrange(a) if rng is not None and rng.random() < 0.1 else 0),
            "num_tokens": len(p),
        }
        for i, p in enumerate(prompts)
    ]
    return [r for r in rows if r["max_length"] >= 0]


def unit_hashes(tokens: list[int], hash_block_size: int, lookahead: int = 0) -> list[bytes]:
    """One 8-byte hash per full ``hash_block_size`` tokens, chained over the
    prefix; with ``lookahead``, each also covers that many tokens after its
    unit, and a unit without them has no hash (vLLM's lookahead hashes)."""
    out: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - hash_block_size - lookahead + 1, hash_block_size):
        end = start + hash_block_size + lookahead
        chunk = b"".join(t.to_bytes(4, "big") for t in tokens[start:end])
        parent = hashlib.sha256(parent + chunk).digest()[:8]
        out.append(parent)
    return out


ARCHETYPES_COVERED = ("full", "full+mamba", "full+swa", "full+swa+mamba", "swa+mamba")


def random_archetype_config(
    rng: random.Random, models: Sequence[str] = ARCHETYPES_COVERED, *, lookahead: bool = False
) -> TraceConfig:
    """An archetype the block-pool model covers (no chunked local, hash unit
    = block; one of ``models``), random sizes, EAGLE on or off, sometimes a
    flagged draft group; with ``lookahead``, EAGLE sometimes with lookahead
    block hashes."""
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
    if lookahead and config.use_eagle and rng.random() < 0.4:
        # Drafts of a few tokens, and one lookahead longer than two blocks.
        config = replace(config, num_hash_lookahead_tokens=rng.choice((1, 2, 3, 5, 40)))
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


def answerable(config: TraceConfig, policy: str, cache: str) -> bool:
    """Whether ``policy`` answers this configuration in ``cache`` (the cache
    existed in its releases, and they take the configuration)."""
    from replay.rules.coordinator import Coordinator

    try:
        Coordinator(config, policy, cache)
    except ConfigError:
        return False
    return True


def vllm_metadata(where: Path, version: str) -> Path:
    """A directory holding only the installed-package metadata of a vLLM that
    reports ``version`` (what a development build from a shallow clone
    reports: ``0.1.dev1+g<commit>``). Put first on ``PYTHONPATH``, it is the
    distribution ``importlib.metadata`` finds first, which is how the tool
    reads the installed vLLM's version; vLLM's code still imports from where
    it is installed."""
    info = where / f"vllm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return where
