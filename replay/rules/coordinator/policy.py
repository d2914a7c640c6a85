"""Policies: one per range of vLLM releases whose lookup behaves the same.

A policy holds, for each of vLLM's two lookup paths (``replay.coordinator.
cache``), the rules that path followed in those releases, or ``None`` when
the path did not exist (the Mooncake store mirror arrived in 0.22.0). A
behaviour change in vLLM becomes a new policy here (new field values, and a
new field when the change is new in kind), never a fork of the fixed-point
code. The boundaries were read from the release wheels (docs/releases.md).

``pre-49502`` and ``pre-32802`` are the emulations that came before (0.33.0
with one rule turned back); they stay, and say which releases they stand for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from replay.base.errors import ConfigError, Entry, ReplayError, by_name, named
from replay.rules.coordinator.cache import ENGINE, MIRROR, Cache, get_cache


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy(Entry):
    #: the first and last vLLM releases (``major.minor.patch``) it models
    first: str
    last: str
    #: the vLLM changes that bound the range (what changed at ``first``)
    prs: str
    #: the engine's rules (``gpu``) and the mirror's (``mooncake``, ``None``
    #: before the mirror existed)
    gpu: Cache
    mooncake: Cache | None
    #: for an emulation: which releases it stands for, printed when it is used
    alias_note: str = ""

    @property
    def releases(self) -> str:
        return self.first if self.first == self.last else f"{self.first} - {self.last}"

    def rules(self, cache: str | Cache) -> Cache:
        """This release's rules for a cache (by name, or rules given as is)."""
        if isinstance(cache, Cache) and cache is not ENGINE and cache is not MIRROR:
            return cache
        name = get_cache(cache).name
        if name == "gpu":
            return self.gpu
        if self.mooncake is None:
            raise ConfigError(
                f"policy {self.name} (vLLM {self.releases}) has no Mooncake store "
                "mirror: it came with #42828 in vLLM 0.22.0; use --cache gpu"
            )
        return self.mooncake


# The engine's rules, newest first: each release range departs from the next.
_E33 = ENGINE
_E32 = _E33.but(drop_needs_use_eagle=False)
_E30 = _E32.but(peek_cap_hashed=False)
_E29 = _E30.but(partial_hits="mamba+managers", sliding_window_needs_block_alignment=True)
_E28 = _E29.but(trim_every_full=False, one_spec_group_refused=True)
_E26 = _E28.but(partial_hits="mamba")
_E23 = _E26.but(
    partial_hits="none", mamba_peek_margin=True, full_reuse_own_hit=False, trim_ceil=False
)
_E20 = _E23.but(lcm_alignment=True)
_E16 = _E20.but(verify_eagle_once=False, eagle_flags=False, sliding_window_align_before_pop=True)

# The mirror's rules, newest first.
_M33 = MIRROR
_M32 = _M33.but(widen_window=False)
_M29 = _M32.but(
    peek_cap_hashed=False, partial_hits="mamba", sliding_window_needs_block_alignment=True
)
_M27 = _M29.but(trim_every_full=False)
_M26 = _M27.but(
    partial_hits="none", mamba_peek_margin=True, single_spec_own_block=True, trim_ceil=False
)
_M22 = _M26.but(full_reuse_own_hit=False)


def _release(
    first: str, last: str, prs: str, what: str, gpu: Cache, mooncake: Cache | None
) -> Policy:
    minor = ".".join(first.split(".")[:2])
    span = first if first == last else f"{first}-{last}"
    return Policy(
        name=f"vllm-{minor}",
        description=f"vLLM {span}: {what} [{prs}]",
        first=first,
        last=last,
        prs=prs,
        gpu=gpu,
        mooncake=mooncake,
    )


RELEASES: tuple[Policy, ...] = (
    _release(
        "0.16.0",
        "0.19.1",
        "#33524",
        "one pass for a simple hybrid; every EAGLE finder call drops a block, "
        "no peek margin, no per-group EAGLE flags; no Mooncake mirror",
        _E16,
        None,
    ),
    _release(
        "0.20.0",
        "0.21.0",
        "#40860",
        "the EAGLE drop once per candidate with a one-block peek margin (Mamba "
        "included: #43559), per-group EAGLE flags; no Mooncake mirror",
        _E20,
        None,
    ),
    _release(
        "0.22.0",
        "0.22.1",
        "#42828",
        "the Mooncake store mirror is created (peek margin for Mamba too)",
        _E20,
        _M22,
    ),
    _release(
        "0.23.0",
        "0.25.1",
        "scheduler_block_size",
        "the engine aligns hits to the scheduler block, not the lcm of block sizes",
        _E23,
        _M22,
    ),
    _release(
        "0.26.0",
        "0.26.0",
        "#46384",
        "engine: the Mamba gate (no peek margin for Mamba), partial hash hits, "
        "the fine-grained margin; the mirror still grants Mamba the margin",
        _E26,
        _M26,
    ),
    _release(
        "0.27.0",
        "0.27.1",
        "#49502",
        "mirror: the Mamba gate, partial hash hits, the fine-grained margin",
        _E26,
        _M27,
    ),
    _release(
        "0.28.0",
        "0.28.0",
        "partial-hit manager check",
        "engine: partial hits off when a group can neither probe inside a block "
        "nor has one hash unit per block",
        _E28,
        _M27,
    ),
    _release(
        "0.29.0",
        "0.29.0",
        "#49069",
        "every full-attention spec group trimmed to the hit; the engine's hybrid "
        "loop takes a single spec group",
        _E29,
        _M29,
    ),
    _release(
        "0.30.0",
        "0.31.0",
        "allow_partial_hash_hits",
        "engine: the trace's partial-hit flag can turn them off; the "
        "sliding-window finder takes a finer alignment",
        _E30,
        _M29.but(sliding_window_needs_block_alignment=False),
    ),
    _release(
        "0.32.0",
        "0.32.0",
        "peek cap",
        "the peek margin capped at the hashed length; the mirror takes the "
        "engine's partial-hit decision",
        _E32,
        _M32,
    ),
    _release(
        "0.33.0",
        "0.33.0",
        "#50062",
        "mirror: sliding windows widened by extra_retained_tokens; engine: the "
        "EAGLE drop needs use_eagle",
        _E33,
        _M33,
    ),
)
_BY_NAME = by_name(*RELEASES)

# The two emulations the tool had before it modelled releases: vLLM 0.33.0's
# code with one rule turned back. The corpus and its expectations are pinned
# on them, so they keep their meaning; using one prints which releases really
# behaved that way (``alias_note``).
ALIASES: tuple[Policy, ...] = (
    Policy(
        name="pre-49502",
        description="emulation: vLLM 0.33.0 with Mamba given the EAGLE peek margin "
        "(#43559); the releases that had it: vllm-0.26 and older (mirror), "
        "vllm-0.23 and older (engine)",
        first="0.33.0",
        last="0.33.0",
        prs="#46384 (engine), #49502 (mirror)",
        gpu=_E33.but(mamba_peek_margin=True),
        mooncake=_M33.but(mamba_peek_margin=True),
        alias_note="policy pre-49502 is vLLM 0.33.0 with the Mamba gate removed; the "
        "releases without the gate are vllm-0.23 (0.23.0-0.25.1) in the gpu cache, "
        "whose gate came with #46384 in 0.26.0, and vllm-0.26 (0.26.0) in the mooncake "
        "cache, whose gate came with #49502 in 0.27.0",
    ),
    Policy(
        name="pre-32802",
        description="emulation: vLLM 0.33.0 with the EAGLE drop on every finder call "
        "and no peek margin; the releases that had it: vllm-0.16 (0.16.0-0.19.1)",
        first="0.33.0",
        last="0.33.0",
        prs="#40860",
        gpu=_E33.but(verify_eagle_once=False),
        mooncake=_M33.but(verify_eagle_once=False),
        alias_note="policy pre-32802 is vLLM 0.33.0 with the EAGLE drop on every finder "
        "call; #32802 is the issue, #40860 (0.20.0) the fix: the releases before it are "
        "vllm-0.16 (0.16.0-0.19.1, gpu cache only)",
    ),
)

POLICIES: dict[str, Policy] = by_name(*RELEASES, *ALIASES)
DEFAULT_POLICY = "vllm-0.33"


def get_policy(name: str | Policy) -> Policy:
    return name if isinstance(name, Policy) else named(POLICIES, name, "policy")


def version_key(version: str) -> tuple[int, int, int]:
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if m is None:
        raise ReplayError(f"vLLM version {version!r}: expected MAJOR.MINOR[.PATCH]")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def policy_rules(policy: str | Policy, cache: str | Cache) -> Cache:
    """A policy's rules for a cache; refused when the cache did not exist."""
    return get_policy(policy).rules(cache)


def trace_policy(source: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """The policy of the vLLM release a trace was recorded from
    (``source.vllm_version``) and a line saying so, or None."""
    version = None if source is None else source.get("vllm_version")
    if not isinstance(version, str):
        # A generated or imported trace records the release whose stores it
        # holds (``StoreSettings.as_source``) by its policy.
        named_policy = None if source is None else source.get("policy")
        if isinstance(named_policy, str) and named_policy in POLICIES:
            return named_policy, (
                f"policy {named_policy}: the trace's stores are vLLM "
                f"{POLICIES[named_policy].releases}'s (source.policy); --policy or --vllm "
                "overrides"
            )
        return None
    policy = policy_for_version(version)
    return policy.name, (
        f"policy {policy.name}: the trace's vLLM {version} (source.vllm_version, vLLM "
        f"{policy.releases}); --policy or --vllm overrides"
    )


def policy_for_version(version: str) -> Policy:
    """The release policy that models an installed vLLM version (``0.26.0``,
    ``0.30.1.dev3+g...``); a version past the newest modelled one gets the
    newest policy, one before the oldest is refused."""
    key = version_key(version)
    if key < version_key(RELEASES[0].first):
        raise ReplayError(
            f"vLLM {version} is older than the oldest modelled release "
            f"{RELEASES[0].first}: no policy models it"
        )
    found = RELEASES[0]
    for policy in RELEASES:
        if version_key(policy.first) <= key:
            found = policy
    return found
