"""Flags: what is wrong with a lookup's answer, each with the numbers that prove it.

Each flag is one named polars expression over a results frame's columns, in
the registry ``FLAGS``: the answer (the hit, ``max_length``, every group's
load mask), the facts the replay wrote beside it (``replay/rules/facts.py``:
the hit alignment, each Mamba group's resumed state, the tokens the attention
KV covers, each group's first loaded block that is absent, whether the unit
an EAGLE drop recomputes is present) and the observed hit. ``add_flags``
adds ``flags`` and ``flag_details`` (the numbers) to a results frame; adding a
flag is one ``FlagKind`` and its test. The checks never ask the coordinator
how it decided, so they also catch a wrong coordinator, vLLM's included.

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
  ``seq`` (``first_absent_block``), or, in a model without Mamba groups
  (where ``mamba_overrun`` reports it), an attention group's mask stops
  short of ``H``.
- ``eagle_not_dropped``: an EAGLE full-attention or sliding-window group
  (one that drops for EAGLE in this cache) and ``H > 0``, but the unit the
  drop would have recomputed is absent: the hit reached the group's whole
  match, so nothing is recomputed and EAGLE's drafter gets no hidden states.
  The resumed state is consistent; the cost is acceptance.
- ``observed_mismatch``: the production-reported hit differs from ``H``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import polars as pl

from replay.base.errors import ReplayError
from replay.base.spec import GroupKind, TraceConfig
from replay.format.schema import FACT_COLUMNS, RESULTS_SCHEMA
from replay.rules.coordinator import DEFAULT_CACHE, Cache, LookupOutcome
from replay.rules.facts import FactRules, LookupFacts

if TYPE_CHECKING:
    from replay.engine.answers import ReplayResult

#: How bad a flag is, worst first (each ``FlagKind`` of ``FLAGS`` names one).
#: ``corruption``: the request computes with state that belongs to other
#: tokens, silently; ``inconsistent``: the answer contradicts itself or the
#: lookup's bounds (an invariant of vLLM's is broken; what follows depends on
#: the code path); ``performance``: the answer is consistent but costs work or
#: speculative acceptance; ``observed``: the production-reported hit differs
#: from the replay.
SEVERITIES = ("corruption", "inconsistent", "performance", "observed")


def severity(flag: str) -> str:
    """The severity of ``flag``; a flag this version does not know (in a
    results file from another version) counts as ``inconsistent``."""
    kind = FLAGS.get(flag)
    return kind.severity if kind is not None else "inconsistent"


def by_severity(flags: Sequence[str]) -> list[str]:
    """``flags`` worst first (corruption first), each severity's in
    ``FLAG_KINDS`` order, unknown names last."""
    order = {name: i for i, name in enumerate(FLAG_KINDS)}
    return sorted(
        dict.fromkeys(flags),
        key=lambda f: (f not in FLAGS, SEVERITIES.index(severity(f)), order.get(f, 0), f),
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

#: One flag with its numbers, as ``flag_details`` holds it.
DETAIL_TYPE = pl.Struct(
    {
        "flag": pl.String,
        "group_id": pl.Int32,
        "actual": pl.Int64,
        "expected": pl.Int64,
        "detail": pl.String,
    }
)
DETAILS_TYPE = pl.List(DETAIL_TYPE)


def empty_flags() -> pl.DataFrame:
    return pl.DataFrame(schema=FLAGS_SCHEMA)


@dataclass(frozen=True, slots=True)
class Layout:
    """What the flag expressions know of a configuration: each group's kind
    and block size (the results' ``kv_cache_groups``)."""

    kinds: tuple[GroupKind, ...]
    block_sizes: tuple[int, ...]

    @classmethod
    def of(cls, config: TraceConfig) -> Layout:
        return cls(tuple(g.kind for g in config.groups), tuple(g.block_size for g in config.groups))

    def groups(self, *kinds: GroupKind) -> list[int]:
        """The group ids of these kinds (every group when none is named)."""
        return [g for g, k in enumerate(self.kinds) if not kinds or k in kinds]


# The columns the expressions read.
H = pl.col("hit_tokens")
M = pl.col("max_length").fill_null(0)  # as the replay reads a lookup's max_length
A = pl.col("attention_tokens")
O = pl.col("observed_hit_tokens")  # noqa: E741


def _of(name: str, g: int) -> pl.Expr:
    return pl.col(name).list.get(g)


def _detail(
    flag: str, group_id: int | None, actual: pl.Expr, expected: pl.Expr | None, text: pl.Expr
) -> pl.Expr:
    return pl.struct(
        pl.lit(flag, pl.String).alias("flag"),
        pl.lit(group_id, pl.Int32).alias("group_id"),
        actual.cast(pl.Int64).alias("actual"),
        (expected if expected is not None else pl.lit(None)).cast(pl.Int64).alias("expected"),
        text.alias("detail"),
    )


#: One occurrence of a flag: when it holds (a boolean per lookup) and its
#: detail struct (``DETAIL_TYPE``).
Occurrence = tuple[pl.Expr, pl.Expr]


def _n(e: pl.Expr) -> pl.Expr:
    """A number in a flag's text as every command writes counts: thousands
    separated (``1,040``, as ``replay.base.text.counted``)."""
    a = e.cast(pl.Int64).abs()
    chain: Any = pl.when(a < 1000).then(a.cast(pl.Utf8))
    for k in range(1, 7):
        parts = [(a // 10 ** (3 * k)).cast(pl.Utf8)] + [
            ((a // 10 ** (3 * j)) % 1000).cast(pl.Utf8).str.zfill(3) for j in range(k - 1, -1, -1)
        ]
        text = pl.concat_str(parts, separator=",")
        chain = chain.when(a < 10 ** (3 * k + 3)).then(text) if k < 6 else chain.otherwise(text)
    return pl.concat_str([pl.when(e < 0).then(pl.lit("-")).otherwise(pl.lit("")), chain])


def _mamba_bound() -> pl.Expr:
    return pl.when(A.is_null()).then(H).otherwise(pl.min_horizontal(H, A))


def _mamba_overrun(layout: Layout) -> list[Occurrence]:
    out = []
    for g in layout.groups(GroupKind.MAMBA):
        s, bound = _of("group_state_tokens", g), _mamba_bound()
        what = (
            pl.when(A.is_null() | (H <= A))
            .then(pl.format("the hit {}", _n(H)))
            .otherwise(pl.format("the attention KV loaded for {} tokens", _n(A)))
        )
        text = pl.format(
            f"group {g} resumes Mamba state at {{}}, {{}} tokens past {{}}",
            _n(s),
            _n(s - bound),
            what,
        )
        out.append((s > bound, _detail("mamba_overrun", g, s, bound, text)))
    return out


def _mamba_state_mismatch(layout: Layout) -> list[Occurrence]:
    out = []
    for g in layout.groups(GroupKind.MAMBA):
        s = _of("group_state_tokens", g)
        text = pl.format(f"group {g} resumes Mamba state at {{}} but the hit is {{}}", _n(s), _n(H))
        out.append((s != H, _detail("mamba_state_mismatch", g, s, H, text)))
    return out


def _hit_beyond_max_length(layout: Layout) -> list[Occurrence]:
    text = pl.format("hit {} > max_length {}", _n(H), _n(M))
    return [(H > M, _detail("hit_beyond_max_length", None, H, M, text))]


def _hit_misaligned(layout: Layout) -> list[Occurrence]:
    a = pl.col("hit_alignment")
    text = pl.format("hit {} is not a multiple of {}", _n(H), _n(a))
    return [(H % a != 0, _detail("hit_misaligned", None, H, H - H % a, text))]


def _missing_block(layout: Layout) -> list[Occurrence]:
    out = []
    no_mamba = not layout.groups(GroupKind.MAMBA)
    for g, (kind, bs) in enumerate(zip(layout.kinds, layout.block_sizes, strict=True)):
        absent = _of("first_absent_block", g).cast(pl.Int64)
        mask = _of("mask_blocks", g).cast(pl.Int64)
        # Without a Mamba group (where ``mamba_overrun`` reports it), a mask
        # that stops short of the hit leaves tokens neither loaded nor
        # recomputed.
        short = absent.is_null() & (mask * bs < H) if no_mamba else pl.lit(False)
        block = pl.when(absent.is_not_null()).then(absent).otherwise(mask)
        where = (
            pl.when(absent.is_not_null())
            .then(pl.lit("is absent"))
            .otherwise(pl.lit("is not in the group's load mask"))
        )
        text = pl.format(
            f"group {g} ({kind.value}) block {{}} (tokens {{}}..{{}}) {{}} but the hit of {{}} "
            "relies on it",
            _n(block),
            _n(block * bs),
            _n((block + 1) * bs),
            where,
            _n(H),
        )
        out.append((absent.is_not_null() | short, _detail("missing_block", g, block, None, text)))
    return out


def _eagle_not_dropped(layout: Layout) -> list[Occurrence]:
    out = []
    for g in layout.groups(GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW):
        # Null for a group that does not drop for EAGLE in this cache.
        present = _of("eagle_unit_present", g)
        text = pl.format(
            f"hit {{}} reaches group {g}'s whole match: EAGLE recomputes nothing past it", _n(H)
        )
        out.append(((H > 0) & present.not_(), _detail("eagle_not_dropped", g, H, None, text)))
    return out


def _observed_mismatch(layout: Layout) -> list[Occurrence]:
    text = pl.format("replayed hit {} but production reported {}", _n(H), _n(O))
    return [(O.is_not_null() & (O != H), _detail("observed_mismatch", None, H, O, text))]


@dataclass(frozen=True, slots=True)
class FlagKind:
    """One flag: its name, its severity, what it means, and its rule as
    polars expressions over a results frame (built per group layout)."""

    name: str
    severity: str
    meaning: str
    #: Each place the flag can occur in a lookup (once, or once per group):
    #: when it holds, and its detail.
    occurrences: Callable[[Layout], list[Occurrence]]

    def expression(self, layout: Layout) -> pl.Expr:
        """Whether each lookup has this flag."""
        conds = [c.fill_null(False) for c, _ in self.occurrences(layout)]
        # With no place to occur (no Mamba group, say): false on every row.
        return pl.any_horizontal(conds) if conds else H.is_null() & pl.lit(False)

    def details(self, layout: Layout) -> pl.Expr:
        """Each lookup's occurrences of this flag, with their numbers
        (``flag_details`` entries; an empty list when it has none)."""
        parts = [
            pl.when(c.fill_null(False)).then(d).otherwise(pl.lit(None, DETAIL_TYPE))
            for c, d in self.occurrences(layout)
        ]
        if not parts:
            return pl.lit([], DETAILS_TYPE)
        return pl.concat_list(parts).list.drop_nulls().cast(DETAILS_TYPE)


#: Every flag, in the order ``flags`` and ``flag_details`` list them.
FLAGS: dict[str, FlagKind] = {
    k.name: k
    for k in (
        FlagKind(
            "mamba_overrun",
            "corruption",
            "Mamba resumes recurrent state past the hit or the attention KV it loads (#43559)",
            _mamba_overrun,
        ),
        FlagKind(
            "mamba_state_mismatch",
            "inconsistent",
            "Mamba resumes state at a position other than the hit",
            _mamba_state_mismatch,
        ),
        FlagKind(
            "hit_beyond_max_length",
            "inconsistent",
            "the hit is longer than the lookup's max_length",
            _hit_beyond_max_length,
        ),
        FlagKind(
            "hit_misaligned",
            "inconsistent",
            "the hit is not a multiple of the hit alignment",
            _hit_misaligned,
        ),
        FlagKind(
            "missing_block",
            "corruption",
            "a block the hit relies on is absent from the store at that seq",
            _missing_block,
        ),
        FlagKind(
            "eagle_not_dropped",
            "performance",
            "EAGLE is on but the hit covers the whole present prefix (nothing left to recompute)",
            _eagle_not_dropped,
        ),
        FlagKind(
            "observed_mismatch",
            "observed",
            "the production-reported hit differs from the replayed one",
            _observed_mismatch,
        ),
    )
}

FLAG_KINDS = tuple(FLAGS)


def flag_exprs(layout: Layout) -> tuple[pl.Expr, pl.Expr]:
    """The ``flags`` and ``flag_details`` columns from the facts. Built once
    per layout and registry (thousands of expression nodes: ``replay watch``
    judges many small batches, and building them cost more than using them)."""
    return _flag_exprs(layout, tuple(FLAGS.items()))


@functools.lru_cache(maxsize=64)
def _flag_exprs(
    layout: Layout, registry: tuple[tuple[str, FlagKind], ...]
) -> tuple[pl.Expr, pl.Expr]:
    names = [
        pl.when(kind.expression(layout)).then(pl.lit(name)).otherwise(pl.lit(None, pl.String))
        for name, kind in registry
    ]
    details = [kind.details(layout) for _, kind in registry]
    return (
        pl.concat_list(names).list.drop_nulls().cast(pl.List(pl.String)).alias("flags"),
        pl.concat_list(details).cast(DETAILS_TYPE).alias("flag_details"),
    )


def has_facts(results: pl.DataFrame) -> bool:
    return all(name in results.columns for name in FACT_COLUMNS)


def with_facts(
    results: pl.DataFrame, config: TraceConfig, cache: str | Cache = DEFAULT_CACHE
) -> pl.DataFrame:
    """A results frame with its facts: its own, else worked out from its
    ``unit_present`` (the store state each lookup saw), whoever wrote it."""
    if has_facts(results):
        return results
    if "unit_present" not in results.columns:
        raise ReplayError(
            "results have neither the facts columns nor 'unit_present' (the store state "
            "each lookup saw): re-run `replay run` to produce them"
        )
    rules = FactRules(config, cache)
    mamba = [g.kind is GroupKind.MAMBA for g in config.groups]
    facts: list[LookupFacts] = []
    cols = results.select("hit_tokens", "mask_blocks", "loaded_blocks", "group_hit_tokens")
    for (hit, mask, loaded, ghits), units in zip(
        cols.iter_rows(), results["unit_present"].to_list(), strict=True
    ):
        present = [bytes(bytearray(u)) for u in units]
        states = [ghits[g] if mamba[g] else None for g in range(config.num_groups)]
        facts.append(rules.facts(present, hit, list(zip(mask, loaded, strict=True)), states))
    return results.with_columns(
        pl.lit(rules.alignment, pl.Int64).alias("hit_alignment"),
        pl.Series("group_state_tokens", [f.state_tokens for f in facts], pl.List(pl.Int64)),
        pl.Series("attention_tokens", [f.attention_tokens for f in facts], pl.Int64),
        pl.Series("first_absent_block", [f.first_absent_block for f in facts], pl.List(pl.Int32)),
        pl.Series("eagle_unit_present", [f.eagle_unit_present for f in facts], pl.List(pl.Boolean)),
    )


#: add_flags' own column while the flagged lookups are apart.
_ROW = "__flags_row"


def add_flags(results: pl.DataFrame, config: TraceConfig) -> pl.DataFrame:
    """``results`` with ``flags`` and ``flag_details`` computed from its
    facts; a frame without facts (a file from before them) keeps the flags it
    was written with."""
    if not has_facts(results):
        if "flags" in results.columns:
            return results
        raise ReplayError(
            "results have neither the facts columns nor flags: re-run `replay run` to produce them"
        )
    flags, details = flag_exprs(Layout.of(config))
    # Lazy: the optimiser's common-subexpression pass evaluates the facts
    # the flags share once (half the time of the eager ``with_columns``).
    flagged = results.lazy().with_columns(flags).collect()
    # A lookup's details are its flags' occurrences: none without a flag. The
    # details' expression is most of the plan (about 30 ms to plan, however
    # few the rows: ``replay watch`` judges many small batches, most with no
    # flag), so it runs on the flagged lookups alone.
    has = flagged["flags"].list.len() > 0
    none = pl.lit([], DETAILS_TYPE).alias("flag_details")
    if not has.any():
        flagged = flagged.with_columns(none)
    elif has.all():
        flagged = flagged.lazy().with_columns(details).collect()
    else:
        numbered = flagged.with_row_index(_ROW)
        some = numbered.filter(has).lazy().with_columns(details).collect()
        rest = numbered.filter(~has).with_columns(none)
        flagged = pl.concat([some, rest]).sort(_ROW).drop(_ROW)
    # The results file's column order (flags among the answers' columns).
    known = [n for n in RESULTS_SCHEMA.names if n in flagged.columns]
    return flagged.select(known + [n for n in flagged.columns if n not in known])


def flag_results(results: Sequence[ReplayResult]) -> list[ReplayResult]:
    """The replay's results with their flags (the faces write and read these)."""
    return [replace(r, results=add_flags(r.results, r.config)) for r in results]


def result_flags(result: ReplayResult) -> pl.DataFrame:
    """One row per (lookup, flag) of a replay, with the numbers that prove it."""
    return flags_table(add_flags(result.results, result.config))


@dataclass(frozen=True, slots=True)
class Flag:
    """One flag of one lookup, as ``replay explain`` prints it."""

    flag: str
    group_id: int | None
    actual: int | None
    expected: int | None
    detail: str
    severity: str


def lookup_flags(
    config: TraceConfig,
    cache: str | Cache,
    outcome: LookupOutcome,
    facts: LookupFacts,
    max_length: int | None,
    observed: int | None,
) -> list[Flag]:
    """The flags of one explained lookup, by the same expressions, worst first."""
    row = pl.DataFrame(
        {
            "hit_tokens": [outcome.hit_tokens],
            "max_length": [max_length],
            "observed_hit_tokens": [observed],
            "mask_blocks": [[g.mask_blocks for g in outcome.groups]],
            "hit_alignment": [FactRules(config, cache).alignment],
            "group_state_tokens": [list(facts.state_tokens)],
            "attention_tokens": [facts.attention_tokens],
            "first_absent_block": [list(facts.first_absent_block)],
            "eagle_unit_present": [list(facts.eagle_unit_present)],
        },
        schema={
            "hit_tokens": pl.Int64,
            "max_length": pl.Int64,
            "observed_hit_tokens": pl.Int64,
            "mask_blocks": pl.List(pl.Int32),
            "hit_alignment": pl.Int64,
            "group_state_tokens": pl.List(pl.Int64),
            "attention_tokens": pl.Int64,
            "first_absent_block": pl.List(pl.Int32),
            "eagle_unit_present": pl.List(pl.Boolean),
        },
    )
    _, details = flag_exprs(Layout.of(config))
    flags = [Flag(**d, severity=severity(d["flag"])) for d in row.select(details).item()]
    return sorted(flags, key=lambda f: SEVERITIES.index(f.severity))


def sweep_flag_counts(rows: Sequence[dict[str, Any]], config: TraceConfig) -> list[dict[str, Any]]:
    """A what-if sweep's runs with, in place of each run's ``facts``, one
    count per flag kind (occurrences, as ``flag_details`` lists them)."""
    details = flag_exprs(Layout.of(config))[1]
    out = []
    for row in rows:
        row = dict(row)
        facts = row.pop("facts")
        found = facts.select(details).explode("flag_details").drop_nulls()
        counts = dict.fromkeys(FLAG_KINDS, 0)
        if found.height:
            for name, n in found.unnest("flag_details")["flag"].value_counts().iter_rows():
                counts[name] = int(n)
        out.append({**row, **counts})
    return out


def worst_first(counts: Mapping[str, int]) -> list[tuple[str, int, str]]:
    """Lookups per flag, worst first: (flag, count, severity) each, as
    ``replay.tools.render.counts_text`` words them."""
    return [(f, counts[f], severity(f)) for f in by_severity(list(counts))]


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
    """The flags of a results frame recomputed from its ``unit_present``
    (the store state each lookup saw: the facts are worked out again from
    it, for answers whoever wrote them), else from its facts."""
    if results.height == 0:
        return empty_flags()
    if "unit_present" in results.columns:
        results = results.drop(FACT_COLUMNS, strict=False)
    return flags_table(add_flags(with_facts(results, config, cache), config))


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
    """The first ``limit`` flagged rows of each kind, worst kind first, as
    dicts of ``FLAGS_SCHEMA``'s columns (``replay.tools.render`` words them)."""
    rows: list[dict[str, Any]] = []
    for name in by_severity(FLAG_KINDS):
        rows += flags.filter(pl.col("flag") == name).head(limit).iter_rows(named=True)
    return rows


def results_flags(
    results: pl.DataFrame, config: TraceConfig, cache: str | Cache = DEFAULT_CACHE
) -> pl.DataFrame:
    """The flag table of a results frame: recomputed from its facts; else
    (a file from before them) its own ``flag_details``; else recomputed from
    its ``unit_present``; else (a writer that kept only the names) one row per
    name in ``flags``, with no numbers."""
    if has_facts(results):
        return flags_table(add_flags(results, config))
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
