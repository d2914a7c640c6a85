"""Diff two replays of one trace, lookup by lookup.

The two sides are either two policies (or coordinators) replayed here from
one trace, or two results files written by ``replay run`` from the same
trace. A lookup is *changed* when its hit differs; every changed lookup gets
one explanation:

1. a flag present on one side and not the other (the first in
   ``replay.analysis.flags.FLAG_KINDS`` order: ``mamba_overrun`` before
   ``eagle_not_dropped`` before ``observed_mismatch``). A flag is a finding
   about the hit, so it is the better story: on the #43559 trace the
   ``pre-49502`` side gains 16 tokens exactly where it gains ``mamba_overrun``;
2. otherwise the group whose own finder hit (``group_hit_tokens``) moved the
   most. Ties go to a group that is not full attention: full attention only
   ever shrinks to follow the others inside the fixed point, so it is the
   follower, not the cause. Every group's mask length follows the hit, so
   masks alone are the last resort (results files without
   ``group_hit_tokens``);
3. ``unexplained`` when neither flags nor groups differ.

When the two sides are two caches (``--cache mooncake --cache gpu``), each
changed lookup also names the cache rule behind it (``rule``): the rule of
``replay.rules.coordinator.cache`` that treats the explaining group differently
in this configuration (a widened window, a flag honoured without
``use_eagle``, a different merge), else the configuration-wide one (the
single-spec shortcut, the unitary coordinator, derived partial hits).

Gains and losses are ``hit B - hit A`` per lookup.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq

from replay.analysis.flags import (
    FLAG_KINDS,
    add_flags,
    has_facts,
    recompute_flags,
    with_flag_column,
)
from replay.base.errors import ReplayError
from replay.base.spec import GroupKind, TraceConfig
from replay.base.text import readable
from replay.engine.answers import Progress
from replay.engine.run import ReplayOptions, Variant, replay
from replay.format.paths import arrow_file
from replay.format.results import is_results_file, read_results, results_cache, results_config
from replay.format.tracedir import open_trace
from replay.format.writer import atomic_path
from replay.rules.coordinator import (
    DEFAULT_COORDINATOR,
    DEFAULT_POLICY,
    build_spec_groups,
    eagle_group_ids,
    get_cache,
    hit_alignment,
    lookup_spec,
    resolve_cache,
)
from replay.tools.render import group_label

DIFF_META_KEY = b"replay.diff"
_FLAG_ORDER = {name: i for i, name in enumerate(FLAG_KINDS)}

#: One row per changed lookup (``-o diff.parquet`` and ``--json``).
DIFF_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {
    "seq": pl.Int64,
    "request_id": pl.String,
    "max_length": pl.Int64,
    "hit_a": pl.Int64,
    "hit_b": pl.Int64,
    "delta": pl.Int64,
    "reason": pl.String,
    "reason_kind": pl.String,
    "reason_side": pl.String,
    "reason_group": pl.Int32,
    "flags_a": pl.List(pl.String),
    "flags_b": pl.List(pl.String),
    "flags_only_a": pl.List(pl.String),
    "flags_only_b": pl.List(pl.String),
    "groups_changed": pl.List(pl.Int32),
    "group_hit_tokens_a": pl.List(pl.Int64),
    "group_hit_tokens_b": pl.List(pl.Int64),
    "mask_blocks_a": pl.List(pl.Int32),
    "mask_blocks_b": pl.List(pl.Int32),
    "loaded_blocks_a": pl.List(pl.Int32),
    "loaded_blocks_b": pl.List(pl.Int32),
    "rule": pl.String,
}

REASON_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {
    "reason": pl.String,
    "reason_kind": pl.String,
    "reason_side": pl.String,
    "reason_group": pl.Int32,
    "lookups": pl.Int64,
    "gained": pl.Int64,
    "lost": pl.Int64,
    "net": pl.Int64,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Side:
    """One replay: its results (with a ``flags`` column) and where they came from."""

    label: str
    policy: str | None
    coordinator: str | None
    source: str
    results: pl.DataFrame
    cache: str | None = None

    def describe(self) -> dict[str, Any]:
        """Where this side came from (the results frame aside), for the JSON output."""
        return {k: getattr(self, k) for k in ("label", "policy", "coordinator", "cache", "source")}


@dataclass(frozen=True, slots=True, kw_only=True)
class DiffResult:
    a: Side
    b: Side
    config: TraceConfig
    trace: str
    compared: int
    hit_tokens_a: int
    hit_tokens_b: int
    #: lookups with the same hit whose masks or group hits differ
    same_hit_groups_changed: int
    lookups: pl.DataFrame = field(repr=False)
    reasons: pl.DataFrame = field(repr=False)

    @property
    def changed(self) -> int:
        return self.lookups.height

    @property
    def gained(self) -> int:
        return int(self.lookups["delta"].clip(lower_bound=0).sum())

    @property
    def lost(self) -> int:
        return int((-self.lookups["delta"]).clip(lower_bound=0).sum())

    def summary(self) -> dict[str, Any]:
        d = self.lookups["delta"]
        return {
            "trace": self.trace,
            "a": self.a.describe(),
            "b": self.b.describe(),
            "lookups": self.compared,
            "changed": self.changed,
            "b_higher": int((d > 0).sum()),
            "b_lower": int((d < 0).sum()),
            "hit_tokens_a": self.hit_tokens_a,
            "hit_tokens_b": self.hit_tokens_b,
            "gained": self.gained,
            "lost": self.lost,
            "net": self.gained - self.lost,
            "same_hit_groups_changed": self.same_hit_groups_changed,
        }


# ---------------------------------------------------------------- the diff


def _ensure_columns(frame: pl.DataFrame) -> pl.DataFrame:
    """Optional results columns as nulls / empty lists when a file lacks them."""
    exprs = []
    if "flags" not in frame.columns:
        exprs.append(pl.lit([], dtype=pl.List(pl.String)).alias("flags"))
    if "group_hit_tokens" not in frame.columns:
        exprs.append(pl.lit(None, dtype=pl.List(pl.Int64)).alias("group_hit_tokens"))
    frame = frame.with_columns(exprs) if exprs else frame
    return frame.select(
        pl.col("seq").cast(pl.Int64),
        pl.col("request_id").cast(pl.String),
        pl.col("max_length").cast(pl.Int64),
        pl.col("hit_tokens").cast(pl.Int64),
        pl.col("flags").cast(pl.List(pl.String)).fill_null(pl.lit([], dtype=pl.List(pl.String))),
        pl.col("group_hit_tokens").cast(pl.List(pl.Int64)),
        pl.col("mask_blocks").cast(pl.List(pl.Int32)),
        pl.col("loaded_blocks").cast(pl.List(pl.Int32)),
    )


def _only(left: str, right: str) -> pl.Expr:
    """Flags in ``left`` and not in ``right``, in FLAG_KINDS order (unknown ones
    after, by name)."""
    diff = pl.col(left).list.set_difference(pl.col(right))
    return diff.list.eval(
        pl.element().sort_by(
            pl.element().replace_strict(
                _FLAG_ORDER, default=len(_FLAG_ORDER), return_dtype=pl.Int32
            ),
            pl.element(),
        )
    )


def _explanations(config: TraceConfig) -> list[pl.Expr]:
    """Columns explaining each changed lookup (see the module docstring)."""
    n = config.num_groups
    n_flags = len(_FLAG_ORDER)

    def rank(col: str) -> pl.Expr:
        return (
            pl.col(col)
            .list.first()
            .replace_strict(_FLAG_ORDER, default=n_flags, return_dtype=pl.Int32)
        )

    # A flag: the earlier kind wins; between equal ranks (unknown kinds), the
    # name, then side A.
    first_a, first_b = pl.col("flags_only_a").list.first(), pl.col("flags_only_b").list.first()
    take_b = first_a.is_null() | (
        first_b.is_not_null()
        & (
            (rank("flags_only_b") < rank("flags_only_a"))
            | ((rank("flags_only_b") == rank("flags_only_a")) & (first_b < first_a))
        )
    )
    flag = pl.when(take_b).then(first_b).otherwise(first_a)
    flag_side = (
        pl.when(first_a.is_null() & first_b.is_null())
        .then(None)
        .otherwise(pl.when(take_b).then(pl.lit("B")).otherwise(pl.lit("A")))
    )
    # A group: the largest move of its own hit; ties to a group that is not
    # full attention, then the lowest group_id. One integer key per group
    # orders all three: |delta| * 2n + (not full) * n + (n - 1 - gid).
    keys, changed = [], []
    for gid, spec in enumerate(config.groups):
        ga = pl.col("group_hit_tokens").list.get(gid, null_on_oob=True)
        gb = pl.col("group_hit_tokens_b").list.get(gid, null_on_oob=True)
        not_full = 0 if spec.kind is GroupKind.FULL_ATTENTION else 1
        moved = (gb - ga).abs()
        keys.append(pl.when(moved > 0).then(moved * (2 * n) + not_full * n + (n - 1 - gid)))
        masks = [
            pl.col(c)
            .list.get(gid, null_on_oob=True)
            .ne_missing(pl.col(f"{c}_b").list.get(gid, null_on_oob=True))
            for c in ("mask_blocks", "loaded_blocks")
        ]
        differs = ga.ne_missing(gb) | masks[0] | masks[1]
        changed.append(pl.when(differs).then(pl.lit(gid, pl.Int32)))
    best = pl.max_horizontal(keys)
    moved_gid = (n - 1 - best % n).cast(pl.Int32)
    first_changed = pl.min_horizontal(changed)
    group = pl.coalesce(moved_gid, first_changed)
    labels = {gid: f"group {group_label(config, gid)}" for gid in range(n)}
    kind = (
        pl.when(flag.is_not_null())
        .then(pl.lit("flag"))
        .when(group.is_not_null())
        .then(pl.lit("group"))
        .otherwise(pl.lit("none"))
    )
    return [
        pl.coalesce(
            flag,
            group.replace_strict(labels, default=None, return_dtype=pl.String),
            pl.lit("unexplained"),
        ).alias("reason"),
        kind.alias("reason_kind"),
        flag_side.alias("reason_side"),
        pl.when(flag.is_null()).then(group).cast(pl.Int32).alias("reason_group"),
        pl.concat_list(changed).list.drop_nulls().alias("groups_changed"),
    ]


def cache_rules(config: TraceConfig, a: str, b: str) -> tuple[dict[int, str], str | None]:
    """Where caches ``a`` and ``b`` treat this configuration differently: per
    group_id the rule that touches that group, and the configuration-wide
    rule (or None)."""
    if a == b:
        return {}, None
    ca, cb = get_cache(a), get_cache(b)
    per_group: dict[int, str] = {}
    drops = {c.name: eagle_group_ids(config, c) for c in (ca, cb)}
    members = {
        c.name: {gid: sg.group_ids for sg in build_spec_groups(config, c) for gid in sg.group_ids}
        for c in (ca, cb)
    }
    for gid, g in enumerate(config.groups):
        rules = []
        if lookup_spec(g, ca) != lookup_spec(g, cb):
            widens = ca.name if ca.widen_window else cb.name
            rules.append(
                f"sliding window {g.sliding_window} widened by extra_retained_tokens "
                f"{g.extra_retained_tokens} in {widens} only"
            )
        if (gid in drops[ca.name]) != (gid in drops[cb.name]):
            who = ca.name if gid in drops[ca.name] else cb.name
            rules.append(f"is_eagle_group with use_eagle off: drops for EAGLE in {who} only")
        if members[ca.name][gid] != members[cb.name][gid]:
            rules.append(
                f"merged spec groups: {ca.name} {list(members[ca.name][gid])}, "
                f"{cb.name} {list(members[cb.name][gid])}"
            )
        if rules:
            per_group[gid] = "; ".join(rules)
    wide: list[str] = []
    if hit_alignment(config, ca) != hit_alignment(config, cb):
        wide.append(
            f"hit alignment {ca.name} {hit_alignment(config, ca)}, {cb.name} "
            f"{hit_alignment(config, cb)} (the engine derives partial hits and runs one "
            "group through its unitary coordinator)"
        )
    spec_groups = {c.name: build_spec_groups(config, c) for c in (ca, cb)}
    single = [
        c
        for c in (ca, cb)
        if len(spec_groups[c.name]) == 1 and c.single_spec_shortcut and config.num_groups > 1
    ]
    if single and len(single) == 1 and any(sg.eagle for sg in spec_groups[single[0].name]):
        wide.append(
            f"one spec group over {config.num_groups} KV-cache groups: the engine's loop "
            f"grants the EAGLE peek margin, {single[0].name}'s single call does not"
        )
    return per_group, "; ".join(wide) or None


def diff_sides(a: Side, b: Side, config: TraceConfig, trace: str) -> DiffResult:
    """Compare two replays of one trace (same lookups, same config)."""
    fa = _ensure_columns(a.results)
    fb = _ensure_columns(b.results)
    joined = fa.join(fb, on="seq", how="inner", suffix="_b")
    if joined.height != fa.height or joined.height != fb.height:
        raise ReplayError(
            f"{b.source}: has {fb.height} lookups, {a.source} has {fa.height} and they share "
            f"{joined.height} seqs, expected the same lookups (results of the same trace)"
        )
    bad = joined.filter(
        (pl.col("request_id") != pl.col("request_id_b"))
        | (pl.col("max_length") != pl.col("max_length_b"))
    )
    if bad.height:
        r = bad.row(0, named=True)
        raise ReplayError(
            f"{b.source}: seq {r['seq']}: lookup {r['request_id_b']!r} max_length "
            f"{r['max_length_b']}, but {a.source} has {r['request_id']!r} max_length "
            f"{r['max_length']} (expected results of the same trace)"
        )
    if "unit_present" in a.results.columns and "unit_present" in b.results.columns:
        # The store a lookup saw does not depend on the policy: a difference
        # means the two sides replayed different event logs.
        seen = (
            a.results.select("seq", "unit_present")
            .join(b.results.select("seq", "unit_present"), on="seq", suffix="_b")
            .filter(pl.col("unit_present") != pl.col("unit_present_b"))
            .sort("seq")
        )
        if seen.height:
            raise ReplayError(
                f"{b.source}: seq {seen['seq'][0]}: the lookup saw a different store than "
                f"in {a.source} (expected results of the same trace)"
            )
    joined = joined.sort("seq")
    is_changed = pl.col("hit_tokens") != pl.col("hit_tokens_b")
    groups_differ = (
        (pl.col("mask_blocks") != pl.col("mask_blocks_b"))
        | (pl.col("loaded_blocks") != pl.col("loaded_blocks_b"))
        | (pl.col("group_hit_tokens") != pl.col("group_hit_tokens_b")).fill_null(False)
    )
    same_hit_changed = int(joined.select((~is_changed & groups_differ).sum()).item())
    lookups = (
        joined.filter(is_changed)
        .with_columns(
            _only("flags", "flags_b").alias("flags_only_a"),
            _only("flags_b", "flags").alias("flags_only_b"),
        )
        .with_columns(_explanations(config))
        .select(
            "seq",
            "request_id",
            "max_length",
            pl.col("hit_tokens").alias("hit_a"),
            pl.col("hit_tokens_b").alias("hit_b"),
            (pl.col("hit_tokens_b") - pl.col("hit_tokens")).alias("delta"),
            "reason",
            "reason_kind",
            "reason_side",
            "reason_group",
            pl.col("flags").alias("flags_a"),
            "flags_b",
            "flags_only_a",
            "flags_only_b",
            "groups_changed",
            pl.col("group_hit_tokens").alias("group_hit_tokens_a"),
            "group_hit_tokens_b",
            pl.col("mask_blocks").alias("mask_blocks_a"),
            "mask_blocks_b",
            pl.col("loaded_blocks").alias("loaded_blocks_a"),
            "loaded_blocks_b",
        )
        .with_columns(_rule_column(config, a, b))
        .cast(pl.Schema(DIFF_SCHEMA))
    )
    reasons = (
        lookups.group_by("reason", "reason_kind", "reason_side", "reason_group")
        .agg(
            pl.len().cast(pl.Int64).alias("lookups"),
            pl.col("delta").clip(lower_bound=0).sum().cast(pl.Int64).alias("gained"),
            (-pl.col("delta")).clip(lower_bound=0).sum().cast(pl.Int64).alias("lost"),
            pl.col("delta").sum().cast(pl.Int64).alias("net"),
            pl.col("seq").min().alias("_first"),
        )
        .sort(pl.col("net").abs(), "lookups", "_first", descending=[True, True, False])
        .drop("_first")
        .select(list(REASON_SCHEMA))
        .cast(pl.Schema(REASON_SCHEMA))
    )
    return DiffResult(
        a=a,
        b=b,
        config=config,
        trace=trace,
        compared=joined.height,
        hit_tokens_a=int(fa["hit_tokens"].sum() or 0),
        hit_tokens_b=int(fb["hit_tokens"].sum() or 0),
        same_hit_groups_changed=same_hit_changed,
        lookups=lookups,
        reasons=reasons,
    )


def _rule_column(config: TraceConfig, a: Side, b: Side) -> pl.Expr:
    """The cache rule behind each changed lookup (null unless the sides are
    two caches): the explaining group's, else any changed group's, else the
    configuration-wide one."""
    if a.cache is None or b.cache is None or a.cache == b.cache:
        return pl.lit(None, pl.String).alias("rule")
    per_group, wide = cache_rules(config, a.cache, b.cache)
    by_group = {gid: f"group {gid}: {text}" for gid, text in per_group.items()}
    touched = pl.col("groups_changed").list.eval(
        pl.element().replace_strict(by_group, default=None, return_dtype=pl.String)
    )
    return pl.coalesce(
        pl.col("reason_group").replace_strict(by_group, default=None, return_dtype=pl.String),
        touched.list.drop_nulls().list.first(),
        pl.lit(wide, pl.String),
        pl.lit("unexplained by a cache rule", pl.String),
    ).alias("rule")


# ---------------------------------------------------------------- inputs


def _pair(option: str, values: Sequence[str], default: str) -> tuple[str, str]:
    if len(values) > 2:
        raise ReplayError(
            f"{option} given {len(values)} times, expected at most twice (side A, side B)"
        )
    if not values:
        return default, default
    if len(values) == 1:
        return values[0], values[0]
    return values[0], values[1]


def _labels(a: tuple[str | None, ...], b: tuple[str | None, ...]) -> tuple[str, str]:
    """Short names for the two sides: whatever differs between them."""
    parts_a, parts_b = [], []
    for x, y in zip(a, b, strict=True):
        if x != y:
            parts_a.append(str(x))
            parts_b.append(str(y))
    if not parts_a:
        return "A", "B"
    return "/".join(parts_a), "/".join(parts_b)


def diff_policies(
    trace: str | os.PathLike[str],
    policies: Sequence[str],
    coordinators: Sequence[str] = (),
    caches: Sequence[str] = (),
    progress: Callable[[Progress], None] | None = None,
) -> DiffResult:
    """Replay ``trace`` twice (``--policy A --policy B``, two coordinators
    and/or two caches)."""
    if is_results_file(trace):
        raise ReplayError(
            f"{trace}: is a results file, expected a trace to replay with `policy` twice "
            "(or give two results files and no `policy`)"
        )
    pa_, pb = _pair("`policy`", policies, DEFAULT_POLICY)
    ca, cb = _pair("`coordinator`", coordinators, DEFAULT_COORDINATOR)
    if len(policies) < 2 and len(coordinators) < 2 and len(caches) < 2:
        raise ReplayError(
            f"{trace}: a trace needs two sides to diff: give `policy` twice "
            "(e.g. `policy` vllm-0.33 `policy` pre-49502), `cache` twice "
            "(`cache` mooncake `cache` gpu) or `coordinator` twice"
        )
    reader = open_trace(trace)  # validates metadata and schema before any replay
    config = reader.config
    own = resolve_cache(config, None)
    ka, kb = _pair("`cache`", caches, own)
    la, lb = _labels((pa_, ca, ka), (pb, cb, kb))
    # Both sides from one fold of the trace: presence does not depend on the
    # policy, the cache or the coordinator.
    sides = (
        Variant(policy=pa_, cache=ka, coordinator=ca),
        Variant(policy=pb, cache=kb, coordinator=cb),
    )
    results = replay(reader, ReplayOptions(variants=sides, progress=progress))
    a, b = (
        Side(
            label=label,
            policy=result.policy,
            coordinator=result.coordinator,
            source=str(trace),
            results=add_flags(result.results, config),
            cache=result.cache,
        )
        for label, result in zip((la, lb), results, strict=True)
    )
    return diff_sides(a, b, config, Path(trace).name)


def _load_results(path: str | os.PathLike[str]) -> tuple[pl.DataFrame, dict[str, Any]]:
    return read_results(
        path,
        not_results=f"{path}: is not a results file (no 'replay.results' metadata), expected "
        "the output of `replay run`; to replay a trace give it once with `policy` twice",
    )


def _with_flags(frame: pl.DataFrame, config: TraceConfig, info: dict[str, Any]) -> pl.DataFrame:
    """A results file's flags: from its facts, else its own ``flags``, else
    computed from ``unit_present`` when a writer left the column out."""
    if has_facts(frame):
        return add_flags(frame, config)
    if "flags" in frame.columns or "unit_present" not in frame.columns:
        return frame
    return with_flag_column(frame, recompute_flags(frame, config, results_cache(info)))


def diff_results_files(
    path_a: str | os.PathLike[str], path_b: str | os.PathLike[str]
) -> DiffResult:
    """Compare two results files of the same trace (same name, config and lookups)."""
    frame_a, info_a = _load_results(path_a)
    frame_b, info_b = _load_results(path_b)
    config_a = results_config(info_a, path_a)
    config_b = results_config(info_b, path_b)
    trace_a, trace_b = info_a.get("trace"), info_b.get("trace")
    if trace_a != trace_b:
        raise ReplayError(
            f"{path_b}: results of trace {trace_b!r}, but {path_a} is of trace {trace_a!r} "
            "(expected two results files of the same trace)"
        )
    if config_a != config_b:
        raise ReplayError(
            f"{path_b}: KV-cache config {config_b.dumps()} differs from {path_a}'s "
            f"{config_a.dumps()} (expected two results files of the same trace)"
        )
    pol_a, pol_b = info_a.get("policy"), info_b.get("policy")
    co_a, co_b = info_a.get("coordinator"), info_b.get("coordinator")
    la, lb = _labels((pol_a, co_a), (pol_b, co_b))
    if (la, lb) == ("A", "B"):
        la, lb = Path(path_a).name, Path(path_b).name
        if la == lb:
            la, lb = str(path_a), str(path_b)
    frame_a = _with_flags(frame_a, config_a, info_a)
    frame_b = _with_flags(frame_b, config_b, info_b)
    a, b = (
        Side(
            label=label,
            policy=policy,
            coordinator=coordinator,
            source=str(path),
            results=frame,
            cache=results_cache(info),
        )
        for label, policy, coordinator, path, frame, info in (
            (la, pol_a, co_a, path_a, frame_a, info_a),
            (lb, pol_b, co_b, path_b, frame_b, info_b),
        )
    )
    return diff_sides(a, b, config_a, str(trace_a))


def diff_inputs(
    paths: Sequence[str | os.PathLike[str]],
    policies: Sequence[str] = (),
    coordinators: Sequence[str] = (),
    caches: Sequence[str] = (),
    progress: Callable[[Progress], None] | None = None,
) -> DiffResult:
    """What ``replay diff`` does: one trace and two policies or caches, or two
    results files."""
    if len(paths) == 1:
        return diff_policies(paths[0], policies, coordinators, caches, progress)
    if len(paths) == 2:
        if policies or coordinators or caches:
            raise ReplayError(
                "`policy`/`coordinator`/`cache` replay a trace; two results files are "
                "compared as they are (give one trace with `policy` or `cache` twice, or two "
                "results files alone)"
            )
        return diff_results_files(paths[0], paths[1])
    raise ReplayError(
        f"expected a trace (with `policy` twice) or two results files, got {len(paths)} paths"
    )


# ---------------------------------------------------------------- output


def write_diff(diff: DiffResult, path: str | os.PathLike[str]) -> Path:
    """The changed lookups as Parquet, the summary in metadata ``replay.diff`` (atomic)."""
    tbl = diff.lookups.to_arrow()
    meta = {**diff.summary(), "version": 1, "reasons": diff.reasons.to_dicts()}
    tbl = tbl.replace_schema_metadata(
        {DIFF_META_KEY: json.dumps(readable(meta), sort_keys=True).encode()}
    )
    with atomic_path(path) as tmp, arrow_file(tmp, "wb") as where:
        pq.write_table(tbl, where, compression="zstd")
    return Path(path)
