"""Key-sharded presence against the serial engine: every column of the
results identical for any shard count, file count, hash width and policy."""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from replay.base.errors import ReplayError
from replay.cli.scale import results_paths
from replay.engine.answers import LookupBatch
from replay.engine.kernels import key_meta
from replay.engine.shard import ShardFold, gather, scatter, shard_of
from replay.format.hashwords import hash_words
from replay.format.tracedir import open_trace
from replay.format.writer import TraceWriter, write_trace
from tests.builders import random_config, random_rows, replay_sharded, replay_trace, seeds
from tests.conftest import run_cli

# Two policies that answer every configuration vllm-0.33 answers (the
# aliases' releases refuse some random ones).
POLICIES = ("vllm-0.33", "vllm-0.33-no-mamba-gate")
CACHES = ("mooncake", "gpu")


def widen(rows: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    """Give each hash one of several widths, always the same for one hash:
    8 bytes, 16 bytes sharing their first 8 (the Mooncake importer's), 13
    bytes (not whole words) and 32 bytes."""
    salt = rng.random()

    def one(h: bytes) -> bytes:
        pick = hash((salt, h)) % 4
        if pick == 0:
            return h[:8]
        if pick == 1:
            return b"SAMEPREF" + h[:8]
        if pick == 2:
            return h[:13]
        return h

    out = []
    for row in rows:
        hashes = row.get("block_hashes")
        out.append({**row, "block_hashes": None if hashes is None else [one(h) for h in hashes]})
    return out


def write_dir(tmp_path: Path, config: Any, rows: list[dict[str, Any]], files: int) -> Path:
    """The rows as ``files`` trace files of random sizes (some empty)."""
    rng = random.Random(files * 7919 + len(rows))
    cuts = sorted(rng.randint(0, len(rows)) for _ in range(files - 1))
    bounds = [0, *cuts, len(rows)]
    d = tmp_path / "dir"
    d.mkdir()
    for i in range(files):
        with TraceWriter(d / f"f{i:03d}.parquet", config) as w:
            part = rows[bounds[i] : bounds[i + 1]]
            # Several row groups: the shards must carry state across batches.
            for j in range(0, len(part), 7):
                w.write_rows(part[j : j + 7])
    return d


@pytest.mark.parametrize("seed", seeds(30, fast=3))
def test_sharded_replay_is_the_serial_replay(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    config = random_config(rng)
    rows = random_rows(rng, config, n_requests=rng.randint(5, 40))
    if seed % 2:
        rows = widen(rows, rng)
    single = write_trace(tmp_path / "one.parquet", config, rows)
    variants = [(p, c) for p in POLICIES for c in CACHES]
    want = {(p, c): replay_trace(single, policy=p, cache=c).results for p, c in variants}
    d = write_dir(tmp_path, config, rows, rng.randint(1, 5))
    for shards in (1, 2, 3, 5):
        got = replay_sharded(d, policies=POLICIES, caches=CACHES, shards=shards)
        assert [(r.policy, r.cache) for r in got] == variants
        for r in got:
            assert r.results.equals(want[r.policy, r.cache]), (shards, r.policy, r.cache)
            assert r.events == len(rows)


@pytest.mark.parametrize("seed", [1, 3])
def test_metas_made_on_the_reader_thread_fold_the_same_bytes(tmp_path: Path, seed: int) -> None:
    """The serial replay makes each piece's key metas in ``scatter`` (on the
    reader's thread): they are each hash's ``key_meta``, and a fold handed
    them writes the presence bytes a fold making its own writes, on hashes
    of mixed widths (8, 13, 16 and 32 bytes, some sharing their first 8)."""
    rng = random.Random(seed)
    config = random_config(rng)
    rows = widen(random_rows(rng, config, n_requests=30), rng)
    with TraceWriter(tmp_path / "t.parquet", config) as w:
        for j in range(0, len(rows), 7):  # several batches: state carries over
            w.write_rows(rows[j : j + 7])
    ahead, own = ShardFold(config.num_groups), ShardFold(config.num_groups)
    lookups = 0
    for batch in open_trace(tmp_path / "t.parquet").iter_batches(batch_size=7):
        (piece,), lb = scatter(batch, 1, metas=True)
        words = hash_words(piece.hashes)
        start, nbytes = words.word_offsets, words.nbytes
        want = [
            int(key_meta(words.words, start[h], (nbytes[h] + 7) // 8, nbytes[h]))
            for h in range(words.num_hashes)
        ]
        assert piece.metas is not None and piece.metas.tolist() == want
        assert ahead.fold(piece).tolist() == own.fold(replace(piece, metas=None)).tolist()
        lookups += len(lb.units)
    assert lookups == sum(r["kind"] == "lookup" for r in rows) > 0


def test_shards_spread_whole_hashes_not_prefixes() -> None:
    # 16-byte hashes that share their first 8 bytes must still spread.
    rng = random.Random(1)
    hashes = [b"SAMEPREF" + rng.randbytes(8) for _ in range(4000)]
    arr = pa.array([hashes], type=pa.list_(pa.binary()))
    counts = np.bincount(shard_of(arr, 4), minlength=4)
    assert counts.min() > 800, counts
    # The same hash goes to the same shard wherever it appears.
    again = pa.array([hashes[::-1]], type=pa.list_(pa.binary()))
    assert (shard_of(again, 4)[::-1] == shard_of(arr, 4)).all()


def test_shard_count_out_of_range(tmp_path: Path) -> None:
    rng = random.Random(3)
    config = random_config(rng)
    path = write_trace(tmp_path / "t.parquet", config, random_rows(rng, config))
    with pytest.raises(ReplayError, match="0 shards: expected 1 to 4096"):
        replay_sharded(path, policies=POLICIES, shards=0)


@pytest.mark.parametrize("option", [["--workers", "2"], ["--ray", "auto"]])
def test_without_ray_the_cluster_options_say_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, option: list[str]
) -> None:
    # As on a machine without the extra: `import ray` fails.
    monkeypatch.setitem(sys.modules, "ray", None)
    rng = random.Random(4)
    config = random_config(rng)
    path = write_trace(tmp_path / "t.parquet", config, random_rows(rng, config))
    out = tmp_path / "r.parquet"
    result = run_cli(["run", str(path), *option, "-o", str(out)])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == (
        "error: --workers and --ray need Ray: pip install 'cache-trace-replay[ray]'\n"
    )
    assert not out.exists()


def test_several_policies_in_one_process_write_one_file_each(tmp_path: Path) -> None:
    rng = random.Random(8)
    config = random_config(rng)
    path = write_trace(tmp_path / "t.parquet", config, random_rows(rng, config, 30))
    result = run_cli(["run", str(path), "--policy", "pre-49502", "--policy", "vllm-0.33", "-q"])
    assert result.exit_code == 0, result.stderr
    for policy in ("pre-49502", "vllm-0.33"):
        got = pl.read_parquet(tmp_path / f"t.{policy}.results.parquet")
        assert got.equals(replay_trace(path, policy=policy).results)
    assert not (tmp_path / "t.results.parquet").exists()


def test_policies_times_caches_in_one_process(tmp_path: Path) -> None:
    rng = random.Random(9)
    config = random_config(rng)
    path = write_trace(tmp_path / "t.parquet", config, random_rows(rng, config, 30))
    args = ["run", str(path), "-q", "--policy", "pre-49502", "--policy", "vllm-0.33"]
    result = run_cli([*args, "--cache", "gpu", "--cache", "mooncake"])
    assert result.exit_code == 0, result.stderr
    for policy in ("pre-49502", "vllm-0.33"):
        for cache in ("gpu", "mooncake"):
            got = pl.read_parquet(tmp_path / f"t.{policy}.{cache}.results.parquet")
            assert got.equals(replay_trace(path, policy=policy, cache=cache).results)
    assert len(list(tmp_path.iterdir())) == 5


@pytest.mark.parametrize(
    ("output", "names"),
    [
        (None, ["t.a.results.parquet", "t.b.results.parquet"]),
        ("out.parquet", ["out.a.parquet", "out.b.parquet"]),
        ("out", ["out.a", "out.b"]),
    ],
)
def test_results_paths_put_the_policy_before_the_suffix(
    output: str | None, names: list[str]
) -> None:
    got = results_paths(Path("d/t.parquet"), Path("d", output) if output else None, ["a", "b"])
    assert got == [Path("d", n) for n in names]
    assert results_paths(Path("d/t.parquet"), None, ["a"]) == [Path("d/t.results.parquet")]


def test_unit_present_for_several_policies_comes_from_one_fold(tmp_path: Path) -> None:
    """`replay run --unit-present` with several policies: one fold, each
    results file the serial replay's, store state included."""
    rng = random.Random(10)
    config = random_config(rng)
    path = write_trace(tmp_path / "t.parquet", config, random_rows(rng, config, 30))
    args = ["run", str(path), "-q", "--unit-present", "--policy", "pre-49502"]
    result = run_cli([*args, "--policy", "vllm-0.33"])
    assert result.exit_code == 0, result.stderr
    for policy in ("pre-49502", "vllm-0.33"):
        got = pl.read_parquet(tmp_path / f"t.{policy}.results.parquet")
        want = replay_trace(path, policy=policy, unit_present=True).results
        assert "unit_present" in got.columns
        assert got.equals(want)


def test_the_one_replay_call_refuses_what_ray_cannot_do_before_reading(tmp_path: Path) -> None:
    """Refusals are ReplayErrors said before Ray starts or the trace is read
    (the CLI prints them as its one-line errors)."""
    import io

    from replay.base.errors import ReplayError
    from replay.engine.run import ReplayOptions, Variant, replay

    missing = tmp_path / "nowhere.parquet"  # never opened: each refusal comes first
    for options, message in [
        (
            ReplayOptions(workers=2, coordinator="vllm"),
            "`coordinator` vllm runs in one process: drop `workers`/`ray_address` to use it",
        ),
        (
            ReplayOptions(
                ray_address="auto",
                variants=(Variant(policy="vllm-0.33", cache="mooncake", coordinator="vllm"),),
            ),
            "`coordinator` vllm runs in one process: drop `workers`/`ray_address` to use it",
        ),
        (
            ReplayOptions(workers=2, unit_present=True),
            "`unit_present` runs in one process: drop `workers`/`ray_address`",
        ),
    ]:
        with pytest.raises(ReplayError) as err:
            replay(missing, options)
        assert str(err.value) == message
    with pytest.raises(ReplayError) as err:
        replay(io.BytesIO(b""), ReplayOptions(workers=2))
    assert str(err.value) == "`workers`: Ray replays a trace file or directory by its path"
    rng = random.Random(3)
    config = random_config(rng)
    path = write_trace(tmp_path / "t.parquet", config, random_rows(rng, config, 5))
    with pytest.raises(ReplayError, match="no policy or cache to replay under"):
        replay(path, ReplayOptions(policies=()))
    run = run_cli(["run", str(path), "--workers", "2", "--coordinator", "vllm"])
    assert (run.exit_code, run.stderr) == (
        2,
        "error: --coordinator vllm runs in one process: drop --workers/--ray to use it\n",
    )


@pytest.mark.parametrize("seed", range(4))
def test_gather_puts_every_shards_bytes_where_the_serial_fold_writes_them(seed: int) -> None:
    """Lookups of 0 to 7 units spread over 1 to 5 shards and 1 to 3 groups:
    each shard's bytes (per lookup, per group, its units in order) land at
    the serial fold's place (per lookup, per group, all its units)."""
    rng = random.Random(seed)
    shards, groups = rng.randint(1, 5), rng.randint(1, 3)
    units = [rng.randint(0, 7) for _ in range(40)]
    unit_shards = [rng.randrange(shards) for _ in range(sum(units))]
    want = [rng.randrange(256) for _ in range(sum(units) * groups)]
    pieces: list[list[int]] = [[] for _ in range(shards)]
    start = 0
    for n in units:
        mine = unit_shards[start : start + n]
        for k in range(shards):
            for g in range(groups):
                pieces[k] += [want[groups * start + g * n + u] for u in range(n) if mine[u] == k]
        start += n
    lookups = LookupBatch(
        rows=pl.DataFrame(),
        units=np.array(units, dtype=np.int64),
        shards=np.array(unit_shards, dtype=np.uint16),
        events=len(units),
        counts={"lookup": len(units)},
        first_seq=0,
        last_seq=len(units) - 1,
        hash_entries=sum(units),
    )
    got = gather(lookups, [np.array(p, dtype=np.uint8) for p in pieces], groups)
    assert got.tolist() == want
