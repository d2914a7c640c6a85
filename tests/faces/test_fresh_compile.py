"""Every compiled kernel a command reaches compiles from nothing: a fresh
install has no numba cache, and the suite's own caches hide a kernel that
only compiles after another one (a ``refcounts=False`` caller reaching an
allocation failed ``replay whatif``'s first run on a fresh install while
every test passed here). Each command runs in its own process with an
empty numba cache directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _replay(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "replay", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["gpu", "mooncake"])
def test_the_kernels_compile_from_an_empty_cache(cache: str, tmp_path: Path) -> None:
    trace = tmp_path / "t.parquet"
    synth = _replay(
        "synth", "--model", "full+mamba", "--eagle", "--requests", "300", "--cache", cache,
        "-o", str(trace), cache=tmp_path / "numba-synth",
    )  # fmt: skip
    assert synth.returncode == 0, synth.stderr
    run = _replay("run", str(trace), "-o", str(tmp_path / "r.parquet"), cache=tmp_path / "n1")
    assert run.returncode == 0, run.stderr
    assert pl.read_parquet(tmp_path / "r.parquet").height == 300
    whatif = _replay(
        "whatif", str(trace), "--capacity-blocks", "500,5000", "-o", str(tmp_path / "w.parquet"),
        cache=tmp_path / "n2",
    )  # fmt: skip
    assert whatif.returncode == 0, whatif.stderr
    rows = pl.read_parquet(tmp_path / "w.parquet")
    assert rows["capacity_blocks"].to_list() == [500, 5000]
    assert rows["simulator"].to_list() == ["compiled", "compiled"]
