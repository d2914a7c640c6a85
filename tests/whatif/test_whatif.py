"""``replay whatif``: properties of the sweep, emitted traces that replay to
the same hits, and the command line."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from replay.analysis.flags import FLAG_KINDS
from replay.base.spec import TraceConfig
from replay.format.sweepfile import SWEEP_COLUMNS, read_sweep
from replay.format.tracedir import open_trace
from replay.format.writer import write_trace
from replay.rules.coordinator import Coordinator
from replay.rules.store_rules import StoreRules, StoreSettings, junction_tokens
from replay.sources.archetypes import archetype_config
from replay.whatif.requests import load_requests
from replay.whatif.sweep import RunSpec, simulate, sweep
from tests.builders import random_archetype_config, random_prompts, replay_trace, unit_hashes
from tests.conftest import run_cli


def rules_trace(
    path: Path, config: TraceConfig, cache: str, settings: StoreSettings, prompts: list[list[int]]
) -> Path:
    """A trace whose stores are what the store rules say each request leaves
    behind, in an unbounded store (the trace's own hits)."""
    coordinator = Coordinator(config, "vllm-0.33", cache)
    rules = StoreRules(config, settings)
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


def random_case(rng: random.Random, cache: str) -> tuple[TraceConfig, StoreSettings]:
    config = random_archetype_config(rng)
    sparse = config.num_groups > 1
    return config, StoreSettings(
        retention_interval=rng.choice((0, None)) if sparse else 0,
        max_num_batched_tokens=config.scheduler_block_size * rng.choice((1, 3, 64)),
        cache=cache,
    )


def observed_hits(path: str | Path) -> list[int]:
    frame = open_trace(path).read_frame(["kind", "observed_hit_tokens"])
    return frame.filter(pl.col("kind") == "lookup")["observed_hit_tokens"].to_list()


def spec_for(
    settings: StoreSettings, cache: str, eviction: str, capacity: int, emit: Path
) -> RunSpec:
    return RunSpec(
        cache=cache,
        eviction=eviction,
        capacity_blocks=capacity,
        retention_interval=settings.retention_interval,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        emit=str(emit),
    )


@pytest.mark.parametrize("cache", [pytest.param("gpu", marks=pytest.mark.slow), "mooncake"])
def test_unbounded_capacity_reproduces_the_traces_own_hits(cache: str, tmp_path: Path) -> None:
    rng = random.Random(1600 + len(cache))
    compared = nonzero = 0
    for case in range(12):
        config, settings = random_case(rng, cache)
        prompts = random_prompts(rng, config.scheduler_block_size, 30)
        trace = rules_trace(tmp_path / f"t{case}.parquet", config, cache, settings, prompts)
        own = replay_trace(trace, cache=cache).results["hit_tokens"].to_list()
        emitted = tmp_path / f"w{case}.parquet"
        row = simulate(load_requests(trace), spec_for(settings, cache, "lru", 10**7, emitted))
        assert observed_hits(emitted) == own, config.to_json()
        assert row["hit_tokens"] == sum(own) and row["evicted_blocks"] == 0
        compared += len(own)
        nonzero += sum(1 for h in own if h)
    assert compared == 360 and nonzero > 100


@pytest.mark.parametrize("cache", ["gpu", "mooncake"])
def test_emitted_runs_replay_to_exactly_their_hits(cache: str, tmp_path: Path) -> None:
    """At capacities with many evictions, every eviction order: ``replay run`` on the
    emitted trace gives each lookup the hit the what-if found."""
    rng = random.Random(1616)
    evicted = 0
    for case in range(4):
        config, settings = random_case(rng, cache)
        prompts = random_prompts(rng, config.scheduler_block_size, 40)
        trace = rules_trace(tmp_path / f"t{case}.parquet", config, cache, settings, prompts)
        requests = load_requests(trace)
        longest = max(len(p) for p in prompts) // config.groups[0].block_size + 1
        for eviction in ("lru", "fifo", "lfu", "belady"):
            emitted = tmp_path / f"w{case}-{eviction}.parquet"
            spec = spec_for(settings, cache, eviction, longest * config.num_groups, emitted)
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
        settings = StoreSettings(cache=cache, max_num_batched_tokens=bs * rng.choice((1, 4, 64)))
        prompts = random_prompts(rng, bs, 60)
        trace = rules_trace(tmp_path / f"f{case}.parquet", config, cache, settings, prompts)
        requests = load_requests(trace)
        longest = max(len(p) for p in prompts) // bs + 1
        capacities = sorted({longest + rng.randrange(0, 4 * longest) for _ in range(6)})
        specs = [
            RunSpec(
                cache=cache,
                eviction=e,
                capacity_blocks=c,
                max_num_batched_tokens=settings.max_num_batched_tokens,
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
    from replay.base.units import parse_bytes

    assert parse_bytes("64GiB", "--capacity-bytes") == 64 * 2**30
    assert parse_bytes("500MB", "--capacity-bytes") == 500 * 10**6
    assert parse_bytes("4096", "--capacity-bytes") == 4096
    assert parse_bytes("1.5KiB", "--capacity-bytes") == 1536


def _demo_trace(tmp_path: Path) -> Path:
    config = archetype_config("full+mamba", 16, 16, True)
    prompts = random_prompts(random.Random(3), 16, 40)
    return rules_trace(
        tmp_path / "demo.parquet", config, "gpu", StoreSettings(cache="gpu"), prompts
    )


@pytest.mark.slow
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
        (["--capacity-blocks", "10,x"], "--capacity-blocks 'x': expected a whole number from 1 to"),
        (
            ["--capacity-blocks", "10,1.5"],
            "--capacity-blocks '1.5': expected a whole number from 1",
        ),
        (["--capacity", "10,10%"], "--capacity: '10%' is in percent, '10' in blocks"),
        (["--capacity", "1GiB"], "bytes need the groups' page sizes"),
        (["--points", "3", "--min", "10k"], "--points, --min and --max go together"),
        (["--points", "3", "--min", "10k", "--max", "1GiB"], "are in different units"),
        (["--capacity", "10", "--points", "3"], "exactly one of"),
        (["--capacity-blocks", "10", "--eviction", "mru"], "unknown eviction order 'mru'"),
        (["--capacity-bytes", "1GiB"], "need the groups' page sizes"),
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
    assert (result.exit_code, result.output) == (
        2,
        f"error: -o {trace}: is the input {trace}; refusing to overwrite it (give another output path)\n",
    )
    assert trace.read_bytes() == before


def test_report_charts_one_line_per_policy_and_writes_the_markdown_table(tmp_path: Path) -> None:
    trace = _demo_trace(tmp_path)
    sweep_file = tmp_path / "sweep.parquet"
    args = ["whatif", str(trace), "--capacity-blocks", "300,100,200", "-o", str(sweep_file)]
    assert run_cli([*args, "--eviction", "lru,belady", "--jobs", "1"]).exit_code == 0
    html_out, md_out = tmp_path / "sweep.html", tmp_path / "sweep.md"
    assert run_cli(["report", str(sweep_file), "-o", str(html_out)]).exit_code == 0
    page = html_out.read_text()
    # The Altair chart, inlined as SVG (no script, nothing fetched): one line
    # per eviction of the hit ratio, three percentile lines per eviction
    # below it, the unbounded ceiling's rule.
    assert page.count('<svg id="sweep-chart"') == 1
    lines = re.findall(r'class="mark-line role-mark (concat_\d)[^"]*"', page)
    assert lines.count("concat_0") == 2 and lines.count("concat_1") == 2 * 3
    assert "unbounded ceiling" in page
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


def test_cli_capacity_in_percent_bytes_and_log_ranges(tmp_path: Path) -> None:
    trace = _demo_trace(tmp_path)
    requests = load_requests(trace)
    working_set = requests.working_set_blocks()
    assert working_set == len(requests.digests) * 2
    out = tmp_path / "pct.parquet"
    args = ["whatif", str(trace), "--cache", "gpu", "-o", str(out), "-q"]
    assert run_cli([*args, "--capacity", "10%,50%"]).exit_code == 0
    frame, meta = read_sweep(out)
    assert frame["capacity_blocks"].to_list() == [working_set // 10, working_set // 2]
    assert meta["capacity_unit"] == "percent" and meta["working_set_blocks"] == working_set
    assert meta["capacities"] == ["10%", "50%"] and meta["page_bytes_source"] is None
    assert run_cli([*args, "--points", "4", "--min", "1k", "--max", "8k"]).exit_code == 0
    frame, meta = read_sweep(out)
    assert frame["capacity_blocks"].to_list() == [1000, 2000, 4000, 8000]
    assert meta["capacity_unit"] == "blocks"
    assert run_cli([*args, "--capacity", "8MiB,16MiB", "--page-bytes", "32KiB"]).exit_code == 0
    frame, meta = read_sweep(out)
    assert frame["capacity_blocks"].to_list() == [256, 512]
    assert frame["capacity_bytes"].to_list() == [8 * 2**20, 16 * 2**20]
    assert meta["page_bytes_source"] == "--page-bytes" and meta["block_bytes"] == 32 * 1024
    model = tmp_path / "config.json"
    model.write_text(
        '{"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,'
        ' "head_dim": 64, "torch_dtype": "float16"}'
    )
    assert run_cli([*args, "--capacity", "1MiB", "--model-config", str(model)]).exit_code == 0
    frame, meta = read_sweep(out)
    page = 2 * 4 * 2 * 64 * 16 * 2  # K+V, 4 layers, 2 heads, 64 dims, 16 tokens, 2 bytes
    assert meta["block_bytes"] == page and meta["page_bytes_source"] == "--model-config config.json"
    assert frame["capacity_blocks"].to_list() == [2**20 // page]


def _lower_percentile(values: list[float], q: int) -> float:
    ordered = sorted(values)
    return ordered[int(q / 100 * (len(ordered) - 1))]


def test_rows_carry_per_request_percentiles_and_the_sweep_its_ceiling(tmp_path: Path) -> None:
    trace = _demo_trace(tmp_path)
    requests = load_requests(trace)
    out = tmp_path / "sweep.parquet"
    result = run_cli(
        ["whatif", str(trace), "--capacity", "150,600", "--cache", "gpu", "-o", str(out), "-q"]
    )
    assert result.exit_code == 0, result.output
    frame, meta = read_sweep(out)
    for row in frame.iter_rows(named=True):
        spec = RunSpec(cache="gpu", eviction="lru", capacity_blocks=row["capacity_blocks"])
        hits = simulate(requests, spec, compiled=False)["_hits"].tolist()
        ratios = [max(h, 0) / n for h, n in zip(hits, requests.num_tokens, strict=True)]
        for q in (50, 90, 99):
            assert row[f"hit_ratio_p{q}"] == _lower_percentile(ratios, q)
    own = replay_trace(trace, cache="gpu").results["hit_tokens"].sum()
    ceiling = meta["ceiling"]
    assert ceiling["hit_tokens"] == own and ceiling["evicted_blocks"] == 0
    assert ceiling["hit_ratio"] >= max(frame["hit_ratio"])
    assert meta["partial"] is False and meta["sample"] is None
    # What the operator reads: the percentiles per run and the ceiling.
    shown = run_cli(
        ["whatif", str(trace), "--capacity", "150", "--cache", "gpu", "-o", str(out)]
    ).output.splitlines()
    assert shown[1].split()[-3:] == ["p50", "p90", "p99"]
    row = frame.row(0, named=True)
    assert shown[2].split()[-3:] == [f"{row[f'hit_ratio_p{q}']:.1%}" for q in (50, 90, 99)]
    # The ceiling is a row like the runs, in their units (issue 36), and
    # its capacity is said to be room enough, not a least size.
    assert shown[3].split() == [
        "unbounded",
        f"{ceiling['hit_ratio']:.2%}",
        f"{ceiling['hit_tokens']:,}",
        "0",
        *(f"{ceiling[f'hit_ratio_p{q}']:.1%}" for q in (50, 90, 99)),
    ]
    assert shown[4] == (
        f"unbounded: a run with room for {ceiling['capacity_blocks']:,} blocks (the working "
        f"set, {meta['working_set_blocks']:,}, and more), never full"
    )


def test_sample_keeps_whole_sessions_deterministically_and_says_so(tmp_path: Path) -> None:
    config = archetype_config("full", 16, 16, False)
    rng = random.Random(5)
    # Sessions: each a conversation extending its own turns behind one shared
    # system prompt.
    system = list(range(64))
    rows, fresh = [], iter(range(10**6, 10**9))
    sessions: dict[str, list[int]] = {}
    for i in range(120):
        name = f"s{rng.randrange(30)}"
        # every turn adds a block or more: a session's first turn has a hash of its own
        prompt = sessions.get(name, system) + [next(fresh) for _ in range(rng.randrange(16, 80))]
        sessions[name] = prompt
        rows.append(
            {
                "kind": "lookup",
                "request_id": f"{name}-{i}",
                "block_hashes": unit_hashes(prompt, 16),
                "max_length": len(prompt) - 1,
                "num_tokens": len(prompt),
            }
        )
    trace = write_trace(tmp_path / "sessions.parquet", config, rows)
    requests = load_requests(trace)
    sub, info = requests.sample(0.5)
    again, _ = requests.sample(0.5)
    assert sub.request_id == again.request_id
    kept = {r.split("-")[0] for r in sub.request_id}
    # Whole sessions: every request of a kept session, none of the others.
    assert sub.request_id == [r for r in requests.request_id if r.split("-")[0] in kept]
    assert 0 < len(kept) < len(sessions) and info["sessions"] == len(kept)
    assert info["sessions_total"] == len(sessions) and info["requests"] == len(sub)
    out = tmp_path / "sampled.parquet"
    args = ["whatif", str(trace), "--capacity", "400", "--cache", "gpu", "-q", "-o", str(out)]
    assert run_cli([*args, "--sample", "0.5"]).exit_code == 0
    frame, meta = read_sweep(out)
    assert (
        meta["sample"]["requests"] == len(sub)
        and "spatial sampling" in meta["sample"]["capacities"]
    )
    assert frame["capacity_blocks"].to_list() == [400]
    want = simulate(sub, RunSpec(cache="gpu", eviction="lru", capacity_blocks=200))
    assert frame["hit_tokens"].to_list() == [want["hit_tokens"]]
    assert frame["lookups"].to_list() == [len(sub)]


def test_a_signal_mid_sweep_keeps_the_finished_runs_and_stops_the_others(tmp_path: Path) -> None:
    trace = _demo_trace(tmp_path)
    requests = load_requests(trace)
    specs = [RunSpec(cache="gpu", eviction="lru", capacity_blocks=100 + k) for k in range(400)]
    kept: dict[int, dict[str, Any]] = {}

    def interrupt(done: int, total: int, runs: int, all_runs: int) -> None:
        if runs >= 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sweep(requests, specs, jobs=1, progress=interrupt, on_row=kept.__setitem__, poll=0.001)
    assert 1 <= len(kept) < len(specs)
    for k, row in list(kept.items())[:5]:
        assert row["hit_tokens"] == simulate(requests, specs[k])["hit_tokens"]


def test_sigterm_mid_sweep_exits_143_with_the_finished_runs_and_no_temporary_file(
    tmp_path: Path,
) -> None:
    """The sweep on a terminal: once the bar shows a finished run, SIGTERM.
    The command exits 143 and the sweep file holds the finished runs,
    marked partial; nothing else is left in the directory."""
    import os
    import signal
    import subprocess
    import sys
    import tty

    config = archetype_config("full+mamba", 16, 16, True)
    prompts = random_prompts(random.Random(9), 16, 1000)
    trace = rules_trace(
        tmp_path / "big.parquet", config, "gpu", StoreSettings(cache="gpu"), prompts
    )
    out = tmp_path / "out" / "sweep.parquet"
    out.parent.mkdir()
    root = Path(__file__).resolve().parents[2]
    master, slave = os.openpty()
    tty.setraw(slave)
    proc = subprocess.Popen(
        [sys.executable, "-m", "replay", "whatif", str(trace), "--cache", "gpu", "--jobs", "1",
         "--points", "2000", "--min", "100", "--max", "100k", "--eviction", "lru,belady",
         "-o", str(out)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    os.close(slave)
    shown = b""
    try:
        while not re.search(rb"  ([1-9]\d*)/\d+ runs", shown):
            chunk = os.read(master, 65536)
            assert chunk, shown[-500:]
            shown += chunk
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(master)
    assert proc.returncode == 143, shown[-1000:]
    assert b"interrupted by SIGTERM" in shown and b"partial" in shown
    assert [p.name for p in out.parent.iterdir()] == ["sweep.parquet"]
    frame, meta = read_sweep(out)
    assert meta["partial"] is True and 0 < frame.height < 2 * 2000
