"""The engine against the loop a user would write by hand, on random traces."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from replay.base.spec import TraceConfig
from replay.format.link import save_results
from replay.format.results import read_results
from replay.format.writer import write_trace
from replay.rules.coordinator import Coordinator
from replay.rules.store import ClearEvent, RemoveEvent, StoreEvent
from tests.builders import (
    full_mamba,
    issue_43559_rows,
    random_config,
    random_rows,
    replay_trace,
    seeds,
)


def naive_replay(
    rows: list[dict[str, Any]], config: TraceConfig, policy: str
) -> list[tuple[Any, ...]]:
    """Fold into one set of (group, bytes), call the coordinator per lookup."""
    keys: set[tuple[int, bytes]] = set()
    out = []

    def member(g: int) -> Callable[[Hashable], bool]:
        return lambda h: (g, h) in keys

    tests = [member(g) for g in range(config.num_groups)]
    coord = Coordinator(config, policy)
    for row in rows:
        kind = row["kind"]
        if kind == "store":
            keys.update((row["group_id"], h) for h in row["block_hashes"])
        elif kind == "remove":
            keys.difference_update((row["group_id"], h) for h in row["block_hashes"])
        elif kind == "clear":
            gone = {k for k in keys if row["group_id"] is None or k[0] == row["group_id"]}
            keys.difference_update(gone)
        else:
            res = coord.lookup(row["block_hashes"], row["max_length"], tests)
            present = [
                [(g, h) in keys for h in row["block_hashes"]] for g in range(config.num_groups)
            ]
            out.append(
                (
                    row["seq"],
                    res.hit_tokens,
                    [g.mask_blocks for g in res.groups],
                    [g.loaded_blocks for g in res.groups],
                    present,
                )
            )
    return out


def _replayed(path: Path, policy: str) -> list[tuple[Any, ...]]:
    res = replay_trace(path, policy=policy, unit_present=True).results
    columns = ("seq", "hit_tokens", "mask_blocks", "loaded_blocks", "unit_present")
    return list(zip(*(res[c].to_list() for c in columns), strict=True))


@pytest.mark.parametrize("seed", seeds(40, fast=3))
@pytest.mark.parametrize("policy", ["vllm-0.33", "pre-49502"])
def test_engine_matches_naive_loop_on_random_traces(tmp_path: Path, seed: int, policy: str) -> None:
    rng = random.Random(seed)
    config = random_config(rng)
    rows = random_rows(rng, config)
    path = write_trace(tmp_path / "r.parquet", config, rows)
    want = naive_replay(rows, config, policy)
    assert _replayed(path, policy) == want


def test_results_file_round_trip_and_metadata(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.parquet", full_mamba(), issue_43559_rows())
    result = replay_trace(path, policy="pre-49502", unit_present=True)
    out = save_results(result, tmp_path / "t.results.parquet")
    frame, info = read_results(out)
    assert info["version"] == 1
    assert info["policy"] == "pre-49502"
    assert info["coordinator"] == "reference"
    assert info["kv_cache_groups"] == [g.to_json() for g in full_mamba().groups]
    row = frame.row(0, named=True)
    assert (row["seq"], row["request_id"], row["max_length"], row["hit_tokens"]) == (
        2,
        "req-43559",
        64,
        64,
    )
    assert (row["mask_blocks"], row["loaded_blocks"]) == ([3, 4], [3, 1])
    assert (row["verified_tokens"], row["mamba_state_tokens"]) == (48, 64)
    assert row["unit_present"] == [[True] * 4, [True] * 4]
    assert frame.schema["mask_blocks"] == pl.List(pl.Int32)


def test_deterministic_row_for_row(tmp_path: Path) -> None:
    rng = random.Random(99)
    config = random_config(rng)
    path = write_trace(tmp_path / "r.parquet", config, random_rows(rng, config, 30))
    a = save_results(replay_trace(path), tmp_path / "a.parquet")
    b = save_results(replay_trace(path), tmp_path / "b.parquet")
    assert a.read_bytes() == b.read_bytes()


def test_store_fold_events_and_order() -> None:
    from replay.base.errors import TraceError
    from replay.rules.store import Store

    s: Store[bytes] = Store(2)
    s.apply(StoreEvent(seq=1, group_id=0, hashes=[b"a", b"b"]))
    s.apply(StoreEvent(seq=2, group_id=1, hashes=[b"a"]))
    s.apply(RemoveEvent(seq=3, group_id=0, hashes=[b"a", b"zz"]))
    assert (s.keys(0), s.keys(1)) == (frozenset({b"b"}), frozenset({b"a"}))
    s.apply(ClearEvent(seq=4, group_id=1))
    assert (s.keys(0), s.keys(1)) == (frozenset({b"b"}), frozenset())
    s.apply(ClearEvent(seq=5, group_id=None))
    assert s.num_keys() == [0, 0]
    with pytest.raises(TraceError, match="seq 5: out of order, expected a seq greater than 5"):
        s.apply(StoreEvent(seq=5, group_id=0, hashes=[b"c"]))


@pytest.mark.parametrize("seed", seeds(10))
def test_one_row_group_per_event_streams_through_the_prefetcher(tmp_path: Path, seed: int) -> None:
    """Every event its own row group: state carries across every batch the
    prefetching reader hands over (clears and removes included)."""
    from replay.format.writer import TraceWriter

    rng = random.Random(300 + seed)
    config = random_config(rng)
    rows = random_rows(rng, config, 14)
    path = tmp_path / "rg.parquet"
    with TraceWriter(path, config) as writer:
        for row in rows:
            writer.write_rows([row])
    want = naive_replay(rows, config, "vllm-0.33")
    assert _replayed(path, "vllm-0.33") == want


def test_run_writes_unit_present_only_when_asked(tmp_path: Path, trace_43559: Path) -> None:
    from tests.conftest import run_cli

    plain, raw = tmp_path / "plain.parquet", tmp_path / "raw.parquet"
    assert run_cli(["run", str(trace_43559), "-o", str(plain), "-q"]).exit_code == 0
    assert run_cli(["run", str(trace_43559), "-o", str(raw), "-q", "--unit-present"]).exit_code == 0
    a, _ = read_results(plain)
    b, _ = read_results(raw)
    assert "unit_present" not in a.columns
    assert b["unit_present"].to_list() == [[[True] * 4, [True] * 4]]
    assert a.equals(b.drop("unit_present"))
    # A results file with the raw state can have its flags recomputed.
    assert run_cli(["check", str(raw)]).exit_code == 0


def test_explain_stops_at_until_seq_and_answers_as_the_replay(tmp_path: Path) -> None:
    from replay.analysis.flags import lookup_flags
    from replay.engine.replay import explain_lookups
    from replay.format.tracedir import open_trace

    rng = random.Random(41)
    config = random_config(rng)
    path = write_trace(tmp_path / "r.parquet", config, random_rows(rng, config, 20))
    reader = open_trace(path)
    results = replay_trace(reader, policy="pre-49502").results
    _, every = explain_lookups(reader, lambda e: True, "pre-49502")
    assert [e.seq for e, _, _ in every] == results["seq"].to_list()
    assert [o.hit_tokens for _, o, _ in every] == results["hit_tokens"].to_list()
    flags = [
        [
            f.flag
            for f in lookup_flags(config, "mooncake", o, fa, e.max_length, e.observed_hit_tokens)
        ]
        for e, o, fa in every
    ]
    assert flags == results["flags"].to_list()
    until = every[len(every) // 2][0].seq
    _, part = explain_lookups(reader, lambda e: e.seq % 2 == 0, "pre-49502", until_seq=until)
    assert [(e.seq, o.hit_tokens) for e, o, _ in part] == [
        (e.seq, o.hit_tokens) for e, o, _ in every if e.seq <= until and e.seq % 2 == 0
    ]
