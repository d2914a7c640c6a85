"""Flags: what is wrong with a lookup's answer, each with the numbers that prove it.

The definitions are stated here once, as ``FlagChecker.check``: a pure
function of one lookup's answer (the hit and every group's load mask, the
results columns) and of the store that lookup saw (``present[g][u]``: group
``g`` held the key of the request's hash unit ``u``). The replay calls it for
every lookup in the same pass, so a results file carries its flags
(``flags``, and ``flag_details`` with the numbers); ``recompute_flags``
runs it again over a results file that kept ``unit_present``. The checks
never ask the coordinator how it decided, so they also catch a wrong
coordinator, vLLM's included.

Definitions (``H`` the hit, ``M`` the lookup's max_length, ``a`` the hit
alignment of the cache that answered, ``S`` a Mamba group's resumed state
position, ``A`` the tokens every attention group's loaded KV covers: the
least ``mask_blocks x block_size`` over the non-Mamba groups):

- ``mamba_overrun``: ``S > H`` or ``S > A``: the request resumes recurrent
  state for tokens whose attention KV it does not load (the #43559 class:
  silent corruption).
- ``mamba_state_mismatch``: ``S != H``.
- ``hit_beyond_max_length``: ``H > M``.
- ``hit_misaligned``: ``H % a != 0``.
- ``missing_block``: a block of a group's load mask is absent at that
  ``seq`` (each loaded block's key: its last hash unit; for a block the hit
  or the Mamba state ends inside, some present unit of that block at or
  past the end; the Mamba state's own unit; anything past the request's
  hashes), or, in a model without Mamba groups (where ``mamba_overrun``
  reports it), an attention group's mask stops short of ``H``.
- ``eagle_not_dropped``: an EAGLE full-attention or sliding-window group
  (one that drops for EAGLE in this cache) and ``H > 0``, but the unit the
  drop would have recomputed (the block at ``H``, or the hash unit at ``H``
  when the group probes inside blocks) is absent: the hit reached the
  group's whole match, so nothing is recomputed and EAGLE's drafter gets no
  hidden states. The resumed state is consistent; the cost is acceptance.
- ``observed_mismatch``: the production-reported hit differs from ``H``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from replay.base.errors import ReplayError
from replay.base.spec import GroupKind, TraceConfig
from replay.rules.coordinator import (
    DEFAULT_CACHE,
    Cache,
    LookupOutcome,
    build_spec_groups,
    get_cache,
    hit_alignment,
    partial_hits,
)

FLAG_KINDS = (
    "mamba_overrun",
    "mamba_state_mismatch",
    "hit_beyond_max_length",
    "hit_misaligned",
    "missing_block",
    "eagle_not_dropped",
    "observed_mismatch",
)

FLAGS_SCHEMA: dict[str, Any] = {
    "seq": pl.Int64,
    "request_id": pl.String,
    "flag": pl.String,
    "group_id": pl.Int32,
    "hit_tokens": pl.Int64,
    "max_length": pl.Int64,
    "actual": pl.Int64,
    "expected": pl.Int64,
    "detail": pl.String,
}


def empty_flags() -> pl.DataFrame:
    return pl.DataFrame(schema=FLAGS_SCHEMA)


@dataclass(frozen=True, slots=True)
class Flag:
    flag: str
    group_id: int | None
    actual: int | None
    expected: int | None
    detail: str


class FlagChecker:
    """The flag definitions for one configuration and cache."""

    def __init__(self, config: TraceConfig, cache: str | Cache = DEFAULT_CACHE) -> None:
        self.config = config
        self.cache = get_cache(cache)
        self.alignment = hit_alignment(config, self.cache)
        partial = partial_hits(config, self.cache)
        hbs = config.hash_block_size
        # Groups that probe hash units inside a block (vLLM's fine-grained
        # lookups): full attention and Mamba with partial hits and big blocks.
        self._fine = tuple(
            partial
            and g.kind in (GroupKind.FULL_ATTENTION, GroupKind.MAMBA)
            and g.block_size > hbs
            and g.block_size % self.alignment == 0
            for g in config.groups
        )
        eagle = {
            gid for sg in build_spec_groups(config, self.cache) if sg.eagle for gid in sg.group_ids
        }
        self._eagle_attention = tuple(
            gid
            for gid, g in enumerate(config.groups)
            if gid in eagle and g.kind in (GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW)
        )
        self._attention = tuple(
            gid for gid, g in enumerate(config.groups) if g.kind is not GroupKind.MAMBA
        )
        self._mamba = tuple(gid for gid, g in enumerate(config.groups) if g.kind is GroupKind.MAMBA)

    def state_tokens(
        self, gid: int, mask_blocks: int, loaded_blocks: int, state: int | None
    ) -> int:
        """Where a Mamba group resumes: the end of its one loaded block, or
        the exact hash unit when it probes inside blocks."""
        if loaded_blocks == 0:
            return 0
        if self._fine[gid] and state is not None:
            return state
        return mask_blocks * self.config.groups[gid].block_size

    def check(
        self,
        present: Sequence[bytes],
        max_length: int,
        hit: int,
        masks: Sequence[tuple[int, int]],
        states: Sequence[int | None],
        observed: int | None,
    ) -> list[Flag]:
        """Every flag of one lookup, in ``FLAG_KINDS`` order. ``masks[g]`` is
        group ``g``'s ``(mask_blocks, loaded_blocks)``; ``states[g]`` its
        reported Mamba state position (None elsewhere)."""
        groups = self.config.groups
        out: list[Flag] = []
        resumed = {
            gid: self.state_tokens(gid, masks[gid][0], masks[gid][1], states[gid])
            for gid in self._mamba
        }
        covered = min((masks[g][0] * groups[g].block_size for g in self._attention), default=None)
        for gid, s in resumed.items():
            bound = hit if covered is None else min(hit, covered)
            if s > bound:
                what = (
                    f"the hit {hit}"
                    if covered is None or hit <= covered
                    else f"the attention KV loaded for {covered} tokens"
                )
                out.append(
                    Flag(
                        "mamba_overrun",
                        gid,
                        s,
                        bound,
                        f"group {gid} resumes Mamba state at {s}, {s - bound} tokens past {what}",
                    )
                )
        for gid, s in resumed.items():
            if s != hit:
                out.append(
                    Flag(
                        "mamba_state_mismatch",
                        gid,
                        s,
                        hit,
                        f"group {gid} resumes Mamba state at {s} but the hit is {hit}",
                    )
                )
        if hit > max_length:
            out.append(
                Flag(
                    "hit_beyond_max_length",
                    None,
                    hit,
                    max_length,
                    f"hit {hit} > max_length {max_length}",
                )
            )
        a = self.alignment
        if hit % a:
            out.append(
                Flag(
                    "hit_misaligned",
                    None,
                    hit,
                    hit - hit % a,
                    f"hit {hit} is not a multiple of {a}",
                )
            )
        for gid, (mask_blocks, loaded) in enumerate(masks):
            end = resumed.get(gid, hit)
            bs = groups[gid].block_size
            missing = self._first_missing(gid, present[gid], mask_blocks - loaded, mask_blocks, end)
            where = "is absent"
            if missing is None and not resumed and mask_blocks * bs < hit:
                # The group's mask stops short of the hit: the tokens between
                # are neither loaded nor recomputed (with a Mamba group this
                # is what ``mamba_overrun`` reports).
                missing, where = mask_blocks, "is not in the group's load mask"
            if missing is not None:
                out.append(
                    Flag(
                        "missing_block",
                        gid,
                        missing,
                        None,
                        f"group {gid} ({groups[gid].kind.value}) block {missing} "
                        f"(tokens {missing * bs}..{(missing + 1) * bs}) {where} but the hit "
                        f"of {hit} relies on it",
                    )
                )
        if hit > 0:
            hbs = self.config.hash_block_size
            for gid in self._eagle_attention:
                bs = groups[gid].block_size
                unit = hit // hbs if self._fine[gid] else (hit // bs + 1) * (bs // hbs) - 1
                p = present[gid]
                if unit >= len(p) or not p[unit]:
                    out.append(
                        Flag(
                            "eagle_not_dropped",
                            gid,
                            hit,
                            None,
                            f"hit {hit} reaches group {gid}'s whole match: EAGLE recomputes "
                            "nothing past it",
                        )
                    )
        if observed is not None and observed != hit:
            out.append(
                Flag(
                    "observed_mismatch",
                    None,
                    hit,
                    observed,
                    f"replayed hit {hit} but production reported {observed}",
                )
            )
        return out

    def _first_missing(
        self, gid: int, present: bytes, first: int, stop: int, end: int
    ) -> int | None:
        """The first block in ``[first, stop)`` of the group's mask whose key
        is absent. A block that ``end`` (the hit, or the Mamba state) lands
        inside is served by any present unit of it at or past ``end``: the
        tail block's KV is append-only, so a longer match still covers it."""
        if stop <= first:
            return None
        hbs = self.config.hash_block_size
        bs = self.config.groups[gid].block_size
        k = bs // hbs
        # Whole blocks are keyed by their last unit; scanning that view with
        # ``find`` keeps a 750-block lookup at C speed.
        view = present if k == 1 else present[k - 1 :: k]
        tail = end // bs if end % bs else -1  # the block ``end`` lands inside

        def first_absent(lo: int, hi: int) -> int | None:
            if lo >= hi:
                return None
            miss = view.find(0, lo, min(hi, len(view)))
            if miss >= 0:
                return miss
            # Blocks past the request's own hashes cannot be present.
            return max(lo, len(view)) if hi > len(view) else None

        if not first <= tail < stop:
            return first_absent(first, stop)
        before = first_absent(first, tail)
        if before is not None:
            return before
        lo = -(-end // hbs) - 1  # the unit that ends at or past ``end``
        if self.config.groups[gid].kind is GroupKind.MAMBA:
            ok = lo < len(present) and present[lo] == 1
        else:
            ok = present.find(1, lo, min((tail + 1) * k, len(present))) >= 0
        return first_absent(tail + 1, stop) if ok else tail

    def check_outcome(
        self,
        present: Sequence[bytes],
        max_length: int,
        outcome: LookupOutcome,
        observed: int | None,
    ) -> list[Flag]:
        return self.check(
            present,
            max_length,
            outcome.hit_tokens,
            [(g.mask_blocks, g.loaded_blocks) for g in outcome.groups],
            [g.state_tokens for g in outcome.groups],
            observed,
        )


def flag_lines(flags: Sequence[Flag]) -> str:
    """A lookup's flags as ``replay explain`` prints them under its table."""
    if not flags:
        return "flags: none"
    return "\n".join(["flags:", *(f"  {f.flag}: {f.detail}" for f in flags)])


def flag_names(flags: Sequence[Flag]) -> list[str]:
    """The ``flags`` column value: each kind once, in ``FLAG_KINDS`` order."""
    return list(dict.fromkeys(f.flag for f in flags))


def flag_rows(flags: Sequence[Flag]) -> list[dict[str, Any]]:
    """The ``flag_details`` column value."""
    return [
        {
            "flag": f.flag,
            "group_id": f.group_id,
            "actual": f.actual,
            "expected": f.expected,
            "detail": f.detail,
        }
        for f in flags
    ]


def flags_table(results: pl.DataFrame) -> pl.DataFrame:
    """One row per (lookup, flag) from a results frame's ``flag_details``."""
    if results.height == 0 or "flag_details" not in results.columns:
        return empty_flags()
    exploded = (
        results.select("seq", "request_id", "hit_tokens", "max_length", "flag_details")
        .explode("flag_details")
        .drop_nulls("flag_details")
        .unnest("flag_details")
    )
    if exploded.height == 0:
        return empty_flags()
    return exploded.select(pl.col(name).cast(dtype) for name, dtype in FLAGS_SCHEMA.items())


def recompute_flags(
    results: pl.DataFrame, config: TraceConfig, cache: str | Cache = DEFAULT_CACHE
) -> pl.DataFrame:
    """The flags of a results frame recomputed from its answers and its
    ``unit_present`` (the store state each lookup saw), whoever wrote it."""
    if results.height == 0:
        return empty_flags()
    if "unit_present" not in results.columns:
        raise ReplayError(
            "results have no 'unit_present' column (the store state each lookup saw): "
            "re-run `replay run --unit-present` to produce it"
        )
    checker = FlagChecker(config, cache)
    rows: list[dict[str, Any]] = []
    cols = results.select(
        "seq",
        "request_id",
        "hit_tokens",
        "max_length",
        "mask_blocks",
        "loaded_blocks",
        "group_hit_tokens",
        "observed_hit_tokens",
        "unit_present",
    )
    for seq, rid, hit, max_length, mask, loaded, ghits, observed, units in cols.iter_rows():
        present = [bytes(bytearray(u)) for u in units]
        states = [
            ghits[g] if config.groups[g].kind is GroupKind.MAMBA else None
            for g in range(config.num_groups)
        ]
        for f in checker.check(
            present, max_length, hit, list(zip(mask, loaded, strict=True)), states, observed
        ):
            rows.append(
                {
                    "seq": seq,
                    "request_id": rid,
                    "flag": f.flag,
                    "group_id": f.group_id,
                    "hit_tokens": hit,
                    "max_length": max_length,
                    "actual": f.actual,
                    "expected": f.expected,
                    "detail": f.detail,
                }
            )
    if not rows:
        return empty_flags()
    return pl.DataFrame(rows, schema=FLAGS_SCHEMA)


def with_flag_column(results: pl.DataFrame, flags: pl.DataFrame) -> pl.DataFrame:
    per = flags.group_by("seq", maintain_order=True).agg(
        pl.col("flag").unique(maintain_order=True).alias("_flags")
    )
    return (
        results.join(per, on="seq", how="left")
        .with_columns(
            pl.col("_flags").fill_null(pl.lit([], dtype=pl.List(pl.String))).alias("flags")
        )
        .drop("_flags")
    )


def flag_counts(flags: pl.DataFrame) -> dict[str, int]:
    """Lookups flagged, per flag kind."""
    if flags.height == 0:
        return {}
    counts = flags.group_by("flag").agg(pl.col("seq").n_unique().alias("n"))
    return {str(f): int(n) for f, n in counts.sort("flag").iter_rows()}


def flag_examples(flags: pl.DataFrame, limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` flagged rows of each kind, as dicts with a ``text`` line."""
    rows: list[dict[str, Any]] = []
    for name in FLAG_KINDS:
        part = flags.filter(pl.col("flag") == name).head(limit)
        for r in part.iter_rows(named=True):
            r["text"] = f"{r['flag']}: request {r['request_id']} seq {r['seq']}: {r['detail']}"
            rows.append(r)
    return rows


def results_flags(
    results: pl.DataFrame, config: TraceConfig, cache: str | Cache = DEFAULT_CACHE
) -> pl.DataFrame:
    """The flag table of a results frame: its own ``flag_details``; else
    recomputed from its ``unit_present``; else (a writer that kept only the
    names) one row per name in ``flags``, with no numbers."""
    if "flag_details" in results.columns:
        return flags_table(results)
    if "unit_present" in results.columns:
        return recompute_flags(results, config, cache)
    if "flags" not in results.columns or results.height == 0:
        return empty_flags()
    return (
        results.select(
            "seq", "request_id", "hit_tokens", "max_length", pl.col("flags").alias("flag")
        )
        .explode("flag")
        .drop_nulls("flag")
        .select(
            pl.col(name).cast(dtype)
            if name in ("seq", "request_id", "flag", "hit_tokens", "max_length")
            else pl.lit(None, dtype).alias(name)
            for name, dtype in FLAGS_SCHEMA.items()
        )
    )
