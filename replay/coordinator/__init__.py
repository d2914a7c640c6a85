"""The reference coordinator: vLLM 0.33.0's hybrid cache-hit semantics."""

from replay.coordinator.finders import FINDERS, FinderResult, block_view
from replay.coordinator.hybrid import (
    Coordinator,
    GroupOutcome,
    LookupOutcome,
    SpecGroup,
    Step,
    build_spec_groups,
)
from replay.coordinator.policy import DEFAULT_POLICY, POLICIES, Policy, get_policy

__all__ = [
    "DEFAULT_POLICY",
    "FINDERS",
    "POLICIES",
    "Coordinator",
    "FinderResult",
    "GroupOutcome",
    "LookupOutcome",
    "Policy",
    "SpecGroup",
    "Step",
    "block_view",
    "build_spec_groups",
    "get_policy",
]
