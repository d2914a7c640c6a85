"""The facts of a lookup: what every flag needs to know about one answer and
the store it was answered from, and nothing about how it is judged.

The replay (``replay.engine.answers``) and the what-if (``replay.whatif.sweep``)
compute them as they answer, from the presence bytes the lookup saw
(``present[g][u]``: group ``g`` held the key of hash unit ``u``), and write
them as results columns; the flags are polars expressions over those columns
(``analysis/flags.py``), so the replay never imports its judge (issue 21).
Pure: no pyarrow, polars or click.

Per lookup, with ``H`` the hit:

- ``hit_alignment``: the hit alignment of the cache that answered.
- ``state_tokens[g]``: where Mamba group ``g`` resumes its state: 0 when it
  loads nothing, the exact hash unit it matched when it probes inside blocks
  (vLLM's fine-grained lookups), else the end of its mask; None for a group
  that is not Mamba.
- ``attention_tokens``: the tokens every attention group's loaded KV covers
  (the least ``mask_blocks x block_size`` over the non-Mamba groups); None in
  a model of Mamba groups only.
- ``first_absent_block[g]``: the first block of group ``g``'s load mask whose
  key is absent from the store at that ``seq`` (each loaded block's key: its
  last hash unit; for a block the hit or the Mamba state ends inside, some
  present unit of that block at or past the end; the Mamba state's own unit;
  anything past the request's hashes); None when every loaded block is there.
- ``eagle_unit_present[g]``: for an EAGLE full-attention or sliding-window
  group (one that drops for EAGLE in this cache), whether the unit the drop
  recomputes (the block at ``H``, or the hash unit at ``H`` when the group
  probes inside blocks) is present; None for the other groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from replay.base.spec import GroupKind, TraceConfig
from replay.rules.coordinator import (
    DEFAULT_CACHE,
    Cache,
    LookupOutcome,
    build_spec_groups,
    get_cache,
    hit_alignment,
    partial_hits,
)


@dataclass(frozen=True, slots=True)
class LookupFacts:
    """One lookup's facts beyond its answer (see the module's docstring)."""

    state_tokens: tuple[int | None, ...]
    attention_tokens: int | None
    first_absent_block: tuple[int | None, ...]
    eagle_unit_present: tuple[bool | None, ...]


class FactRules:
    """How the facts of a lookup are read, for one configuration and cache."""

    def __init__(self, config: TraceConfig, cache: str | Cache = DEFAULT_CACHE) -> None:
        self.config = config
        self.cache = get_cache(cache)
        self.alignment = hit_alignment(config, self.cache)
        partial = partial_hits(config, self.cache)
        hbs = config.hash_block_size
        # Groups that probe hash units inside a block (vLLM's fine-grained
        # lookups): full attention and Mamba with partial hits and big blocks.
        self.fine = tuple(
            partial
            and g.kind in (GroupKind.FULL_ATTENTION, GroupKind.MAMBA)
            and g.block_size > hbs
            and g.block_size % self.alignment == 0
            for g in config.groups
        )
        eagle = {
            gid for sg in build_spec_groups(config, self.cache) if sg.eagle for gid in sg.group_ids
        }
        self.eagle_attention = frozenset(
            gid
            for gid, g in enumerate(config.groups)
            if gid in eagle and g.kind in (GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW)
        )
        self._attention = tuple(
            gid for gid, g in enumerate(config.groups) if g.kind is not GroupKind.MAMBA
        )
        self._mamba = frozenset(
            gid for gid, g in enumerate(config.groups) if g.kind is GroupKind.MAMBA
        )

    def state_tokens(
        self, gid: int, mask_blocks: int, loaded_blocks: int, state: int | None
    ) -> int:
        """Where a Mamba group resumes: the end of its one loaded block, or
        the exact hash unit when it probes inside blocks."""
        if loaded_blocks == 0:
            return 0
        if self.fine[gid] and state is not None:
            return state
        return mask_blocks * self.config.groups[gid].block_size

    def facts(
        self,
        present: Sequence[bytes],
        hit: int,
        masks: Sequence[tuple[int, int]],
        states: Sequence[int | None],
    ) -> LookupFacts:
        """The facts of one lookup: ``masks[g]`` is group ``g``'s
        ``(mask_blocks, loaded_blocks)``, ``states[g]`` its reported Mamba
        state position (None elsewhere)."""
        groups = self.config.groups
        resumed = [
            self.state_tokens(gid, masks[gid][0], masks[gid][1], states[gid])
            if gid in self._mamba
            else None
            for gid in range(len(groups))
        ]
        covered = min((masks[g][0] * groups[g].block_size for g in self._attention), default=None)
        absent = tuple(
            self._first_missing(
                gid,
                present[gid],
                mask_blocks - loaded,
                mask_blocks,
                hit if resumed[gid] is None else resumed[gid],  # type: ignore[arg-type]
            )
            for gid, (mask_blocks, loaded) in enumerate(masks)
        )
        hbs = self.config.hash_block_size
        eagle: list[bool | None] = []
        for gid, g in enumerate(groups):
            if gid not in self.eagle_attention:
                eagle.append(None)
                continue
            bs = g.block_size
            unit = hit // hbs if self.fine[gid] else (hit // bs + 1) * (bs // hbs) - 1
            p = present[gid]
            eagle.append(unit < len(p) and bool(p[unit]))
        return LookupFacts(tuple(resumed), covered, absent, tuple(eagle))

    def outcome_facts(self, present: Sequence[bytes], outcome: LookupOutcome) -> LookupFacts:
        return self.facts(
            present,
            outcome.hit_tokens,
            [(g.mask_blocks, g.loaded_blocks) for g in outcome.groups],
            [g.state_tokens for g in outcome.groups],
        )

    def _first_missing(
        self, gid: int, present: bytes, first: int, stop: int, end: int
    ) -> int | None:
        """The first block in ``[first, stop)`` of the group's mask whose key
        is absent. A block that ``end`` (the hit, or the Mamba state) lands
        inside is served by any present unit of it at or past ``end``: the
        tail block's KV is append-only, so a longer match still covers it."""
        if stop <= first:
            return None
        hbs = self.config.hash_block_size
        bs = self.config.groups[gid].block_size
        k = bs // hbs
        # Whole blocks are keyed by their last unit; scanning that view with
        # ``find`` keeps a 750-block lookup at C speed.
        view = present if k == 1 else present[k - 1 :: k]
        tail = end // bs if end % bs else -1  # the block ``end`` lands inside

        def first_absent(lo: int, hi: int) -> int | None:
            if lo >= hi:
                return None
            miss = view.find(0, lo, min(hi, len(view)))
            if miss >= 0:
                return miss
            # Blocks past the request's own hashes cannot be present.
            return max(lo, len(view)) if hi > len(view) else None

        if not first <= tail < stop:
            return first_absent(first, stop)
        before = first_absent(first, tail)
        if before is not None:
            return before
        lo = -(-end // hbs) - 1  # the unit that ends at or past ``end``
        if self.config.groups[gid].kind is GroupKind.MAMBA:
            ok = lo < len(present) and present[lo] == 1
        else:
            ok = present.find(1, lo, min((tail + 1) * k, len(present))) >= 0
        return first_absent(tail + 1, stop) if ok else tail
