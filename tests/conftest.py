"""Fixtures and the CLI runner; the builders they use live in tests/builders.py."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from hypothesis import settings

from replay.cli import cli
from replay.trace import write_trace
from tests.builders import full_mamba, issue_43559_rows

pytest_plugins = ("pytester",)

# Property tests run on a shared 2-core machine: a slow example is load, not a
# bug, so no per-example deadline (the example counts stay bounded).
settings.register_profile("replay", deadline=None)
settings.load_profile("replay")


@pytest.fixture
def trace_43559(tmp_path: Path) -> Path:
    path = tmp_path / "t43559.parquet"
    write_trace(path, full_mamba(), issue_43559_rows())
    return path


def run_cli(args: Sequence[str | os.PathLike[str]]) -> Result:
    return CliRunner().invoke(cli, [os.fspath(a) for a in args], catch_exceptions=False)


def check_store_options(command: Any, args: list[str], out: Path, budget: int) -> None:
    """Run a trace source with dense retention, ``budget``-token steps and the
    GPU cache; check its summary line and the trace's ``source`` name them."""
    from replay.store_rules import StorePolicy
    from replay.trace import open_trace

    args = [*args, "--retention-interval", "none", "--max-num-batched-tokens", str(budget)]
    result = CliRunner().invoke(command, [*args, "--cache", "gpu"])
    assert result.exit_code == 0, result.output
    assert f"gpu stores (dense retention, {budget:,}-token steps)" in result.output
    source = open_trace(out).config.source or {}
    want = StorePolicy(retention_interval=None, max_num_batched_tokens=budget, cache="gpu")
    assert {k: source.get(k) for k in want.as_source()} == want.as_source()
