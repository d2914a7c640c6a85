"""The flag definitions of ``analysis/flags.py`` restated in plain Python,
from a fold of the trace rows and the answers in a results frame (the
hit and each group's load mask), for the checker to be compared against."""

from __future__ import annotations

from typing import Any

import polars as pl

from replay.base.spec import GroupKind, TraceConfig
from replay.rules.coordinator import Cache, build_spec_groups, hit_alignment, partial_hits
from tests.builders import hand_fold

FULL = GroupKind.FULL_ATTENTION
SWA = GroupKind.SLIDING_WINDOW
MAMBA = GroupKind.MAMBA


def _fold(rows: list[dict[str, Any]], num_groups: int) -> dict[int, list[list[bool]]]:
    """Per lookup seq: per group, whether each of its hash units was present."""
    return {
        row.get("seq", i): [[h in keys for h in row["block_hashes"]] for keys in present]
        for i, row, present in hand_fold(rows, num_groups)
    }


def plain_flags(
    rows: list[dict[str, Any]], results: pl.DataFrame, config: TraceConfig, cache: str | Cache
) -> set[tuple[int, str, int | None]]:
    units_at = _fold(rows, config.num_groups)
    hbs = config.hash_block_size
    a = hit_alignment(config, cache)
    partial = partial_hits(config, cache)
    eagle = {g for sg in build_spec_groups(config, cache) if sg.eagle for g in sg.group_ids}
    out: set[tuple[int, str, int | None]] = set()
    for r in results.iter_rows(named=True):
        seq, H, M = r["seq"], r["hit_tokens"], r["max_length"]
        units = units_at[seq]
        n = len(units[0]) if units else 0

        def has(g: int, u: int) -> bool:
            return 0 <= u < n and units[g][u]  # noqa: B023

        fine = [partial and s.kind in (FULL, MAMBA) and s.block_size > hbs for s in config.groups]
        state: dict[int, int] = {}
        for g, s in enumerate(config.groups):
            if s.kind is MAMBA:
                if r["loaded_blocks"][g] == 0:
                    state[g] = 0
                elif fine[g]:
                    state[g] = r["group_hit_tokens"][g]
                else:
                    state[g] = r["mask_blocks"][g] * s.block_size
        attention = [
            r["mask_blocks"][g] * s.block_size
            for g, s in enumerate(config.groups)
            if s.kind is not MAMBA
        ]
        for g, S in state.items():
            if S > H or (attention and min(attention) < S):
                out.add((seq, "mamba_overrun", g))
            if S != H:
                out.add((seq, "mamba_state_mismatch", g))
        if H > M:
            out.add((seq, "hit_beyond_max_length", None))
        if H % a:
            out.add((seq, "hit_misaligned", None))
        for g, s in enumerate(config.groups):
            bs = s.block_size
            k = bs // hbs
            end = state.get(g, H)
            mask, loaded = r["mask_blocks"][g], r["loaded_blocks"][g]
            bad = False
            for j in range(mask - loaded, mask):
                if j * bs < end < (j + 1) * bs:
                    first = (end + hbs - 1) // hbs - 1
                    if s.kind is MAMBA:
                        bad |= not has(g, first)
                    else:
                        bad |= not any(has(g, u) for u in range(first, (j + 1) * k))
                else:
                    bad |= not has(g, (j + 1) * k - 1)
            if not state and mask * bs < H:
                bad = True
            if bad:
                out.add((seq, "missing_block", g))
            if H > 0 and g in eagle and s.kind in (FULL, SWA):
                unit = H // hbs if fine[g] else (H // bs + 1) * k - 1
                if not has(g, unit):
                    out.add((seq, "eagle_not_dropped", g))
        observed = r["observed_hit_tokens"]
        if observed is not None and observed != H:
            out.add((seq, "observed_mismatch", None))
    return out
