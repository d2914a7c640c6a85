"""replay minimize: thousands of events with one injected overrun shrink to a
handful, and the result is a regression trace the plugin runs."""

from __future__ import annotations

import random
from pathlib import Path

import polars as pl

from replay.analysis.flags import add_flags
from replay.format.tracedir import open_trace
from replay.format.writer import write_trace
from replay.pytest_plugin import read_expectations
from tests.builders import chain, full_mamba, replay_trace
from tests.conftest import run_cli


def _noisy_trace(path: Path) -> Path:
    rng = random.Random(3)
    rows = []
    for i in range(700):
        hs = chain(rng.randint(2, 30), f"noise{i % 37}")
        rows.append({"kind": "store", "group_id": 0, "block_hashes": hs})
        rows.append({"kind": "store", "group_id": 1, "block_hashes": hs[-2:]})
        if rng.random() < 0.3:
            rows.append({"kind": "remove", "group_id": 0, "block_hashes": hs[-3:]})
        rows.append(
            {
                "kind": "lookup",
                "request_id": f"n{i}",
                "block_hashes": hs,
                "max_length": len(hs) * 16 - 1,
            }
        )
    victim = chain(8, "victim")
    rows[900:900] = [
        {"kind": "store", "group_id": 0, "block_hashes": victim},
        {"kind": "store", "group_id": 1, "block_hashes": victim},
    ]
    rows.append(
        {"kind": "lookup", "request_id": "victim", "block_hashes": victim, "max_length": 128}
    )
    return write_trace(path, full_mamba(), rows)


def test_injected_overrun_shrinks_to_a_handful_of_events(tmp_path: Path) -> None:
    big = _noisy_trace(tmp_path / "big.parquet")
    assert open_trace(big).num_rows > 2000
    small = tmp_path / "small.parquet"
    result = run_cli(
        [
            "minimize",
            str(big),
            "--request",
            "victim",
            "--flag",
            "mamba_overrun",
            "--policy",
            "pre-49502",
            "-o",
            str(small),
        ]
    )
    assert result.exit_code == 0, result.output
    frame = open_trace(small).read_frame()
    assert frame.height <= 4
    assert frame.filter(pl.col("kind") == "lookup")["request_id"].to_list() == ["victim"]
    expect = read_expectations(small)
    assert expect is not None
    by_policy = {e["policy"]: e for e in expect}
    assert by_policy["vllm-0.33"]["flags"] == {}
    assert "mamba_overrun" in by_policy["pre-49502"]["flags"]
    # Issue 31: both caches and every pinned policy, each with the answer the
    # original lookup got in the big trace.
    assert sorted((e["policy"], e["cache"]) for e in expect) == [
        ("pre-32802", "gpu"),
        ("pre-49502", "gpu"),
        ("pre-49502", "mooncake"),
        ("vllm-0.33", "gpu"),
        ("vllm-0.33", "mooncake"),
        ("vllm-0.34", "gpu"),
        ("vllm-0.34", "mooncake"),
    ]
    for e in expect:
        result = replay_trace(big, policy=e["policy"], cache=e["cache"])
        victim = result.results.filter(pl.col("request_id") == "victim")
        assert e["hits"] == {"victim": victim["hit_tokens"][-1]}, e
        assert e["masks"]["victim"] == [
            [m, n]
            for m, n in zip(victim["mask_blocks"][-1], victim["loaded_blocks"][-1], strict=True)
        ], e
    # The minimized trace still tells the story: clean by default, overrun before #49502.
    assert run_cli(["check", str(small)]).exit_code == 0
    assert run_cli(["check", str(small), "--policy", "pre-49502"]).exit_code == 1


def test_minimize_refuses_a_clean_request(tmp_path: Path) -> None:
    big = _noisy_trace(tmp_path / "big.parquet")
    out = tmp_path / "small.parquet"
    result = run_cli(
        [
            "minimize",
            str(big),
            "--request",
            "n3",
            "--flag",
            "mamba_overrun",
            "--policy",
            "pre-49502",
            "-o",
            str(out),
        ]
    )
    assert result.exit_code == 2
    assert (
        result.stderr
        == f"error: {big}: request 'n3' raises no mamba_overrun flag under pre-49502: nothing to minimize\n"
    )
    assert not out.exists()


def test_synthetic_injected_overrun_becomes_a_regression_trace(tmp_path: Path) -> None:
    from replay.pytest_plugin import read_expectations
    from replay.sources.synth import synth_trace

    big = tmp_path / "synth.parquet"
    summary = synth_trace(
        big,
        model="full+mamba",
        requests=600,
        seed=11,
        eagle=True,
        capacity_blocks=8000,
        inject_overrun=1,
    )
    assert summary["events"] > 2000
    small = tmp_path / "overrun.parquet"
    result = run_cli(
        [
            "minimize",
            str(big),
            "--request",
            "overrun-0000-resend",
            "--flag",
            "mamba_overrun",
            "--policy",
            "pre-49502",
            "-o",
            str(small),
        ]
    )
    assert result.exit_code == 0, result.output
    assert open_trace(small).num_rows <= 6
    by_policy = {e["policy"]: e for e in read_expectations(small) or []}
    assert by_policy["vllm-0.33"]["flags"] == {}
    assert by_policy["pre-49502"]["flags"]["mamba_overrun"] == 1
    # Still #43559: the resumed Mamba state lies one block past the verified prefix.
    import json

    check = run_cli(["check", str(small), "--policy", "pre-49502", "--json"])
    assert check.exit_code == 1
    (variant,) = json.loads(check.stdout)["variants"]
    overrun = [f for f in variant["flagged"] if f["flag"] == "mamba_overrun"]
    assert [(f["request_id"], f["actual"] - f["expected"]) for f in overrun] == [
        ("overrun-0000-resend", 16)
    ]


def test_minimize_reads_a_trace_from_memory_and_writes_once(tmp_path: Path) -> None:
    """Every shrinking step replays in memory, so a trace that exists only as
    bytes minimizes to the same rows and expectations as its file; the
    output directory holds the output alone afterwards."""
    import io

    from replay.tools.minimize import minimize

    big = _noisy_trace(tmp_path / "big.parquet")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    from_file = minimize(
        big, "victim", out_dir / "a.parquet", flag="mamba_overrun", judge=add_flags
    )
    stream = io.BytesIO(big.read_bytes())
    from_bytes = minimize(
        stream, "victim", out_dir / "b.parquet", flag="mamba_overrun", judge=add_flags
    )
    assert from_bytes == from_file
    # Three events: the flag alone needs two, the other policies' original
    # answers one more.
    assert (from_file["events_before"], from_file["events_after"]) == (2314, 3)
    # The original lookup's answers (issue 31: the shrunk trace used to pin
    # vllm-0.33 at 0), in both caches; pre-32802's releases had no Mooncake
    # mirror: not pinned there.
    assert [(e["policy"], e["cache"], e["flags"], e["hits"]) for e in from_file["expect"]] == [
        ("vllm-0.33", "mooncake", {}, {"victim": 112}),
        ("vllm-0.34", "mooncake", {}, {"victim": 112}),
        ("pre-49502", "mooncake", {"eagle_not_dropped": 1, "mamba_overrun": 1}, {"victim": 128}),
        ("vllm-0.33", "gpu", {}, {"victim": 112}),
        ("vllm-0.34", "gpu", {}, {"victim": 112}),
        ("pre-49502", "gpu", {"eagle_not_dropped": 1, "mamba_overrun": 1}, {"victim": 128}),
        ("pre-32802", "gpu", {}, {"victim": 112}),
    ]
    a = open_trace(out_dir / "a.parquet").read_frame()
    assert a.equals(open_trace(out_dir / "b.parquet").read_frame())
    assert a["kind"].to_list() == ["store", "store", "lookup"]
    assert sorted(p.name for p in out_dir.iterdir()) == ["a.parquet", "b.parquet"]
    expect_b = read_expectations(out_dir / "b.parquet")
    assert expect_b == from_file["expect"]
