"""Fixtures and the CLI runner; the builders they use live in tests/builders.py."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from hypothesis import settings

from replay.cli import cli
from replay.format.writer import write_trace
from tests.builders import full_mamba, issue_43559_rows

pytest_plugins = ("pytester",)

# The contract suites are plain modules: their asserts say what differed too.
pytest.register_assert_rewrite("tests.contracts")

# Property tests run on a shared 2-core machine: a slow example is load, not a
# bug, so no per-example deadline (the example counts stay bounded).
settings.register_profile("replay", deadline=None)
settings.load_profile("replay")


@pytest.fixture
def trace_43559(tmp_path: Path) -> Path:
    path = tmp_path / "t43559.parquet"
    write_trace(path, full_mamba(), issue_43559_rows())
    return path


@pytest.fixture(scope="session")
def inputs_once(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One of each input a command reads, built once per session."""
    from replay.format.link import save_results
    from replay.format.writer import write_trace
    from replay.sources.dump import DumpWriter
    from tests.builders import replay_trace
    from tests.kvpayloads import T0, payload, stored

    d = tmp_path_factory.mktemp("inputs") / "in"
    d.mkdir()
    trace = write_trace(d / "t.parquet", full_mamba(), issue_43559_rows())
    results = d / "t.results.parquet"
    save_results(replay_trace(trace, policy="pre-49502", unit_present=True), results)
    dump = d / "d.kvdump"
    with DumpWriter(dump) as w:
        w.write([b"", (0).to_bytes(8, "big"), payload(T0, stored([1]))], "live", T0)
    lookups = d / "l.jsonl"
    lookups.write_text(
        json.dumps({"request_id": "x", "ts": T0, "block_hashes": [1], "max_length": 15}) + "\n"
    )
    config = d / "kv.json"
    config.write_text(
        json.dumps({k: v for k, v in full_mamba().to_json().items() if k != "version"})
    )
    mooncake = d / "m.jsonl"
    mooncake.write_text(
        json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]})
        + "\n"
    )
    return {"trace": trace, "results": results, "dump": dump, "lookups": lookups, "config": config, "mooncake": mooncake}  # fmt: skip


@pytest.fixture
def inputs(tmp_path: Path, inputs_once: dict[str, Path]) -> dict[str, Path]:
    """One of each input a command reads, in one folder of the test's own
    (a copy: tests link, rename and compare these files)."""
    d = tmp_path / "in"
    shutil.copytree(next(iter(inputs_once.values())).parent, d)
    return {k: d / p.name for k, p in inputs_once.items()}


def run_cli(args: Sequence[str | os.PathLike[str]]) -> Result:
    return CliRunner().invoke(cli, [os.fspath(a) for a in args], catch_exceptions=False)


def check_store_options(command: Any, args: list[str], out: Path, budget: int) -> None:
    """Run a trace source with dense retention, ``budget``-token steps and the
    GPU cache; check its summary line and the trace's ``source`` name them."""
    from replay.format.tracedir import open_trace
    from replay.rules.store_rules import StoreSettings

    args = [*args, "--retention-interval", "none", "--max-num-batched-tokens", str(budget)]
    result = CliRunner().invoke(command, [*args, "--cache", "gpu"])
    assert result.exit_code == 0, result.output
    assert f"gpu stores (dense retention, {budget:,}-token steps)" in result.output
    source = open_trace(out).config.source or {}
    want = StoreSettings(retention_interval=None, max_num_batched_tokens=budget, cache="gpu")
    assert {k: source.get(k) for k in want.as_source()} == want.as_source()
