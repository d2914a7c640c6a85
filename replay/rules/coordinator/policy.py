"""Policies: one per range of vLLM releases whose lookup behaves the same.

A policy holds, for each of vLLM's two lookup paths (``replay.rules.coordinator.
cache``), the rules that path followed in those releases, or ``None`` when
the path did not exist (the Mooncake store mirror arrived in 0.22.0). A
behaviour change in vLLM becomes a new policy here (new field values, and a
new field when the change is new in kind), never a fork of the fixed-point
code. The boundaries were read from the release wheels (docs/releases.md).

``pre-49502`` and ``pre-32802`` are the names the tool had before, named
after a PR and an issue; they are aliases of the release rules they mean
(cache by cache) and say so when used. ``choose_policies`` is the one rule by
which every command picks its policy (given, ``--vllm``, a results file's
own, the trace's recorded release, the default).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
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
    #: for an alias or an emulation: what it means, printed when it is used;
    #: for an alias, the release policy whose rules it takes in each cache
    alias_note: str = ""
    stands_for: tuple[tuple[str, str], ...] = ()

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
                "mirror: it came with #42828 in vLLM 0.22.0; use `cache` gpu"
            )
        return self.mooncake

    def label(self, cache: str | Cache) -> str:
        """The name as an answer's header shows it: an alias with the release
        it takes in ``cache`` (``pre-49502 (here vllm-0.26)``), so that its
        long note need not follow every command."""
        if not self.stands_for:
            return self.name
        return f"{self.name} (here {self.release(cache).name})"

    def release(self, cache: str | Cache) -> Policy:
        """The release policy whose rules this one takes in ``cache`` (itself
        unless it is an alias)."""
        name = dict(self.stands_for).get(get_cache(cache).name)
        return self if name is None else _BY_NAME[name]


def version_key(version: str) -> tuple[int, int, int]:
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if m is None:
        raise ReplayError(f"vLLM version {version!r}: expected MAJOR.MINOR[.PATCH]")
    return int(m[1]), int(m[2]), int(m[3] or 0)


# The engine's rules, newest first: each release range departs from the next.
_E34 = ENGINE
# The engine's lookup path is the same code in 0.33.0 and 0.34.0
# (kv_cache_coordinator.py unchanged; the scheduler clears the EAGLE drop
# under lookahead hashes in both).
_E33 = _E34
# No lookahead hashes before 0.33.0: a trace's lookahead changes nothing there.
_E32 = _E33.but(drop_needs_use_eagle=False, lookahead_clears_eagle=False)
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
_M34 = MIRROR
# 0.33.0's mirror took no lookahead (vLLM gave a KV connector plain hashes):
# a flagged group drops whatever a trace's lookahead says.
_M33 = _M34.but(lookahead_clears_eagle=False)
_M32 = _M33.but(widen_window=False)
_M29 = _M32.but(
    peek_cap_hashed=False, partial_hits="mamba", sliding_window_needs_block_alignment=True
)
_M27 = _M29.but(trim_every_full=False)
_M26 = _M27.but(
    partial_hits="none",
    mamba_peek_margin=True,
    single_spec_own_block=True,
    trim_ceil=False,
    store_worker_entry=False,
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
        "0.23.0",
        "scheduler_block_size",
        "the engine aligns hits to the scheduler block, not the lcm of block sizes",
        _E23,
        _M22,
    ),
    # The same lookup as 0.23.0 in both caches; the stores changed (Mamba
    # retention, the store mask's interval, unhashed blocks freed first).
    _release(
        "0.24.0",
        "0.25.1",
        "sparse Mamba retention",
        "lookup as 0.23; stores: Mamba states and the Mooncake store honour the "
        "retention interval, the block pool frees unhashed blocks first",
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
        "mirror: the Mamba gate, partial hash hits, the fine-grained margin; "
        "lookups enter through the store worker's lookup(num_tokens, block_hashes)",
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
    _release(
        "0.34.0",
        "0.34.0",
        "mirror lookahead",
        "mirror: with lookahead block hashes (num_hash_lookahead_tokens) no group "
        "drops its EAGLE block, as in the engine; the engine's lookup as 0.33",
        _E34,
        _M34,
    ),
)
_BY_NAME = by_name(*RELEASES)

# The two names the tool had before it modelled releases, named after a PR
# (#49502) and an issue (#32802). Each is now the real rules of the newest
# releases that still behaved as the name says, cache by cache, and says so
# when used (``alias_note``).


def _alias(name: str, gpu: str, mooncake: str | None, prs: str, what: str, note: str) -> Policy:
    engine, mirror = _BY_NAME[gpu], None if mooncake is None else _BY_NAME[mooncake]
    return Policy(
        name=name,
        description=f"alias: {what}",
        first=engine.first,
        last=engine.last if mirror is None else max(engine.last, mirror.last, key=version_key),
        prs=prs,
        gpu=engine.gpu,
        mooncake=None if mirror is None else mirror.mooncake,
        alias_note=note,
        stands_for=(("gpu", engine.name),)
        + (() if mirror is None else (("mooncake", mirror.name),)),
    )


ALIASES: tuple[Policy, ...] = (
    _alias(
        "pre-49502",
        "vllm-0.24",
        "vllm-0.26",
        "ended by #46384 (engine, 0.26.0) and #49502 (mirror, 0.27.0)",
        "the newest releases with the #43559 overrun (Mamba given the EAGLE peek margin): "
        "vllm-0.24 in the gpu cache, vllm-0.26 in the mooncake cache",
        "policy pre-49502 means vllm-0.24 (vLLM 0.24.0 - 0.25.1) in the gpu cache, whose "
        "Mamba gate came with #46384 in 0.26.0, and vllm-0.26 (vLLM 0.26.0) in the "
        "mooncake cache, whose gate came with #49502 in 0.27.0",
    ),
    _alias(
        "pre-32802",
        "vllm-0.16",
        None,
        "ended by #40860 (0.20.0)",
        "the releases with the EAGLE drop on every finder call and no peek margin: "
        "vllm-0.16 (gpu cache only; the mirror came in 0.22.0)",
        "policy pre-32802 means vllm-0.16 (vLLM 0.16.0 - 0.19.1): #32802 is the issue, "
        "#40860 in 0.20.0 the fix; the Mooncake mirror did not exist yet",
    ),
)

# Not a release and not an alias: vLLM 0.33.0's structure with the Mamba
# gates taken out, what `make mutants` makes of vLLM 0.33.0 with its
# engine-no-mamba-gate and mirror-no-mamba-gate mutants. No release ever
# answered so (0.33.0's peek cap on the hashed length with Mamba's margin
# can leave a hit past max_length's alignment); it stays for the flags'
# tests of such facts and says so when used.
EMULATIONS: tuple[Policy, ...] = (
    Policy(
        name="vllm-0.33-no-mamba-gate",
        description="emulation, no release: vLLM 0.33.0 with the Mamba gates of #46384 "
        "(engine) and #49502 (mirror) removed, as make mutants' no-mamba-gate mutants",
        first="0.33.0",
        last="0.33.0",
        prs="#46384 and #49502 taken out",
        gpu=_E33.but(mamba_peek_margin=True),
        mooncake=_M33.but(mamba_peek_margin=True),
        alias_note="policy vllm-0.33-no-mamba-gate is an emulation, no vLLM release: 0.33.0 "
        "with the Mamba gate removed; the releases with the #43559 overrun are pre-49502",
    ),
)

POLICIES: dict[str, Policy] = by_name(*RELEASES, *ALIASES, *EMULATIONS)
DEFAULT_POLICY = "vllm-0.33"


def pinned_policies(cache: str | Cache, also: Sequence[str] = ()) -> tuple[str, ...]:
    """What a regression trace pins in ``cache`` (``traces/build.py``,
    ``replay minimize``): the default release, the newest (what a vLLM no
    policy models yet is checked as: ``version_policy``), the aliases (the
    releases of the bugs the corpus is about) and ``also``, each only where
    it has that cache (``pre-32802`` has no Mooncake mirror)."""
    names = dict.fromkeys((DEFAULT_POLICY, RELEASES[-1].name, *(p.name for p in ALIASES), *also))
    engine = get_cache(cache).name == "gpu"
    return tuple(n for n in names if engine or get_policy(n).mooncake is not None)


def get_policy(name: str | Policy) -> Policy:
    return name if isinstance(name, Policy) else named(POLICIES, name, "policy")


def policy_rules(policy: str | Policy, cache: str | Cache) -> Cache:
    """A policy's rules for a cache; refused when the cache did not exist."""
    return get_policy(policy).rules(cache)


@dataclass(frozen=True, slots=True)
class Chosen:
    """The policies a command answers with, and the lines that say what was
    inferred (and what an alias means), for standard error."""

    policies: tuple[str, ...]
    notes: tuple[str, ...] = ()


def choose_policies(
    given: Sequence[str] = (),
    *,
    vllm: Sequence[str] = (),
    source: Mapping[str, Any] | None = None,
    results_policy: str | None = None,
    alias_notes: bool = True,
) -> Chosen:
    """Every command's one rule for its policies: ``--policy`` (``given``),
    else each ``--vllm`` release's policy, else a results file's own policy,
    else the release that recorded the trace (``source.vllm_version``), else
    :data:`DEFAULT_POLICY`. Giving both ``--policy`` and ``--vllm`` is an
    error; an alias named here (``--policy``; a results file's was said
    when it was made) adds the line saying what it means, unless the
    command's output names its release itself (``alias_notes=False``:
    :meth:`Policy.label`)."""
    notes: list[str] = []
    chosen = tuple(given)
    if vllm:
        if chosen:
            raise ReplayError("`vllm` and `policy` both choose the policy: give one")
        releases = []
        for version in vllm:
            try:
                found = version_policy(version)
            except ReplayError as exc:
                raise ReplayError(f"`vllm`: {exc}") from None
            release = found.policy
            releases.append(release.name)
            notes.append(
                found.note or f"policy {release.name}: vLLM {version} (vLLM {release.releases})"
            )
        chosen = tuple(releases)
    elif not chosen and results_policy is not None:
        chosen = (results_policy,)
    elif not chosen:
        recorded = recorded_release(source)
        chosen = (DEFAULT_POLICY,) if recorded is None else (recorded[0].name,)
        if recorded is not None:
            notes.append(f"{recorded[1]}; --policy or --vllm overrides")
    if given:
        notes.extend(
            p.alias_note
            for p in map(POLICIES.get, dict.fromkeys(chosen))
            if p and p.alias_note and (alias_notes or not p.stands_for)
        )
    return Chosen(chosen, tuple(notes))


def recorded_release(source: Mapping[str, Any] | None) -> tuple[Policy, str] | None:
    """The release policy of the vLLM that recorded a trace
    (``source.vllm_version``) and the note's words for it; None when the
    trace does not say."""
    recorded = None if source is None else source.get("vllm_version")
    if not isinstance(recorded, str):
        # A generated or imported trace records the release whose stores it
        # holds by its policy (``StoreSettings.as_source``).
        named_policy = None if source is None else source.get("policy")
        if isinstance(named_policy, str) and named_policy in POLICIES:
            policy = POLICIES[named_policy]
            return policy, (
                f"policy {policy.name}: the trace's stores are vLLM {policy.releases}'s "
                "(source.policy)"
            )
        return None
    try:
        found = version_policy(recorded)
    except ReplayError as exc:
        raise ReplayError(
            f"the trace's source.vllm_version: {exc}; choose one with `policy`"
        ) from None
    release = found.policy
    if found.note:
        return release, f"the trace's source.vllm_version: {found.note}"
    return release, (
        f"policy {release.name}: the trace's vLLM {recorded} (source.vllm_version, "
        f"vLLM {release.releases})"
    )


def same_rules(a: str | Policy, b: str | Policy, cache: str | Cache) -> bool:
    """Whether two policies answer alike in ``cache`` (an alias and the
    release it means there); a cache one of them lacks: whether both do."""
    pa, pb = get_policy(a), get_policy(b)
    try:
        return pa.rules(cache) == pb.rules(cache)
    except ConfigError:
        return pa.release(cache).mooncake is None and pb.release(cache).mooncake is None


#: The environment variable that chooses the policy the installed vLLM is
#: checked and answered under (``replay test --policy`` sets the same).
POLICY_ENV = "REPLAY_POLICY"


@dataclass(frozen=True, slots=True)
class VersionPolicy:
    """The policy that models a vLLM version, and the one line that says
    what was assumed ("" for a release a policy models)."""

    policy: Policy
    note: str = ""


_HOW_TO_CHOOSE = f"choose another with --policy or {POLICY_ENV}"


def _development(version: str) -> bool:
    """A build from a source checkout: a ``.devN`` pre-release or a local
    version (``+g<commit>``), as setuptools-scm names one."""
    return ".dev" in version or "+" in version


def version_policy(version: str, chosen: str | None = None) -> VersionPolicy:
    """The one rule from a vLLM version to the policy that models it (every
    caller: the vLLM backend, ``replay run --vllm``, ``replay test``).

    ``chosen`` (``--policy``, ``$REPLAY_POLICY``) wins. A release a policy
    models gets it (``0.25.1``: ``vllm-0.24``). A version past the newest
    modelled release gets the policy of its minor release if one exists
    (``0.34.1.dev3+g...``: ``vllm-0.34``), else the newest policy; so does a
    development build with no release tag (``0.1.dev1+g...``, what a shallow
    clone reports): each with the one line that says so. A release before the
    oldest modelled one, or no version at all, is refused."""
    if chosen is not None:
        policy = get_policy(chosen)
        return VersionPolicy(
            policy,
            f"vLLM {version}: checked as policy {policy.name} (vLLM {policy.releases}), as chosen",
        )
    key = version_key(version)
    oldest, newest = RELEASES[0], RELEASES[-1]
    if key < version_key(oldest.first):
        if _development(version):
            return VersionPolicy(
                newest,
                f"vLLM {version} is a development build with no release tag: assuming policy "
                f"{newest.name} (vLLM {newest.releases}, the newest modelled); {_HOW_TO_CHOOSE}",
            )
        raise ReplayError(
            f"vLLM {version} is older than the oldest modelled release "
            f"{oldest.first}: no policy models it"
        )
    found = oldest
    for policy in RELEASES:
        if version_key(policy.first) <= key:
            found = policy
    if key > version_key(newest.last):
        return VersionPolicy(
            found,
            f"vLLM {version} is newer than vLLM {newest.last}, the newest modelled release: "
            f"assuming policy {found.name} (vLLM {found.releases}); {_HOW_TO_CHOOSE}",
        )
    if _development(version):
        return VersionPolicy(
            found,
            f"vLLM {version} is a development build: assuming policy {found.name} "
            f"(vLLM {found.releases}); {_HOW_TO_CHOOSE}",
        )
    return VersionPolicy(found)


def policy_for_version(version: str) -> Policy:
    """The policy that models vLLM ``version`` (``version_policy``'s, without
    its note)."""
    return version_policy(version).policy
