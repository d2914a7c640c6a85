"""The reference coordinator: vLLM 0.33.0's hybrid cache-hit semantics."""

from replay.rules.coordinator.cache import CACHES, DEFAULT_CACHE, Cache, get_cache, trace_cache
from replay.rules.coordinator.finders import FINDERS, FinderResult, block_view
from replay.rules.coordinator.hybrid import (
    Coordinator,
    GroupOutcome,
    LookupCoordinator,
    LookupOutcome,
    SpecGroup,
    Step,
    build_spec_groups,
    check_config,
    eagle_group_ids,
    engine_derives_partial_hits,
    hit_alignment,
    lookup_spec,
    partial_hits,
)
from replay.rules.coordinator.policy import DEFAULT_POLICY, POLICIES, Policy, get_policy

__all__ = [
    "CACHES",
    "DEFAULT_CACHE",
    "DEFAULT_POLICY",
    "FINDERS",
    "POLICIES",
    "Cache",
    "Coordinator",
    "FinderResult",
    "GroupOutcome",
    "LookupCoordinator",
    "LookupOutcome",
    "Policy",
    "SpecGroup",
    "Step",
    "block_view",
    "build_spec_groups",
    "check_config",
    "eagle_group_ids",
    "engine_derives_partial_hits",
    "get_cache",
    "get_policy",
    "hit_alignment",
    "lookup_spec",
    "partial_hits",
    "trace_cache",
]
