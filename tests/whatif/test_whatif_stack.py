"""Every LRU capacity in one pass (``replay.whatif.stack``, issue 24 item 2):
inside its exact class it equals the per-capacity simulation on every field
the sweep reports; outside it, it differs, and the sweep does not use it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from replay.base.spec import TraceConfig
from replay.format.sweepfile import read_sweep
from replay.format.writer import write_trace
from replay.rules.coordinator import POLICIES
from replay.sources.archetypes import archetype_config
from replay.whatif import stack
from replay.whatif.requests import Requests, load_requests
from replay.whatif.sweep import RunSpec, one_pass_specs, simulate, sweep
from tests.builders import random_prompts, unit_hashes
from tests.conftest import run_cli


def _requests(
    path: Path, config: TraceConfig, prompts: list[list[int]], caps: list[int] | None = None
) -> Requests:
    return load_requests(_trace(path, config, prompts, caps))


def _trace(
    path: Path, config: TraceConfig, prompts: list[list[int]], caps: list[int] | None = None
) -> Path:
    """A trace of lookups (vLLM's bound: ``max_length`` = n - 1, unless
    ``caps`` lowers it)."""
    bs = config.hash_block_size
    rows = [
        {
            "kind": "lookup",
            "request_id": f"r{i}",
            "block_hashes": unit_hashes(p, bs),
            "max_length": len(p) - 1 if caps is None else caps[i],
            "num_tokens": len(p),
        }
        for i, p in enumerate(prompts)
    ]
    return write_trace(path, config, rows)


def _unaligned(prompts: list[list[int]], bs: int) -> list[list[int]]:
    """No prompt a whole number of blocks: the lookup cap (n - 1 tokens)
    then never stops short of a present block."""
    return [[*p, 7] if len(p) % bs == 0 else p for p in prompts]


def _same_row(mine: dict[str, Any], theirs: dict[str, Any], where: object) -> None:
    assert mine["method"] == "one-pass" and theirs["method"] == "per-capacity"
    assert mine["_hits"].tolist() == theirs["_hits"].tolist(), where
    assert mine["facts"].equals(theirs["facts"]), where
    assert mine["simulator"] == "compiled"
    for column in theirs:
        if column not in ("seconds", "method", "simulator", "_hits", "facts"):
            assert mine[column] == theirs[column], (column, where)


@pytest.mark.parametrize("seed", range(6))
def test_one_pass_equals_the_per_capacity_runs_on_random_streams(seed: int, tmp_path: Path) -> None:
    """Seeded random streams inside the class (one full-attention group,
    prompts sharing prefixes, resends, extensions), random capacities from
    the largest prompt to far past the working set, random budgets: every
    row of the one pass equals the compiled per-capacity run on hit tokens,
    hit ratio, every request's hit, the percentiles, evictions, admissions
    and every lookup's facts, under the release policies whose engine rules
    the compiled model covers (another release's runs the Python model,
    per capacity)."""
    rng = random.Random(2400 + seed)
    compared = evicting = 0
    policies: set[str] = set()
    for case in range(6):
        bs = rng.choice((4, 16, 32))
        config = archetype_config("full", bs, bs, False)
        prompts = _unaligned(random_prompts(rng, bs, rng.randrange(40, 160)), bs)
        requests = _requests(tmp_path / f"t{case}.parquet", config, prompts)
        largest = max(-(-len(p) // bs) for p in prompts)
        capacities = sorted({rng.randrange(largest, 12 * largest) for _ in range(8)})
        budget = bs * rng.choice((1, 3, 64))
        policy = rng.choice([p for p in POLICIES if stack.exact_config(config, p) is None])
        specs = [
            RunSpec(
                cache="gpu",
                eviction="lru",
                capacity_blocks=c,
                max_num_batched_tokens=budget,
                policy=policy,
            )
            for c in capacities
        ]
        assert one_pass_specs(requests, specs) == list(range(len(specs)))
        for spec, row in zip(specs, sweep(requests, specs), strict=True):
            _same_row(row, simulate(requests, spec), (seed, case, spec))
            compared += 1
            evicting += row["evicted_blocks"] > 0
            policies.add(policy)
    assert compared >= 30 and evicting >= 15 and len(policies) >= 2


def test_one_pass_equals_the_python_model(tmp_path: Path) -> None:
    """The same against the Python block pool itself (the specification)."""
    rng = random.Random(2424)
    compared = 0
    for case in range(4):
        bs = rng.choice((4, 16))
        config = archetype_config("full", bs, bs, False)
        prompts = _unaligned(random_prompts(rng, bs, 60), bs)
        requests = _requests(tmp_path / f"p{case}.parquet", config, prompts)
        largest = max(-(-len(p) // bs) for p in prompts)
        specs = [
            RunSpec(cache="gpu", eviction="lru", capacity_blocks=c)
            for c in sorted({rng.randrange(largest, 6 * largest) for _ in range(4)})
        ]
        for spec, row in zip(specs, sweep(requests, specs), strict=True):
            _same_row(row, simulate(requests, spec, compiled=False), (case, spec))
            compared += 1
    assert compared >= 12


# The smallest stream found (random search) where a duplicate copy makes a
# plain stack algorithm wrong: 4-token blocks, a pool of 3.
DUPLICATE_PROMPTS = [
    [1, 6, 4, 6, 9],
    [2, 7, 6, 4, 4, 5],
    [9, 0, 4, 7],
    [9, 0, 4, 7],  # resent: its one block is present, but the lookup stops at 3 tokens
    [9, 100],
    [2, 7, 6, 4, 4, 5, 102, 100, 102, 100],
]


def test_a_duplicate_copy_breaks_a_plain_stack_and_the_pass_counts_it(tmp_path: Path) -> None:
    """Request 4 resends a block-aligned prompt: its block is cached, but
    vLLM recomputes a prompt's last token, so the lookup stops short of it,
    the block is recomputed and cached a second time. The stale copy holds
    one of the 3 blocks, so request 6's first block is evicted: vLLM's pool
    (the per-capacity run) hits nothing, while a plain stack of keys still
    holds it and says 4 tokens (and 3 evictions, not 4). The pass tracks
    the stale copy per capacity and gets vLLM's numbers."""
    config = archetype_config("full", 4, 4, False)
    requests = _requests(tmp_path / "dup.parquet", config, DUPLICATE_PROMPTS)
    plain = stack.run_stack(requests, [3, 4], copies=False)
    assert plain.why.tolist() == [[stack.DUPLICATE, 3], [stack.DUPLICATE, 3]]
    assert plain.hits[0].tolist() == [0, 0, 0, 0, 0, 4] and plain.evicted[0] == 3
    truth = simulate(requests, RunSpec(cache="gpu", eviction="lru", capacity_blocks=3))
    assert truth["_hits"].tolist() == [0, 0, 0, 0, 0, 0] and truth["evicted_blocks"] == 4
    assert simulate(
        requests, RunSpec(cache="gpu", eviction="lru", capacity_blocks=3), compiled=False
    )["_hits"].tolist() == [0, 0, 0, 0, 0, 0]
    run = stack.run_stack(requests, [3, 4])
    assert run.why.tolist() == [[stack.EXACT, 0], [stack.EXACT, 0]]
    assert run.hits[0].tolist() == [0, 0, 0, 0, 0, 0] and run.evicted[0] == 4
    rows = sweep(
        requests, [RunSpec(cache="gpu", eviction="lru", capacity_blocks=c) for c in (3, 4)]
    )
    assert [r["method"] for r in rows] == ["one-pass", "one-pass"]
    assert [r["hit_tokens"] for r in rows] == [0, 4]


def test_a_third_copy_is_outside_the_class(tmp_path: Path) -> None:
    """A block-aligned one-block prompt sent three times: the third send
    recomputes a key that already has two copies; the pass does not model
    that, names the request, and the sweep simulates the capacity."""
    config = archetype_config("full", 4, 4, False)
    prompts = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4, 5]]
    requests = _requests(tmp_path / "three.parquet", config, prompts)
    run = stack.run_stack(requests, [4, 8])
    assert run.why.tolist() == [[stack.DUPLICATE, 2], [stack.DUPLICATE, 2]]
    specs = [RunSpec(cache="gpu", eviction="lru", capacity_blocks=c) for c in (4, 8)]
    rows = sweep(requests, specs)
    assert [r["method"] for r in rows] == ["per-capacity"] * 2
    for spec, row in zip(specs, rows, strict=True):
        assert row["_hits"].tolist() == simulate(requests, spec)["_hits"].tolist()


def test_the_copies_are_needed_on_random_streams(tmp_path: Path) -> None:
    """Streams with block-aligned resends and shortened lookups (the lookup
    cap recomputes present blocks): the sweep's rows all equal the
    per-capacity runs, many from the pass; a plain stack algorithm (no
    copies) is wrong at some of those capacities."""
    rng = random.Random(99)
    one_pass = plain_wrong = outside = 0
    for case in range(10):
        bs = 16
        config = archetype_config("full", bs, bs, False)
        prompts = random_prompts(rng, bs, 80)
        caps = [
            max(0, len(p) - 1 - (rng.randrange(bs) if rng.random() < 0.1 else 0)) for p in prompts
        ]
        requests = _requests(tmp_path / f"d{case}.parquet", config, prompts, caps)
        largest = max(-(-len(p) // bs) for p in prompts)
        capacities = sorted({rng.randrange(largest, 8 * largest) for _ in range(6)})
        plain = stack.run_stack(requests, capacities, copies=False)
        run = stack.run_stack(requests, capacities)
        specs = [RunSpec(cache="gpu", eviction="lru", capacity_blocks=c) for c in capacities]
        rows = sweep(requests, specs)
        for j, (spec, row) in enumerate(zip(specs, rows, strict=True)):
            truth = simulate(requests, spec)
            if run.why[j, 0] == stack.EXACT:
                _same_row(row, truth, (case, spec))
                one_pass += 1
                plain_wrong += plain.hits[j].tolist() != truth["_hits"].tolist() or int(
                    plain.evicted[j]
                ) != int(truth["evicted_blocks"])
            else:
                assert run.why[j, 0] == stack.DUPLICATE and row["method"] == "per-capacity"
                assert row["_hits"].tolist() == truth["_hits"].tolist()
                outside += 1
    assert one_pass >= 20 and plain_wrong >= 5 and outside >= 20, (one_pass, plain_wrong, outside)


def test_capacities_below_the_largest_prompt_are_simulated(tmp_path: Path) -> None:
    """A prompt larger than the pool is never scheduled there but moves the
    stack at larger capacities: those capacities run on their own, the
    others come from the pass."""
    rng = random.Random(5)
    config = archetype_config("full", 16, 16, False)
    prompts = _unaligned(random_prompts(rng, 16, 60), 16)
    requests = _requests(tmp_path / "small.parquet", config, prompts)
    largest = max(-(-len(p) // 16) for p in prompts)
    capacities = [largest // 2, largest - 1, largest, 3 * largest]
    run = stack.run_stack(requests, capacities)
    assert [int(w) for w in run.why[:, 0]] == [stack.TOO_SMALL] * 2 + [stack.EXACT] * 2
    specs = [RunSpec(cache="gpu", eviction="lru", capacity_blocks=c) for c in capacities]
    rows = sweep(requests, specs)
    assert [r["method"] for r in rows] == ["per-capacity"] * 2 + ["one-pass"] * 2
    assert rows[0]["not_admitted"] > 0
    for spec, row in zip(specs, rows, strict=True):
        assert row["_hits"].tolist() == simulate(requests, spec)["_hits"].tolist()


def test_a_repeated_hash_in_a_prompt_is_outside_the_class(tmp_path: Path) -> None:
    """Hashes that do not chain (one hash twice in a prompt): two copies at
    every capacity, so the pass answers none."""
    config = archetype_config("full", 4, 4, False)
    rows = [
        {
            "kind": "lookup",
            "request_id": f"r{i}",
            "block_hashes": hashes,
            "max_length": 4 * len(hashes),
            "num_tokens": 4 * len(hashes) + 1,
        }
        for i, hashes in enumerate([[b"a", b"b", b"a"], [b"a", b"c"], [b"a", b"b", b"a"]])
    ]
    requests = load_requests(write_trace(tmp_path / "rep.parquet", config, rows))
    run = stack.run_stack(requests, [4, 8])
    assert run.why.tolist() == [[stack.REPEATED, 0], [stack.REPEATED, 0]]
    specs = [RunSpec(cache="gpu", eviction="lru", capacity_blocks=c) for c in (4, 8)]
    assert [r["method"] for r in sweep(requests, specs)] == ["per-capacity"] * 2


@pytest.mark.parametrize(
    ("model", "eagle", "policy", "why"),
    [
        ("full+mamba", False, "vllm-0.33", "more than one KV-cache group"),
        ("full+swa", False, "vllm-0.33", "more than one KV-cache group"),
        ("full", True, "vllm-0.33", "an EAGLE drop"),
        ("full", False, "vllm-0.32", "policy vllm-0.32's engine rules"),
    ],
)
def test_configurations_outside_the_class_run_per_capacity(
    model: str, eagle: bool, policy: str, why: str, tmp_path: Path
) -> None:
    config = archetype_config(model, 16, 16, eagle)
    assert (stack.exact_config(config, policy) or "").startswith(why)
    prompts = random_prompts(random.Random(1), 16, 30)
    requests = _requests(tmp_path / "o.parquet", config, _unaligned(prompts, 16))
    specs = [
        RunSpec(cache="gpu", eviction="lru", capacity_blocks=c, policy=policy) for c in (400, 800)
    ]
    assert one_pass_specs(requests, specs) == []
    assert [r["method"] for r in sweep(requests, specs)] == ["per-capacity"] * 2


def test_only_lru_gpu_runs_join_the_pass(tmp_path: Path) -> None:
    config = archetype_config("full", 16, 16, False)
    prompts = _unaligned(random_prompts(random.Random(2), 16, 30), 16)
    requests = _requests(tmp_path / "m.parquet", config, prompts)
    specs = [
        RunSpec(cache="gpu", eviction="lru", capacity_blocks=500),
        RunSpec(cache="gpu", eviction="fifo", capacity_blocks=500),
        RunSpec(cache="mooncake", eviction="lru", capacity_blocks=500),
        RunSpec(cache="gpu", eviction="lru", capacity_blocks=900),
        RunSpec(cache="gpu", eviction="lru", capacity_blocks=900, emit=str(tmp_path / "e.parquet")),
    ]
    assert one_pass_specs(requests, specs) == [0, 3]
    rows = sweep(requests, specs)
    assert [r["method"] for r in rows] == [
        "one-pass",
        "per-capacity",
        "per-capacity",
        "one-pass",
        "per-capacity",
    ]
    assert rows[3]["hit_tokens"] == rows[4]["hit_tokens"]


def test_the_sweep_file_says_how_each_row_was_computed(tmp_path: Path) -> None:
    """``replay whatif`` writes ``method`` per row: one-pass for the LRU
    capacities of a full-attention trace, per-capacity for fifo."""
    config = archetype_config("full", 16, 16, False)
    prompts = _unaligned(random_prompts(random.Random(8), 16, 50), 16)
    trace = _trace(tmp_path / "t.parquet", config, prompts)
    out = tmp_path / "sweep.parquet"
    args = ["whatif", str(trace), "--cache", "gpu", "--capacity", "40,80,160", "-q"]
    result = run_cli([*args, "--eviction", "lru,fifo", "-o", str(out)])
    assert result.exit_code == 0, result.output
    frame, meta = read_sweep(out)
    assert frame.select("capacity_blocks", "eviction", "method").rows() == [
        (40, "lru", "one-pass"),
        (40, "fifo", "per-capacity"),
        (80, "lru", "one-pass"),
        (80, "fifo", "per-capacity"),
        (160, "lru", "one-pass"),
        (160, "fifo", "per-capacity"),
    ]
    assert meta["ceiling"] is not None


def test_a_signal_keeps_the_one_pass_rows_and_stops_the_pass(tmp_path: Path) -> None:
    """The pass's rows reach ``on_row`` before the per-capacity runs start,
    so a signal during those keeps them; asked to stop, the pass stops at
    its next request."""
    config = archetype_config("full", 16, 16, False)
    prompts = _unaligned(random_prompts(random.Random(4), 16, 300), 16)
    requests = _requests(tmp_path / "sig.parquet", config, prompts)
    largest = max(-(-len(p) // 16) for p in prompts)
    lru = [RunSpec(cache="gpu", eviction="lru", capacity_blocks=largest + k) for k in range(5)]
    fifo = [RunSpec(cache="gpu", eviction="fifo", capacity_blocks=largest + k) for k in range(50)]
    kept: dict[int, dict[str, Any]] = {}

    def after_the_pass(done: int, total: int, runs: int, all_runs: int) -> None:
        if runs > len(lru):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sweep(
            requests,
            [*lru, *fifo],
            progress=after_the_pass,
            on_row=kept.__setitem__,
            poll=0.001,
        )
    assert set(range(len(lru))) <= set(kept) and len(kept) < len(lru) + len(fifo)
    assert all(kept[k]["method"] == "one-pass" for k in range(len(lru)))
    for k in range(len(lru)):
        assert kept[k]["hit_tokens"] == simulate(requests, lru[k])["hit_tokens"]

    # The pass itself stops at its next request when asked (what the sweep
    # does on a signal), every capacity then unanswered.
    control = np.array([0, 1], dtype=np.int64)
    run = stack.run_stack(requests, [largest], control)
    assert run.why.tolist() == [[stack.STOPPED, 0]] and control[0] == 0
