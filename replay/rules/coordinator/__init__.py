"""The reference coordinator: vLLM's hybrid cache-hit semantics, per release."""

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
from replay.rules.coordinator.policy import (
    ALIASES,
    DEFAULT_POLICY,
    POLICIES,
    RELEASES,
    Chosen,
    Policy,
    choose_policies,
    get_policy,
    pinned_policies,
    policy_for_version,
    policy_rules,
    same_rules,
)

#: Who answers the lookups: this project's coordinator, or the installed vLLM's.
COORDINATORS = ("reference", "vllm")

__all__ = [
    "ALIASES",
    "CACHES",
    "COORDINATORS",
    "DEFAULT_CACHE",
    "DEFAULT_POLICY",
    "FINDERS",
    "POLICIES",
    "RELEASES",
    "Cache",
    "Chosen",
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
    "choose_policies",
    "eagle_group_ids",
    "engine_derives_partial_hits",
    "get_cache",
    "get_policy",
    "hit_alignment",
    "lookup_spec",
    "partial_hits",
    "pinned_policies",
    "policy_for_version",
    "policy_rules",
    "same_rules",
    "trace_cache",
]
