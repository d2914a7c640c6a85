"""`replay diff`: two replays of one trace, lookup by lookup.

The #43559 trace pins the numbers a reviewer checks (one lookup, +16 tokens,
explained by ``mamba_overrun``); a small seeded workload below exercises many
lookups; hand-made results files pin the explanation rules (flag order,
group ranking) and every bad input.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

from replay.analysis.diff import DIFF_META_KEY, diff_inputs
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.cli import cli
from replay.cli.analysis import diff
from replay.format.link import save_results
from replay.format.results import read_results, write_results
from replay.format.schema import FACT_COLUMNS, RESULTS_SCHEMA
from replay.format.writer import write_trace
from tests.builders import full_mamba, issue_43559_rows, replay_trace

BLOCK = 16


def invoke(args: Sequence[str | os.PathLike[str]]) -> Result:
    return CliRunner().invoke(diff, [str(a) for a in args], catch_exceptions=False)


# ---------------------------------------------------------------- a small workload


def _continue(parent: bytes, n: int, tag: str) -> list[bytes]:
    out = []
    for i in range(n):
        parent = hashlib.sha256(parent + tag.encode() + i.to_bytes(4, "big")).digest()
        out.append(parent)
    return out


def workload_rows(
    n_requests: int = 60, *, seed: int = 7, families: int = 4, timestamps: bool = True
) -> list[dict[str, Any]]:
    """Requests sharing one of a few system prompts, each looked up then stored.

    Attention stores every block of a request, Mamba the state at every second
    block, at the end of the shared prefix and at the end of the request (align
    mode with a two-block prefill chunk). A
    prompt of ``16 n + 1`` tokens asks for ``max_length = 16 n``: the #43559
    shape, where the pre-49502 peek margin lets Mamba's state overrun the
    EAGLE-dropped attention prefix. Every tenth request evicts its family's
    attention blocks past the first two.
    """
    rng = random.Random(seed)
    t0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
    prefixes = [_continue(f"fam{f}".encode(), rng.randint(2, 5), "p") for f in range(families)]
    rows: list[dict[str, Any]] = []
    clock = 0.0

    def add(row: dict[str, Any]) -> None:
        nonlocal clock
        clock += rng.uniform(0.05, 0.4)
        row["ts"] = t0 + timedelta(seconds=clock) if timestamps else None
        rows.append(row)

    for i in range(n_requests):
        prefix = prefixes[rng.randrange(families)]
        hs = prefix + _continue(prefix[-1], rng.randint(0, 3), f"req{i}")
        num_tokens = len(hs) * BLOCK + rng.choice([1, 1, 5, 9])
        add(
            {
                "kind": "lookup",
                "request_id": f"req-{i:03d}",
                "block_hashes": hs,
                "max_length": num_tokens - 1,
                "num_tokens": num_tokens,
            }
        )
        add({"kind": "store", "group_id": 0, "block_hashes": hs, "request_id": f"req-{i:03d}"})
        add(
            {
                "kind": "store",
                "group_id": 1,
                "block_hashes": sorted({*hs[1::2], prefix[-1], hs[-1]}, key=hs.index),
                "request_id": f"req-{i:03d}",
            }
        )
        if i % 10 == 9:
            add({"kind": "remove", "group_id": 0, "block_hashes": prefix[2:]})
    return rows


def write_workload(path: Path, **kwargs: Any) -> Path:
    write_trace(path, full_mamba(), workload_rows(**kwargs))
    return path


# ---------------------------------------------------------------- #43559


def test_diff_policies_43559(trace_43559: Path) -> None:
    res = invoke([trace_43559, "--policy", "vllm-0.33", "--policy", "pre-49502"])
    assert res.exit_code == 0, res.output
    # The alias names its release in this cache beside B; its long note is
    # for the command that makes results with it (`replay run`), not every one.
    assert res.stderr == ""
    lines = res.stdout.splitlines()
    assert lines[0] == "diff of trace t43559.parquet"
    assert lines[2].startswith("  B = pre-49502: policy pre-49502 (here vllm-0.26), coordinator")
    assert lines[3] == "lookups: 1 compared, 1 with a different hit (B higher on 1, lower on 0)"
    assert lines[4] == "hit tokens: A 48, B 64: net +16 (B gains 16, loses 0)"
    reasons = lines[lines.index("explained by:") + 3]
    assert reasons.split() == [
        "flag",
        "mamba_overrun",
        "(corruption)",
        "only",
        "in",
        "B",
        "1",
        "16",
        "0",
        "+16",
    ]
    row = lines[-1].split()
    assert row == [
        "2",
        "req-43559",
        "64",
        "48",
        "64",
        "+16",
        "mamba_overrun",
        "-",
        "mamba_overrun,eagle_not_dropped",
        "1",
    ]


def test_diff_json_43559(trace_43559: Path) -> None:
    res = invoke([trace_43559, "--policy", "vllm-0.33", "--policy", "pre-49502", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [v["policy"] for v in data["variants"]] == ["vllm-0.33", "pre-49502"]
    assert (data["lookups"], data["changed"], data["gained"], data["lost"], data["net"]) == (
        1,
        1,
        16,
        0,
        16,
    )
    assert [v["hit_tokens"] for v in data["variants"]] == [48, 64]
    assert data["reasons"] == [
        {
            "reason": "mamba_overrun",
            "reason_kind": "flag",
            "reason_side": "B",
            "reason_group": None,
            "lookups": 1,
            "gained": 16,
            "lost": 0,
            "net": 16,
            "severity": "corruption",
        }
    ]
    (lk,) = data["changed_lookups"]
    assert (lk["seq"], lk["request_id"], lk["hit_a"], lk["hit_b"], lk["delta"]) == (
        2,
        "req-43559",
        48,
        64,
        16,
    )
    assert lk["flags_only_a"] == []
    assert lk["flags_only_b"] == ["mamba_overrun", "eagle_not_dropped"]
    assert lk["groups_changed"] == [1]
    assert lk["group_hit_tokens_a"] == [48, 48]
    assert lk["group_hit_tokens_b"] == [48, 64]


def test_diff_reversed_sides_lose_tokens(trace_43559: Path) -> None:
    d = diff_inputs([trace_43559], ["pre-49502", "vllm-0.33"])
    assert (d.changed, d.gained, d.lost) == (1, 0, 16)
    assert d.reasons.row(0, named=True)["reason_side"] == "A"
    assert d.reasons.row(0, named=True)["net"] == -16


def test_diff_results_files_43559(tmp_path: Path, trace_43559: Path) -> None:
    a, b = tmp_path / "a.results.parquet", tmp_path / "b.results.parquet"
    for path, policy in ((a, "vllm-0.33"), (b, "pre-49502")):
        r = CliRunner().invoke(
            cli,
            ["run", str(trace_43559), "--policy", policy, "-o", str(path), "-q"],
        )
        assert r.exit_code == 0, r.output
    res = invoke([a, b])
    assert res.exit_code == 0, res.output
    assert (
        f"  A = vllm-0.33: policy vllm-0.33, coordinator reference, cache mooncake ({a})"
        in res.output
    )
    assert "hit tokens: A 48, B 64: net +16 (B gains 16, loses 0)" in res.output
    assert "flag mamba_overrun (corruption)  only in B        1      16     0  +16" in res.output


def test_diff_output_parquet(tmp_path: Path, trace_43559: Path) -> None:
    out = tmp_path / "diff.parquet"
    res = invoke([trace_43559, "--policy", "vllm-0.33", "--policy", "pre-49502", "-o", out])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[-1] == f"wrote 1 changed lookups to {out}"
    table = pq.read_table(out)
    meta = json.loads(table.schema.metadata[DIFF_META_KEY])
    assert (meta["changed"], meta["net"], meta["trace"]) == (1, 16, "t43559.parquet")
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    assert frame.select("seq", "hit_a", "hit_b", "delta", "reason").rows() == [
        (2, 48, 64, 16, "mamba_overrun")
    ]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_diff_same_policy_twice_is_empty(trace_43559: Path) -> None:
    res = invoke([trace_43559, "--policy", "pre-49502", "--policy", "pre-49502", "--json"])
    data = json.loads(res.stdout)
    assert (res.exit_code, data["changed"], data["net"], data["reasons"]) == (0, 0, 0, [])


# ---------------------------------------------------------------- a workload


def test_diff_workload(tmp_path: Path) -> None:
    trace = write_workload(tmp_path / "work.parquet")
    d = diff_inputs([trace], ["vllm-0.33", "pre-49502"])
    a = replay_trace(trace, policy="vllm-0.33").results
    b = replay_trace(trace, policy="pre-49502").results
    # Totals agree with the two replays themselves.
    assert d.hit_tokens_a == a["hit_tokens"].sum()
    assert d.hit_tokens_b == b["hit_tokens"].sum()
    assert d.gained - d.lost == d.hit_tokens_b - d.hit_tokens_a
    expected_changed = int((a["hit_tokens"] != b["hit_tokens"]).sum())
    assert d.changed == expected_changed
    # B only ever gains, and every change is #43559: Mamba resumes past the
    # attention-verified prefix, by one or two of its sparse state blocks.
    assert d.reasons.select("reason", "reason_side").rows() == [("mamba_overrun", "B")]
    deltas = d.lookups["delta"].value_counts().sort("delta").rows()
    # Pinned numbers of this seeded workload.
    assert deltas == [(16, 23), (32, 33)]
    assert (d.compared, d.changed, d.gained, d.lost) == (60, 56, 1424, 0)
    assert (d.hit_tokens_a, d.hit_tokens_b) == (1792, 3216)


# ---------------------------------------------------------------- explanation rules


def _results(
    path: Path,
    rows: list[dict[str, Any]],
    *,
    policy: str = "vllm-0.33",
    trace: str = "t.parquet",
    config: TraceConfig | None = None,
) -> Path:
    config = config or full_mamba()
    cols: dict[str, list[Any]] = {
        k: [r.get(k) for r in rows]
        for k in (
            "seq",
            "request_id",
            "max_length",
            "hit_tokens",
            "mask_blocks",
            "loaded_blocks",
            "group_hit_tokens",
        )
    }
    cols["flags"] = [r.get("flags", []) for r in rows]
    cols["flag_details"] = [
        [{"flag": f, "group_id": None, "actual": None, "expected": None, "detail": f} for f in fl]
        for fl in cols["flags"]
    ]
    # A results file as written before the facts columns: its flags are read as given.
    schema = pa.schema([f for f in RESULTS_SCHEMA if f.name not in FACT_COLUMNS])
    table = pa.table(
        {name: cols.get(name, [None] * len(rows)) for name in schema.names}, schema=schema
    )
    meta = {
        "version": 1,
        "coordinator": "reference",
        "policy": policy,
        "kv_cache_groups": [g.to_json() for g in config.groups],
        "trace_config": config.to_json(),
        "trace": trace,
    }
    return write_results(path, table, meta)


def _row(seq: int, hit: int, group_hits: list[int], **kw: Any) -> dict[str, Any]:
    return {
        "seq": seq,
        "request_id": f"r{seq}",
        "max_length": 128,
        "hit_tokens": hit,
        "mask_blocks": kw.get("mask", [hit // BLOCK, hit // BLOCK]),
        "loaded_blocks": kw.get("loaded", [hit // BLOCK, 1 if hit else 0]),
        "group_hit_tokens": group_hits,
        "flags": kw.get("flags", []),
    }


def test_explanation_rules(tmp_path: Path) -> None:
    a = _results(
        tmp_path / "a.parquet",
        [
            _row(1, 64, [64, 64]),
            _row(2, 64, [64, 64]),
            _row(3, 64, [64, 64], flags=["observed_mismatch"]),
            _row(4, 32, [32, 32]),
            _row(5, 32, [32, 32]),
        ],
        policy="pre-49502",
    )
    b = _results(
        tmp_path / "b.parquet",
        [
            # Mamba's own hit fell, attention followed by the same amount: Mamba.
            _row(1, 32, [32, 32]),
            # Only attention's own hit moved: attention.
            _row(2, 48, [48, 64]),
            # A flag beats a group; observed_mismatch gone from B, so "only in A".
            _row(3, 48, [48, 48]),
            # Both a flag kind earlier in FLAG_KINDS and a later one: the earlier wins.
            _row(4, 48, [48, 48], flags=["eagle_not_dropped", "mamba_state_mismatch"]),
            # Same hit, different masks: not a changed lookup, but counted.
            _row(5, 32, [32, 32], loaded=[1, 1]),
        ],
    )
    d = diff_inputs([a, b])
    assert (d.a.label, d.b.label) == ("pre-49502", "vllm-0.33")
    got = d.lookups.select("seq", "delta", "reason", "reason_kind", "reason_side", "reason_group")
    assert got.rows() == [
        (1, -32, "group 1: mamba block=16 (mamba)", "group", None, 1),
        (2, -16, "group 0: full_attention block=16 (attn)", "group", None, 0),
        (3, -16, "observed_mismatch", "flag", "A", None),
        (4, 16, "mamba_state_mismatch", "flag", "B", None),
    ]
    assert d.same_hit_groups_changed == 1
    assert (d.gained, d.lost) == (16, 64)
    # Largest |net| first.
    assert d.reasons.select("reason", "lookups", "net").rows() == [
        ("group 1: mamba block=16 (mamba)", 1, -32),
        ("group 0: full_attention block=16 (attn)", 1, -16),
        ("observed_mismatch", 1, -16),
        ("mamba_state_mismatch", 1, 16),
    ]
    text = invoke([a, b]).output
    assert "same hit, different group masks or group hits: 1 lookup" in text
    assert "lookups: 5 compared, 4 with a different hit (B higher on 1, lower on 3)" in text


def test_mask_only_difference_without_group_hits(tmp_path: Path) -> None:
    row_a = _row(1, 64, [64, 64]) | {"group_hit_tokens": None}
    row_b = _row(1, 48, [48, 48]) | {"group_hit_tokens": None}
    a = _results(tmp_path / "a.parquet", [row_a])
    b = _results(tmp_path / "b.parquet", [row_b], policy="pre-49502")
    d = diff_inputs([a, b])
    assert d.lookups.select("reason_group", "groups_changed").rows() == [(0, [0, 1])]


def test_unexplained_when_nothing_else_differs(tmp_path: Path) -> None:
    a = _results(tmp_path / "a.parquet", [_row(1, 64, [64, 64], mask=[4, 4], loaded=[4, 1])])
    b = _results(
        tmp_path / "b.parquet",
        [_row(1, 48, [64, 64], mask=[4, 4], loaded=[4, 1])],
        policy="pre-49502",
    )
    d = diff_inputs([a, b])
    assert d.lookups.select("reason", "reason_kind").rows() == [("unexplained", "none")]


# ---------------------------------------------------------------- bad input


def _two_results(tmp_path: Path, trace: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.results.parquet", tmp_path / "b.results.parquet"
    save_results(replay_trace(trace, policy="vllm-0.33"), a)
    save_results(replay_trace(trace, policy="pre-49502"), b)
    return a, b


def _error(args: Sequence[Any]) -> str:
    res = invoke(args)
    assert res.exit_code == 2, res.output
    lines = res.output.splitlines()
    assert len(lines) == 1, res.output
    return lines[0]


def test_results_given_for_a_trace_lead_to_it(tmp_path: Path, trace_43559: Path) -> None:
    """One results file and two policies: its trace is replayed (it was
    refused before results led back); a changed trace is refused."""
    a, _ = _two_results(tmp_path, trace_43559)
    both = ["--policy", "vllm-0.33", "--policy", "pre-49502"]
    res = invoke([a, *both])
    assert res.exit_code == 0, res.output
    assert res.output == invoke([trace_43559, *both]).output
    write_trace(trace_43559, full_mamba(), issue_43559_rows()[:2])
    out = tmp_path / "d.parquet"
    assert _error([a, *both, "-o", out]).startswith(
        f"error: {a}: its trace {trace_43559} has changed since these results were made "
    )
    assert not out.exists()


def test_bad_trace_given_for_results(tmp_path: Path, trace_43559: Path) -> None:
    a, _ = _two_results(tmp_path, trace_43559)
    assert _error([trace_43559, a]) == (
        f"error: {trace_43559}: is not a results file (no 'replay.results' metadata), expected "
        "the output of `replay run`; to replay a trace give it once with --policy twice"
    )


def test_bad_one_policy(trace_43559: Path) -> None:
    assert _error([trace_43559, "--policy", "pre-49502"]) == (
        f"error: {trace_43559}: a trace needs two sides to diff: give --policy twice "
        "(e.g. --policy vllm-0.33 --policy pre-49502), --cache twice "
        "(--cache mooncake --cache gpu) or --coordinator twice"
    )


def test_bad_three_policies(trace_43559: Path) -> None:
    assert (
        _error(
            [trace_43559, "--policy", "pre-49502", "--policy", "vllm-0.33", "--policy", "vllm-0.33"]
        )
        == "error: --policy given 3 times, expected at most twice (side A, side B)"
    )


def test_bad_policy_with_results_files(tmp_path: Path, trace_43559: Path) -> None:
    a, b = _two_results(tmp_path, trace_43559)
    assert _error([a, b, "--policy", "pre-49502"]).startswith(
        "error: --policy/--coordinator/--cache replay a trace; two results files are "
        "compared as they are"
    )


def test_bad_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "nope.parquet"
    assert _error([p, "--policy", "vllm-0.33", "--policy", "pre-49502"]) == (
        f"error: {p}: no such file"
    )


def test_bad_results_of_different_traces(tmp_path: Path, trace_43559: Path) -> None:
    a, _ = _two_results(tmp_path, trace_43559)
    other = write_workload(tmp_path / "work.parquet", n_requests=3)
    b = tmp_path / "other.results.parquet"
    save_results(replay_trace(other), b)
    out = tmp_path / "d.parquet"
    assert _error([a, b, "-o", out]) == (
        f"error: {b}: results of trace 'work.parquet', but {a} is of trace 't43559.parquet' "
        "(expected two results files of the same trace)"
    )
    assert not out.exists()


def test_bad_results_of_different_configs(tmp_path: Path) -> None:
    a = _results(tmp_path / "a.parquet", [_row(1, 64, [64, 64])])
    other = TraceConfig(
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16, name="attn"),
            GroupSpec(kind=GroupKind.MAMBA, block_size=16, mamba_cache_mode="align", name="mamba"),
        ),
        hash_block_size=16,
        scheduler_block_size=16,
        use_eagle=False,
    )
    b = _results(tmp_path / "b.parquet", [_row(1, 64, [64, 64])], config=other)
    msg = _error([a, b])
    assert msg.startswith(f"error: {b}: KV-cache config ")
    assert msg.endswith("(expected two results files of the same trace)")


def test_bad_results_with_different_lookups(tmp_path: Path) -> None:
    a = _results(tmp_path / "a.parquet", [_row(1, 64, [64, 64]), _row(2, 64, [64, 64])])
    b = _results(tmp_path / "b.parquet", [_row(1, 64, [64, 64]), _row(3, 64, [64, 64])])
    assert _error([a, b]) == (
        f"error: {b}: has 2 lookups, {a} has 2 and they share 1 seqs, expected the same "
        "lookups (results of the same trace)"
    )


def test_bad_results_that_saw_different_stores(tmp_path: Path) -> None:
    # Same name, config and lookups, but another event log: the store each
    # lookup saw (unit_present, written on request) gives it away.
    rows = issue_43559_rows()
    t1 = tmp_path / "one" / "t.parquet"
    t2 = tmp_path / "two" / "t.parquet"
    t1.parent.mkdir()
    t2.parent.mkdir()
    write_trace(t1, full_mamba(), rows)
    write_trace(
        t2,
        full_mamba(),
        [rows[0], {**rows[1], "block_hashes": rows[1]["block_hashes"][:2]}, rows[2]],
    )
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    save_results(replay_trace(t1, unit_present=True), a)
    save_results(replay_trace(t2, unit_present=True), b)
    assert read_results(a)[0]["seq"].to_list() == read_results(b)[0]["seq"].to_list()
    assert _error([a, b]) == (
        f"error: {b}: seq 2: the lookup saw a different store than in {a} "
        "(expected results of the same trace)"
    )


@pytest.mark.parametrize("n", [0, 3])
def test_bad_path_count(tmp_path: Path, n: int) -> None:
    paths = [tmp_path / f"{i}.parquet" for i in range(n)]
    res = invoke(paths)
    assert res.exit_code == 2
    if n == 3:
        assert res.output.strip() == (
            "error: expected a trace (with --policy twice) or two results files, got 3 paths"
        )
