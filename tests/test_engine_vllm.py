"""`replay run --coordinator vllm` and the reference give identical results."""

from __future__ import annotations

import random
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from replay.trace import read_results, write_trace
from tests.conftest import run_cli
from tests.randtrace import random_config, random_rows

pytest.importorskip("vllm", reason="vLLM not importable: run make test-vllm")
pytestmark = pytest.mark.vllm

TRACES = sorted(Path(__file__).parent.parent.joinpath("traces").glob("*.parquet"))


def _same_results(path: Path, policy: str, tmp_path: Path) -> None:
    ref, out = tmp_path / "ref.parquet", tmp_path / "vllm.parquet"
    for coordinator, target in (("reference", ref), ("vllm", out)):
        args = [
            "run",
            str(path),
            "--coordinator",
            coordinator,
            "--policy",
            policy,
            "-o",
            str(target),
            "-q",
        ]
        result = run_cli(args)
        assert result.exit_code == 0, result.output
    a, meta_a = read_results(ref)
    b, meta_b = read_results(out)
    assert (meta_a["coordinator"], meta_b["coordinator"]) == ("reference", "vllm")
    assert (a["coordinator"].unique().to_list(), b["coordinator"].unique().to_list()) == (
        ["reference"],
        ["vllm"],
    )
    assert_frame_equal(a.drop("coordinator"), b.drop("coordinator"))


@pytest.mark.parametrize("trace", TRACES, ids=[t.stem for t in TRACES])
@pytest.mark.parametrize("policy", ["vllm-0.33", "pre-49502"])
def test_regression_traces_identical_through_vllm(trace: Path, policy: str, tmp_path: Path) -> None:
    _same_results(trace, policy, tmp_path)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy", ["vllm-0.33", "pre-49502"])
def test_random_traces_identical_through_vllm(seed: int, policy: str, tmp_path: Path) -> None:
    rng = random.Random(7000 + seed)
    config = random_config(rng)
    path = write_trace(tmp_path / "r.parquet", config, random_rows(rng, config, 20))
    _same_results(path, policy, tmp_path)
    assert pl.read_parquet(tmp_path / "vllm.parquet").height == 20
