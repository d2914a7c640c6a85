"""Shared builders: small traces written as real Parquet files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from replay.cli import cli
from replay.spec import GroupKind, GroupSpec, TraceConfig
from replay.trace import write_trace
from traces.build import chain

pytest_plugins = ("pytester",)

FULL = GroupKind.FULL_ATTENTION
SWA = GroupKind.SLIDING_WINDOW
CHUNKED = GroupKind.CHUNKED_LOCAL_ATTENTION
MAMBA = GroupKind.MAMBA


def full_mamba(block: int = 16, eagle: bool = True) -> TraceConfig:
    return TraceConfig(
        groups=(
            GroupSpec(kind=FULL, block_size=block, name="attn"),
            GroupSpec(kind=MAMBA, block_size=block, mamba_cache_mode="align", name="mamba"),
        ),
        hash_block_size=block,
        scheduler_block_size=block,
        use_eagle=eagle,
    )


def issue_43559_rows() -> list[dict[str, Any]]:
    """#43559: four blocks of both groups stored, lookup of the four hashes, max_length 64."""
    hs = chain(4, "43559")
    return [
        {"kind": "store", "group_id": 0, "block_hashes": hs},
        {"kind": "store", "group_id": 1, "block_hashes": hs},
        {
            "kind": "lookup",
            "request_id": "req-43559",
            "block_hashes": hs,
            "max_length": 64,
            "num_tokens": 65,
        },
    ]


@pytest.fixture
def trace_43559(tmp_path: Path) -> Path:
    path = tmp_path / "t43559.parquet"
    write_trace(path, full_mamba(), issue_43559_rows())
    return path


def run_cli(args: Sequence[str]) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


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
