"""The figures of a report, from results frames built here
(analysis/report/data.py): each as a user reads it off the page."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import polars as pl

from replay.analysis.report import data
from replay.analysis.report.data import Example
from tests.builders import full_mamba

T0 = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)


def _results(hits: list[int], **columns: list[object]) -> pl.DataFrame:
    """A results frame: prompts of 100 tokens unless ``num_tokens`` says otherwise."""
    n = len(hits)
    base: dict[str, list[object]] = {
        "seq": list(range(0, 2 * n, 2)),
        "request_id": [f"r{i}" for i in range(n)],
        "max_length": [99] * n,
        "num_tokens": [100] * n,
        "hit_tokens": list(hits),
    }
    return pl.DataFrame({**base, **columns})


def _flags(rows: list[tuple[str, int]]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "seq": [s for _, s in rows],
            "request_id": [f"r{s // 2}" for _, s in rows],
            "hit_tokens": [64] * len(rows),
            "max_length": [99] * len(rows),
            "flag": [f for f, _ in rows],
        }
    )


def test_summary_counts_a_lookup_with_two_flags_once() -> None:
    res = _results([0, 64, 32], observed_hit_tokens=[0, 48, None])
    flags = _flags([("mamba_overrun", 2), ("eagle_not_dropped", 2), ("eagle_not_dropped", 4)])
    assert data.summary(res, flags) == {
        "lookups": 3,
        "lookups_with_hit": 2,
        "prompt_tokens": 300,
        "hit_tokens": 96,
        "hit_ratio": 0.32,
        "flagged_lookups": 2,
        "by_severity": {"corruption": 1, "inconsistent": 0, "performance": 2, "observed": 0},
        "observed": 2,
        "observed_mismatches": 1,
        "mean_hit": 32.0,
        "median_hit": 32.0,
    }


def test_timeline_by_seq_without_timestamps() -> None:
    x_axis, points = data.timeline(_results([50, 0, 100]))
    assert x_axis == "seq-no-ts"
    # One lookup per bin: each point is that lookup, hit over its 100-token prompt.
    assert [(p.x, p.ratio, p.lookups, p.hit_tokens, p.prompt_tokens) for p in points] == [
        (0.0, 0.5, 1, 50, 100),
        (2.0, 0.0, 1, 0, 100),
        (4.0, 1.0, 1, 100, 100),
    ]
    assert [p.label for p in points] == [
        "seq 0: 1 lookup, hit ratio 50.00% (50 of 100 tokens)",
        "seq 2: 1 lookup, hit ratio 0.00% (0 of 100 tokens)",
        "seq 4: 1 lookup, hit ratio 100.00% (100 of 100 tokens)",
    ]


def test_timeline_by_seq_when_some_timestamps_are_missing() -> None:
    res = _results([10, 20], ts=[T0, None])
    assert data.timeline(res)[0] == "seq"


def test_timeline_bins_by_time_at_most_40() -> None:
    n = 100
    res = _results([i % 3 * 10 for i in range(n)], ts=[T0 + timedelta(seconds=i) for i in range(n)])
    x_axis, points = data.timeline(res)
    assert x_axis == "time"
    assert len(points) == data.TIMELINE_BINS == 40
    assert sum(p.lookups for p in points) == n
    assert sum(p.hit_tokens for p in points) == int(res["hit_tokens"].sum())
    # 99 s over 40 bins: the first bin holds seconds 0-2, said as clock times.
    assert points[0].lookups == 3
    assert points[0].label == "12:00:00 – 12:00:02: 3 lookups, hit ratio 10.00% (30 of 300 tokens)"


def test_timeline_empty() -> None:
    assert data.timeline(_results([])) == ("seq", [])


def test_histogram_one_bar_per_alignment() -> None:
    bins = data.histogram(_results([0, 16, 16, 48]), 16)
    # No hit is a bar of its own (issue 26: its bar held every hit under a width).
    assert [(b.lo, b.width, b.lookups, b.label) for b in bins] == [
        (0, 1, 1, "0"),
        (16, 16, 2, "16"),
        (32, 16, 0, "32"),
        (48, 16, 1, "48"),
    ]
    assert [b.tooltip for b in bins] == [
        "no hit: 1 lookup",
        "hit 16 tokens: 2 lookups",
        "hit 32 tokens: 0 lookups",
        "hit 48 tokens: 1 lookup",
    ]


def test_histogram_empty() -> None:
    assert data.histogram(_results([]), 16) == []


def test_groups_sum_loaded_and_skipped_blocks() -> None:
    res = _results(
        [48, 64],
        loaded_blocks=[[3, 1], [4, 1]],
        mask_blocks=[[3, 3], [4, 4]],
    )
    assert data.groups(res, full_mamba()) == [
        {
            "group_id": 0,
            "label": "0: full_attention block=16 (attn)",
            "kind": "full_attention",
            "block_size": 16,
            "loaded_blocks": 7,
            "skipped_blocks": 0,
            "tokens_saved": 112,
        },
        {
            "group_id": 1,
            "label": "1: mamba block=16 (mamba)",
            "kind": "mamba",
            "block_size": 16,
            "loaded_blocks": 2,
            "skipped_blocks": 5,
            "tokens_saved": 32,
        },
    ]


def test_flag_rows_worst_severity_first_unknown_kinds_last() -> None:
    flags = _flags(
        [("zz_new", 0), ("eagle_not_dropped", 2), ("mamba_overrun", 2), ("eagle_not_dropped", 4)]
    )
    assert data.flag_rows(flags, 4) == [
        {
            "flag": "mamba_overrun",
            "severity": "corruption",
            "lookups": 1,
            "share": 0.25,
            "meaning": "Mamba resumes recurrent state past the hit or the attention KV it loads (#43559)",
        },
        {
            "flag": "eagle_not_dropped",
            "severity": "performance",
            "lookups": 2,
            "share": 0.5,
            "meaning": "EAGLE is on but the hit covers the whole present prefix (nothing left to recompute)",
        },
        # A flag of a newer version: inconsistent until this version knows it, listed last.
        {
            "flag": "zz_new",
            "severity": "inconsistent",
            "lookups": 1,
            "share": 0.25,
            "meaning": "",
        },
    ]
    assert data.flag_rows(_flags([]), 0) == []


def test_flag_examples_first_n_per_kind_one_per_lookup() -> None:
    flags = _flags([("eagle_not_dropped", 2), ("eagle_not_dropped", 2), ("eagle_not_dropped", 6)])
    flags = flags.with_columns(
        pl.Series("group_id", [0, 1, 0]), pl.Series("detail", ["a", "b", "c"])
    )

    def shown(seq: int, detail: str) -> Example:
        return Example(
            flag="eagle_not_dropped",
            seq=seq,
            request_id=f"r{seq // 2}",
            hit_tokens=64,
            max_length=99,
            group_id=0,
            detail=detail,
        )

    assert data.flag_examples(flags, ["eagle_not_dropped"], 5) == {
        "eagle_not_dropped": [shown(2, "a"), shown(6, "c")]
    }
    assert data.flag_examples(flags, ["eagle_not_dropped"], 1)["eagle_not_dropped"][0].seq == 2
    assert data.flag_examples(flags, ["eagle_not_dropped"], 0) == {"eagle_not_dropped": []}


def test_histogram_bins_widen_for_long_hits() -> None:
    import polars as pl

    frame = pl.DataFrame({"hit_tokens": [0, 16, 47, 48, 1000]})
    bins = data.histogram(frame, 16)
    # No hit is a bar of its own; then 63 alignments up to 1000 in at most
    # 29 bars: bars of 3 alignments (48 tokens) from 16 on, 21 of them.
    assert (len(bins), [b.width for b in bins[:2]], bins[-1].width) == (22, [1, 48], 48)
    assert [b.tooltip for b in bins[:2]] == ["no hit: 1 lookup", "hit 16–63 tokens: 3 lookups"]
    assert bins[-1].lookups == 1
