"""Caches: which of vLLM 0.33.0's two lookup paths answers.

vLLM looks a prefix up in two places that run different code over the same
per-kind finders:

- ``gpu``: the engine's own prefix cache (``KVCacheCoordinator`` in
  ``vllm/v1/core/kv_cache_coordinator.py`` over the ``BlockPool``). vLLM's KV
  events describe this cache, so recorded traffic replays against it.
- ``mooncake``: the Mooncake store's hand-kept mirror of the hybrid loop
  (``MooncakeStoreCoordinator``).

They differ in a handful of named rules, kept here as fields (like the
policies) so the fixed point exists once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from replay.base.errors import Entry, by_name, named


@dataclass(frozen=True, slots=True, kw_only=True)
class Cache(Entry):
    #: The sliding window widened by ``extra_retained_tokens`` for lookup and
    #: for merging equal specs (the mirror's ``_coverage_spec``: an external
    #: hit restores the MTP re-prefill tail too). The engine's finder uses
    #: the bare window and merges only identical specs.
    widen_window: bool = False
    #: ``is_eagle_group`` drops a block only while ``use_eagle`` is on (the
    #: engine's ``drop_eagle_group_ids``: lookahead hashes clear
    #: ``use_eagle`` and leave groups flagged). The mirror drops for a
    #: flagged group regardless.
    drop_needs_use_eagle: bool = True
    #: One spec group is answered by a single finder call with no peek
    #: margin (the mirror's shortcut). The engine runs its hybrid loop for
    #: any number of spec groups, so a spec group spanning several KV-cache
    #: groups gets the margin.
    single_spec_shortcut: bool = False
    #: One KV-cache group runs ``UnitaryKVCacheCoordinator``: hits align to
    #: the block, which must equal the hash unit, and there is no margin.
    unitary_single_group: bool = True
    #: Partial hash hits are what ``partial_hash_hits_enabled`` derives from
    #: the groups, and the trace's flag can only turn them off; the mirror
    #: takes the flag as given.
    derive_partial_hits: bool = True


ENGINE = Cache(
    name="gpu",
    description="vLLM's engine prefix cache (KVCacheCoordinator over the BlockPool, 0.33.0)",
)
# The defaults above are the engine's rules; the mirror departs from each.
MIRROR = Cache(
    name="mooncake",
    description="the Mooncake store (MooncakeStoreCoordinator, vLLM 0.33.0)",
    widen_window=True,
    drop_needs_use_eagle=False,
    single_spec_shortcut=True,
    unitary_single_group=False,
    derive_partial_hits=False,
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
