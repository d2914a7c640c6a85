"""Flags: minimal cases for each kind, #43559 under both policies, and the
polars code against a plain-Python recomputation from the store."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from analysis.flags import FLAG_KINDS, compute_flags, flag_counts
from replay.coordinator import build_spec_groups
from replay.engine import replay_trace
from replay.spec import GroupKind, GroupSpec, TraceConfig
from replay.trace import write_trace
from tests.conftest import FULL, MAMBA, SWA, chain, full_mamba, issue_43559_rows, run_cli
from tests.randtrace import random_config, random_rows


def _flags(
    tmp_path: Path, config: TraceConfig, rows: list[dict[str, Any]], policy: str = "vllm-0.33"
) -> pl.DataFrame:
    path = write_trace(tmp_path / "t.parquet", config, rows)
    result = replay_trace(path, policy=policy)
    return compute_flags(result.results, config)


def test_mamba_overrun_43559_flagged_under_pre_49502_only(tmp_path: Path) -> None:
    clean = _flags(tmp_path, full_mamba(), issue_43559_rows())
    assert clean.height == 0
    bad = _flags(tmp_path, full_mamba(), issue_43559_rows(), "pre-49502")
    assert bad.select("flag", "group_id", "actual", "expected").rows() == [
        ("mamba_overrun", 1, 64, 48),
        ("eagle_not_dropped", 0, 64, 64),
    ]
    assert (
        bad["detail"][0]
        == "group 1 resumes Mamba state at 64, 16 tokens past the attention-verified prefix 48"
    )


def test_check_cli_exit_codes_and_json(trace_43559: Path) -> None:
    ok = run_cli(["check", str(trace_43559)])
    assert (ok.exit_code, ok.stdout) == (0, f"{trace_43559}: clean under vllm-0.33 (no flags)\n")
    bad = run_cli(["check", str(trace_43559), "--policy", "pre-49502", "--json"])
    assert bad.exit_code == 1
    import json

    data = json.loads(bad.stdout)
    assert data["counts"] == {"eagle_not_dropped": 1, "mamba_overrun": 1}
    assert data["flags"][0] | {"detail": ""} == {
        "seq": 2,
        "request_id": "req-43559",
        "flag": "mamba_overrun",
        "group_id": 1,
        "hit_tokens": 64,
        "max_length": 64,
        "actual": 64,
        "expected": 48,
        "detail": "",
    }


def test_check_results_file(tmp_path: Path, trace_43559: Path) -> None:
    out = tmp_path / "r.parquet"
    assert (
        run_cli(["run", str(trace_43559), "--policy", "pre-49502", "-o", str(out), "-q"]).exit_code
        == 0
    )
    res = run_cli(["check", str(out)])
    assert res.exit_code == 1
    assert (
        res.stdout.splitlines()[0]
        == f"{out}: 1 flagged lookup(s) under pre-49502 (eagle_not_dropped 1, mamba_overrun 1)"
    )
    frame = pl.read_parquet(out)
    assert frame["flags"].to_list() == [["mamba_overrun", "eagle_not_dropped"]]


def _result_frame(tmp_path: Path) -> tuple[pl.DataFrame, TraceConfig]:
    path = write_trace(tmp_path / "t.parquet", full_mamba(), issue_43559_rows())
    result = replay_trace(path)
    return result.results, result.config


# A correct coordinator never raises these: feed the checks a wrong answer,
# as a broken coordinator (or a broken vLLM) would give.
WRONG_ANSWERS = {
    "hit_beyond_max_length": ({"hit_tokens": 80, "mask_blocks": [5, 5]}, (80, 64)),
    "hit_misaligned": ({"hit_tokens": 40}, (40, 32)),
    "mamba_state_mismatch": ({"hit_tokens": 32, "mask_blocks": [2, 3]}, (48, 32)),
    "observed_mismatch": ({"observed_hit_tokens": 64}, (48, 64)),
}


@pytest.mark.parametrize("flag", sorted(WRONG_ANSWERS))
def test_wrong_answers_are_flagged(tmp_path: Path, flag: str) -> None:
    results, config = _result_frame(tmp_path)
    change, (actual, expected) = WRONG_ANSWERS[flag]
    wrong = results.with_columns(
        [pl.lit(v, dtype=results.schema[k]).alias(k) for k, v in change.items()]
    )
    flags = compute_flags(wrong, config)
    row = flags.filter(pl.col("flag") == flag)
    assert row.select("actual", "expected").rows() == [(actual, expected)]
    assert compute_flags(results, config).height == 0


def test_missing_block_when_the_hit_relies_on_an_absent_block(tmp_path: Path) -> None:
    hs = chain(4)
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": [hs[0], hs[2], hs[3]]},
        {"kind": "store", "group_id": 1, "block_hashes": hs},
        {"kind": "lookup", "request_id": "gap", "block_hashes": hs, "max_length": 63},
    ]
    path = write_trace(tmp_path / "t.parquet", full_mamba(eagle=False), rows)
    result = replay_trace(path)
    assert result.results["hit_tokens"].to_list() == [16]
    # A coordinator that skipped the hole in full attention:
    wrong = result.results.with_columns(
        pl.lit(48, pl.Int64).alias("hit_tokens"),
        pl.lit([3, 3], dtype=pl.List(pl.Int32)).alias("mask_blocks"),
    )
    flags = compute_flags(wrong, result.config)
    assert flags.filter(pl.col("flag") == "missing_block").select("group_id", "actual").rows() == [
        (0, 1)
    ]


def test_eagle_not_dropped_when_nothing_is_recomputed(tmp_path: Path) -> None:
    results, config = _result_frame(tmp_path)
    wrong = results.with_columns(
        pl.lit(64, pl.Int64).alias("hit_tokens"),
        pl.lit([4, 4], dtype=pl.List(pl.Int32)).alias("mask_blocks"),
    )
    flags = compute_flags(wrong, config)
    assert flag_counts(flags) == {"eagle_not_dropped": 1, "mamba_overrun": 1}


def test_swa_mamba_overrun_under_pre_49502(tmp_path: Path) -> None:
    config = TraceConfig(
        groups=(
            GroupSpec(kind=SWA, block_size=16, sliding_window=32),
            GroupSpec(kind=MAMBA, block_size=16, mamba_cache_mode="align"),
        ),
        hash_block_size=16,
        scheduler_block_size=16,
        use_eagle=True,
    )
    hs = chain(6)
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": hs},
        {"kind": "store", "group_id": 1, "block_hashes": hs},
        {"kind": "lookup", "request_id": "r", "block_hashes": hs[:5], "max_length": 79},
    ]
    assert _flags(tmp_path, config, rows).height == 0
    pre = _flags(tmp_path, config, rows, "pre-49502")
    assert pre.filter(pl.col("flag") == "mamba_overrun").select("actual", "expected").rows() == [
        (80, 64)
    ]


# ----------------------------------------------- plain-Python recomputation


def _python_flags(
    rows: list[dict[str, Any]], results: pl.DataFrame, config: TraceConfig
) -> set[tuple[int, str, int | None]]:
    """The flag definitions of analysis/flags.py, recomputed with a plain fold."""
    keys: list[set[bytes]] = [set() for _ in config.groups]
    lookups: dict[int, list[list[bool]]] = {}
    for row in rows:
        if row["kind"] == "store":
            keys[row["group_id"]].update(row["block_hashes"])
        elif row["kind"] == "remove":
            keys[row["group_id"]].difference_update(row["block_hashes"])
        elif row["kind"] == "clear":
            for g, s in enumerate(keys):
                if row["group_id"] in (None, g):
                    s.clear()
        else:
            lookups[row["seq"]] = [[h in s for h in row["block_hashes"]] for s in keys]
    eagle = {g: sg.eagle for sg in build_spec_groups(config) for g in sg.group_ids}
    hbs, a = config.hash_block_size, config.alignment
    out: set[tuple[int, str, int | None]] = set()
    for r in results.iter_rows(named=True):
        seq, H, M = r["seq"], r["hit_tokens"], r["max_length"]
        units = lookups[seq]
        n = len(units[0])
        if H > M:
            out.add((seq, "hit_beyond_max_length", None))
        if H % a:
            out.add((seq, "hit_misaligned", None))
        if r["observed_hit_tokens"] is not None and r["observed_hit_tokens"] != H:
            out.add((seq, "observed_mismatch", None))
        verified = []
        for g, spec in enumerate(config.groups):
            bs = spec.block_size
            k = bs // hbs
            blocks = [units[g][(j + 1) * k - 1] for j in range(n // k)]
            fine = config.enable_partial_hash_hits and spec.kind in (FULL, MAMBA) and bs > hbs
            missing: list[int] = []
            if spec.kind is FULL:
                cap = (
                    min(M + ((hbs if fine else bs) if eagle[g] else 0), n * hbs) if eagle[g] else M
                )
                run = 0
                while run < min(cap // bs, len(blocks)) and blocks[run]:
                    run += 1
                C = run * bs
                if fine:
                    for u in range(min(run * k + k - 1, cap // hbs, n) - 1, run * k - 1, -1):
                        if units[g][u]:
                            C = (u + 1) * hbs
                            break
                V = C - (min(a, bs) if eagle[g] else 0) if C > 0 else 0
                verified.append(V - V % a)
                missing += [j for j in range(H // bs) if j >= len(blocks) or not blocks[j]]
                tail_units = range(H // hbs - 1, min((H // bs + 1) * k, n))
                if fine and H % bs and not any(units[g][u] for u in tail_units):
                    missing.append(H // bs)
                if eagle[g] and H > 0 and H >= C:
                    out.add((seq, "eagle_not_dropped", g))
            elif spec.kind is SWA:
                need = -(-((spec.coverage_window or 0) - 1) // bs)
                shift = 1 if eagle[g] else 0
                # P is served when the window's blocks before P are present
                # (none below block 0), with EAGLE also the block at P.
                best, run = 0, 0
                for j, here in enumerate(blocks):
                    run = run + 1 if here else 0
                    P = (j + 1 - shift) * bs
                    if (
                        here
                        and P <= M
                        and j < M // bs + shift
                        and P % a == 0
                        and run >= min(need + shift, j + 1)
                    ):
                        best = max(best, P)
                verified.append(best)
                missing += [
                    j
                    for j in range(max(0, H // bs - need), H // bs)
                    if j >= len(blocks) or not blocks[j]
                ]
            elif spec.kind is GroupKind.CHUNKED_LOCAL_ATTENTION:
                chunk = spec.attention_chunk_size or bs
                start = (M // chunk * chunk) // bs
                j = start
                while j < M // bs and j < len(blocks) and blocks[j]:
                    j += 1
                verified.append(j * bs)
                missing += [i for i in range(start, H // bs) if i >= len(blocks) or not blocks[i]]
            else:
                state = r["mask_blocks"][g] * bs
                if fine and r["mamba_state_tokens"] is not None:
                    state = r["mamba_state_tokens"]
                if state != H:
                    out.add((seq, "mamba_state_mismatch", g))
                if state > 0:
                    if fine:
                        u = state // hbs - 1
                        if u >= n or not units[g][u]:
                            missing.append(u // k)
                    else:
                        j = state // bs - 1
                        if j >= len(blocks) or not blocks[j]:
                            missing.append(j)
            if missing:
                out.add((seq, "missing_block", g))
        if verified:
            for g, spec in enumerate(config.groups):
                if spec.kind is MAMBA:
                    state = r["mask_blocks"][g] * spec.block_size
                    if (
                        config.enable_partial_hash_hits
                        and spec.block_size > hbs
                        and r["mamba_state_tokens"] is not None
                    ):
                        state = r["mamba_state_tokens"]
                    if state > min(verified):
                        out.add((seq, "mamba_overrun", g))
    return out


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("policy", ["vllm-0.33", "pre-49502"])
def test_flags_agree_with_plain_python_on_random_traces(
    tmp_path: Path, seed: int, policy: str
) -> None:
    rng = random.Random(1000 + seed)
    config = random_config(rng)
    rows = random_rows(rng, config, 16)
    path = write_trace(tmp_path / "r.parquet", config, rows)
    result = replay_trace(path, policy=policy)
    flags = compute_flags(result.results, config)
    got = {(s, f, g) for s, f, g in flags.select("seq", "flag", "group_id").rows()}
    assert got == _python_flags(rows, result.results, config)
    assert set(flags["flag"].unique()) <= set(FLAG_KINDS)
    if policy == "vllm-0.33":
        # vLLM 0.33 never overruns: the #49502 fix holds on any store state.
        assert "mamba_overrun" not in flags["flag"].to_list()


def test_flag_column_lists_each_lookups_flags(tmp_path: Path) -> None:
    from analysis.flags import with_flag_column

    hs = chain(4, "two")
    rows = [
        *issue_43559_rows(),
        {"kind": "lookup", "request_id": "miss", "block_hashes": hs, "max_length": 63},
    ]
    path = write_trace(tmp_path / "t.parquet", full_mamba(), rows)
    result = replay_trace(path, policy="pre-49502")
    flags = compute_flags(result.results, result.config)
    with_flags = with_flag_column(result.results, flags)
    assert with_flags.select("request_id", "flags").rows() == [
        ("req-43559", ["mamba_overrun", "eagle_not_dropped"]),
        ("miss", []),
    ]
    assert_frame_equal(with_flags.drop("flags"), result.results.drop("flags"))
