"""What a configuration compiles to: the reference coordinator's decisions
for one policy in one cache, as small integer tables the compiled fixed
point (``replay.rules.compiled.lookup``) reads.

Nothing is decided here: every value is read off the Python reference
(``replay.rules.coordinator.Coordinator`` and ``replay.rules.facts.FactRules``),
so a release's rules reach the compiled path as the same field values
(``replay.rules.coordinator.cache.Cache``) and never as a second copy of a
rule. The tables:

- ``params``: the scalars (``L_*``): the hash unit, the hit alignment, and
  each ``Cache`` field the fixed point branches on;
- ``specs``: one row per spec group in lookup order (``SP_*``): its kind,
  block, the window it is looked up by (the mirror's widened one), the
  chunk, whether it drops for EAGLE, its peek margin, its members;
- ``members``: ``members[s, g]`` is 1 when KV-cache group ``g`` is in spec
  group ``s``;
- ``groups``: one row per KV-cache group (``G_*``): its kind, block, spec
  group, whether it probes inside blocks, whether it is an EAGLE attention
  group (the facts' ``eagle_unit_present``), and the blocks the Mooncake
  store worker asks about (``AskedBlocks``: per, need, shift).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from replay.base.spec import GroupKind, TraceConfig
from replay.rules.coordinator import Coordinator, Policy
from replay.rules.coordinator.cache import Cache
from replay.rules.coordinator.hybrid import AskedBlocks
from replay.rules.coordinator.kinds import get_coordinator
from replay.rules.facts import FactRules

#: Group kinds, as the kernels number them.
FA, SWA, MAMBA, CHUNKED = 0, 1, 2, 3
KIND_CODES = {
    GroupKind.FULL_ATTENTION: FA,
    GroupKind.SLIDING_WINDOW: SWA,
    GroupKind.MAMBA: MAMBA,
    GroupKind.CHUNKED_LOCAL_ATTENTION: CHUNKED,
}

# The scalars, by index.
(
    L_HBS,
    L_ALIGN,
    L_SINGLE_CALL,
    L_SINGLE_PASS,
    L_VERIFY_ONCE,
    L_MAMBA_PEEK,
    L_PEEK_CAP_HASHED,
    L_FULL_REUSE_OWN,
    L_TRIM_EVERY_FULL,
    L_TRIM_CEIL,
    L_ALIGN_BEFORE_POP,
    L_WORKER,
    L_ASK_ALL,
    L_LEN,
) = range(14)

# Columns of a spec group's row.
SP_KIND, SP_BS, SP_WINDOW, SP_CHUNK, SP_EAGLE, SP_MARGIN, SP_MEMBERS, SP_FIRST, SP_LEN = range(9)

# Columns of a KV-cache group's row.
(
    G_KIND,
    G_BS,
    G_SPEC,
    G_FINE,
    G_EAGLE_ATTENTION,
    G_ASK_PER,
    G_ASK_NEED,
    G_ASK_SHIFT,
    G_LEN,
) = range(9)

#: Columns of one lookup's answer and facts (a row of ``answer``'s ``out``),
#: -1 where the value is None: the hit, the tokens every attention group's
#: loaded KV covers, the verified prefix, the Mamba state; then per group,
#: ``O_WIDTH`` columns from ``O_GROUPS + O_WIDTH * g``: its mask blocks, its
#: resumed Mamba state, the first absent loaded block, whether the EAGLE
#: drop's unit is present, its loaded blocks and its own verified hit.
O_HIT, O_ATTENTION, O_VERIFIED, O_STATE, O_GROUPS = range(5)
O_MASK, O_GROUP_STATE, O_ABSENT, O_EAGLE, O_LOADED, O_GROUP_HIT, O_WIDTH = range(7)


def out_width(num_groups: int) -> int:
    """The columns of one lookup's row for ``num_groups`` KV-cache groups."""
    return O_GROUPS + O_WIDTH * num_groups


Int64s = np.ndarray[Any, np.dtype[np.int64]]


@dataclass(frozen=True, slots=True)
class LookupTables:
    """The arrays one configuration, policy and cache compile to."""

    params: Int64s
    specs: Int64s
    members: Int64s
    groups: Int64s
    #: the hit alignment (the results' ``hit_alignment``)
    alignment: int

    def arrays(self) -> tuple[Int64s, Int64s, Int64s, Int64s]:
        """The tables in the order the kernels take them."""
        return self.params, self.specs, self.members, self.groups


def lookup_tables(config: TraceConfig, policy: str | Policy, cache: str | Cache) -> LookupTables:
    """The tables of ``config`` answered under ``policy`` in ``cache``; a
    configuration the release refuses raises as the reference does."""
    coordinator = Coordinator(config, policy, cache)
    rules = coordinator.cache
    facts = FactRules(config, rules)
    spec_groups = coordinator.spec_groups
    params = np.zeros(L_LEN, dtype=np.int64)
    params[L_HBS] = config.hash_block_size
    params[L_ALIGN] = coordinator.alignment
    params[L_SINGLE_CALL] = coordinator.single_call
    params[L_SINGLE_PASS] = coordinator.simple_hybrid and rules.simple_hybrid_single_pass
    params[L_VERIFY_ONCE] = rules.verify_eagle_once
    params[L_MAMBA_PEEK] = rules.mamba_peek_margin
    params[L_PEEK_CAP_HASHED] = rules.peek_cap_hashed
    params[L_FULL_REUSE_OWN] = rules.full_reuse_own_hit
    params[L_TRIM_EVERY_FULL] = rules.trim_every_full
    params[L_TRIM_CEIL] = rules.trim_ceil
    params[L_ALIGN_BEFORE_POP] = rules.sliding_window_align_before_pop
    asked = coordinator.asked
    params[L_WORKER] = asked is not None
    params[L_ASK_ALL] = coordinator.ask_every_unit
    specs = np.zeros((len(spec_groups), SP_LEN), dtype=np.int64)
    members = np.zeros((len(spec_groups), config.num_groups), dtype=np.int64)
    spec_of = {}
    for sg in spec_groups:
        row = specs[sg.index]
        row[SP_KIND] = KIND_CODES[sg.kind]
        row[SP_BS] = sg.spec.block_size
        row[SP_WINDOW] = sg.spec.sliding_window or 0
        row[SP_CHUNK] = sg.spec.attention_chunk_size or sg.spec.block_size
        row[SP_EAGLE] = sg.eagle
        row[SP_MARGIN] = coordinator.margins[sg.index]
        row[SP_MEMBERS] = len(sg.group_ids)
        row[SP_FIRST] = sg.group_ids[0]
        for gid in sg.group_ids:
            members[sg.index, gid] = 1
            spec_of[gid] = sg.index
    groups = np.zeros((config.num_groups, G_LEN), dtype=np.int64)
    for gid, g in enumerate(config.groups):
        ask = asked[gid] if asked is not None else AskedBlocks()
        groups[gid] = (
            KIND_CODES[g.kind],
            g.block_size,
            spec_of[gid],
            facts.fine[gid],
            gid in facts.eagle_attention,
            ask.per,
            ask.need,
            ask.shift,
        )
    return LookupTables(params, specs, members, groups, coordinator.alignment)


#: Where a replay's fold may stop probing a lookup (``probe_stop``): the
#: KV-cache group whose absence ends a hit, its block in hash units, and the
#: units past that block that an answer may still read.
ProbeStop = tuple[int, int, int]


def probe_stop(tables: LookupTables) -> ProbeStop | None:
    """How far a lookup's presence is read, when full attention is looked
    up first (``build_spec_groups``): its hit ends at the first absent block
    ``a`` of spec group 0 (a block is present when its last hash unit is),
    so every later finder's bound is at most ``a`` blocks plus its EAGLE
    peek margin, and every fact reads at most a block past a finder's
    answer. Units more than a margin and two blocks past ``a`` are never
    read: the fold need not probe them (about a quarter of a day's lookup
    probes, most of them misses). Any member of spec group 0 stands for it:
    the merged presence's first absent block is at or before the member's.
    None when spec group 0 is not full attention."""
    specs, groups = tables.specs, tables.groups
    if specs.shape[0] == 0 or specs[0, SP_KIND] != FA:
        return None
    hbs = int(tables.params[L_HBS])
    widest = max(int(specs[:, SP_BS].max()), int(groups[:, G_BS].max())) // hbs
    margin = -(-int(specs[:, SP_MARGIN].max()) // hbs)
    return int(specs[0, SP_FIRST]), int(specs[0, SP_BS]) // hbs, margin + 2 * widest + 1


def supported(coordinator: str) -> str | None:
    """Why lookups answered by ``coordinator`` cannot run compiled, or None.
    Every release's rules, both caches and every group kind compile (the
    tables above carry each ``Cache`` field the fixed point reads); only
    another coordinator than the reference (vLLM's own, asked by hash)
    answers in Python."""
    if not get_coordinator(coordinator).compiled:
        return f"the {coordinator} coordinator answers through its own code"
    return None
