"""Caches: which of vLLM's two lookup paths answers, and the rules each
path follows in a given release.

vLLM looks a prefix up in two places that run different code over the same
per-kind finders:

- ``gpu``: the engine's own prefix cache (``KVCacheCoordinator`` in
  ``vllm/v1/core/kv_cache_coordinator.py`` over the ``BlockPool``). vLLM's KV
  events describe this cache, so recorded traffic replays against it.
- ``mooncake``: the Mooncake store's hand-kept mirror of the hybrid loop
  (``MooncakeStoreCoordinator``, from vLLM 0.22.0 on).

A ``Cache`` is one path's rules in one release range, kept as fields so the
fixed point exists once; ``ENGINE`` and ``MIRROR`` are vLLM 0.34.0's. A
release policy (``replay.rules.coordinator.policy``) holds one ``Cache`` per path
that existed in it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from replay.base.errors import Entry, by_name, named
from replay.base.spec import TraceConfig

#: How a path decides whether hits may land on a hash unit inside a block:
#: ``none``: never (before vLLM 0.26); ``mamba``: whenever an align-mode Mamba
#: group's block is larger than the hash unit (the trace's flag is ignored);
#: ``mamba+managers``: that, and every other group can probe inside a block or
#: has one hash unit per block (flag ignored); ``mamba+managers+flag``: that,
#: and the trace's flag can turn them off (``allow_partial_hash_hits``);
#: ``flag``: the trace's flag as given (the mirror taking core's decision).
PartialHits = Literal["none", "mamba", "mamba+managers", "mamba+managers+flag", "flag"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Cache(Entry):
    #: The sliding window widened by ``extra_retained_tokens`` for lookup and
    #: for merging equal specs (the mirror's ``_coverage_spec``, 0.33.0: an
    #: external hit restores the MTP re-prefill tail too). The engine's finder
    #: uses the bare window and merges only identical specs.
    widen_window: bool = False
    #: ``is_eagle_group`` drops a block only while ``use_eagle`` is on (the
    #: engine's ``drop_eagle_group_ids``, 0.33.0: lookahead hashes clear
    #: ``use_eagle`` and leave groups flagged). Otherwise a flagged group
    #: drops regardless.
    drop_needs_use_eagle: bool = True
    #: Lookahead block hashes (``num_hash_lookahead_tokens`` > 0) key the
    #: drafter's KV past each block, so no group drops its EAGLE block: the
    #: engine's scheduler clears ``use_eagle_block_drop`` (0.33.0, when the
    #: lookahead hashes came); the mirror clears ``use_eagle`` and each
    #: group's drop (``drops_eagle_block``, 0.34.0; 0.33.0's mirror took no
    #: lookahead, a KV connector got plain hashes). Otherwise the lookahead
    #: changes no lookup.
    lookahead_clears_eagle: bool = True
    #: Per-group ``is_eagle_group`` flags pick the EAGLE groups (from vLLM
    #: 0.20.0, #40860). Before, ``use_eagle`` made every group drop and the
    #: flags did not exist.
    eagle_flags: bool = True
    #: One spec group is answered by a single finder call with no peek
    #: margin (the mirror's shortcut). The engine runs its hybrid loop for
    #: any number of spec groups, so a spec group spanning several KV-cache
    #: groups gets the margin.
    single_spec_shortcut: bool = False
    #: The mirror's shortcut aligns a single spec group to its own block size
    #: (vLLM 0.22-0.26) instead of the hit alignment.
    single_spec_own_block: bool = False
    #: A hybrid with a single spec group over several KV-cache groups is
    #: refused (the engine's ``len(attention_groups) > 1`` assertion, before
    #: vLLM 0.29.0).
    one_spec_group_refused: bool = False
    #: One KV-cache group runs ``UnitaryKVCacheCoordinator``: hits align to
    #: the block, which must equal the hash unit, and there is no margin.
    unitary_single_group: bool = True
    #: How partial hash hits are decided (``PartialHits``).
    partial_hits: PartialHits = "mamba+managers+flag"
    #: Hits are multiples of the lcm of the groups' block sizes, which the
    #: trace's scheduler block must equal (the engine before vLLM 0.23.0,
    #: which had no scheduler block of its own).
    lcm_alignment: bool = False
    #: The sliding-window finder asserts on a hit alignment finer than its
    #: block (before vLLM 0.30.0): partial hits with such a group are refused.
    sliding_window_needs_block_alignment: bool = False
    #: Each EAGLE group drops at most once per candidate length, matching one
    #: unit past the candidate (the peek margin) so the drop lands back on it
    #: (#40860, vLLM 0.20.0, for issue #32802). Before, every finder call of
    #: an EAGLE group dropped a block with the candidate as its bound, so a
    #: loop of three or more spec groups spiralled the hit down.
    verify_eagle_once: bool = True
    #: Grant the Mamba group the EAGLE peek margin. Mamba never drops, so the
    #: widened bound lets its state land one block past the attention-verified
    #: prefix (#43559). The gate came with #46384 in the engine (0.26.0) and
    #: #49502 in the mirror (0.27.0).
    mamba_peek_margin: bool = False
    #: The peek margin is capped at the request's hashed length
    #: (``len(block_hashes) * hash_block_size``, vLLM 0.32.0); before, at the
    #: lookup's ``max_length``.
    peek_cap_hashed: bool = True
    #: Full attention after its first lookup shrinks the candidate to its own
    #: hit (vLLM 0.26.0); before, it floored the candidate to its block size.
    full_reuse_own_hit: bool = True
    #: Every full-attention spec group is trimmed to the converged hit (vLLM
    #: 0.29.0); before, only the first spec group, and only when it is full
    #: attention.
    trim_every_full: bool = True
    #: The trim keeps ``ceil(hit / block_size)`` blocks (the partial tail
    #: block, vLLM 0.26.0 in the engine, 0.27.0 in the mirror); before,
    #: ``hit // block_size``.
    trim_ceil: bool = True
    #: The sliding-window finder lets a run end where the length before the
    #: EAGLE pop is aligned (before vLLM 0.20.0), not after it.
    sliding_window_align_before_pop: bool = False
    #: A simple hybrid (one full-attention spec group first, one other) stops
    #: after one pass (#33524, vLLM 0.16.0).
    simple_hybrid_single_pass: bool = True
    #: A lookup enters where the Mooncake connector's does, the store
    #: worker's ``lookup(num_tokens, block_hashes)`` for a prompt of
    #: ``max_length + 1`` tokens (vLLM 0.27.0): the prompt's length aligned
    #: down (``align_lookup_length``), the store asked only for the blocks
    #: within it that a hit can end on (``lookup_mask``: a sliding window's
    #: reachable tails; every block with partial hash hits), the fixed point
    #: run at that length over what the store answered, and run again below
    #: the prompt's end when it hit the whole prompt. Otherwise the fixed
    #: point runs at ``max_length`` over every key the store holds (the
    #: engine; the mirror before 0.27.0, whose worker took a length its
    #: scheduler had aligned).
    store_worker_entry: bool = False

    def but(self, **changes: Any) -> Cache:
        """These rules with some changed (a release's departures)."""
        return replace(self, **changes)


ENGINE = Cache(
    name="gpu",
    description="vLLM's engine prefix cache (KVCacheCoordinator over the BlockPool)",
)
# The defaults above are the engine's rules in 0.33.0 and 0.34.0; the mirror
# (0.34.0's) departs from each of these.
MIRROR = Cache(
    name="mooncake",
    description="the Mooncake store (MooncakeStoreCoordinator, from vLLM 0.22.0)",
    widen_window=True,
    drop_needs_use_eagle=False,
    single_spec_shortcut=True,
    unitary_single_group=False,
    partial_hits="flag",
    store_worker_entry=True,
)
CACHES: dict[str, Cache] = by_name(MIRROR, ENGINE)
DEFAULT_CACHE = "mooncake"


def get_cache(name: str | Cache) -> Cache:
    return name if isinstance(name, Cache) else named(CACHES, name, "cache")


def trace_cache(source: Mapping[str, Any] | None) -> str:
    """The cache a trace's events describe (``source.cache``), else the default."""
    if source is not None:
        named = source.get("cache")
        if isinstance(named, str) and named in CACHES:
            return named
    return DEFAULT_CACHE


def resolve_cache(config: TraceConfig, cache: str | None) -> str:
    """The cache that answers: the one asked for, else the one the trace's
    events describe (``source.cache``), else the Mooncake store."""
    return get_cache(cache).name if cache is not None else trace_cache(config.source)
