"""The hybrid fixed point (vLLM 0.33.0 ``HybridKVCacheCoordinator`` and its
Mooncake store mirror): every spec group must agree on one hit length.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from replay.coordinator.finders import FINDERS, FinderResult, cdiv, eagle_margin
from replay.coordinator.policy import DEFAULT_POLICY, Policy, get_policy
from replay.spec import GroupKind, GroupSpec, TraceConfig


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


def build_spec_groups(config: TraceConfig) -> tuple[SpecGroup, ...]:
    merged: list[tuple[GroupSpec, list[int], bool]] = []
    for gid, group in enumerate(config.groups):
        key = group.spec_key()
        for i, (spec, gids, eagle) in enumerate(merged):
            if spec.spec_key() == key:
                gids.append(gid)
                merged[i] = (spec, gids, eagle or group.is_eagle_group)
                break
        else:
            merged.append((group, [gid], group.is_eagle_group))
    # Full attention first; otherwise group order (a stable sort).
    merged.sort(key=lambda m: m[0].kind is not GroupKind.FULL_ATTENTION)
    # When EAGLE is on and no group says which, every group is treated as one.
    flag_all = config.use_eagle and not any(e for _, _, e in merged)
    return tuple(
        SpecGroup(index=i, spec=spec, group_ids=tuple(gids), eagle=eagle or flag_all)
        for i, (spec, gids, eagle) in enumerate(merged)
    )


def _all_present(per_group: Sequence[bytes]) -> bytes:
    """A merged spec group holds a unit only when every member group does."""
    if len(per_group) == 1:
        return per_group[0]
    n = len(per_group[0])
    merged = int.from_bytes(per_group[0], "little")
    for p in per_group[1:]:
        merged &= int.from_bytes(p, "little")
    return merged.to_bytes(n, "little")


class Coordinator:
    """Finds the longest cache hit every KV-cache group agrees on."""

    name = "reference"

    def __init__(self, config: TraceConfig, policy: str | Policy = DEFAULT_POLICY) -> None:
        self.config = config
        self.policy = get_policy(policy)
        self.spec_groups = build_spec_groups(config)
        self.alignment = config.alignment
        hbs = config.hash_block_size
        fine = config.enable_partial_hash_hits
        self._margins = tuple(
            eagle_margin(sg.spec, hbs, fine and FINDERS[sg.kind].fine_grained)
            for sg in self.spec_groups
        )
        self._simple_hybrid = (
            len(self.spec_groups) == 2 and self.spec_groups[0].kind is GroupKind.FULL_ATTENTION
        )

    def _call(self, sg: SpecGroup, present: bytes, bound: int, drop: bool) -> FinderResult:
        return FINDERS[sg.kind](
            sg.spec,
            present,
            max_length=bound,
            drop_eagle=drop,
            alignment=self.alignment,
            hash_block_size=self.config.hash_block_size,
        )

    def _gets_margin(self, sg: SpecGroup) -> bool:
        # No peek margin for Mamba (#49502): its finder never drops, so a
        # widened bound resumes state past the verified prefix (#43559).
        return sg.kind is not GroupKind.MAMBA or self.policy.mamba_peek_margin

    def lookup(
        self,
        hashes: Sequence[Hashable],
        max_length: int,
        contains: Sequence[Callable[[Hashable], bool]],
        *,
        explain: bool = False,
    ) -> LookupOutcome:
        """``contains[g]`` tests whether group ``g`` holds a key for a hash."""
        present = [bytes(map(c, hashes)) for c in contains]
        return self.lookup_present(present, max_length, explain=explain)

    def lookup_present(
        self, present: Sequence[bytes], max_length: int, *, explain: bool = False
    ) -> LookupOutcome:
        """``present[g][u]`` is 1 when group ``g`` holds a key for the request's
        hash unit ``u`` (the store state the lookup sees), else 0."""
        merged = [_all_present([present[g] for g in sg.group_ids]) for sg in self.spec_groups]
        results: list[FinderResult | None] = [None] * len(self.spec_groups)
        steps: list[Step] = []

        if len(self.spec_groups) == 1:
            sg = self.spec_groups[0]
            res = self._call(sg, merged[0], max_length, sg.eagle)
            results[0] = res
            if explain:
                steps.append(
                    self._step(1, sg, max_length, max_length, 0, sg.eagle, res, res.hit_tokens)
                )
            return self._outcome(res.hit_tokens, results, steps)

        hit = max_length
        peek_cap = len(present[0]) * self.config.hash_block_size
        verified: set[int] = set()
        pass_no = 0
        while True:
            pass_no += 1
            cand = hit
            for sg in self.spec_groups:
                prev = results[sg.index]
                if sg.kind is GroupKind.FULL_ATTENTION and prev is not None:
                    before = cand
                    cand = min(cand, prev.hit_tokens)
                    if explain:
                        steps.append(
                            self._step(
                                pass_no, sg, before, before, 0, False, prev, cand, reused=True
                            )
                        )
                    continue
                drop = sg.eagle and sg.index not in verified
                bound, margin = cand, 0
                if drop and self._gets_margin(sg):
                    margin = self._margins[sg.index]
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
            if self._simple_hybrid:
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
        for sg in self.spec_groups:
            res = results[sg.index]
            assert res is not None  # every spec group is called in the first pass
            nulls, loaded = res.null_blocks, res.loaded_blocks
            if trim_full and sg.kind is GroupKind.FULL_ATTENTION:
                # Full attention keeps the blocks of the converged hit (the
                # partial tail block included); other kinds trimmed themselves.
                loaded = min(loaded, cdiv(hit, sg.spec.block_size))
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
