"""Policies: named sets of differences from vLLM 0.33.0's coordinator.

A behaviour change in vLLM becomes a new policy here (a new field and a new
entry), never a fork of the fixed-point code.
"""

from __future__ import annotations

from dataclasses import dataclass

from replay.base.errors import Entry, by_name, named


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy(Entry):
    #: Grant the Mamba group the EAGLE peek margin. vLLM did before #49502;
    #: Mamba never drops, so the widened bound lets its state land one
    #: block past the attention-verified prefix (#43559).
    mamba_peek_margin: bool = False
    #: Each EAGLE group drops at most once per candidate length, matching one
    #: unit past the candidate (the peek margin) so the drop lands back on it
    #: (#32802). Before that, every finder call of an EAGLE group dropped a
    #: block with the candidate as its bound, so a loop of three or more spec
    #: groups spiralled the hit down one block per pass.
    verify_eagle_once: bool = True


POLICIES: dict[str, Policy] = by_name(
    Policy(
        name="vllm-0.33",
        description="vLLM 0.33.0 (with #49502: no EAGLE peek margin for Mamba)",
    ),
    Policy(
        name="pre-49502",
        description="before vLLM #49502: Mamba gets the EAGLE peek margin (#43559)",
        mamba_peek_margin=True,
    ),
    Policy(
        name="pre-32802",
        description="before vLLM #32802: every EAGLE finder call drops a block, "
        "no peek margin (the hit spirals down)",
        verify_eagle_once=False,
    ),
)
DEFAULT_POLICY = "vllm-0.33"


def get_policy(name: str | Policy) -> Policy:
    return name if isinstance(name, Policy) else named(POLICIES, name, "policy")
