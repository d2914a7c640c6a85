"""What the report shows, computed from a results frame alone: the summary
figures, the hit ratio per bin of time (or seq), the hit-length histogram,
the tokens each KV-cache group loaded, and the flags with their first
examples. No I/O and no formatting of pages: ``build`` fills these in,
``html`` and ``markdown`` only lay them out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import polars as pl

from analysis.flags import FLAG_KINDS
from analysis.report.fmt import fmt_time
from analysis.summary import hit_figures, prompt_tokens_expr
from replay.base.spec import TraceConfig
from replay.tools.render import group_label

TIMELINE_BINS = 40
HISTOGRAM_BINS = 30

FLAG_MEANINGS: dict[str, str] = {
    "mamba_overrun": "Mamba resumes recurrent state past the hit or the attention KV it loads (#43559)",
    "mamba_state_mismatch": "Mamba resumes state at a position other than the hit",
    "hit_beyond_max_length": "the hit is longer than the lookup's max_length",
    "hit_misaligned": "the hit is not a multiple of the hit alignment",
    "missing_block": "a block the hit relies on is absent from the store at that seq",
    "eagle_not_dropped": "EAGLE is on but the hit covers the whole present prefix "
    "(nothing left to recompute)",
    "observed_mismatch": "the production-reported hit differs from the replayed one",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Point:
    """One bin of the hit-ratio timeline; ``x`` is the mean epoch µs or seq."""

    x: float
    ratio: float
    lookups: int
    hit_tokens: int
    prompt_tokens: int
    label: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Bin:
    """One bar of the hit-length histogram: hits in ``[lo, lo + width)``."""

    lo: int
    width: int
    lookups: int
    label: str
    tooltip: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Example:
    """A flagged lookup shown under its flag, with its ``replay explain``
    table when the trace was found."""

    flag: str
    seq: int
    request_id: str
    hit_tokens: int
    max_length: int
    group_id: int | None = None
    actual: int | None = None
    expected: int | None = None
    detail: str | None = None
    explain: str | None = None

    def explained(self, text: str | None) -> Example:
        return replace(self, explain=text)


@dataclass(slots=True, kw_only=True)
class ReportData:
    results_path: str
    info: dict[str, Any]
    config: TraceConfig
    cache: str
    alignment: int
    summary: dict[str, Any]
    x_axis: str  # "time", "seq" (some ts missing) or "seq-no-ts"
    timeline: list[Point]
    histogram: list[Bin]
    groups: list[dict[str, Any]]
    flag_rows: list[dict[str, Any]]
    examples: dict[str, list[Example]]
    trace_path: str | None = None
    trace_note: str | None = None
    explain_note: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return f"Replay report: {self.info.get('trace') or Path(self.results_path).name}"


def summary(res: pl.DataFrame, flags: pl.DataFrame) -> dict[str, Any]:
    """The headline figures; a lookup with several flags counts once."""
    figures = hit_figures(res)
    observed = figures.pop("observed")
    return {
        **figures,
        "flagged_lookups": int(flags["seq"].n_unique()) if flags.height else 0,
        "observed": observed["lookups"],
        "observed_mismatches": observed["mismatches"],
        "mean_hit": float(res["hit_tokens"].mean() or 0.0) if res.height else 0.0,  # type: ignore[arg-type]
        "median_hit": float(res["hit_tokens"].median() or 0.0) if res.height else 0.0,  # type: ignore[arg-type]
    }


def timeline(res: pl.DataFrame) -> tuple[str, list[Point]]:
    """Hit ratio per bin of time (or of seq when any lookup lacks a timestamp)."""
    if res.height == 0:
        return "seq", []
    use_time = "ts" in res.columns and res["ts"].null_count() == 0
    x = pl.col("ts").dt.epoch("us") if use_time else pl.col("seq")
    frame = res.select(
        x.cast(pl.Int64).alias("x"),
        pl.col("hit_tokens").cast(pl.Int64),
        prompt_tokens_expr().cast(pl.Int64).alias("prompt"),
    )
    lo, hi = int(frame["x"].min()), int(frame["x"].max())  # type: ignore[arg-type]
    nbins = min(res.height, TIMELINE_BINS)
    span = hi - lo + 1
    bins = (
        frame.with_columns(((pl.col("x") - lo) * nbins // span).alias("bin"))
        .group_by("bin")
        .agg(
            pl.len().alias("n"),
            pl.col("hit_tokens").sum().alias("hit"),
            pl.col("prompt").sum().alias("prompt"),
            pl.col("x").mean().alias("xm"),
            pl.col("x").min().alias("x0"),
            pl.col("x").max().alias("x1"),
        )
        .sort("bin")
    )
    points = []
    for r in bins.iter_rows(named=True):
        if use_time:
            where = fmt_time(r["x0"], hi - lo)
            if r["x1"] != r["x0"]:
                where += f" – {fmt_time(r['x1'], hi - lo)}"
        else:
            where = f"seq {r['x0']}" + (f"–{r['x1']}" if r["x1"] != r["x0"] else "")
        ratio = r["hit"] / r["prompt"] if r["prompt"] else 0.0
        points.append(
            Point(
                x=float(r["xm"]),
                ratio=ratio,
                lookups=int(r["n"]),
                hit_tokens=int(r["hit"]),
                prompt_tokens=int(r["prompt"]),
                label=f"{where}: {r['n']} lookups, hit ratio {100 * ratio:.1f}% "
                f"({r['hit']} of {r['prompt']} tokens)",
            )
        )
    if use_time:
        return "time", points
    no_ts = "ts" not in res.columns or res["ts"].null_count() == res.height
    return ("seq-no-ts" if no_ts else "seq"), points


def histogram(res: pl.DataFrame, alignment: int) -> list[Bin]:
    """Lookups per hit length, in bars a whole number of alignments wide
    (at most ``HISTOGRAM_BINS`` of them)."""
    if res.height == 0:
        return []
    top = int(res["hit_tokens"].max() or 0)  # type: ignore[arg-type]
    units = top // alignment + 1
    width = alignment * math.ceil(units / HISTOGRAM_BINS)
    counts = res.select((pl.col("hit_tokens") // width).alias("b")).group_by("b").len().sort("b")
    by_bin = {int(b): int(n) for b, n in counts.iter_rows()}
    out = []
    for b in range(top // width + 1):
        lo = b * width
        n = by_bin.get(b, 0)
        what = f"hit {lo} tokens" if width == alignment else f"hit {lo}–{lo + width - 1} tokens"
        out.append(
            Bin(
                lo=lo,
                width=width,
                lookups=n,
                label=str(lo),
                tooltip=f"{what}: {n} lookup{'s' if n != 1 else ''}",
            )
        )
    return out


def groups(res: pl.DataFrame, config: TraceConfig) -> list[dict[str, Any]]:
    """Blocks loaded and skipped per group, summed over every lookup."""
    out = []
    for gid, g in enumerate(config.groups):
        loaded = int(res["loaded_blocks"].list.get(gid).sum() or 0) if res.height else 0
        mask = int(res["mask_blocks"].list.get(gid).sum() or 0) if res.height else 0
        out.append(
            {
                "group_id": gid,
                "label": group_label(config, gid),
                "kind": g.kind.value,
                "block_size": g.block_size,
                "loaded_blocks": loaded,
                "skipped_blocks": mask - loaded,
                "tokens_saved": loaded * g.block_size,
            }
        )
    return out


def flag_rows(flags: pl.DataFrame, lookups: int) -> list[dict[str, Any]]:
    """One row per flag kind that occurs, in ``FLAG_KINDS`` order (kinds this
    version does not know last): lookups flagged, their share, the meaning."""
    counts = (
        {
            str(f): int(n)
            for f, n in flags.group_by("flag").agg(pl.col("seq").n_unique()).iter_rows()
        }
        if flags.height
        else {}
    )
    kinds = [k for k in FLAG_KINDS if k in counts] + sorted(set(counts) - set(FLAG_KINDS))
    return [
        {
            "flag": k,
            "lookups": counts[k],
            "share": counts[k] / lookups if lookups else 0.0,
            "meaning": FLAG_MEANINGS.get(k, ""),
        }
        for k in kinds
    ]


def flag_examples(flags: pl.DataFrame, kinds: list[str], first: int) -> dict[str, list[Example]]:
    """The first ``first`` lookups of each kind, in seq order, one row each."""
    out: dict[str, list[Example]] = {}
    for k in kinds:
        part = flags.filter(pl.col("flag") == k).unique("seq", keep="first", maintain_order=True)
        out[k] = [
            Example(
                flag=k,
                seq=int(r["seq"]),
                request_id=str(r["request_id"]),
                hit_tokens=int(r["hit_tokens"]),
                max_length=int(r["max_length"]),
                group_id=r.get("group_id"),
                actual=r.get("actual"),
                expected=r.get("expected"),
                detail=r.get("detail"),
            )
            for r in part.head(max(first, 0)).iter_rows(named=True)
        ]
    return out
