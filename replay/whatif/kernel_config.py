"""What the what-if's compiled pools are given: the codes, the scalar
parameters (``P_*``) and the per-group store arrays of a configuration, with
the lookup's tables of the compiled fixed point (``replay.rules.compiled``),
and which configurations they cover (``supported``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from replay.base.spec import GroupKind, TraceConfig
from replay.rules.compiled import LookupTables, lookup_tables, tables
from replay.rules.coordinator import get_policy
from replay.rules.coordinator.cache import ENGINE
from replay.rules.coordinator.hybrid import hit_alignment, partial_hits
from replay.rules.coordinator.stores import STORES_033, policy_stores
from replay.rules.eviction.codes import EVICTION_CODES
from replay.rules.store_rules import StoreRules, StoreSettings

FA, SWA, MAMBA = tables.FA, tables.SWA, tables.MAMBA
_KINDS = {GroupKind.FULL_ATTENTION: FA, GroupKind.SLIDING_WINDOW: SWA, GroupKind.MAMBA: MAMBA}
#: Per-request results: not scheduled (the prompt never fits), preempted.
NOT_ADMITTED, PREEMPTED = -1, -2
#: ``run_gpu``'s return when its ``control`` asked it to stop.
STOPPED = -2
#: Columns of the per-request facts (``run_gpu``'s ``facts``): the rows of
#: the compiled fixed point (``replay.rules.compiled.tables``'s ``O_*``): the
#: lookup's answer, the tokens the attention KV covers, then per group its
#: mask blocks, resumed Mamba state, first absent loaded block and whether
#: the EAGLE drop's unit is present (-1: None), as ``replay.rules.facts`` says.
FACT_HIT, FACT_ATTENTION = tables.O_HIT, tables.O_ATTENTION
FACT_GROUPS, FACT_WIDTH = tables.O_GROUPS, tables.O_WIDTH

# Scalar parameters (``params``), by index.
(
    P_HBS,
    P_ALIGN,
    P_A,
    P_BUDGET,
    P_RETENTION,
    P_HAS_MAMBA,
    P_UNITARY,
    P_USES_JUNCTION,
    P_ANY_EAGLE,
    P_MAX_MODEL_LEN,
    P_EVICTION,
    P_CAPACITY,
    P_NUM_KEYS,
    P_HAS_ATTENTION,
    P_LOOKAHEAD,
    P_LEN,
) = range(16)


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """The arrays a configuration compiles to (see ``compile_config``)."""

    params: np.ndarray[Any, np.dtype[np.int64]]
    #: per group: kind, block size, engine window, extra retained tokens,
    #: engine EAGLE (store rules)
    groups: np.ndarray[Any, np.dtype[np.int64]]
    #: the lookup's tables (the compiled fixed point's, in the cache simulated)
    lookup: LookupTables

    def arrays(self) -> tuple[np.ndarray[Any, np.dtype[np.int64]], ...]:
        """The arrays in the order the runs take them."""
        return (self.params, self.groups, *self.lookup.arrays())


def supported(config: TraceConfig, cache: str, policy: str | None = None) -> str | None:
    """Why the kernel cannot run this configuration, or None when it can.
    It models vLLM 0.33's engine rules, with or without the EAGLE drop once
    per candidate and Mamba's peek margin (the emulated policies); another
    release's engine runs the Python model."""
    if cache != "gpu":
        return "the compiled model covers the gpu cache"
    if policy is not None:
        rules = get_policy(policy).rules("gpu")
        if rules.but(verify_eagle_once=True, mamba_peek_margin=False) != ENGINE:
            return f"policy {policy}'s engine rules"
        if policy_stores(policy) != STORES_033:
            return f"policy {policy}'s store rules"
    return shape_supported(config, cache, _KINDS)


def shape_supported(config: TraceConfig, cache: str, kinds: Mapping[GroupKind, int]) -> str | None:
    """Why a compiled kernel over ``kinds`` of groups cannot run this
    configuration's shape in ``cache``, or None: every group's block one hash
    unit, hits aligned to whole blocks, no partial hash hits."""
    if partial_hits(config, cache):
        return "partial hash hits"
    for g in config.groups:
        if g.kind not in kinds:
            return f"{g.kind.value} groups"
        if g.block_size != config.hash_block_size:
            return "blocks larger than the hash unit"
    align = hit_alignment(config, cache)
    if any(align < g.block_size or align % g.block_size for g in config.groups):
        return "a hit alignment below a block size"
    if config.scheduler_block_size % config.hash_block_size:
        return "a scheduler block that is not whole blocks"
    return None


def compile_config(
    config: TraceConfig,
    policy: str,
    store_settings: StoreSettings,
    eviction: str,
    capacity: int,
    num_keys: int,
    max_model_len: int = 1 << 20,
) -> KernelConfig:
    lookup = lookup_tables(config, policy, "gpu")
    rules = StoreRules(config, store_settings)
    params = np.zeros(P_LEN, dtype=np.int64)
    params[P_HBS] = config.hash_block_size
    params[P_ALIGN] = lookup.alignment
    params[P_A] = rules.alignment
    params[P_BUDGET] = store_settings.max_num_batched_tokens
    r = store_settings.retention_interval
    params[P_RETENTION] = -1 if r is None else r
    params[P_HAS_MAMBA] = rules.has_mamba
    params[P_UNITARY] = rules.unitary
    params[P_USES_JUNCTION] = rules.uses_junction
    params[P_ANY_EAGLE] = rules.engine_any_eagle
    params[P_LOOKAHEAD] = rules.lookahead
    params[P_MAX_MODEL_LEN] = max_model_len
    params[P_EVICTION] = EVICTION_CODES[eviction]
    params[P_CAPACITY] = capacity
    params[P_NUM_KEYS] = num_keys
    params[P_HAS_ATTENTION] = any(g.kind is not GroupKind.MAMBA for g in config.groups)
    groups = np.array(
        [
            [
                _KINDS[g.kind],
                g.block_size,
                g.sliding_window or 0,
                g.extra_retained_tokens,
                rules.groups[gid].engine_eagle,
            ]
            for gid, g in enumerate(config.groups)
        ],
        dtype=np.int64,
    )
    return KernelConfig(params=params, groups=groups, lookup=lookup)
