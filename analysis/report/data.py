"""What the report shows, computed from a results frame alone: the summary
figures, the hit ratio per bin of time (or seq), the hit-length histogram,
the tokens each KV-cache group loaded, and the flags with their first
examples. No I/O and no formatting of pages: ``build`` fills these in,
``html`` and ``markdown`` only lay them out."""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import polars as pl

from replay.analysis.flags import FLAGS, SEVERITIES, by_severity, severity
from replay.analysis.report.fmt import fmt_time, pct
from replay.analysis.summary import hit_figures, prompt_tokens_expr
from replay.base.spec import TraceConfig
from replay.tools.render import group_label

TIMELINE_BINS = 40
HISTOGRAM_BINS = 30

#: What each flag means, as the report words it (from ``replay.analysis.flags.FLAGS``).
FLAG_MEANINGS: dict[str, str] = {name: kind.meaning for name, kind in FLAGS.items()}


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

    def explain_command(self, e: Example) -> str:
        """The whole ``replay explain`` command line behind an example's table,
        as it runs from where the report was made (the trace as it was found)."""
        return shlex.join(
            [
                "replay",
                "explain",
                str(self.trace_path),
                "--request",
                e.request_id,
                "--seq",
                str(e.seq),
                "--policy",
                str(self.info.get("policy")),
                "--cache",
                self.cache,
            ]
        )

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
        "by_severity": lookups_by_severity(flags),
        "observed": observed["lookups"],
        "observed_mismatches": observed["mismatches"],
        "mean_hit": float(res["hit_tokens"].mean() or 0.0) if res.height else 0.0,  # type: ignore[arg-type]
        "median_hit": float(res["hit_tokens"].median() or 0.0) if res.height else 0.0,  # type: ignore[arg-type]
    }


def lookups_by_severity(flags: pl.DataFrame) -> dict[str, int]:
    """Lookups with at least one flag of each severity (a lookup counts under
    every severity it has)."""
    names = flags["flag"].unique().to_list() if flags.height else []
    return {
        sev: int(
            flags.filter(pl.col("flag").is_in([f for f in names if severity(f) == sev]))[
                "seq"
            ].n_unique()
        )
        for sev in SEVERITIES
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
                label=f"{where}: {r['n']:,} lookup{'s' if r['n'] != 1 else ''}, hit ratio {pct(ratio)} "
                f"({r['hit']:,} of {r['prompt']:,} tokens)",
            )
        )
    if use_time:
        return "time", points
    no_ts = "ts" not in res.columns or res["ts"].null_count() == res.height
    return ("seq-no-ts" if no_ts else "seq"), points


def histogram(res: pl.DataFrame, alignment: int) -> list[Bin]:
    """Lookups per hit length: the lookups with no hit in a bar of their own,
    then the hits in bars a whole number of alignments wide, from one
    alignment up (at most ``HISTOGRAM_BINS`` bars in all)."""
    if res.height == 0:
        return []
    hits = res["hit_tokens"]
    top = int(hits.max() or 0)  # type: ignore[arg-type]
    none = int((hits == 0).sum())
    out = [
        Bin(
            lo=0,
            width=1,
            lookups=none,
            label="0",
            tooltip=f"no hit: {none} lookup{'s' if none != 1 else ''}",
        )
    ]
    if top == 0:
        return out
    units = -(-top // alignment)  # alignments up to the longest hit
    width = alignment * math.ceil(units / (HISTOGRAM_BINS - 1))
    # Bar b holds the hits in [a + b * width, a + (b + 1) * width); a hit
    # shorter than one alignment (misaligned) goes in the first.
    counts = (
        res.filter(pl.col("hit_tokens") > 0)
        .select(((pl.col("hit_tokens") - alignment) // width).clip(lower_bound=0).alias("b"))
        .group_by("b")
        .len()
    )
    by_bin = {int(b): int(n) for b, n in counts.iter_rows()}
    for b in range(max(top - alignment, 0) // width + 1):
        lo = alignment + b * width
        n = by_bin.get(b, 0)
        what = (
            f"hit {lo:,} tokens" if width == alignment else f"hit {lo:,}–{lo + width - 1:,} tokens"
        )
        out.append(
            Bin(
                lo=lo,
                width=width,
                lookups=n,
                label=f"{lo:,}",
                tooltip=f"{what}: {n:,} lookup{'s' if n != 1 else ''}",
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
    """One row per flag kind that occurs, worst severity first (each
    severity's in ``FLAG_KINDS`` order, kinds this version does not know
    last): its severity, lookups flagged, their share, the meaning."""
    counts = (
        {
            str(f): int(n)
            for f, n in flags.group_by("flag").agg(pl.col("seq").n_unique()).iter_rows()
        }
        if flags.height
        else {}
    )
    return [
        {
            "flag": k,
            "severity": severity(k),
            "lookups": counts[k],
            "share": counts[k] / lookups if lookups else 0.0,
            "meaning": FLAG_MEANINGS.get(k, ""),
        }
        for k in by_severity(list(counts))
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
