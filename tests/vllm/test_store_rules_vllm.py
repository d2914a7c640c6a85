"""The store rules (``replay.rules.store_rules``) against the installed vLLM.

The rules run under the release policy that models the installed release
(``policy_for_version``), so ``make test-vllm VLLM=X`` checks that release's
stores; the release's API differences are detected, nothing of vLLM's is
patched (retention is the environment variable before 0.29.0, the config
field after; the Mooncake store takes Mamba states by hand-offs from 0.29.0,
by its store mask before).

Per request and per group, the blocks the rules say a prefill leaves behind
are compared with what vLLM's own code leaves behind for the same prompt
and hit:

* ``gpu``: the ``BlockStored`` events of a real ``KVCacheManager`` (real
  ``BlockPool``, prefix caching on, blocks to spare), driven chunk by chunk
  the way the scheduler drives it: ``get_computed_blocks`` (its
  ``shared_prefix_boundary`` set on the request), then ``allocate_slots``
  per prefill chunk as ``Scheduler._mamba_block_aligned_split`` (vLLM's own
  method) clips it to the token budget.
* ``mooncake``: attention groups per ``MooncakeStoreCoordinator.store_mask``
  for the suffix past the hit, Mamba groups per the boundary-state hand-offs
  the same manager produces (``take_boundary_state_offloads``), filtered to
  the prompt as the connector filters them.

Requests share prefixes with earlier ones (so hits start mid-prompt), about
a quarter of the prompts are block-aligned, and every archetype runs with
retention 0 (vLLM's default), dense (None) and a positive interval where
vLLM accepts one, EAGLE on and off. Seeded; the agreement table is printed
(``pytest -s``). Runs only where vLLM imports: ``make test-vllm``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.core.kv_cache_manager", reason="vLLM not importable: run make test-vllm"
)

from replay.adapters.vllm.backend import installed_vllm_version, vllm_groups
from replay.base.errors import ReplayError
from replay.base.spec import GroupKind, TraceConfig
from replay.rules.coordinator import RELEASES, Coordinator, policy_for_version
from replay.rules.coordinator.stores import policy_stores
from replay.rules.store_rules import StoreRules, StoreSettings
from replay.sources.archetypes import ARCHETYPES, archetype_config
from tests.vllm_modules import overreads_lookahead_hashes, split_state, vllm_modules

pytestmark = pytest.mark.vllm

VERSION = installed_vllm_version()
POLICY = policy_for_version(VERSION)
STORES = policy_stores(POLICY)
#: the caches this release has (the Mooncake store from 0.22.0)
CACHES = ("gpu", "mooncake") if POLICY.mooncake is not None else ("gpu",)

REQUESTS_PER_SESSION = 24


def _takes_lookahead(cls: Any) -> bool:
    return cls is not None and "num_hash_lookahead_tokens" in inspect.signature(cls).parameters


def _lookahead_caches() -> tuple[str, ...]:
    """The caches of this release that take lookahead block hashes: the
    engine's from 0.33.0; the Mooncake store's from 0.34.0 (0.33.0 gave a KV
    connector plain hashes)."""
    v = vllm_modules()
    engine = ("gpu",) if _takes_lookahead(v.KVCacheManager) else ()
    return engine + (("mooncake",) if engine and _takes_lookahead(v.Mooncake) else ())


LOOKAHEAD_CACHES = _lookahead_caches()


@dataclass(frozen=True, slots=True)
class Session:
    model: str
    config: TraceConfig
    retention: int | None
    budget: int
    seed: int

    @property
    def retention_name(self) -> str:
        r = self.retention
        return "dense" if r is None else ("0" if r == 0 else "interval")


_vllm = vllm_modules


def _has_extra_retained() -> bool:
    from vllm.v1 import kv_cache_interface as iface

    return "extra_retained_tokens" in getattr(iface.SlidingWindowSpec, "__dataclass_fields__", {})


_HAS_EXTRA = _has_extra_retained()


@contextlib.contextmanager
def retention_env(retention: int | None) -> Iterator[None]:
    """Before 0.29.0 vLLM reads the retention interval from
    ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` (unset: dense) when a
    coordinator is built: set it for that, then restore the environment."""
    name = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"
    saved = os.environ.pop(name, None)
    if retention is not None and STORES.retention == "env":
        os.environ[name] = str(retention)
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if saved is not None:
            os.environ[name] = saved


def random_session(
    rng: random.Random, model: str, retention: str, eagle: bool, lookahead: int = 0
) -> Session:
    bs = rng.choice((16, 32))
    kinds = ARCHETYPES[model].kinds
    hybrid = len(kinds) > 1
    hbs = bs // 2 if hybrid and rng.random() < 0.3 else bs
    mamba_bs = None
    if GroupKind.MAMBA in kinds:
        if GroupKind.SLIDING_WINDOW not in kinds:
            hbs = bs  # else vLLM turns partial hash hits on, which the rules do not model
        elif hbs < bs and rng.random() < 0.5:
            mamba_bs = 2 * bs  # a scheduler block of two attention blocks
    config = archetype_config(
        model,
        bs,
        hbs,
        eagle,
        sliding_window=rng.choice((bs + 1, 2 * bs, 3 * bs - 5, 100, 128, 256)),
        extra_retained_tokens=rng.choice((0, 0, bs // 2, bs)) if _HAS_EXTRA else 0,
        attention_chunk_size=rng.choice((2, 4, 8)) * bs,
        mamba_block_size=mamba_bs,
    )
    config = replace(config, num_hash_lookahead_tokens=lookahead)
    if rng.random() < 0.3:
        # A flagged draft group (with EAGLE on or off): only it and the
        # groups sharing its spec take the drop.
        flaggable = [
            gid
            for gid, g in enumerate(config.groups)
            if g.kind is not GroupKind.CHUNKED_LOCAL_ATTENTION
        ]
        gid = rng.choice(flaggable)
        groups = list(config.groups)
        groups[gid] = replace(groups[gid], is_eagle_group=True)
        config = replace(config, groups=tuple(groups))
    a = config.scheduler_block_size
    interval = {"0": 0, "dense": None, "interval": a * rng.choice((2, 3, 4))}[retention]
    budget = a * rng.choice((2, 3, 5, 8, 64))
    return Session(model, config, interval, budget, rng.randrange(1 << 30))


class Engine:
    """A real ``KVCacheManager`` driven one request at a time, as the scheduler would."""

    def __init__(self, v: SimpleNamespace, s: Session) -> None:
        self.v, self.s = v, s
        cfg = s.config
        self.groups = vllm_groups(cfg, v.iface, v.torch)
        # The retention interval: a config field from 0.29.0, before it the
        # environment variable (unset: dense) read when the coordinator is built.
        field = "prefix_cache_retention_interval"
        retention = (
            {field: s.retention}
            if field in getattr(v.iface.KVCacheConfig, "__dataclass_fields__", {})
            else {}
        )
        kv_config = v.iface.KVCacheConfig(
            num_blocks=50_000, kv_cache_tensors=[], kv_cache_groups=self.groups, **retention
        )
        # The manager takes a scheduler block size from 0.23.0 (before, hits
        # align to the lcm of the block sizes, which the sessions equal).
        params = inspect.signature(v.KVCacheManager).parameters
        scheduler = (
            {"scheduler_block_size": cfg.scheduler_block_size}
            if "scheduler_block_size" in params
            else {}
        )
        # Lookahead hashes (0.33.0 on): the scheduler clears its EAGLE block
        # drop and hands the lookahead to the manager and the hasher.
        lookahead = cfg.num_hash_lookahead_tokens
        with_lookahead = {"num_hash_lookahead_tokens": lookahead} if lookahead else {}
        with retention_env(s.retention):
            self.manager = v.KVCacheManager(
                kv_config,
                max_model_len=1 << 16,
                hash_block_size=cfg.hash_block_size,
                enable_caching=True,
                use_eagle=cfg.use_eagle and not lookahead,
                enable_kv_cache_events=True,
                **scheduler,
                **with_lookahead,
            )
        self.hasher = v.utils.get_request_block_hasher(
            cfg.hash_block_size, v.sha256, *([lookahead] if lookahead else [])
        )
        self.has_mamba = any(g.kind is GroupKind.MAMBA for g in cfg.groups)
        self.split_state = split_state(cfg, s.budget)
        self.handoffs = hasattr(self.manager, "take_boundary_state_offloads")
        self.mooncake: Any = None
        if v.Mooncake is not None and (not lookahead or "mooncake" in LOOKAHEAD_CACHES):
            # The store takes the retention interval from 0.24.
            takes = "retention_interval" in inspect.signature(v.Mooncake).parameters
            self.mooncake = v.Mooncake(
                self.groups,
                cfg.scheduler_block_size,
                cfg.hash_block_size,
                use_eagle=cfg.use_eagle,
                **({"retention_interval": s.retention} if takes else {}),
                **with_lookahead,
            )

    def _positions(self, request: Any) -> list[dict[Any, int]]:
        """Per group: event hash -> the token position the entry ends at (a
        block's end, or a hash unit's inside a block for a partial tail)."""
        utils, hbs = self.v.utils, self.s.config.hash_block_size
        ends = {
            utils.maybe_convert_block_hash(h): (u + 1) * hbs
            for u, h in enumerate(request.block_hashes)
        }
        return [ends for _ in self.groups]

    def prefill(
        self, rid: str, tokens: list[int]
    ) -> tuple[int, int, list[set[int]], list[set[int]]]:
        """(hit, junction, gpu stores, mamba hand-offs) per group, as token ends;
        ``self.hit_blocks``: per group, the blocks the lookup handed the request."""
        v, mgr = self.v, self.manager
        n = len(tokens)
        request = v.Request(
            rid, tokens, v.SamplingParams(max_tokens=1), None, block_hasher=self.hasher
        )
        found = mgr.get_computed_blocks(request)
        blocks, hit = found[0], found[1]
        junction = found[2] if len(found) > 2 else 0  # from 0.26.0
        self.hit_blocks = [len(b) for b in blocks.blocks]
        if hasattr(request, "shared_prefix_boundary"):
            request.shared_prefix_boundary = junction
        positions = self._positions(request)
        stored: list[set[int]] = [set() for _ in self.groups]
        handed: list[set[int]] = [set() for _ in self.groups]
        local, first = hit, True
        while request.num_computed_tokens + local < n:
            mgr.new_step_starts()
            todo = min(self.s.budget, n - request.num_computed_tokens - local)
            if self.has_mamba:
                todo = v.Scheduler._mamba_block_aligned_split(
                    self.split_state, request, todo, local, 0
                )
            assert todo > 0
            got = mgr.allocate_slots(
                request,
                todo,
                num_new_computed_tokens=local,
                new_computed_blocks=blocks if first else None,
            )
            assert got is not None, "the pool ran out of blocks"
            request.num_computed_tokens += local + todo
            local, first = 0, False
            for event in mgr.take_events():
                if type(event).__name__ != "BlockStored":
                    continue
                # Before 0.20 an event does not say its group: it goes to every
                # group of its block size (compared per block size, ``_same_size``).
                gids = (
                    [event.group_idx]
                    if hasattr(event, "group_idx")
                    else [
                        i
                        for i, g in enumerate(self.s.config.groups)
                        if g.block_size == event.block_size
                    ]
                )
                for gid in gids:
                    for h in event.block_hashes:
                        stored[gid].add(positions[gid][h])
            if not self.handoffs:
                continue  # before 0.29.0 the store saves Mamba per its mask
            for entries in mgr.take_boundary_state_offloads().values():
                for gid, _block, boundary in entries:
                    if boundary <= n:  # the connector's filter: past the prompt, dropped
                        handed[gid].add(boundary)
        mgr.free(request)
        mgr.take_events()
        self.hashed = len(request.block_hashes) * self.s.config.hash_block_size
        return hit, junction, stored, handed

    def store_mask(self, n: int, hit: int) -> list[set[int] | None]:
        """Attention groups' Mooncake stores as token ends (None for Mamba),
        after the last ``prefill``: the connector saves whole scheduler blocks
        of the prompt's hashed tokens (``ReqMeta``'s ``num_tokens_to_save``:
        fewer with lookahead hashes)."""
        a = self.s.config.scheduler_block_size
        if self.mooncake is None:
            return [None for _ in self.s.config.groups]
        saved = min(n, self.hashed) // a * a
        suffix = "start_token" in inspect.signature(self.mooncake.store_mask).parameters
        if suffix:
            masks = self.mooncake.store_mask(saved, min(hit, saved), num_prompt_tokens=n)
        else:
            # Before 0.25 the mask covers the whole prefix and the worker
            # skips the keys the store holds: the hit's, for these prompts.
            masks = self.mooncake.store_mask(saved)
        out: list[set[int] | None] = []
        for g, mask in zip(self.s.config.groups, masks, strict=True):
            if g.kind is GroupKind.MAMBA and self.handoffs:
                out.append(None)
                continue
            bs = g.block_size
            first = min(saved // bs, -(-hit // bs))
            if not suffix:
                mask = mask[first:]
            count = saved // bs - first
            keep = [True] * count if mask is None else mask
            out.append({(first + i + 1) * bs for i, k in enumerate(keep) if k})
        return out


def _ends(blocks: Any, block_size: int) -> set[int]:
    return {(int(b) + 1) * block_size for b in blocks}


def _has_group_idx() -> bool:
    from vllm.distributed.kv_events import BlockStored

    return "group_idx" in getattr(BlockStored, "__struct_fields__", ())


#: ``BlockStored`` names its KV-cache group from 0.20 on.
GROUPED_EVENTS = _has_group_idx()


def _same_size(config: TraceConfig, got: Any, gid: int) -> set[int]:
    """The token ends the rules store over every group of ``gid``'s block size."""
    bs = config.groups[gid].block_size
    return {e for i, g in enumerate(config.groups) if g.block_size == bs for e in _ends(got[i], bs)}


def vllm_ends(
    config: TraceConfig,
    cache: str,
    gid: int,
    gpu: list[set[int]],
    handed: list[set[int]],
    mask: list[set[int] | None],
) -> tuple[set[int], int]:
    """The token ends vLLM stored for group ``gid`` in ``cache`` (from
    ``Engine.prefill`` and ``Engine.store_mask``), and how many sub-block
    entries were left out: the prompt's partial tail when the hash unit is
    finer than the block, keys no per-block lookup reads without partial
    hits (counted, not generated)."""
    g = config.groups[gid]
    if cache == "gpu":
        theirs = {e for e in gpu[gid] if e % g.block_size == 0}
        return theirs, len(gpu[gid]) - len(theirs)
    handoff = g.kind is GroupKind.MAMBA and STORES.mirror_mamba_handoffs
    return (handed[gid] if handoff else mask[gid] or set()), 0


def prompts(rng: random.Random, config: TraceConfig, count: int) -> list[list[int]]:
    """Prompts that share prefixes with earlier ones, some block-aligned."""
    a = config.scheduler_block_size
    fresh = iter(range(10**6, 10**9))
    out: list[list[int]] = []
    for _ in range(count):
        n = rng.randrange(1, 40 * a)
        if rng.random() < 0.25:
            n = max(a, n // a * a)
        lookahead = config.num_hash_lookahead_tokens
        if lookahead and rng.random() < 0.3:
            # The lookahead reaches back across a block boundary: the last
            # whole block goes unhashed.
            n = max(a, n // a * a) + rng.randrange(lookahead)
        base: list[int] = []
        if out and rng.random() < 0.8:
            parent = rng.choice(out)
            keep = rng.randrange(0, len(parent) + 1)
            if rng.random() < 0.3:
                keep = keep // a * a
            base = parent[:keep] if rng.random() < 0.7 else list(parent)
        prompt = (base + [next(fresh) for _ in range(max(0, n - len(base)))])[: max(n, 1)]
        if rng.random() < 0.15 and out:
            prompt = list(rng.choice(out))  # an identical resend
        out.append(prompt)
    return out


def _runs_with_eagle(model: str) -> bool:
    try:
        archetype_config(model, use_eagle=True)
    except ReplayError:
        return False
    return True


def sessions(rng: random.Random) -> list[Session]:
    out = []
    for model, arch in ARCHETYPES.items():
        sparse = any(k in (GroupKind.SLIDING_WINDOW, GroupKind.MAMBA) for k in arch.kinds)
        retentions: tuple[str, ...] = ("0", "dense", "interval") if sparse else ("0", "dense")
        if STORES.retention == "none":
            retentions = ("dense",)  # no retention setting before 0.23.0
        elif STORES.retention == "env":
            # Set, the variable needs a sparse group (a Mamba one from 0.24).
            counted = (GroupKind.SLIDING_WINDOW,) + (
                (GroupKind.MAMBA,) if STORES.mamba_retention else ()
            )
            if not any(k in counted for k in arch.kinds):
                retentions = ("dense",)
        for retention in retentions:
            for eagle in (False, True) if _runs_with_eagle(model) else (False,):
                for _ in range(2):
                    out.append(random_session(rng, model, retention, eagle))
            if LOOKAHEAD_CACHES and _runs_with_eagle(model):
                # EAGLE with lookahead block hashes (MTP's prefill lookahead).
                for _ in range(2):
                    lookahead = rng.choice((1, 1, 2, 3, 5))
                    out.append(random_session(rng, model, retention, True, lookahead))
    return out


def session_caches(s: Session) -> tuple[str, ...]:
    """The caches compared for a session: a release's caches, those that
    take lookahead hashes when the session has them."""
    if s.config.num_hash_lookahead_tokens:
        return LOOKAHEAD_CACHES
    return CACHES


NEWEST = RELEASES[-1].name


def release_rules(s: Session, policy: str = POLICY.name) -> dict[str, StoreRules]:
    """A release's store rules for a session (the installed one's by
    default), per cache the installed release has."""
    return {
        cache: StoreRules(
            s.config,
            StoreSettings(
                retention_interval=s.retention,
                max_num_batched_tokens=s.budget,
                cache=cache,
                policy=policy,
            ),
        )
        for cache in session_caches(s)
    }


def test_store_rules_match_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    v = _vllm()
    rng = random.Random(15)
    agree: Counter[tuple[str, str, str]] = Counter()
    total: Counter[tuple[str, str]] = Counter()
    failures: list[str] = []
    partial_tails = 0
    shape: Counter[str] = Counter()
    unstatable = 0
    differs: Counter[str] = Counter()
    shape_raised: Counter[str] = Counter()
    for s in sessions(rng):
        try:
            rules = release_rules(s)
        except ReplayError:
            # A configuration the release cannot run without partial hash
            # hits (0.26-0.28 turn them on for a Mamba block above the hash
            # unit), which the rules do not model: counted, not compared.
            unstatable += 1
            continue
        engine = Engine(v, s)
        session_rng = random.Random(s.seed)
        newest = None
        if POLICY.name != NEWEST:
            with contextlib.suppress(ReplayError):
                newest = release_rules(s, NEWEST)
        for i, tokens in enumerate(prompts(session_rng, s.config, REQUESTS_PER_SESSION)):
            n = len(tokens)
            if overreads_lookahead_hashes(s.config, n):
                # vLLM's own failure: the request never prefills.
                with pytest.raises(IndexError, match="list index out of range"):
                    engine.prefill(f"r{i}", tokens)
                shape_raised[s.model] += 1
                continue
            hit, junction, gpu, handed = engine.prefill(f"r{i}", tokens)
            mask = engine.store_mask(n, hit)
            lookahead = s.config.num_hash_lookahead_tokens
            key = (s.model + (" lookahead" if lookahead else ""), s.retention_name)
            total[key] += 1
            a = s.config.scheduler_block_size
            shape["hit mid-prompt"] += hit > 0
            shape["shared-prefix junction"] += junction > 0
            shape["block-aligned prompt"] += n % a == 0
            shape["EAGLE"] += s.config.use_eagle
            shape["a flagged draft group"] += any(g.is_eagle_group for g in s.config.groups)
            shape["several prefill chunks"] += n - hit > s.budget
            if LOOKAHEAD_CACHES:
                shape["lookahead hashes"] += lookahead > 0
            for cache in session_caches(s):
                # The boundary is visible: the newest release's stores, compared too.
                if newest is not None and cache in newest:
                    other = newest[cache].stores(
                        num_tokens=n, hit_tokens=hit, junction_tokens=junction
                    )
                    differs[cache] += any(
                        _ends(other[gid], g.block_size)
                        != vllm_ends(s.config, cache, gid, gpu, handed, mask)[0]
                        for gid, g in enumerate(s.config.groups)
                    )
                got = rules[cache].stores(
                    num_tokens=n,
                    hit_tokens=hit,
                    junction_tokens=junction,
                    hit_blocks=engine.hit_blocks,
                )
                ok = True
                for gid, g in enumerate(s.config.groups):
                    mine = _ends(got[gid], g.block_size)
                    if cache == "gpu" and not GROUPED_EVENTS:
                        mine = _same_size(s.config, got, gid)
                    theirs, tails = vllm_ends(s.config, cache, gid, gpu, handed, mask)
                    partial_tails += tails
                    if mine != theirs:
                        ok = False
                        if len(failures) < 12:
                            failures.append(
                                f"{cache} {s.model} r={s.retention} eagle={s.config.use_eagle} "
                                f"lookahead={lookahead} "
                                f"bs={[x.block_size for x in s.config.groups]} "
                                f"hbs={s.config.hash_block_size} budget={s.budget} N={n} "
                                f"hit={hit} junction={junction} group {gid} ({g.kind.value}): "
                                f"rules {sorted(mine)} vLLM {sorted(theirs)}"
                            )
                if ok:
                    agree[(*key, cache)] += 1
    with capsys.disabled():
        print(
            f"\nstore agreement with vLLM {VERSION} under {POLICY.name} "
            "(requests whose every group agrees):"
        )
        for (model, retention), n in sorted(total.items()):
            compared = LOOKAHEAD_CACHES if model.endswith(" lookahead") else CACHES
            counts = "  ".join(f"{c} {agree[(model, retention, c)]}/{n}" for c in compared)
            print(f"  {model:25s} retention {retention:8s} {counts}")
        print(f"  (gpu partial-tail entries not compared: {partial_tails})")
        print(f"  sessions this release runs with partial hash hits, not compared: {unstatable}")
        if POLICY.name != NEWEST:
            print(
                f"  requests on which {NEWEST}'s stores differ from this release's: "
                + ", ".join(f"{c} {differs[c]}" for c in CACHES)
            )
        print("  requests with: " + ", ".join(f"{k} {v}" for k, v in shape.items()))
        if shape_raised:
            print(
                "  vLLM raised IndexError (lookahead hashes, no full attention): "
                + ", ".join(f"{k} {v}" for k, v in sorted(shape_raised.items()))
            )
    assert not failures, "\n".join(failures)
    assert sum(total.values()) >= 500
    # The cases the rules exist for must each occur many times (the junction
    # from 0.26.0, the release that has it).
    if not STORES.junction:
        assert shape.pop("shared-prefix junction") == 0
    assert min(shape.values()) >= 50, shape


def test_writer_emits_the_engines_block_stored_events(capsys: pytest.CaptureFixture[str]) -> None:
    """End to end: the generator's writer, with ``--cache gpu`` and an
    unbounded store, against the engine fed the same prompts. Per request,
    the keys the writer's ``store`` rows add are the keys the engine's
    ``BlockStored`` events add. The writer looks each request up with the
    engine's coordinator (``--cache gpu``), so its hit is the engine's on
    every request."""
    same, compared, differ_hit, mismatches = writer_against_engine(
        sessions(random.Random(1515))[::2]
    )
    with capsys.disabled():
        print(
            f"\nwriter vs engine: {same}/{compared} requests add the same keys "
            f"({differ_hit} with a different hit not compared)"
        )
    assert compared >= 250  # dense only before 0.23.0: fewer sessions
    assert differ_hit == 0, f"{differ_hit} requests: the engine coordinator's hit differs"
    assert not mismatches, "\n".join(mismatches)


def writer_against_engine(chosen: list[Session]) -> tuple[int, int, int, list[str]]:
    """Per session, the generator's writer (``--cache gpu``, unbounded store)
    and a real engine fed the same prompts: (requests whose store rows add
    the engine's keys, requests compared, requests whose hit differs,
    the first mismatches)."""
    import numpy as np

    from replay.sources.workload import WorkloadWriter

    v = _vllm()
    same = differ_hit = compared = 0
    mismatches: list[str] = []
    for s in chosen:
        try:
            release_rules(s)
        except ReplayError:
            continue  # partial hash hits in this release (see test_store_rules_match_vllm)
        engine = Engine(v, s)
        settings = StoreSettings(
            retention_interval=s.retention,
            max_num_batched_tokens=s.budget,
            cache="gpu",
            policy=POLICY.name,
        )
        rows: list[Any] = []
        writer = WorkloadWriter(
            s.config,
            rows.append,
            lambda keys: keys.astype(">u8").view(np.uint8).reshape(len(keys), 8),
            settings=settings,
            background=False,
        )
        dense: dict[bytes, int] = {}
        present: list[set[int]] = [set() for _ in s.config.groups]
        written: list[set[int]] = [set() for _ in s.config.groups]
        reference = Coordinator(s.config, policy=POLICY.name, cache="gpu")
        hbs = s.config.hash_block_size
        for i, tokens in enumerate(prompts(random.Random(s.seed), s.config, REQUESTS_PER_SESSION)):
            n = len(tokens)
            if overreads_lookahead_hashes(s.config, n):
                continue  # vLLM fails the lookup: no request to compare
            request = v.Request(
                "probe", tokens, v.SamplingParams(max_tokens=1), None, block_hasher=engine.hasher
            )
            units = [dense.setdefault(bytes(h), len(dense)) for h in request.block_hashes]
            hit, _junction, gpu, _handed = engine.prefill(f"r{i}", tokens)
            # The hit the writer's store gives (all its store rows so far).
            ref_hit = reference.lookup(units, n - 1, [k.__contains__ for k in written]).hit_tokens
            writer.add(
                ts_us=0, request_id=f"r{i}", num_tokens=n, unit_keys=np.array(units, dtype=np.int64)
            )
            writer.flush()
            table = [r for t in rows for r in t.to_pylist()]
            rows.clear()
            mine: list[set[int]] = [set() for _ in s.config.groups]
            for r in table:
                if r["kind"] == "store":
                    mine[r["group_id"]] |= {int.from_bytes(h, "big") for h in r["block_hashes"]}
            for gid, keys in enumerate(mine):
                written[gid] |= keys
            theirs: list[set[int]] = []
            before = [set(p) for p in present]
            for gid, g in enumerate(s.config.groups):
                ends = {e for e in gpu[gid] if e % g.block_size == 0}
                keys = {units[e // hbs - 1] for e in ends} - present[gid]
                theirs.append(keys)
                present[gid] |= keys
            if ref_hit != hit:
                differ_hit += 1
                continue
            compared += 1
            if not GROUPED_EVENTS:
                # Events without their group: compared per block size, the
                # keys new to every group of that size.
                sizes = [g.block_size for g in s.config.groups]
                mine = [
                    set().union(*(m for m, b in zip(mine, sizes, strict=True) if b == bs))
                    - before[sizes.index(bs)]
                    for bs in sizes
                ]
                theirs = [theirs[sizes.index(bs)] for bs in sizes]
            if mine == theirs:
                same += 1
            elif len(mismatches) < 5:
                mismatches.append(
                    f"{s.model} r={s.retention} N={n} hit={hit}: writer {mine} engine {theirs}"
                )
        writer.close()
    return same, compared, differ_hit, mismatches


def mooncake_rows(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """A Mooncake-format workload: rows extend or resend earlier rows' chained
    ``hash_ids`` (512-token blocks), a quarter block-aligned."""
    rows: list[dict[str, Any]] = []
    fresh = iter(range(1, 10**9))
    for i in range(count):
        ids: list[int] = []
        if rows and rng.random() < 0.8:
            parent = rng.choice(rows)["hash_ids"]
            ids = list(parent[: rng.randrange(1, len(parent) + 1)])
        ids += [next(fresh) for _ in range(rng.randrange(0 if ids else 1, 6))]
        length = 512 * len(ids) - (0 if rng.random() < 0.25 else rng.randrange(1, 512))
        rows.append({"timestamp": i, "input_length": length, "output_length": 8, "hash_ids": ids})
    return rows


def _row_tokens(row: dict[str, Any]) -> list[int]:
    """Tokens consistent with the row's ids: block ``b`` of id ``h`` is the same
    512 tokens wherever ``h`` appears (ids are chained, so equal ids mean
    equal prefixes)."""
    tokens: list[int] = []
    for h in row["hash_ids"]:
        tokens += [h * 1024 + j for j in range(512)]
    return tokens[: row["input_length"]]


@pytest.mark.parametrize("retention", ["0", "dense"])
def test_imported_mooncake_trace_stores_what_vllm_stores(
    tmp_path: Any, retention: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ingest mooncake`` (full attention + Mamba, EAGLE, 16-token blocks), row
    by row, against vLLM fed the same prompts: the keys each row's ``store``
    rows add are the keys vLLM's store adds (``store_mask`` past the hit for
    full attention, the Mamba hand-offs)."""
    import json

    from replay.format.tracedir import open_trace
    from replay.sources.mooncake import ingest

    if "mooncake" not in CACHES:
        pytest.skip(f"vLLM {VERSION} has no Mooncake store (from 0.22.0)")

    rows = mooncake_rows(random.Random(300), 300)
    src = tmp_path / "mooncake.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    interval = 0 if retention == "0" else None
    if not STORES.mamba_retention:
        # No retention for a full+Mamba model before 0.24.0 (before 0.23.0 no
        # setting at all; 0.23.0's variable needs a sliding-window group).
        interval = None
    settings = StoreSettings(retention_interval=interval, policy=POLICY.name)
    ingest(
        "mooncake",
        src,
        tmp_path / "t.parquet",
        model="full+mamba",
        eagle=True,
        store_settings=settings,
    )
    frame = open_trace(tmp_path / "t.parquet").read_frame()
    config = archetype_config("full+mamba", 16, None, True)
    v = _vllm()
    engine = Engine(v, Session("full+mamba", config, interval, 8192, 0))
    by_request: dict[str, list[set[int]]] = {}
    unit_of: dict[str, dict[bytes, int]] = {}
    for r in frame.iter_rows(named=True):
        rid = r["request_id"]
        if r["kind"] == "lookup":
            unit_of[rid] = {h: (u + 1) * 16 for u, h in enumerate(r["block_hashes"])}
            by_request[rid] = [set(), set()]
        elif r["kind"] == "store":
            ends = unit_of[rid]
            by_request[rid][r["group_id"]] |= {ends[h] for h in r["block_hashes"]}
    present: list[set[bytes]] = [set(), set()]
    agree = 0
    mismatches: list[str] = []
    for line, row in enumerate(rows, start=1):
        tokens = _row_tokens(row)
        n = len(tokens)
        hit, _junction, _gpu, handed = engine.prefill(f"line-{line}", tokens)
        request = v.Request(
            "probe", tokens, v.SamplingParams(max_tokens=1), None, block_hasher=engine.hasher
        )
        mask = engine.store_mask(n, hit)
        theirs: list[set[int]] = []
        mamba = handed[1] if STORES.mirror_mamba_handoffs else (mask[1] or set())
        for gid, stored_ends in enumerate((mask[0] or set(), mamba)):
            new = {
                e
                for e in stored_ends
                if bytes(request.block_hashes[e // 16 - 1]) not in present[gid]
            }
            present[gid] |= {bytes(request.block_hashes[e // 16 - 1]) for e in new}
            theirs.append(new)
        mine = by_request[f"line-{line}"]
        if mine == theirs:
            agree += 1
        elif len(mismatches) < 5:
            mismatches.append(f"line {line} N={n} hit={hit}: trace {mine} vLLM {theirs}")
    with capsys.disabled():
        print(
            f"\nimported Mooncake rows storing what vLLM stores ({retention}): {agree}/{len(rows)}"
        )
    assert not mismatches, "\n".join(mismatches)
