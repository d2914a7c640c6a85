"""``replay whatif``: properties of the sweep, emitted traces that replay to
the same hits, and the command line."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from analysis.flags import FLAG_KINDS
from replay.base.spec import TraceConfig
from replay.format.sweepfile import read_sweep
from replay.format.tracedir import open_trace
from replay.format.writer import write_trace
from replay.rules.coordinator import Coordinator
from replay.rules.store_rules import StorePolicy, StoreRules, junction_tokens
from replay.sources.archetypes import archetype_config
from replay.whatif.requests import load_requests
from replay.whatif.sizes import parse_bytes
from replay.whatif.sweep import SWEEP_COLUMNS, RunSpec, simulate, sweep
from tests.builders import random_archetype_config, random_prompts, replay_trace, unit_hashes
from tests.conftest import run_cli


def rules_trace(
    path: Path, config: TraceConfig, cache: str, policy: StorePolicy, prompts: list[list[int]]
) -> Path:
    """A trace whose stores are what the store rules say each request leaves
    behind, in an unbounded store (the trace's own hits)."""
    coordinator = Coordinator(config, "vllm-0.33", cache)
    rules = StoreRules(config, policy)
    present: list[set[bytes]] = [set() for _ in config.groups]
    hbs = config.hash_block_size
    rows: list[dict[str, Any]] = []
    for i, tokens in enumerate(prompts):
        units = unit_hashes(tokens, hbs)
        n = len(tokens)
        rows.append(
            {
                "kind": "lookup",
                "request_id": f"r{i}",
                "block_hashes": units,
                "max_length": n - 1,
                "num_tokens": n,
            }
        )
        seen = [bytes(u in keys for u in units) for keys in present]
        outcome = coordinator.lookup_present(seen, n - 1, explain=True)
        hit = outcome.hit_tokens
        stores = rules.stores(
            num_tokens=n, hit_tokens=hit, junction_tokens=junction_tokens(outcome)
        )
        for gid, (g, blocks) in enumerate(zip(config.groups, stores, strict=True)):
            k = g.block_size // hbs
            keys = [units[(int(j) + 1) * k - 1] for j in blocks]
            if keys:
                rows.append({"kind": "store", "group_id": gid, "block_hashes": keys})
                present[gid].update(keys)
    src = {"cache": cache}
    config = TraceConfig.from_json({**config.to_json(), "source": src})
    return write_trace(path, config, rows)


def random_case(rng: random.Random, cache: str) -> tuple[TraceConfig, StorePolicy]:
    config = random_archetype_config(rng)
    sparse = config.num_groups > 1
    return config, StorePolicy(
        retention_interval=rng.choice((0, None)) if sparse else 0,
        max_num_batched_tokens=config.scheduler_block_size * rng.choice((1, 3, 64)),
        cache=cache,
    )


def observed_hits(path: str | Path) -> list[int]:
    frame = open_trace(path).read_frame(["kind", "observed_hit_tokens"])
    return frame.filter(pl.col("kind") == "lookup")["observed_hit_tokens"].to_list()


def spec_for(policy: StorePolicy, cache: str, eviction: str, capacity: int, emit: Path) -> RunSpec:
    return RunSpec(
        cache=cache,
        eviction=eviction,
        capacity_blocks=capacity,
        retention_interval=policy.retention_interval,
        max_num_batched_tokens=policy.max_num_batched_tokens,
        emit=str(emit),
    )


@pytest.mark.parametrize("cache", ["gpu", "mooncake"])
def test_unbounded_capacity_reproduces_the_traces_own_hits(cache: str, tmp_path: Path) -> None:
    rng = random.Random(1600 + len(cache))
    compared = nonzero = 0
    for case in range(12):
        config, policy = random_case(rng, cache)
        prompts = random_prompts(rng, config.scheduler_block_size, 30)
        trace = rules_trace(tmp_path / f"t{case}.parquet", config, cache, policy, prompts)
        own = replay_trace(trace, cache=cache).results["hit_tokens"].to_list()
        emitted = tmp_path / f"w{case}.parquet"
        row = simulate(load_requests(trace), spec_for(policy, cache, "lru", 10**7, emitted))
        assert observed_hits(emitted) == own, config.to_json()
        assert row["hit_tokens"] == sum(own) and row["evicted_blocks"] == 0
        compared += len(own)
        nonzero += sum(1 for h in own if h)
    assert compared == 360 and nonzero > 100


@pytest.mark.parametrize("cache", ["gpu", "mooncake"])
def test_emitted_runs_replay_to_exactly_their_hits(cache: str, tmp_path: Path) -> None:
    """At capacities with many evictions, every policy: ``replay run`` on the
    emitted trace gives each lookup the hit the what-if found."""
    rng = random.Random(1616)
    evicted = 0
    for case in range(4):
        config, policy = random_case(rng, cache)
        prompts = random_prompts(rng, config.scheduler_block_size, 40)
        trace = rules_trace(tmp_path / f"t{case}.parquet", config, cache, policy, prompts)
        requests = load_requests(trace)
        longest = max(len(p) for p in prompts) // config.groups[0].block_size + 1
        for eviction in ("lru", "fifo", "lfu", "belady"):
            emitted = tmp_path / f"w{case}-{eviction}.parquet"
            spec = spec_for(policy, cache, eviction, longest * config.num_groups, emitted)
            row = simulate(requests, spec)
            evicted += row["evicted_blocks"]
            replayed = replay_trace(emitted, cache=cache).results
            assert replayed["hit_tokens"].to_list() == observed_hits(emitted)
            assert replayed["observed_match"].all()
    assert evicted > 500


def _full_attention_runs(
    rng: random.Random, cache: str, evictions: tuple[str, ...], tmp_path: Path
) -> list[list[dict[str, Any]]]:
    out = []
    for case in range(6):
        bs = rng.choice((16, 32))
        config = archetype_config("full", bs)
        policy = StorePolicy(cache=cache, max_num_batched_tokens=bs * rng.choice((1, 4, 64)))
        prompts = random_prompts(rng, bs, 60)
        trace = rules_trace(tmp_path / f"f{case}.parquet", config, cache, policy, prompts)
        requests = load_requests(trace)
        longest = max(len(p) for p in prompts) // bs + 1
        capacities = sorted({longest + rng.randrange(0, 4 * longest) for _ in range(6)})
        specs = [
            RunSpec(
                cache=cache,
                eviction=e,
                capacity_blocks=c,
                max_num_batched_tokens=policy.max_num_batched_tokens,
            )
            for c in capacities
            for e in evictions
        ]
        out.append(sweep(requests, specs))
    return out


@pytest.mark.parametrize("cache", ["gpu", "mooncake"])
def test_lru_hit_ratio_never_falls_as_capacity_grows_for_full_attention(
    cache: str, tmp_path: Path
) -> None:
    runs = _full_attention_runs(random.Random(42), cache, ("lru",), tmp_path)
    grew = 0
    for rows in runs:
        hits = [r["hit_tokens"] for r in rows]
        assert hits == sorted(hits), [(r["capacity_blocks"], r["hit_tokens"]) for r in rows]
        grew += hits[-1] > hits[0]
    assert grew >= 3


@pytest.mark.parametrize("cache", ["gpu", "mooncake"])
def test_belady_hits_at_least_as_much_as_lru_for_full_attention(cache: str, tmp_path: Path) -> None:
    runs = _full_attention_runs(random.Random(7), cache, ("lru", "belady"), tmp_path)
    better = 0
    for rows in runs:
        for lru, belady in zip(rows[::2], rows[1::2], strict=True):
            assert belady["capacity_blocks"] == lru["capacity_blocks"]
            assert belady["hit_tokens"] >= lru["hit_tokens"], (lru, belady)
            better += belady["hit_tokens"] > lru["hit_tokens"]
    assert better > 0


def test_parse_bytes() -> None:
    assert parse_bytes("64GiB") == 64 * 2**30
    assert parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("4096") == 4096
    assert parse_bytes("1.5KiB") == 1536


def _demo_trace(tmp_path: Path) -> Path:
    config = archetype_config("full+mamba", 16, 16, True)
    prompts = random_prompts(random.Random(3), 16, 40)
    return rules_trace(tmp_path / "demo.parquet", config, "gpu", StorePolicy(cache="gpu"), prompts)


def test_cli_writes_one_row_per_capacity_and_policy(tmp_path: Path) -> None:
    trace = _demo_trace(tmp_path)
    out = tmp_path / "sweep.parquet"
    emit = tmp_path / "runs"
    result = run_cli(
        [
            "whatif",
            str(trace),
            "--capacity-blocks",
            "200,400,100000",
            "--eviction",
            "lru,fifo",
            "--eviction",
            "belady",
            "--cache",
            "gpu",
            "-o",
            str(out),
            "--emit-traces",
            str(emit),
            "--jobs",
            "2",
        ]
    )
    assert result.exit_code == 0, result.output
    frame, meta = read_sweep(out)
    assert frame.columns == [*SWEEP_COLUMNS, *FLAG_KINDS]
    assert frame.height == 9
    assert frame["capacity_blocks"].to_list() == [200] * 3 + [400] * 3 + [100000] * 3
    assert frame["eviction"].to_list() == ["lru", "fifo", "belady"] * 3
    assert set(frame["cache"]) == {"gpu"} and meta["cache"] == "gpu"
    assert frame["lookups"].to_list() == [40] * 9
    own = replay_trace(trace, cache="gpu").results["hit_tokens"].sum()
    assert frame["hit_tokens"].to_list()[-3:] == [own] * 3
    assert sorted(p.name for p in emit.iterdir()) == sorted(
        f"whatif-gpu-{e}-{c}.parquet" for c in (200, 400, 100000) for e in ("lru", "fifo", "belady")
    )


def test_cli_capacity_bytes_uses_the_page_sizes(tmp_path: Path) -> None:
    trace = _demo_trace(tmp_path)
    out = tmp_path / "sweep.parquet"
    result = run_cli(
        [
            "whatif",
            str(trace),
            "--capacity-bytes",
            "1MiB,4MiB",
            "--page-bytes",
            "4KiB",
            "--cache",
            "mooncake",
            "-o",
            str(out),
        ]
    )
    assert result.exit_code == 0, result.output
    frame, _ = read_sweep(out)
    assert frame["capacity_bytes"].to_list() == [2**20, 4 * 2**20]
    assert frame["capacity_blocks"].to_list() == [256, 1024]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capacity-blocks", "10", "--capacity-bytes", "1GiB"], "exactly one of"),
        ([], "exactly one of"),
        (["--capacity-blocks", "10,x"], "--capacity-blocks: expected positive integers"),
        (["--capacity-blocks", "10", "--eviction", "mru"], "unknown policy 'mru'"),
        (["--capacity-bytes", "1GiB"], "needs the groups' page sizes"),
        (["--capacity-bytes", "1GiB", "--page-bytes", "1,2,3"], "3 sizes for 2 KV-cache groups"),
        (["--capacity-blocks", "10", "--retention-interval", "x"], "--retention-interval"),
    ],
)
def test_cli_user_errors_are_one_line_and_write_nothing(
    tmp_path: Path, args: list[str], message: str
) -> None:
    trace = _demo_trace(tmp_path)
    out = tmp_path / "sweep.parquet"
    result = run_cli(["whatif", str(trace), "-o", str(out), *args])
    assert result.exit_code == 2
    assert message in result.output and result.output.count("\n") == 1
    assert not out.exists()


def test_cli_refuses_to_write_over_its_input(tmp_path: Path) -> None:
    trace = _demo_trace(tmp_path)
    before = trace.read_bytes()
    result = run_cli(["whatif", str(trace), "--capacity-blocks", "10", "-o", str(trace)])
    assert result.exit_code == 2 and "is the input trace" in result.output
    assert trace.read_bytes() == before


def test_report_charts_one_line_per_policy_and_writes_the_markdown_table(tmp_path: Path) -> None:
    trace = _demo_trace(tmp_path)
    sweep_file = tmp_path / "sweep.parquet"
    args = ["whatif", str(trace), "--capacity-blocks", "300,100,200", "-o", str(sweep_file)]
    assert run_cli([*args, "--eviction", "lru,belady", "--jobs", "1"]).exit_code == 0
    html_out, md_out = tmp_path / "sweep.html", tmp_path / "sweep.md"
    assert run_cli(["report", str(sweep_file), "-o", str(html_out)]).exit_code == 0
    page = html_out.read_text()
    assert page.count("<polyline") == 2 and page.count('class="mark"') == 6
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org", "")
    result = run_cli(["report", str(sweep_file), "-o", str(md_out)])
    assert result.exit_code == 0, result.output
    frame, _ = read_sweep(sweep_file)
    lines = md_out.read_text().splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert table[0].startswith("| capacity (blocks) | eviction | hit ratio | hit tokens |")
    expected = frame.sort("capacity_blocks", maintain_order=True)
    got = [[c.strip() for c in line.split("|")[1:5]] for line in table[2:]]
    assert got == [
        [f"{c:,}", e, f"{100 * r:.2f}%", f"{h:,}"]
        for c, e, r, h in expected.select(
            "capacity_blocks", "eviction", "hit_ratio", "hit_tokens"
        ).iter_rows()
    ]


def test_cli_names_the_lookup_whose_max_length_reaches_its_prompt(tmp_path: Path) -> None:
    config = archetype_config("full", 16)
    units = unit_hashes(list(range(64)), 16)
    rows = [
        {
            "kind": "lookup",
            "request_id": "a",
            "block_hashes": units,
            "max_length": 63,
            "num_tokens": 64,
        },
        {
            "kind": "lookup",
            "request_id": "b",
            "block_hashes": units,
            "max_length": 64,
            "num_tokens": 64,
        },
    ]
    trace = write_trace(tmp_path / "bad.parquet", config, rows)
    out = tmp_path / "sweep.parquet"
    result = run_cli(["whatif", str(trace), "--capacity-blocks", "10", "-o", str(out)])
    assert result.exit_code == 2
    assert "seq 1: max_length 64 must be in [0, num_tokens 64)" in result.output
    assert not out.exists()


def test_a_configuration_the_gpu_model_does_not_cover_is_one_line_naming_the_trace(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "chunked.parquet"
    made = run_cli(["synth", "-o", str(trace), "--model", "full+chunked", "--requests", "3"])
    assert made.exit_code == 0, made.output
    out = tmp_path / "sweep.parquet"
    result = run_cli(["whatif", str(trace), "--capacity-blocks", "100", "--cache", "gpu", "-o", str(out)])  # fmt: skip
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (
        f"error: {trace}: kv_cache_groups[1]: the GPU block-pool model does not cover "
        "chunked_local_attention groups\n"
    )
    assert not out.exists()
    # The Mooncake store model takes it.
    ok = run_cli(["whatif", str(trace), "--capacity-blocks", "100", "--cache", "mooncake", "-o", str(out)])  # fmt: skip
    assert ok.exit_code == 0, ok.output
