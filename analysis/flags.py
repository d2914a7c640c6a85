"""Flags: one row per (lookup, flag), each with the numbers that prove it.

The checks look at the coordinator's *answer* (the results file) and the
store at each lookup's ``seq`` (the results' ``unit_present``: whether each
group held a key for each of the lookup's hash units, recorded by the replay's
fold before the coordinator ran); they never ask the coordinator how it
decided, so they also catch a wrong coordinator, vLLM's included.

Definitions (``H`` the hit, ``M`` the lookup's max_length, ``S`` a Mamba
group's resumed state position, ``a`` the hit alignment):

- ``hit_beyond_max_length``: ``H > M``.
- ``hit_misaligned``: ``H % a != 0``.
- ``mamba_state_mismatch``: ``S != H`` (the request would resume recurrent
  state for other tokens than the ones it skips).
- ``mamba_overrun``: ``S > V``, where ``V`` is the attention-verified prefix:
  the minimum over non-Mamba groups of the longest aligned prefix the store
  lets that group serve. Full attention: the present blocks from the left
  (and, with partial hits, the present interior hash units of the next
  block), within ``M`` (with EAGLE: within the request's hashes, one block or
  unit past ``M`` at most), minus the EAGLE drop. Sliding window: the largest
  aligned ``P <= M`` whose window blocks before ``P`` are present, with EAGLE
  also the block at ``P``. Chunked local: the present blocks from the start
  of ``M``'s chunk. The #43559 class.
- ``missing_block``: a block the hit relies on is absent at that ``seq``:
  full attention below ``H`` (for a hit inside a block, some present hash
  unit of that block at or past ``H``), the sliding window before ``H``, the chunk's
  blocks before ``H``, the Mamba state at ``S``.
- ``eagle_not_dropped``: EAGLE is on for a full-attention group and ``H > 0``
  covers the group's whole present prefix (nothing left to recompute).
- ``observed_mismatch``: the production-reported hit differs from ``H``.
"""

from __future__ import annotations

import os
from typing import Any

import polars as pl

from replay.coordinator import build_spec_groups
from replay.errors import ReplayError
from replay.spec import GroupKind, GroupSpec, TraceConfig

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


def _cdiv(a: pl.Expr, b: int) -> pl.Expr:
    return (a + (b - 1)) // b


def presence(results: pl.DataFrame, gid: int) -> pl.DataFrame:
    """(seq, u, present) for every hash unit of every lookup, for group ``gid``,
    from the results' ``unit_present`` (the store state each lookup saw)."""
    return (
        results.select("seq", pl.col("unit_present").list.get(gid).alias("present"))
        .with_columns(pl.int_ranges(0, pl.col("present").list.len(), dtype=pl.Int64).alias("u"))
        .explode("present", "u")
        .drop_nulls("u")
    )


def _fine(config: TraceConfig, spec: GroupSpec) -> bool:
    return (
        config.enable_partial_hash_hits
        and spec.kind in (GroupKind.FULL_ATTENTION, GroupKind.MAMBA)
        and spec.block_size > config.hash_block_size
    )


def _group_facts(
    config: TraceConfig, gid: int, eagle: bool, pres: pl.DataFrame, lk: pl.DataFrame
) -> pl.DataFrame:
    """Per lookup: the group's verified prefix ``V`` (and for full attention
    its covered prefix ``C``), and the first block the hit relies on that is
    absent (``missing``)."""
    spec = config.groups[gid]
    hbs, bs, align = config.hash_block_size, spec.block_size, config.alignment
    k = bs // hbs
    blocks = pres.filter((pl.col("u") + 1) % k == 0).with_columns(
        ((pl.col("u") + 1) // k - 1).alias("j")
    )
    lk = lk.with_columns((pl.col("n_units") // k).alias("n_blocks"))
    fine = _fine(config, spec)

    if spec.kind is GroupKind.FULL_ATTENTION:
        drop = min(align, bs) if eagle else 0
        margin = (hbs if fine else bs) if eagle else 0
        cap = (
            pl.min_horizontal(pl.col("max_length") + margin, pl.col("n_units") * hbs)
            if eagle
            else pl.col("max_length")
        )
        lk = lk.with_columns(cap.alias("cap"))
        first_miss = (
            blocks.join(lk.select("seq", "cap"), on="seq")
            .filter(~pl.col("present") & (pl.col("j") < pl.col("cap") // bs))
            .group_by("seq")
            .agg(pl.col("j").min().alias("first_miss"))
        )
        lk = lk.join(first_miss, on="seq", how="left").with_columns(
            pl.coalesce(
                "first_miss", pl.min_horizontal(pl.col("cap") // bs, pl.col("n_blocks"))
            ).alias("run")
        )
        cover = pl.col("run") * bs
        if fine:
            ext = (
                pres.join(lk.select("seq", "run", "cap", "n_units"), on="seq")
                .filter(
                    pl.col("present")
                    & (pl.col("u") >= pl.col("run") * k)
                    & (
                        pl.col("u")
                        < pl.min_horizontal(
                            pl.col("run") * k + k - 1, pl.col("cap") // hbs, pl.col("n_units")
                        )
                    )
                )
                .group_by("seq")
                .agg(((pl.col("u").max() + 1) * hbs).alias("ext"))
            )
            lk = lk.join(ext, on="seq", how="left")
            cover = pl.coalesce("ext", cover)
        lk = lk.with_columns(cover.alias("C"))
        verified = pl.when(pl.col("C") > 0).then(pl.col("C") - drop).otherwise(0)
        lk = lk.with_columns((verified - verified % align).alias("V"))
        # Relied on: every whole block below H, and the unit at H when H ends inside a block.
        need_lo, need_hi = pl.lit(0), pl.col("hit_tokens") // bs
        unit_at_hit = fine
    elif spec.kind is GroupKind.SLIDING_WINDOW:
        window = spec.coverage_window or 0
        need = -(-(window - 1) // bs)
        # Present run ending at block j (inclusive), restarting after each miss.
        runs = (
            blocks.sort("seq", "j")
            .with_columns(
                pl.when(~pl.col("present"))
                .then(pl.col("j"))
                .otherwise(None)
                .forward_fill()
                .over("seq")
                .alias("last_miss")
            )
            .with_columns((pl.col("j") - pl.col("last_miss").fill_null(-1)).alias("run"))
        )
        # P = (r + 1) * bs is served when the window's blocks before it are present
        # (those below block 0 do not exist); with EAGLE the block at P too.
        shift = 1 if eagle else 0
        cand = (
            runs.with_columns(((pl.col("j") + 1 - shift) * bs).alias("P"))
            .join(lk.select("seq", "max_length"), on="seq")
            .filter(
                (pl.col("P") <= pl.col("max_length"))
                & (pl.col("j") < pl.col("max_length") // bs + shift)
                & (pl.col("P") % align == 0)
                & (pl.col("run") >= pl.min_horizontal(pl.lit(need + shift), pl.col("j") + 1))
                & (pl.col("P") >= 0)
            )
        )
        best = cand.group_by("seq").agg(pl.col("P").max().alias("V"))
        lk = lk.join(best, on="seq", how="left").with_columns(
            pl.col("V").fill_null(0), pl.lit(None, pl.Int64).alias("C")
        )
        need_lo = pl.max_horizontal(pl.col("hit_tokens") // bs - need, pl.lit(0))
        need_hi = pl.col("hit_tokens") // bs
        unit_at_hit = False
    elif spec.kind is GroupKind.CHUNKED_LOCAL_ATTENTION:
        chunk = spec.attention_chunk_size or bs
        start = (pl.col("max_length") // chunk * chunk) // bs
        lk = lk.with_columns(start.alias("start"))
        first_miss = (
            blocks.join(lk.select("seq", "start", "max_length"), on="seq")
            .filter(
                ~pl.col("present")
                & (pl.col("j") >= pl.col("start"))
                & (pl.col("j") < pl.col("max_length") // bs)
            )
            .group_by("seq")
            .agg(pl.col("j").min().alias("first_miss"))
        )
        lk = lk.join(first_miss, on="seq", how="left").with_columns(
            (pl.coalesce("first_miss", pl.col("max_length") // bs) * bs).alias("V"),
            pl.lit(None, pl.Int64).alias("C"),
        )
        need_lo, need_hi = pl.col("start"), pl.col("hit_tokens") // bs
        unit_at_hit = False
    else:  # Mamba: no verified prefix of its own; relies on its state block.
        lk = lk.with_columns(pl.lit(None, pl.Int64).alias("V"), pl.lit(None, pl.Int64).alias("C"))
        state = pl.col("state")
        if fine:
            lo = state // hbs - 1
            missing = (
                pres.join(lk.select("seq", "state"), on="seq")
                .filter(
                    (pl.col("state") > 0)
                    & (pl.col("u") == pl.col("state") // hbs - 1)
                    & ~pl.col("present")
                )
                .select("seq", (pl.col("u") // k).alias("missing"))
            )
        else:
            lo = state // bs - 1
            missing = (
                blocks.join(lk.select("seq", "state"), on="seq")
                .filter(
                    (pl.col("state") > 0)
                    & (pl.col("j") == pl.col("state") // bs - 1)
                    & ~pl.col("present")
                )
                .select("seq", pl.col("j").alias("missing"))
            )
        del lo
        # A state position past the request's own hashes cannot be present.
        beyond = lk.filter(pl.col("state") > pl.col("n_units") * hbs).select(
            "seq", (pl.col("state") // bs - 1).alias("missing")
        )
        missing = (
            pl.concat([missing, beyond], how="vertical_relaxed")
            .group_by("seq")
            .agg(pl.col("missing").min())
        )
        return lk.join(missing, on="seq", how="left").select("seq", "V", "C", "missing")

    rel = blocks.join(
        lk.with_columns(need_lo.alias("lo"), need_hi.alias("hi")).select("seq", "lo", "hi"),
        on="seq",
    )
    missing = rel.filter(
        (pl.col("j") >= pl.col("lo")) & (pl.col("j") < pl.col("hi")) & ~pl.col("present")
    ).select("seq", pl.col("j").alias("missing"))
    if unit_at_hit:
        # A hit ending inside block b relies on b's KV reaching it: some present
        # hash unit of b at or past the hit (the tail block's KV is append-only,
        # so a longer match still covers a hit the EAGLE drop shortened).
        tail_need = lk.filter(pl.col("hit_tokens") % bs != 0).select("seq", "hit_tokens")
        covered = (
            pres.join(tail_need, on="seq")
            .filter(
                pl.col("present")
                & (pl.col("u") >= pl.col("hit_tokens") // hbs - 1)
                & (pl.col("u") < (pl.col("hit_tokens") // bs + 1) * k)
            )
            .select("seq")
            .unique()
        )
        tail = tail_need.join(covered, on="seq", how="anti").select(
            "seq", (pl.col("hit_tokens") // bs).alias("missing")
        )
        missing = pl.concat([missing, tail], how="vertical_relaxed")
    # Blocks the hit relies on beyond the request's own hashes cannot be present.
    beyond = lk.filter(_cdiv(pl.col("hit_tokens"), hbs) > pl.col("n_units")).select(
        "seq", (pl.col("n_units") // k).alias("missing")
    )
    missing = (
        pl.concat([missing, beyond], how="vertical_relaxed")
        .group_by("seq")
        .agg(pl.col("missing").min())
    )
    return lk.join(missing, on="seq", how="left").select("seq", "V", "C", "missing")


def compute_flags(results: pl.DataFrame, config: TraceConfig) -> pl.DataFrame:
    """All flags of a replay, from its results rows (``unit_present`` included)."""
    if results.height == 0:
        return empty_flags()
    if "unit_present" not in results.columns:
        raise ReplayError(
            "results have no 'unit_present' column (the store state each lookup saw): "
            "re-run `replay run` to produce it"
        )
    spec_groups = build_spec_groups(config)
    eagle_of = {gid: sg.eagle for sg in spec_groups for gid in sg.group_ids}
    n_units = results.select(
        "seq", pl.col("unit_present").list.get(0).list.len().cast(pl.Int64).alias("n_units")
    )
    base = (
        results.select(
            "seq",
            "request_id",
            "hit_tokens",
            "max_length",
            "observed_hit_tokens",
            "mamba_state_tokens",
            pl.col("mask_blocks").cast(pl.List(pl.Int64)),
        )
        .join(n_units, on="seq", how="left")
        .with_columns(pl.col("n_units").fill_null(0))
    )
    out: list[pl.DataFrame] = []

    def emit(
        frame: pl.DataFrame,
        flag: str,
        gid: int | None,
        actual: pl.Expr,
        expected: pl.Expr,
        detail: pl.Expr,
    ) -> None:
        if frame.height:
            out.append(
                frame.select(
                    "seq",
                    "request_id",
                    pl.lit(flag).alias("flag"),
                    pl.lit(gid, pl.Int32).alias("group_id"),
                    "hit_tokens",
                    "max_length",
                    actual.cast(pl.Int64).alias("actual"),
                    expected.cast(pl.Int64).alias("expected"),
                    detail.alias("detail"),
                )
            )

    H, M = pl.col("hit_tokens"), pl.col("max_length")
    emit(
        base.filter(H > M),
        "hit_beyond_max_length",
        None,
        H,
        M,
        pl.format("hit {} > max_length {}", H, M),
    )
    a = config.alignment
    emit(
        base.filter(H % a != 0),
        "hit_misaligned",
        None,
        H,
        H - H % a,
        pl.format("hit {} is not a multiple of {}", H, pl.lit(a)),
    )
    obs = pl.col("observed_hit_tokens")
    emit(
        base.filter(obs.is_not_null() & (obs != H)),
        "observed_mismatch",
        None,
        H,
        obs,
        pl.format("replayed hit {} but production reported {}", H, obs),
    )

    facts: dict[int, pl.DataFrame] = {}
    for gid, spec in enumerate(config.groups):
        lk = base.select("seq", "hit_tokens", "max_length", "n_units")
        if spec.kind is GroupKind.MAMBA:
            # The resumed state: the last block of the group's load mask, or the
            # exact hash unit the coordinator reports when it lands inside a block.
            state = pl.coalesce(
                pl.col("mamba_state_tokens"), pl.col("mask_blocks").list.get(gid) * spec.block_size
            )
            if not _fine(config, spec):
                state = pl.col("mask_blocks").list.get(gid) * spec.block_size
            lk = base.select("seq", "hit_tokens", "max_length", "n_units", state.alias("state"))
        facts[gid] = _group_facts(config, gid, eagle_of[gid], presence(results, gid), lk)

    non_mamba = [g for g, s in enumerate(config.groups) if s.kind is not GroupKind.MAMBA]
    verified = None
    if non_mamba:
        verified = (
            pl.concat([facts[g].select("seq", "V") for g in non_mamba])
            .group_by("seq")
            .agg(pl.col("V").min().alias("verified"))
        )
    for gid, spec in enumerate(config.groups):
        f = base.join(facts[gid], on="seq", how="left")
        bs = spec.block_size
        miss = pl.col("missing")
        emit(
            f.filter(miss.is_not_null()),
            "missing_block",
            gid,
            miss,
            pl.lit(None, pl.Int64),
            pl.format(
                "group {} ({}) block {} (tokens {}..{}) is absent but the hit of {} relies on it",
                pl.lit(gid),
                pl.lit(spec.kind.value),
                miss,
                miss * bs,
                (miss + 1) * bs,
                H,
            ),
        )
        if spec.kind is GroupKind.FULL_ATTENTION and eagle_of[gid]:
            emit(
                f.filter((H > 0) & (pl.col("C") <= H)),
                "eagle_not_dropped",
                gid,
                H,
                pl.col("C"),
                pl.format(
                    "hit {} covers group {}'s whole present prefix {}: EAGLE recomputes nothing",
                    H,
                    pl.lit(gid),
                    pl.col("C"),
                ),
            )
        if spec.kind is GroupKind.MAMBA:
            state = pl.col("mask_blocks").list.get(gid) * bs
            if _fine(config, spec):
                state = pl.coalesce(pl.col("mamba_state_tokens"), state)
            f = f.with_columns(state.alias("state"))
            emit(
                f.filter(pl.col("state") != H),
                "mamba_state_mismatch",
                gid,
                pl.col("state"),
                H,
                pl.format(
                    "group {} resumes Mamba state at {} but the hit is {}",
                    pl.lit(gid),
                    pl.col("state"),
                    H,
                ),
            )
            if verified is not None:
                g = f.join(verified, on="seq", how="left")
                emit(
                    g.filter(pl.col("state") > pl.col("verified")),
                    "mamba_overrun",
                    gid,
                    pl.col("state"),
                    pl.col("verified"),
                    pl.format(
                        "group {} resumes Mamba state at {}, {} tokens past the attention-verified prefix {}",
                        pl.lit(gid),
                        pl.col("state"),
                        pl.col("state") - pl.col("verified"),
                        pl.col("verified"),
                    ),
                )
    if not out:
        return empty_flags()
    order = {name: i for i, name in enumerate(FLAG_KINDS)}
    return (
        pl.concat(out)
        .with_columns(pl.col("flag").replace_strict(order, return_dtype=pl.Int32).alias("_o"))
        .sort("seq", "_o", "group_id", nulls_last=True)
        .drop("_o")
    )


def attach_flags(result: Any) -> pl.DataFrame:
    """Compute the flags of a ``ReplayResult`` and fill its ``flags`` column."""
    flags = compute_flags(result.results, result.config)
    result.results = with_flag_column(result.results, flags)
    return flags


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


def check_path(
    path: str | os.PathLike[str], *, policy: str | None, coordinator: str = "reference"
) -> tuple[pl.DataFrame, str]:
    """Flags of a trace (replayed now, under ``policy`` or the default) or of a
    results file (as written; a ``policy`` other than its own is an error).
    Returns the flags and the policy they were computed under. A trace or
    results file without lookups has nothing to check: an error."""
    from replay.coordinator import DEFAULT_POLICY
    from replay.engine import replay_trace
    from replay.trace import is_results_file, read_results, results_config

    if is_results_file(path):
        frame, info = read_results(path)
        made_under = str(info.get("policy", "?"))
        if policy is not None and policy != made_under:
            raise ReplayError(
                f"{path}: these results were made under policy {made_under}, not --policy "
                f"{policy} (check the trace to replay it under {policy}, or drop --policy)"
            )
        if frame.height == 0:
            raise ReplayError(f"{path}: no lookups, nothing to check")
        return compute_flags(frame, results_config(info, path)), made_under
    used = policy or DEFAULT_POLICY
    result = replay_trace(path, policy=used, coordinator=coordinator)
    if result.results.height == 0:
        raise ReplayError(f"{path}: the trace has no lookups, nothing to check")
    return compute_flags(result.results, result.config), used
