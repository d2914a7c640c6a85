"""The hybrid fixed point (vLLM's ``HybridKVCacheCoordinator`` and its
Mooncake store mirror): every spec group must agree on one hit length.

Every helper takes a cache: a name (vLLM 0.33.0's rules for that path) or a
release's rules (``Policy.rules``), which is what a coordinator passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace

from replay.base.errors import ConfigError, ReplayError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.rules.coordinator.cache import DEFAULT_CACHE, Cache, get_cache
from replay.rules.coordinator.finders import (
    FINDERS,
    FinderResult,
    Query,
    cdiv,
    eagle_margin,
    window_tail,
)
from replay.rules.coordinator.kinds import REFERENCE
from replay.rules.coordinator.policy import DEFAULT_POLICY, Policy, get_policy, policy_rules


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecGroup:
    """Groups with equal specs, merged: a block is present only when every
    member holds the key."""

    index: int
    spec: GroupSpec
    group_ids: tuple[int, ...]
    eagle: bool

    @property
    def kind(self) -> GroupKind:
        return self.spec.kind


@dataclass(slots=True, kw_only=True)
class Step:
    """One finder call inside the fixed point (what ``replay explain`` prints)."""

    pass_no: int
    spec_group: int
    kind: GroupKind
    group_ids: tuple[int, ...]
    candidate_before: int
    bound: int
    margin: int
    drop: bool
    matched_tokens: int
    hit_tokens: int
    candidate_after: int
    reused: bool = False  # full attention after its first lookup: only shrinks
    #: vLLM's side (``--coordinator vllm``): the finder call as vLLM made it
    call: str | None = None


@dataclass(slots=True, kw_only=True)
class GroupOutcome:
    group_id: int
    kind: GroupKind
    mask_blocks: int
    loaded_blocks: int
    #: the hit the group's own finder verified on its last call
    hit_tokens: int
    #: Mamba only: the token position of the resumed recurrent state
    state_tokens: int | None = None

    def mask(self) -> list[bool]:
        return [False] * (self.mask_blocks - self.loaded_blocks) + [True] * self.loaded_blocks


@dataclass(slots=True, kw_only=True)
class LookupOutcome:
    hit_tokens: int
    groups: tuple[GroupOutcome, ...]
    steps: tuple[Step, ...] = field(default=())

    @property
    def verified_tokens(self) -> int:
        """The prefix every non-Mamba group verified (after its EAGLE drop);
        the hit when every group is Mamba."""
        hits = [g.hit_tokens for g in self.groups if g.kind is not GroupKind.MAMBA]
        return min(hits) if hits else self.hit_tokens

    @property
    def mamba_state_tokens(self) -> int | None:
        states = [g.state_tokens for g in self.groups if g.state_tokens is not None]
        return max(states) if states else None


def lookup_spec(group: GroupSpec, cache: str | Cache = DEFAULT_CACHE) -> GroupSpec:
    """The spec a group is looked up and merged by in this cache: the mirror
    widens a sliding window by ``extra_retained_tokens`` (its
    ``_coverage_spec``); the engine keeps the spec as it is."""
    if (
        get_cache(cache).widen_window
        and group.kind is GroupKind.SLIDING_WINDOW
        and group.extra_retained_tokens
    ):
        return replace(
            group,
            sliding_window=(group.sliding_window or 0) + group.extra_retained_tokens,
            extra_retained_tokens=0,
        )
    return group


def _merge_key(spec: GroupSpec) -> tuple[object, ...]:
    # Equal specs merge; ``lookup_spec`` already folded the window for the
    # mirror, so the raw fields are what vLLM compares in either cache.
    if spec.kind is GroupKind.SLIDING_WINDOW:
        return (spec.kind, spec.block_size, spec.sliding_window, spec.extra_retained_tokens)
    if spec.kind is GroupKind.CHUNKED_LOCAL_ATTENTION:
        return (spec.kind, spec.block_size, spec.attention_chunk_size)
    return (spec.kind, spec.block_size)


def eagle_group_ids(config: TraceConfig, cache: str | Cache = DEFAULT_CACHE) -> frozenset[int]:
    """The KV-cache groups whose finder drops a block for EAGLE before merging:
    the flagged ones, or every group when EAGLE is on and none is flagged
    (vLLM's conservative fallback). The engine drops nothing while
    ``use_eagle`` is off, flags or not; the mirror honours the flags. With
    lookahead hashes nothing drops where the release says so
    (``Cache.lookahead_clears_eagle``)."""
    c = get_cache(cache)
    if c.lookahead_clears_eagle and config.num_hash_lookahead_tokens:
        return frozenset()  # lookahead hashes: no group drops (0.33.0 engine, 0.34.0 mirror)
    if not c.eagle_flags:
        # Before per-group flags, use_eagle made every group drop.
        return frozenset(range(config.num_groups)) if config.use_eagle else frozenset()
    flagged = frozenset(gid for gid, g in enumerate(config.groups) if g.is_eagle_group)
    if config.use_eagle and not flagged:
        flagged = frozenset(range(config.num_groups))
    if c.drop_needs_use_eagle and not config.use_eagle:
        return frozenset()
    return flagged


def build_spec_groups(
    config: TraceConfig, cache: str | Cache = DEFAULT_CACHE
) -> tuple[SpecGroup, ...]:
    """The spec groups of a configuration in lookup order. This is the one
    place the EAGLE group rule lives: a spec group drops when any member
    does (members are cached and looked up jointly)."""
    drops = eagle_group_ids(config, cache)
    merged: list[tuple[GroupSpec, list[int], bool]] = []
    # Linear in the groups: each merge key's entry found by a dict lookup.
    index: dict[tuple[object, ...], int] = {}
    for gid, group in enumerate(config.groups):
        spec = lookup_spec(group, cache)
        i = index.setdefault(_merge_key(spec), len(merged))
        if i == len(merged):
            merged.append((spec, [gid], gid in drops))
        else:
            seen, gids, eagle = merged[i]
            gids.append(gid)
            merged[i] = (seen, gids, eagle or gid in drops)
    # Full attention first; otherwise group order (a stable sort).
    merged.sort(key=lambda m: m[0].kind is not GroupKind.FULL_ATTENTION)
    return tuple(
        SpecGroup(index=i, spec=spec, group_ids=tuple(gids), eagle=eagle)
        for i, (spec, gids, eagle) in enumerate(merged)
    )


def _partial_mamba(config: TraceConfig) -> bool:
    """An align-mode Mamba group with a block larger than the hash unit."""
    hbs = config.hash_block_size
    return any(g.kind is GroupKind.MAMBA and g.block_size > hbs for g in config.groups)


def engine_derives_partial_hits(config: TraceConfig) -> bool:
    """vLLM's ``partial_hash_hits_enabled``: an align-mode Mamba group with a
    block larger than the hash unit, and every other group either able to
    probe inside a block or one hash unit per block."""
    hbs = config.hash_block_size
    if not _partial_mamba(config):
        return False
    return all(FINDERS[g.kind].fine_grained or g.block_size == hbs for g in config.groups)


def _unitary(config: TraceConfig, cache: Cache) -> bool:
    return cache.unitary_single_group and config.num_groups == 1


def partial_hits(config: TraceConfig, cache: str | Cache = DEFAULT_CACHE) -> bool:
    """Whether hits may land on hash units inside a block, in this cache."""
    c = get_cache(cache)
    if _unitary(config, c):
        return False  # the unitary coordinator has no partial hits
    rule = c.partial_hits
    if rule == "none":
        return False
    if rule == "mamba":
        return _partial_mamba(config)
    if rule == "mamba+managers":
        return engine_derives_partial_hits(config)
    if rule == "mamba+managers+flag":
        return config.enable_partial_hash_hits and engine_derives_partial_hits(config)
    return config.enable_partial_hash_hits


def hit_alignment(config: TraceConfig, cache: str | Cache = DEFAULT_CACHE) -> int:
    """Token granularity every hit is a multiple of, in this cache."""
    c = get_cache(cache)
    if _unitary(config, c):
        return config.groups[0].block_size
    if c.single_spec_own_block and c.single_spec_shortcut:
        spec_groups = build_spec_groups(config, c)
        if len(spec_groups) == 1:
            # The mirror's shortcut before 0.27 aligned to the group's block.
            return spec_groups[0].spec.block_size
    return config.hash_block_size if partial_hits(config, c) else config.scheduler_block_size


def check_config(config: TraceConfig, cache: str | Cache = DEFAULT_CACHE) -> None:
    """The rules vLLM asserts for this cache's coordinator, as ``ConfigError``."""
    c = get_cache(cache)
    if _unitary(config, c):
        bs = config.groups[0].block_size
        if bs != config.hash_block_size:
            raise ConfigError(
                f"the {c.name} cache answers a single KV-cache group with vLLM's "
                f"UnitaryKVCacheCoordinator, which needs hash_block_size equal to "
                f"block_size {bs}, got {config.hash_block_size}"
            )
    if c.lcm_alignment and not _unitary(config, c):
        lcm = math.lcm(*(g.block_size for g in config.groups))
        if config.scheduler_block_size != lcm:
            raise ConfigError(
                f"this vLLM release aligns hybrid hits to the lcm of the block sizes, "
                f"{lcm}; the trace's scheduler_block_size is {config.scheduler_block_size}"
            )
    spec_groups = build_spec_groups(config, c)
    if c.one_spec_group_refused and not _unitary(config, c) and len(spec_groups) == 1:
        raise ConfigError(
            f"this vLLM release's {c.name} coordinator refuses {config.num_groups} "
            "KV-cache groups with one spec (it asserts two spec groups or more)"
        )
    alignment = hit_alignment(config, c)
    for sg in spec_groups:
        if (
            c.sliding_window_needs_block_alignment
            and sg.kind is GroupKind.SLIDING_WINDOW
            and alignment % sg.spec.block_size
        ):
            raise ConfigError(
                f"kv_cache_groups[{sg.group_ids[0]}]: this vLLM release's sliding-window "
                f"finder needs the hit alignment {alignment} to be a multiple of its "
                f"block_size {sg.spec.block_size} (partial hash hits)"
            )
        if sg.kind is not GroupKind.CHUNKED_LOCAL_ATTENTION:
            continue
        gid = sg.group_ids[0]
        if sg.eagle:
            # vLLM's chunked finder cannot drop a block for EAGLE.
            raise ConfigError(
                f"kv_cache_groups[{gid}]: chunked_local_attention does not combine "
                f"with EAGLE (vLLM rejects this hybrid in the {c.name} cache)"
            )
        if sg.spec.block_size != alignment:
            raise ConfigError(
                f"kv_cache_groups[{gid}]: chunked_local_attention needs block_size equal "
                f"to the hit alignment {alignment}, got {sg.spec.block_size}"
            )


@dataclass(frozen=True, slots=True)
class AskedBlocks:
    """Which of a KV-cache group's blocks the Mooncake store worker asks the
    store about (its coordinator's ``lookup_mask``: each manager's
    ``reachable_block_mask`` with no retention interval): every block when
    ``per`` is 0, else block ``c`` when ``c >= shift`` and
    ``(c - shift) % per >= per - need``, the tails a sliding window's hit
    can end on at each multiple of the scheduler block."""

    per: int = 0
    need: int = 0
    shift: int = 0

    def asks(self, block: int) -> bool:
        if not self.per:
            return True
        return block >= self.shift and (block - self.shift) % self.per >= self.per - self.need


def asked_blocks(
    config: TraceConfig, cache: str | Cache = DEFAULT_CACHE
) -> tuple[AskedBlocks, ...]:
    """Per KV-cache group, the blocks the store worker asks about: every one
    with partial hash hits (no lookup mask); else a sliding window's
    reachable tails (its window as the cache looks it up, its spec group's
    EAGLE bit), every block of the other kinds."""
    c = get_cache(cache)
    if partial_hits(config, c):
        return tuple(AskedBlocks() for _ in config.groups)
    eagle = {gid for sg in build_spec_groups(config, c) if sg.eagle for gid in sg.group_ids}
    sched = config.scheduler_block_size
    out = []
    for gid, group in enumerate(config.groups):
        spec = lookup_spec(group, c)
        bs = spec.block_size
        if spec.kind is not GroupKind.SLIDING_WINDOW or sched % bs:
            out.append(AskedBlocks())
            continue
        need, shift = window_tail(spec.sliding_window or 0, bs, gid in eagle)
        per = sched // bs
        out.append(AskedBlocks() if need >= per else AskedBlocks(per, need, shift))
    return tuple(out)


def _all_present(per_group: Sequence[bytes]) -> bytes:
    """A merged spec group holds a unit only when every member group does."""
    if len(per_group) == 1:
        return per_group[0]
    n = len(per_group[0])
    merged = int.from_bytes(per_group[0], "little")
    for p in per_group[1:]:
        merged &= int.from_bytes(p, "little")
    return merged.to_bytes(n, "little")


#: The request's block hashes, and per group a test of whether it holds a key.
Hashes = Sequence[Hashable]
Contains = Sequence[Callable[[Hashable], bool]]


class LookupCoordinator:
    """What answers lookups: one configuration, under one policy, in one of
    vLLM's caches. The reference below and the vLLM backend are the two."""

    name = "abstract"

    def __init__(
        self,
        config: TraceConfig,
        policy: str | Policy = DEFAULT_POLICY,
        cache: str | Cache = DEFAULT_CACHE,
    ) -> None:
        self.config = config
        self.policy = get_policy(policy)
        #: this policy's rules for the cache (its ``name`` is the cache's)
        self.cache = policy_rules(self.policy, cache)
        self._prepare()

    def _prepare(self) -> None:
        """What a coordinator builds once for its configuration."""

    #: Whether answering needs the lookup's hashes, not only its presence
    #: bytes (a coordinator that asks the store by hash, as vLLM's pools do).
    asks_by_hash = True

    def lookup(
        self, hashes: Hashes, max_length: int, contains: Contains, *, explain: bool = False
    ) -> LookupOutcome:
        """``contains[g]`` tests whether group ``g`` holds a key for a hash."""
        raise NotImplementedError

    def answer(
        self,
        present: Sequence[bytes],
        max_length: int,
        hashes: Sequence[bytes] | None,
        *,
        explain: bool = False,
    ) -> LookupOutcome:
        """The answer from the lookup's presence bytes (``present[g][u]``: group
        ``g`` holds hash unit ``u``), asked per hash of the lookup by default:
        the store only ever hears about the request's own hashes."""
        if hashes is None:
            raise ReplayError(f"the {self.name} coordinator needs the lookups' hashes")
        unit = {h: u for u, h in enumerate(hashes)}
        contains = [lambda h, p=p: p[unit[h]] == 1 for p in present]
        return self.lookup(hashes, max_length, contains, explain=explain)


class Coordinator(LookupCoordinator):
    """Finds the longest cache hit every KV-cache group agrees on."""

    name = REFERENCE.name
    asks_by_hash = False

    def answer(
        self,
        present: Sequence[bytes],
        max_length: int,
        hashes: Sequence[bytes] | None,
        *,
        explain: bool = False,
    ) -> LookupOutcome:
        return self.lookup_present(present, max_length, explain=explain)

    def _prepare(self) -> None:
        config = self.config
        check_config(config, self.cache)
        self.spec_groups = build_spec_groups(config, self.cache)
        self.alignment = hit_alignment(config, self.cache)
        hbs = config.hash_block_size
        fine = partial_hits(config, self.cache)
        self.margins = tuple(
            eagle_margin(sg.spec, hbs, fine and FINDERS[sg.kind].fine_grained)
            for sg in self.spec_groups
        )
        self.simple_hybrid = (
            len(self.spec_groups) == 2 and self.spec_groups[0].kind is GroupKind.FULL_ATTENTION
        )
        # One finder call answers: the engine's unitary coordinator (one
        # KV-cache group) or the mirror's single-spec shortcut.
        self.single_call = len(self.spec_groups) == 1 and (
            _unitary(config, self.cache) or self.cache.single_spec_shortcut
        )
        #: The blocks the store worker asks about, per group, where lookups
        #: enter through it (``Cache.store_worker_entry``), else None.
        self.asked = asked_blocks(config, self.cache) if self.cache.store_worker_entry else None
        #: The worker asks for every hash unit, not each block's own key.
        self.ask_every_unit = partial_hits(config, self.cache)

    def _call(self, sg: SpecGroup, present: bytes, bound: int, drop: bool) -> FinderResult:
        query = Query(
            max_length=bound,
            drop_eagle=drop,
            alignment=self.alignment,
            hash_block_size=self.config.hash_block_size,
            align_run_before_pop=self.cache.sliding_window_align_before_pop,
        )
        return FINDERS[sg.kind](sg.spec, present, query)

    def _gets_margin(self, sg: SpecGroup) -> bool:
        if not self.cache.verify_eagle_once:
            return False  # before #40860 the bound was the candidate itself
        # No peek margin for Mamba (#46384, #49502): its finder never drops, so
        # a widened bound resumes state past the verified prefix (#43559).
        return sg.kind is not GroupKind.MAMBA or self.cache.mamba_peek_margin

    def lookup(
        self, hashes: Hashes, max_length: int, contains: Contains, *, explain: bool = False
    ) -> LookupOutcome:
        present = [bytes(map(c, hashes)) for c in contains]
        return self.lookup_present(present, max_length, explain=explain)

    def lookup_present(
        self, present: Sequence[bytes], max_length: int, *, explain: bool = False
    ) -> LookupOutcome:
        """``present[g][u]`` is 1 when group ``g`` holds a key for the request's
        hash unit ``u`` (the store state the lookup sees), else 0."""
        if self.asked is None:
            return self.converge(present, max_length, explain=explain)
        return self._worker_lookup(present, max_length + 1, explain=explain)

    def asked_units(self, gid: int, units: int, token_len: int) -> range | list[int]:
        """The hash units of group ``gid`` whose key the store worker asks
        for, for a request of ``units`` hash units at the aligned length
        ``token_len``: every unit within it with partial hits, else each
        block's own key, of the blocks its lookup mask names."""
        hbs = self.config.hash_block_size
        limit = min(units, token_len // hbs)
        if self.ask_every_unit:
            return range(max(limit, 0))
        assert self.asked is not None
        rule = self.asked[gid]
        k = self.config.groups[gid].block_size // hbs
        return [c * k + k - 1 for c in range(max(limit, 0) // k) if rule.asks(c)]

    def asked_present(self, present: Sequence[bytes], token_len: int) -> list[bytes]:
        """What the store worker learns of ``present`` at the aligned length
        ``token_len``: a group's key reads present only when it asked for it
        (``asked_units``)."""
        out = []
        for gid, p in enumerate(present):
            q = bytearray(len(p))
            for x in self.asked_units(gid, len(p), token_len):
                q[x] = p[x]
            out.append(bytes(q))
        return out

    def _worker_lookup(
        self, present: Sequence[bytes], num_tokens: int, *, explain: bool
    ) -> LookupOutcome:
        """The store worker's ``lookup(num_tokens, block_hashes)``: the fixed
        point at the aligned prompt length over what the store answered, and
        again below the prompt's end when it hit the whole prompt (the last
        token is recomputed for sampling); 0 with nothing loaded when it
        asks nothing or nothing is left below the prompt's end."""
        align = self.alignment
        token_len = num_tokens // align * align
        units = len(present[0]) if present else 0
        if not any(self.asked_units(g, units, token_len) for g in range(len(present))):
            return self.nothing()  # it asks the store nothing
        asked = self.asked_present(present, token_len)
        out = self.converge(asked, token_len, explain=explain)
        if out.hit_tokens < num_tokens:
            return out
        usable = (num_tokens - 1) // align * align
        if usable <= 0:
            return self.nothing(out.steps)
        again = self.converge(asked, usable, explain=explain)
        return replace(again, steps=out.steps + again.steps)

    def nothing(self, steps: Sequence[Step] = ()) -> LookupOutcome:
        """A lookup the worker answered 0 without a coordinator answer to
        keep: no group loads or hits anything."""
        return LookupOutcome(
            hit_tokens=0,
            groups=tuple(
                GroupOutcome(
                    group_id=gid,
                    kind=g.kind,
                    mask_blocks=0,
                    loaded_blocks=0,
                    hit_tokens=0,
                    state_tokens=0 if g.kind is GroupKind.MAMBA else None,
                )
                for gid, g in enumerate(self.config.groups)
            ),
            steps=tuple(steps),
        )

    def converge(
        self, present: Sequence[bytes], max_length: int, *, explain: bool = False
    ) -> LookupOutcome:
        """The fixed point at ``max_length`` over ``present`` (vLLM's
        ``find_longest_cache_hit``)."""
        merged = [_all_present([present[g] for g in sg.group_ids]) for sg in self.spec_groups]
        results: list[FinderResult | None] = [None] * len(self.spec_groups)
        steps: list[Step] = []

        if self.single_call:
            sg = self.spec_groups[0]
            res = self._call(sg, merged[0], max_length, sg.eagle)
            results[0] = res
            if explain:
                steps.append(
                    self._step(1, sg, max_length, max_length, 0, sg.eagle, res, res.hit_tokens)
                )
            return self._outcome(res.hit_tokens, results, steps)

        hit = max_length
        rules = self.cache
        peek_cap = (
            len(present[0]) * self.config.hash_block_size if rules.peek_cap_hashed else max_length
        )
        verified: set[int] = set()
        pass_no = 0
        while True:
            pass_no += 1
            cand = hit
            for sg in self.spec_groups:
                prev = results[sg.index]
                if sg.kind is GroupKind.FULL_ATTENTION and prev is not None:
                    before = cand
                    if rules.full_reuse_own_hit:
                        cand = min(cand, prev.hit_tokens)
                    else:  # before 0.26: floored to the block size
                        cand -= cand % sg.spec.block_size
                    if explain:
                        steps.append(
                            self._step(
                                pass_no, sg, before, before, 0, False, prev, cand, reused=True
                            )
                        )
                    continue
                drop = sg.eagle and (sg.index not in verified or not rules.verify_eagle_once)
                bound, margin = cand, 0
                if drop and self._gets_margin(sg):
                    margin = self.margins[sg.index]
                    bound = min(cand + margin, peek_cap)
                res = self._call(sg, merged[sg.index], bound, drop)
                if drop:
                    verified.add(sg.index)
                elif res.hit_tokens < cand:
                    verified.clear()
                if explain:
                    steps.append(
                        self._step(pass_no, sg, cand, bound, margin, drop, res, res.hit_tokens)
                    )
                cand = res.hit_tokens
                results[sg.index] = res
            if cand >= hit:
                break
            hit = cand
            if self.simple_hybrid and rules.simple_hybrid_single_pass:
                break
        return self._outcome(hit, results, steps, trim_full=True)

    @staticmethod
    def _step(
        pass_no: int,
        sg: SpecGroup,
        before: int,
        bound: int,
        margin: int,
        drop: bool,
        res: FinderResult,
        after: int,
        *,
        reused: bool = False,
    ) -> Step:
        return Step(
            pass_no=pass_no,
            spec_group=sg.index,
            kind=sg.kind,
            group_ids=sg.group_ids,
            candidate_before=before,
            bound=bound,
            margin=margin,
            drop=drop,
            matched_tokens=res.matched_tokens,
            hit_tokens=res.hit_tokens,
            candidate_after=after,
            reused=reused,
        )

    def _outcome(
        self,
        hit: int,
        results: Sequence[FinderResult | None],
        steps: Sequence[Step],
        *,
        trim_full: bool = False,
    ) -> LookupOutcome:
        groups: list[GroupOutcome | None] = [None] * self.config.num_groups
        rules = self.cache
        for sg in self.spec_groups:
            res = results[sg.index]
            assert res is not None  # every spec group is called in the first pass
            nulls, loaded = res.null_blocks, res.loaded_blocks
            if (
                trim_full
                and sg.kind is GroupKind.FULL_ATTENTION
                and (rules.trim_every_full or sg.index == 0)
            ):
                # Full attention keeps the blocks of the converged hit (the
                # partial tail block included from 0.26; only the first spec
                # group before 0.29); other kinds trimmed themselves.
                bs = sg.spec.block_size
                keep = cdiv(hit, bs) if rules.trim_ceil else hit // bs
                loaded = min(loaded, keep)
            for gid in sg.group_ids:
                groups[gid] = GroupOutcome(
                    group_id=gid,
                    kind=sg.kind,
                    mask_blocks=nulls + loaded,
                    loaded_blocks=loaded,
                    hit_tokens=res.hit_tokens,
                    state_tokens=res.hit_tokens if sg.kind is GroupKind.MAMBA else None,
                )
        return LookupOutcome(
            hit_tokens=hit,
            groups=tuple(g for g in groups if g is not None),
            steps=tuple(steps),
        )
