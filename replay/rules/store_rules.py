"""Which blocks a request leaves behind in vLLM 0.33.0's caches.

Given a trace's configuration, a request's prompt length ``N`` and the hit
``H`` its lookup got, ``StoreRules.stores`` gives, per KV-cache group, the
indices (in the group's own blocks) of the keys the request's prefill adds
to the cache: the ``store`` rows a production log shows for it. Pure: no
I/O, no Arrow; the generator, the importers and a what-if simulator all ask
it the same question.

Two caches, chosen by ``StoreSettings.cache``:

* ``gpu``: the engine's block pool, i.e. the ``BlockStored`` events vLLM
  publishes (``BlockPool.cache_full_blocks`` called by each manager's
  ``cache_blocks`` from ``KVCacheManager.allocate_slots``, chunk by chunk).
* ``mooncake``: the Mooncake store connector. Attention groups are written by
  the normal save, masked by ``MooncakeStoreCoordinator.store_mask`` for the
  suffix past the hit; Mamba groups only through the boundary-state
  hand-offs (``take_boundary_state_offloads``), which are exactly the states
  the engine's Mamba manager caches, so Mamba follows the ``gpu`` rule in
  both caches.

Attention groups (``B`` the group's block size, ``A`` the scheduler block
size, ``r`` = ``prefix_cache_retention_interval``):

* full and chunked local attention keep every block from the hit up to the
  end of what is cached: ``N // A * A`` tokens for the store (the connector
  saves whole scheduler blocks); in the engine the hybrid coordinator rounds
  down to ``A`` as well but an EAGLE group caches one block more
  (``get_num_cacheable_tokens``), and a single group caches ``N // B``.
* sliding window keeps the ``need``-block tails (``need = ceil((W - 1) / B)``,
  one more with EAGLE, shifted one block up with EAGLE) that end at every
  ``A`` boundary when ``r`` is None (dense), at every ``r`` tokens when
  ``r > 0``, and, unless dense, the tails at the *replay boundaries*
  (``replay_boundaries``) and, in the engine, at the shared-prefix junction.
  The store widens ``W`` by ``extra_retained_tokens``; the engine does not.

Mamba groups (``align`` mode): the prefill is stepped in chunks from the hit
the way ``Scheduler._mamba_block_aligned_split`` splits it (at most
``max_num_batched_tokens`` each, ends floored to ``A``, stopping at the last
reusable checkpoint ``checkpoint_position(N)`` and at the junction); a state
exists only at a chunk end, and the manager caches it when the end is a whole
block, falls within what the coordinator lets it cache, and the retention
mask keeps it: every state when dense, the ``r``-multiples when ``r > 0``,
plus the replay boundaries and the junction (and, for an EAGLE group, one
block below the junction) otherwise. From 0.32.0 the state at the prompt's
last reusable hash unit (``checkpoint_position`` in hash units) is kept
whatever the retention, when it is a whole block whose state is live.

The prefill is stepped as if the request ran alone: in a busy engine the
budget is shared, chunks can end earlier, and a dense retention keeps the
states at those ends too (under retention 0 only the replay boundaries and
the junction count, and the scheduler always stops at the checkpoint).

Not modelled: partial hash hits (sub-block tails and their copy-on-write),
the engine's sub-block prompt-tail entries when the hash unit is finer than a
block (keys no block-granular lookup reads), multi-token prediction's
re-prefilled tail, decode-time blocks, and the
engine's merging of sliding-window groups by their raw window (the spec
groups here merge by the widened window, as the store does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from replay.base.deprecation import renamed
from replay.base.errors import ReplayError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.rules.coordinator import (
    DEFAULT_POLICY,
    Coordinator,
    LookupOutcome,
    build_spec_groups,
    engine_derives_partial_hits,
    get_cache,
    get_policy,
    partial_hits,
)
from replay.rules.coordinator.finders import window_tail
from replay.rules.coordinator.stores import Stores, policy_stores

Blocks = range | npt.NDArray[np.int64]
"""One group's stored block indices, ascending: a ``range`` when contiguous."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreSettings:
    """The deployment's store settings: the knobs that decide what a prefill
    leaves behind. (Not a policy: in this project a policy is a vLLM
    behaviour, ``replay.rules.coordinator.Policy``.)"""

    #: vLLM's ``prefix_cache_retention_interval``: 0 (its default) keeps only
    #: the replay boundaries, ``k > 0`` one tail or state per ``k`` tokens as
    #: well, None keeps every one (dense).
    retention_interval: int | None = 0
    #: The scheduler's token budget per step: the longest prefill chunk.
    max_num_batched_tokens: int = 8192
    #: Which cache's stores: ``mooncake`` (the store connector's saves) or
    #: ``gpu`` (the block pool's BlockStored events); ``replay.rules.coordinator.CACHES``.
    cache: str = "mooncake"
    #: The vLLM release policy whose stores these are (``replay.rules.coordinator.
    #: stores``): its store rules, and its lookup rules for the hits.
    policy: str = DEFAULT_POLICY
    #: The vLLM version the user named (``--vllm``), recorded with the policy.
    vllm_version: str | None = None

    def __post_init__(self) -> None:
        r = self.retention_interval
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            raise ReplayError(f"retention interval must be an integer >= 0 or none, got {r!r}")
        m = self.max_num_batched_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
            raise ReplayError(f"max_num_batched_tokens must be a positive integer, got {m!r}")
        get_cache(self.cache)  # an unknown name is refused with the known ones
        get_policy(self.policy).rules(self.cache)  # a cache the release lacked is refused

    @property
    def stores(self) -> Stores:
        """The release's store rules."""
        return policy_stores(self.policy, self.cache)

    def as_source(self) -> dict[str, object]:
        """The fields a trace's ``source`` metadata records."""
        out: dict[str, object] = {
            "cache": self.cache,
            "retention_interval": self.retention_interval,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }
        # The release whose stores these are, so ``replay run`` answers as it
        # (0.33.0's, the default, is not recorded: runs default to it anyway).
        if self.policy != DEFAULT_POLICY:
            out["policy"] = self.policy
        if self.vllm_version is not None:
            out["vllm_version"] = self.vllm_version
        return out


#: ``StorePolicy``, the old name of ``StoreSettings`` ("policy" is a vLLM
#: release), kept for outside callers: it warns.
__getattr__ = renamed(__name__, {"StorePolicy": ("StoreSettings", StoreSettings)})


def replay_boundaries(num_tokens: int, alignment: int, use_eagle: bool) -> tuple[int, ...]:
    """Where a later request replaying this prompt can resume (vLLM's
    ``replay_boundaries``): an identical resend is capped at ``N - 1`` (its
    last token is recomputed for the logits); with EAGLE one block below the
    resend's and a longer sibling's aligned hits, since EAGLE drops a block."""
    if not use_eagle:
        return (num_tokens - 1,)
    resend = (num_tokens - 1) // alignment * alignment
    extension = num_tokens // alignment * alignment
    return tuple(sorted({max(resend - alignment, 0), max(extension - alignment, 0)}))


def checkpoint_position(
    num_tokens: int, alignment: int, drop_eagle: bool, lookahead: int = 0
) -> int:
    """The last position whose Mamba state a later hit can resume from (vLLM's
    ``get_mamba_prefill_checkpoint_position``): below ``N - 1`` for the logits
    (below ``N - lookahead``, whose hash needs the lookahead tokens), one
    block lower with EAGLE's drop."""
    limit = num_tokens if drop_eagle else num_tokens - max(1, lookahead)
    position = limit // alignment * alignment
    if drop_eagle:
        position -= alignment
    return max(position, 0)


def junction_tokens(outcome: LookupOutcome) -> int:
    """The shared-prefix junction the engine pins (``shared_prefix_boundary``):
    the longest hit any spec group found on its own, when the fixed point
    settled lower, else 0. Needs the outcome's ``steps`` (``explain=True``)."""
    longest = max((s.hit_tokens for s in outcome.steps if not s.reused), default=0)
    return longest if longest > outcome.hit_tokens else 0


def lookup_junction(
    coordinator: Coordinator, present: Sequence[bytes], max_length: int, outcome: LookupOutcome
) -> int:
    """The shared-prefix junction a prefill of this lookup pins: the engine's
    lookup pins it, so it is the fixed point's at ``max_length``
    (``junction_tokens`` of ``outcome``, asked with ``explain=True``, or,
    where the lookup entered through the Mooncake store worker, of the
    fixed point run again over every key the store holds)."""
    if coordinator.asked is None:
        return junction_tokens(outcome)
    return junction_tokens(coordinator.converge(present, max_length, explain=True))


@dataclass(frozen=True, slots=True)
class _Group:
    kind: GroupKind
    block_size: int
    #: EAGLE group as the store's coordinator sees it, and as the engine does
    mirror_eagle: bool
    engine_eagle: bool
    #: sliding window: the store's (widened) and the engine's window
    mirror_window: int
    engine_window: int


@dataclass(frozen=True, slots=True)
class _Request:
    num_tokens: int
    hit: int
    junction: int
    #: tokens covered by the prompt's full hash units
    hashed: int
    #: per group, the blocks the lookup handed the request (None: the hit's)
    hit_blocks: Sequence[int] | None = None


def _sliding_mask(
    start: int,
    end: int,
    *,
    alignment: int,
    block_size: int,
    window: int,
    eagle: bool,
    retention: int | None,
    boundaries: Sequence[int],
) -> Blocks:
    """``SlidingWindowManager.reachable_block_mask`` over blocks ``[start, end)``."""
    if end <= start:
        return range(start, start)
    if alignment % block_size:
        # A sub-block alignment cannot be masked block-exactly: vLLM keeps all.
        return range(start, end)
    need, shift = window_tail(window, block_size, eagle)
    idx = np.arange(start, end, dtype=np.int64)
    mask = np.zeros(end - start, dtype=bool)
    segment = alignment if retention is None else retention
    if segment:
        per_segment = segment // block_size
        if need >= per_segment:
            return range(start, end)
        mask |= (idx >= shift) & ((idx - shift) % per_segment >= per_segment - need)
    if retention is not None:
        for boundary in boundaries:
            tail_end = boundary // alignment * alignment // block_size + shift
            lo, hi = max(start, tail_end - need), min(end, tail_end)
            if lo < hi:
                mask[lo - start : hi - start] = True
    return idx[mask]


class StoreRules:
    """The store rules of one configuration and its store settings (see the
    module docstring)."""

    def __init__(self, config: TraceConfig, settings: StoreSettings | None = None) -> None:
        self.config = config
        self.settings = settings = settings or StoreSettings()
        policy = get_policy(settings.policy)
        releases_partial = any(
            partial_hits(config, rules) for rules in (policy.gpu, policy.mooncake) if rules
        )
        if (
            config.enable_partial_hash_hits
            or engine_derives_partial_hits(config)
            or releases_partial
        ):
            raise ReplayError(
                "the store rules do not model partial hash hits (vLLM enables them for a "
                f"Mamba block larger than the {config.hash_block_size}-token hash block): "
                "use a hash block size equal to the Mamba block size"
            )
        #: The lookahead block hashes the engine takes (0 before 0.33.0, which
        #: had none: a trace's lookahead changes nothing there).
        self.lookahead = lookahead = (
            config.num_hash_lookahead_tokens if policy.gpu.lookahead_clears_eagle else 0
        )
        mirror = policy.mooncake
        if (
            lookahead
            and settings.cache == "mooncake"
            and mirror
            and not mirror.lookahead_clears_eagle
        ):
            # vLLM resolves num_hash_lookahead_tokens to 0 under a KV connector
            # that does not take them: no such store exists.
            raise ReplayError(
                f"vLLM {policy.releases} gives the Mooncake store plain block hashes "
                f"(num_hash_lookahead_tokens 0 under a KV connector), not "
                f"{lookahead}: use 0, or a release from 0.34.0"
            )
        a = config.scheduler_block_size
        kinds = {g.kind for g in config.groups}
        self.release = release = settings.stores
        sparse_kinds = {GroupKind.SLIDING_WINDOW, GroupKind.MAMBA}
        if not release.mamba_retention:
            sparse_kinds.discard(GroupKind.MAMBA)
        sparse = bool(kinds & sparse_kinds)
        r = settings.retention_interval
        release.check_retention(r, sparse, policy.releases)
        # vLLM refuses these at start-up (``_validate_prefix_cache_retention_interval``).
        if r and not sparse:
            raise ReplayError(
                f"retention interval {r} has no effect without a sliding-window or Mamba "
                "group (vLLM refuses it): use 0"
            )
        if r and r % a:
            raise ReplayError(
                f"retention interval {r} must be a multiple of the scheduler block size {a}"
            )
        self.has_mamba = GroupKind.MAMBA in kinds
        if self.has_mamba and settings.max_num_batched_tokens < a:
            raise ReplayError(
                f"max_num_batched_tokens {settings.max_num_batched_tokens} must be at least "
                f"the scheduler block size {a}: a Mamba prefill chunk ends on a block"
            )
        self.alignment = a
        self.unitary = config.num_groups == 1
        #: Whether the shared-prefix junction can change a store: it ends a
        #: Mamba chunk, and pins a tail in the engine's sliding-window groups.
        self.uses_junction = (
            release.junction
            and not self.unitary
            and (self.has_mamba or (settings.cache == "gpu" and GroupKind.SLIDING_WINDOW in kinds))
        )
        # Which groups drop for EAGLE, as each cache's coordinator merges and
        # flags them (the one rule: ``build_spec_groups``): the engine drops
        # nothing unless EAGLE is on, the store's mirror honours a flag anyway.
        eagle_of: dict[str, list[bool]] = {}
        for cache in ("mooncake", "gpu"):
            eagle_of[cache] = [False] * config.num_groups
            rules = policy.gpu if cache == "gpu" else (policy.mooncake or cache)
            for sg in build_spec_groups(config, rules):
                for gid in sg.group_ids:
                    eagle_of[cache][gid] = sg.eagle
        self.mirror_any_eagle = any(eagle_of["mooncake"])
        # Lookahead hashes clear the scheduler's EAGLE block drop: no block is
        # dropped, so neither the checkpoint nor the boundaries back off one.
        self.engine_any_eagle = config.use_eagle and not lookahead
        #: whether the engine's replay boundaries are EAGLE's
        flagged = any(g.is_eagle_group for g in config.groups) and not lookahead
        self.engine_boundary_eagle = self.engine_any_eagle or (
            release.boundaries_from_flags and flagged
        )
        self.mamba_boundary_eagle = self.engine_any_eagle or (
            release.mamba_boundaries_from_flags and flagged
        )
        # The store widens a window by ``extra_retained_tokens`` from 0.33.0.
        widen = policy.mooncake is not None and policy.mooncake.widen_window
        self.groups = tuple(
            _Group(
                kind=g.kind,
                block_size=g.block_size,
                mirror_eagle=eagle_of["mooncake"][gid],
                engine_eagle=eagle_of["gpu"][gid],
                mirror_window=(g.coverage_window if widen else g.sliding_window) or 0,
                engine_window=g.sliding_window or 0,
            )
            for gid, g in enumerate(config.groups)
        )
        #: Before 0.24.0 the Mooncake store's mask is the lookup of one
        #: alignment segment with every block present, repeated (its
        #: ``store_mask`` template): every block when each group is full
        #: attention or one block a segment, else the lookup's masks, where the
        #: drop of an attention group flagged for EAGLE (a Mamba group's does
        #: not shorten it) leaves no hit in the segment: nothing is written.
        self.mirror_writes_nothing = (
            not release.mirror_retention
            and any(g.mirror_eagle and g.kind is not GroupKind.MAMBA for g in self.groups)
            and any(
                g.kind is not GroupKind.FULL_ATTENTION and g.block_size != a for g in config.groups
            )
        )

    # -- the prefill's chunks

    def chunk_ends(self, num_tokens: int, hit_tokens: int, junction: int = 0) -> list[int]:
        """Where each prefill step ends, from the hit to the prompt's end, as
        the scheduler splits a Mamba model's prefill (``_mamba_block_aligned_split``);
        without Mamba, plain budget-sized chunks."""
        n, a = num_tokens, self.alignment
        budget = self.settings.max_num_batched_tokens
        if self.release.mamba_checkpoint:
            last_cache = checkpoint_position(n, a, self.engine_any_eagle, self.lookahead)
        else:
            # Before 0.30.0: the prompt floored to the block, one lower with EAGLE.
            last_cache = max(n // a * a - (a if self.engine_any_eagle else 0), 0)
        ends: list[int] = []
        start = hit_tokens
        while start < n:
            end = min(start + budget, n)
            if self.has_mamba:
                if end < n:
                    aligned = end // a * a
                    if aligned > start or a <= budget:
                        end = aligned
                junction_stop = start + (junction - start) // a * a
                stops = (
                    (start // a + 1) * a if start % a else 0,
                    last_cache,
                    junction_stop if start < junction < end else 0,
                )
                end = min((s for s in stops if start < s < end), default=end)
            ends.append(end)
            start = end
        return ends

    # -- per group

    def cacheable_tokens(self, group: _Group, tokens: int) -> int:
        """Tokens of the prompt the engine lets a group cache after ``tokens``
        computed ones (``get_num_cacheable_tokens``)."""
        if self.unitary or not self.release.aligned_cache:
            return tokens
        out = tokens // self.alignment * self.alignment
        if group.engine_eagle and out > 0 and self.release.eagle_cache_block:
            # EAGLE matches one block past the aligned boundary and drops it.
            out = min(tokens, out + group.block_size)
        return out

    def _cacheable(self, group: _Group, tokens: int, hashed: int) -> int:
        """:meth:`cacheable_tokens`, capped at the prompt's hashed tokens."""
        return min(self.cacheable_tokens(group, tokens), hashed)

    def _boundaries(
        self, num_tokens: int, any_eagle: bool, group: _Group, junction: int
    ) -> list[int]:
        """The positions whose tail or state a sparse retention keeps anyway:
        the replay boundaries, and in the engine the junction (and, for an
        EAGLE group in 0.33.0, the block below it)."""
        if self.release.eagle_replay_boundaries:
            boundaries = list(replay_boundaries(num_tokens, self.alignment, any_eagle))
        else:
            boundaries = [num_tokens - 1]
        if junction:
            boundaries.append(junction)
            if group.engine_eagle and self.release.junction_eagle_block:
                boundaries.append(junction - group.block_size)
        return boundaries

    def _mamba_keeps(self, block: int, group: _Group, boundaries: Sequence[int]) -> bool:
        """``MambaManager.reachable_block_mask`` for one state block."""
        r = self.settings.retention_interval
        if r is None or not self.release.mamba_retention:
            return True
        bs, a = group.block_size, self.alignment
        if r:
            per_segment = r // bs
            if per_segment <= 1 or (block + 1) % per_segment == 0:
                return True
        return any(b // a * a // bs - 1 == block for b in boundaries)

    def _mamba(self, group: _Group, req: _Request, ends: Sequence[int]) -> Blocks:
        bs, hit_tokens = group.block_size, req.hit
        boundaries = self._boundaries(
            req.num_tokens, self.mamba_boundary_eagle, group, req.junction
        )
        # The prompt's tail state, keyed at the last hash unit a later hit can
        # resume from (``_cache_partial_tail_block``: the checkpoint position
        # in *hash* units, whatever the retention); a whole-block one is a
        # block entry. It equals the scheduler's checkpoint stop when the hash
        # unit is the block, but with a finer unit it is often mid-block
        # (then not a block entry), or with EAGLE a block above the stop.
        tail = (
            checkpoint_position(
                req.num_tokens, self.config.hash_block_size, self.engine_any_eagle, self.lookahead
            )
            if self.release.mamba_checkpoint
            else 0
        )
        cached = hit_tokens // bs
        out: set[int] = set()
        prev = hit_tokens
        for end in ends:
            cacheable = self._cacheable(group, end, req.hashed)
            full = cacheable // bs
            if full > cached:
                # The table holds two live states: this chunk's and the one it
                # was copied from (freed only at the next step).
                for pos in (prev, end):
                    block = pos // bs - 1
                    if (
                        pos % bs == 0
                        and cached <= block < full
                        and self._mamba_keeps(block, group, boundaries)
                    ):
                        out.add(block)
                cached = full
            # Every step re-keys the tail block once the cacheable prefix
            # reaches it, provided the block still holds a live state (the
            # others are null) and the hit did not already bring it.
            if (
                tail
                and cacheable == tail
                and tail % bs == 0
                and tail > hit_tokens
                and tail in (prev, end)
            ):
                out.add(tail // bs - 1)
            prev = end
        return np.array(sorted(out), dtype=np.int64)

    def _attention(self, gid: int, group: _Group, req: _Request) -> Blocks:
        bs, n, a = group.block_size, req.num_tokens, self.alignment
        hit_tokens, junction = req.hit, req.junction
        r = self.settings.retention_interval
        if self.settings.cache == "gpu":
            start = hit_tokens // bs
            if req.hit_blocks is not None:
                # A manager caches from the blocks it was handed: fewer than
                # the hit under the #43559 overrun (the Mamba peek margin in
                # the engine before 0.26), whose dropped block is recomputed.
                start = min(start, req.hit_blocks[gid])
            end = self._cacheable(group, n, req.hashed) // bs
            window, eagle = group.engine_window, group.engine_eagle
            boundaries = self._boundaries(n, self.engine_boundary_eagle, group, junction)
        else:
            # The connector saves whole scheduler blocks of the hashed tokens.
            end = min(n, req.hashed) // a * a // bs
            start = min(end, cdiv(hit_tokens, bs))
            if self.mirror_writes_nothing:
                end = start
            window, eagle = group.mirror_window, group.mirror_eagle
            boundaries = self._boundaries(n, self.mirror_any_eagle, group, 0)
            if not self.release.mirror_eagle_replay_boundaries:
                boundaries = [n - 1]
            if not self.release.mirror_retention:
                r = None
            if group.kind is GroupKind.MAMBA:
                # Before the hand-offs (0.29.0) the store saved Mamba states
                # like attention blocks, per the Mamba manager's mask.
                return np.array(
                    [b for b in range(start, end) if self._mamba_keeps(b, group, boundaries)],
                    dtype=np.int64,
                )
        if group.kind is not GroupKind.SLIDING_WINDOW or (
            self.settings.cache == "gpu" and not self.release.aligned_cache
        ):
            return range(start, max(start, end))
        return _sliding_mask(
            start,
            end,
            alignment=a,
            block_size=bs,
            window=window,
            eagle=eagle,
            retention=r,
            boundaries=boundaries,
        )

    def stores(
        self,
        *,
        num_tokens: int,
        hit_tokens: int,
        junction_tokens: int = 0,
        hit_blocks: Sequence[int] | None = None,
    ) -> tuple[Blocks, ...]:
        """Per group, the block indices the request's prefill caches.

        ``hit_tokens``: the hit the request's lookup got (where its prefill
        starts); ``junction_tokens``: the shared-prefix junction its lookup
        found (``junction_tokens(outcome)``), 0 for none; ``hit_blocks``: per
        group, the blocks the lookup handed the request (``GroupOutcome.
        mask_blocks``), when it may be fewer than the hit's."""
        if num_tokens <= 0:
            raise ReplayError(f"num_tokens must be positive, got {num_tokens}")
        if not 0 <= hit_tokens < num_tokens:
            raise ReplayError(
                f"hit_tokens must be in [0, {num_tokens}) for a {num_tokens}-token prompt, "
                f"got {hit_tokens}"
            )
        hbs = self.config.hash_block_size
        if not self.release.junction:
            junction_tokens = 0  # no shared-prefix junction before 0.26.0
        req = _Request(
            num_tokens=num_tokens,
            hit=hit_tokens,
            junction=junction_tokens,
            # Lookahead hashes need their tokens: the last few units go unhashed
            # (the prompt's own units, whatever the policy makes of them).
            hashed=self.config.hashed_units(num_tokens) * hbs,
            hit_blocks=hit_blocks,
        )
        ends = self.chunk_ends(num_tokens, hit_tokens, junction_tokens) if self.has_mamba else []
        handoffs = self.settings.cache == "gpu" or self.release.mirror_mamba_handoffs
        return tuple(
            self._mamba(g, req, ends)
            if g.kind is GroupKind.MAMBA and handoffs
            else self._attention(gid, g, req)
            for gid, g in enumerate(self.groups)
        )


def with_lookahead(config: TraceConfig, lookahead: int, settings: StoreSettings) -> TraceConfig:
    """``config`` with vLLM's ``num_hash_lookahead_tokens`` for a source that
    writes the stores of ``settings``' release: refused where that vLLM never
    hashes lookahead tokens (only for EAGLE's block drop, from 0.33.0, and for
    the Mooncake store from 0.34.0, which ``StoreRules`` checks)."""
    if not lookahead:
        return config
    if not config.use_eagle:
        raise ReplayError(
            f"num_hash_lookahead_tokens {lookahead}: vLLM hashes lookahead tokens only for "
            "EAGLE's block drop: turn EAGLE on"
        )
    policy = get_policy(settings.policy)
    if not policy.gpu.lookahead_clears_eagle:
        raise ReplayError(
            f"num_hash_lookahead_tokens {lookahead}: vLLM {policy.releases} has no lookahead "
            "block hashes (they came in 0.33.0): use 0, or a release from 0.33.0"
        )
    out = replace(config, num_hash_lookahead_tokens=lookahead)
    StoreRules(out, settings)  # the cache's own refusal (a connector before 0.34.0)
    return out


def request_stores(
    config: TraceConfig,
    settings: StoreSettings | None = None,
    *,
    num_tokens: int,
    hit_tokens: int,
    junction_tokens: int = 0,
) -> tuple[Blocks, ...]:
    """``StoreRules(config, settings).stores(...)``, for a one-off question."""
    return StoreRules(config, settings).stores(
        num_tokens=num_tokens, hit_tokens=hit_tokens, junction_tokens=junction_tokens
    )


def group_block_keys(
    spec: GroupSpec, unit_keys: npt.NDArray[np.int64], hbs: int
) -> npt.NDArray[np.int64]:
    """A group's per-block keys from a prompt's per-hash-unit keys: a block is
    named by the last hash unit inside it (units are chained over the prefix)."""
    k = spec.block_size // hbs
    return unit_keys[k - 1 :: k] if k > 1 else unit_keys
