"""The GPU block-pool model (``replay.rules.blockpool``) against vLLM 0.33.0's own
``KVCacheManager`` (real ``BlockPool``, prefix caching on).

The requests are the first rows of the Mooncake conversation trace, their
tokens built from the rows' ``hash_ids`` (a 512-token block per id, so equal
ids give equal prefixes), one request at a time: ``get_computed_blocks``,
then ``allocate_slots`` per prefill chunk as the scheduler splits it (the
first with ``full_sequence_must_fit``, vLLM's ``scheduler_reserve_full_isl``;
Mamba chunks by vLLM's own ``Scheduler._mamba_block_aligned_split``), then
``free``. The model gets vLLM's own block hashes for the same prompts, so
per request the hits (and whether the request was admitted) must be equal.
Capacities: one with no eviction, two with many (the pool is ``capacity + 1``
blocks, the null block included). Runs only where vLLM imports.
"""

from __future__ import annotations

import inspect
import json
import os
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import polars as pl
import pytest

pytest.importorskip(
    "vllm.v1.core.kv_cache_manager", reason="vLLM not importable: run make test-vllm"
)

from replay.adapters.vllm.backend import vllm_groups
from replay.base.spec import GroupKind, TraceConfig
from replay.format.tracedir import open_trace
from replay.format.writer import write_trace
from replay.rules.blockpool import GpuCache
from replay.rules.store_rules import StoreSettings
from replay.sources.archetypes import archetype_config
from replay.whatif.kernel import NOT_ADMITTED, supported
from replay.whatif.kernel import PREEMPTED as KERNEL_PREEMPTED
from replay.whatif.requests import load_requests
from replay.whatif.sweep import RunSpec, simulate
from tests.builders import random_archetype_config, random_prompts
from tests.vllm_modules import overreads_lookahead_hashes, split_state, vllm_modules

pytestmark = pytest.mark.vllm

#: The engine takes lookahead block hashes (0.33.0 on).
TAKES_LOOKAHEAD = (
    "num_hash_lookahead_tokens" in inspect.signature(vllm_modules().KVCacheManager).parameters
)

MOONCAKE = Path(
    os.environ.get(
        "MOONCAKE_TRACE",
        Path(__file__).resolve().parents[3] / "shared/data/mooncake/conversation_trace.jsonl",
    )
)
REQUESTS = 520
SOURCE_BLOCK = 512
PREEMPTED = -1


_vllm = vllm_modules


def mooncake_prompts(count: int) -> list[list[int]]:
    if not MOONCAKE.exists():
        pytest.skip(f"{MOONCAKE} not found (set MOONCAKE_TRACE)")
    out: list[list[int]] = []
    with MOONCAKE.open() as f:
        for line in f:
            row = json.loads(line)
            tokens: list[int] = []
            for h in row["hash_ids"]:
                tokens.extend(range(h * SOURCE_BLOCK, (h + 1) * SOURCE_BLOCK))
            out.append(tokens[: row["input_length"]])
            if len(out) == count:
                break
    return out


class Engine:
    """vLLM's ``KVCacheManager``, one request at a time, as the scheduler drives it."""

    def __init__(
        self,
        v: SimpleNamespace,
        config: TraceConfig,
        capacity: int,
        budget: int,
        retention: int | None,
    ) -> None:
        self.v, self.config, self.budget = v, config, budget
        lookahead = config.num_hash_lookahead_tokens
        groups = vllm_groups(config, v.iface, v.torch)
        kv_config = v.iface.KVCacheConfig(
            num_blocks=capacity + 1,
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval=retention,
        )
        self.manager = v.KVCacheManager(
            kv_config,
            max_model_len=1 << 20,
            max_in_flight_tokens=budget,
            scheduler_block_size=config.scheduler_block_size,
            hash_block_size=config.hash_block_size,
            enable_caching=True,
            # Lookahead hashes: the scheduler clears its EAGLE block drop.
            use_eagle=config.use_eagle and not lookahead,
            **({"num_hash_lookahead_tokens": lookahead} if lookahead else {}),
        )
        self.hasher = v.utils.get_request_block_hasher(
            config.hash_block_size, v.sha256, *([lookahead] if lookahead else [])
        )
        self.has_mamba = any(g.kind is GroupKind.MAMBA for g in config.groups)
        self.split_state = split_state(config, budget)

    def request(self, rid: str, tokens: list[int]) -> Any:
        v = self.v
        return v.Request(
            rid, tokens, v.SamplingParams(max_tokens=1), None, block_hasher=self.hasher
        )

    def prefill(self, request: Any) -> int | None:
        """The request's hit, None when it is not admitted, ``PREEMPTED`` when
        a later chunk finds too few blocks."""
        v, mgr = self.v, self.manager
        n = request.num_tokens
        blocks, hit, junction = mgr.get_computed_blocks(request)
        request.shared_prefix_boundary = junction
        local, first = hit, True
        while request.num_computed_tokens + local < n:
            mgr.new_step_starts()
            todo = min(self.budget, n - request.num_computed_tokens - local)
            if self.has_mamba:
                todo = v.Scheduler._mamba_block_aligned_split(
                    self.split_state, request, todo, local, 0
                )
            got = mgr.allocate_slots(
                request,
                todo,
                num_new_computed_tokens=local,
                new_computed_blocks=blocks if first else None,
                full_sequence_must_fit=first,
            )
            if got is None:
                if first:
                    return None
                mgr.free(request)  # the scheduler preempts it, which frees it
                return PREEMPTED
            request.num_computed_tokens += local + todo
            local, first = 0, False
        mgr.free(request)
        return int(hit)


def run_both(
    v: SimpleNamespace,
    config: TraceConfig,
    capacity: int,
    settings: StoreSettings,
    prompts: list[list[int]],
    hashes_out: list[list[bytes]] | None = None,
) -> tuple[list[int | None], list[int | None], int]:
    """Per request: vLLM's hit and the model's (None: not admitted); the
    model's evicted cached blocks. ``hashes_out`` collects vLLM's hashes."""
    budget = settings.max_num_batched_tokens
    engine = Engine(v, config, capacity, budget, settings.retention_interval)
    model = GpuCache(config, capacity, store_settings=settings)
    theirs: list[int | None] = []
    mine: list[int | None] = []
    for i, tokens in enumerate(prompts):
        request = engine.request(f"r{i}", tokens)
        unit_hashes = list(request.block_hashes)
        if hashes_out is not None:
            hashes_out.append([bytes(h) for h in unit_hashes])
        theirs.append(engine.prefill(request))
        got = model.request(unit_hashes, len(tokens), len(tokens) - 1)
        mine.append(None if not got.admitted else (got.hit_tokens if got.completed else PREEMPTED))
    return theirs, mine, model.pool.evicted_blocks


def whatif_hits(
    tmp: Path,
    config: TraceConfig,
    capacity: int,
    settings: StoreSettings,
    prompts: list[list[int]],
    hashes: list[list[bytes]],
) -> tuple[list[int], int]:
    """The same requests through ``replay whatif``'s own path: a trace of
    the lookups (vLLM's hashes), one ``gpu``/``lru`` run emitted as a trace;
    per lookup the emitted hit, and the run's hit tokens."""
    requests = _lookups(tmp / "lookups.parquet", config, prompts, hashes)
    emitted = tmp / "run.parquet"
    row = simulate(
        requests,
        RunSpec(
            cache="gpu",
            eviction="lru",
            capacity_blocks=capacity,
            retention_interval=settings.retention_interval,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            emit=str(emitted),
        ),
    )
    frame = open_trace(emitted).read_frame(["kind", "observed_hit_tokens"])
    observed = frame.filter(pl.col("kind") == "lookup")["observed_hit_tokens"].to_list()
    return observed, int(row["hit_tokens"])


def compiled_hits(
    tmp: Path,
    config: TraceConfig,
    capacity: int,
    settings: StoreSettings,
    prompts: list[list[int]],
    hashes: list[list[bytes]],
) -> list[int | None]:
    """The same requests through the compiled what-if (``replay.whatif.kernel``,
    what ``replay whatif --cache gpu`` runs): per request its hit, None when
    not admitted, ``PREEMPTED``."""
    requests = _lookups(tmp / "compiled.parquet", config, prompts, hashes)
    assert supported(config, "gpu") is None
    row = simulate(
        requests,
        RunSpec(
            cache="gpu",
            eviction="lru",
            capacity_blocks=capacity,
            retention_interval=settings.retention_interval,
            max_num_batched_tokens=settings.max_num_batched_tokens,
        ),
    )
    out: list[int | None] = []
    for h in row["_hits"].tolist():
        out.append(None if h == NOT_ADMITTED else PREEMPTED if h == KERNEL_PREEMPTED else h)
    return out


CONFIGS = {
    "full": lambda: archetype_config("full", 64, 64, False),
    "full+mamba eagle": lambda: archetype_config("full+mamba", 64, 64, True),
    "full+swa eagle": lambda: archetype_config("full+swa", 64, 64, True, sliding_window=1024),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_pool_hits_match_vllm(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    v = _vllm()
    config = CONFIGS[name]()
    prompts = mooncake_prompts(REQUESTS)
    bs = config.groups[0].block_size
    longest = max(-(-len(p) // bs) for p in prompts)
    largest = longest * config.num_groups
    total = sum(-(-len(p) // bs) for p in prompts) * config.num_groups
    sparse = config.num_groups > 1
    runs = [
        (total, StoreSettings(cache="gpu")),
        (largest + largest // 4, StoreSettings(cache="gpu", max_num_batched_tokens=2048)),
        (3 * largest, StoreSettings(cache="gpu")),
        (longest * 2 // 3, StoreSettings(cache="gpu", max_num_batched_tokens=4096)),
    ]
    if sparse:
        runs.append((2 * largest, StoreSettings(cache="gpu", retention_interval=None)))
    report = []
    unbounded_hits = 0
    for capacity, settings in runs:
        hashes: list[list[bytes]] = []
        theirs, mine, evicted = run_both(v, config, capacity, settings, prompts, hashes)
        # ``replay whatif --cache gpu --eviction lru`` itself: the same hit
        # for every request vLLM served, and the same total.
        observed, served = whatif_hits(tmp_path, config, capacity, settings, prompts, hashes)
        # The compiled what-if: every request as vLLM served it (or not).
        assert compiled_hits(tmp_path, config, capacity, settings, prompts, hashes) == theirs
        done = [(i, h) for i, h in enumerate(theirs) if h is not None and h != PREEMPTED]
        assert [observed[i] for i, _ in done] == [h for _, h in done]
        assert served == sum(h for _, h in done)
        agree = sum(a == b for a, b in zip(theirs, mine, strict=True))
        hits = sum(a or 0 for a in theirs)
        report.append((capacity, settings, agree, evicted, theirs.count(None), hits))
        first_bad = next(
            ((i, a, b) for i, (a, b) in enumerate(zip(theirs, mine, strict=True)) if a != b), None
        )
        assert first_bad is None, (
            f"{name} capacity {capacity} {settings}: request {first_bad[0]}: vLLM {first_bad[1]}, "
            f"model {first_bad[2]} ({agree}/{len(prompts)} agree)"
        )
        if capacity == total:
            assert evicted == 0
            unbounded_hits = hits
        else:
            # Evictions cost hits: the bounded runs are not the unbounded one.
            assert evicted > 10 * largest
            assert hits < unbounded_hits
        if capacity < longest:
            assert theirs.count(None) > 0
    with capsys.disabled():
        for capacity, settings, agree, evicted, rejected, hits in report:
            print(
                f"\n{name}: capacity {capacity} blocks, budget {settings.max_num_batched_tokens}, "
                f"retention {settings.retention_interval}: {agree}/{len(prompts)} hits agree "
                f"({hits} hit tokens, {evicted} cached blocks evicted, {rejected} not admitted)"
            )


def test_block_pool_matches_vllm_on_random_sessions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Random hybrids, prompts, budgets, retention settings and capacities."""
    v = _vllm()
    rng = random.Random(16)
    agree = total = admitted_off = evicted_total = preempted = 0
    lookahead = ahead = 0
    for _ in range(60):
        config = random_archetype_config(rng, lookahead=TAKES_LOOKAHEAD)
        lookahead += config.num_hash_lookahead_tokens > 0
        a = config.scheduler_block_size
        sparse = config.num_groups > 1
        retention = rng.choice((0, None, 2 * a)) if sparse else 0
        settings = StoreSettings(
            cache="gpu",
            retention_interval=retention,
            max_num_batched_tokens=a * rng.choice((1, 2, 3, 8, 64)),
        )
        prompts = random_prompts(rng, a, 40)
        # Prompts vLLM's own lookup fails (IndexError) never prefill.
        prompts = [p for p in prompts if not overreads_lookahead_hashes(config, len(p))]
        ahead += len(prompts) if config.num_hash_lookahead_tokens else 0
        longest = max(-(-len(p) // config.groups[0].block_size) for p in prompts)
        capacity = rng.randrange(longest * 2 // 3 + 1, longest * config.num_groups * 4)
        hashes: list[list[bytes]] = []
        theirs, mine, evicted = run_both(v, config, capacity, settings, prompts, hashes)
        good = sum(x == y for x, y in zip(theirs, mine, strict=True))
        compiled = compiled_hits(tmp_path, config, capacity, settings, prompts, hashes)
        assert compiled == theirs, f"{config.to_json()} {settings} capacity {capacity} (compiled)"
        assert good == len(prompts), (
            f"{config.to_json()} {settings} capacity {capacity}: vLLM {theirs} model {mine}"
        )
        agree += good
        total += len(prompts)
        admitted_off += theirs.count(None)
        preempted += theirs.count(PREEMPTED)
        evicted_total += evicted
    with capsys.disabled():
        print(
            f"\nrandom sessions: {agree}/{total} hits agree ({evicted_total} cached blocks "
            f"evicted, {admitted_off} requests not admitted, {preempted} preempted; "
            f"{lookahead} sessions, {ahead} requests with lookahead hashes)"
        )
    assert evicted_total > 1000 and admitted_off > 0
    assert not TAKES_LOOKAHEAD or ahead >= 200


def _vllm_hits(
    v: SimpleNamespace, config: TraceConfig, capacity: int, prompts: list[list[int]]
) -> tuple[list[int | None], list[list[bytes]]]:
    """vLLM's ``KVCacheManager`` alone: per request its hit (None: not
    admitted) and its block hashes."""
    engine = Engine(v, config, capacity, 8192, 0)
    hits: list[int | None] = []
    hashes: list[list[bytes]] = []
    for i, tokens in enumerate(prompts):
        request = engine.request(f"r{i}", tokens)
        hashes.append([bytes(h) for h in request.block_hashes])
        hits.append(engine.prefill(request))
    return hits, hashes


def _lookups(
    path: Path, config: TraceConfig, prompts: list[list[int]], hashes: list[list[bytes]]
) -> Any:
    rows = [
        {
            "kind": "lookup",
            "request_id": f"r{i}",
            "block_hashes": units,
            "max_length": len(tokens) - 1,
            "num_tokens": len(tokens),
        }
        for i, (tokens, units) in enumerate(zip(prompts, hashes, strict=True))
    ]
    return load_requests(write_trace(path, config, rows))


def test_one_lru_pass_matches_vllm_at_every_capacity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 24 item 2 against vLLM itself: the Mooncake rows on one
    full-attention group (no prompt a whole number of blocks, so the lookup
    cap never recomputes a present block), six capacities from the largest
    prompt to one that never evicts: every capacity from the one pass, and
    every request's hit is vLLM's."""
    from replay.whatif.sweep import sweep

    v = _vllm()
    config = archetype_config("full", 64, 64, False)
    prompts = [p if len(p) % 64 else p[:-1] for p in mooncake_prompts(REQUESTS)]
    longest = max(-(-len(p) // 64) for p in prompts)
    total = sum(-(-len(p) // 64) for p in prompts)
    capacities = [longest, 2 * longest, total // 8, total // 4, total // 2, total]
    per_capacity = [_vllm_hits(v, config, c, prompts) for c in capacities]
    requests = _lookups(tmp_path / "full.parquet", config, prompts, per_capacity[0][1])
    specs = [RunSpec(cache="gpu", eviction="lru", capacity_blocks=c) for c in capacities]
    rows = sweep(requests, specs)
    assert [r["method"] for r in rows] == ["one-pass"] * len(capacities)
    for c, row, (theirs, _) in zip(capacities, rows, per_capacity, strict=True):
        assert row["_hits"].tolist() == theirs, c
    totals = [row["hit_tokens"] for row in rows]
    assert totals == sorted(totals) and totals[0] < totals[-1]
    with capsys.disabled():
        print(
            f"\none LRU pass: {len(capacities)} capacities x {len(prompts)} requests agree "
            f"with vLLM (hit tokens {totals[0]:,} .. {totals[-1]:,})"
        )


def test_a_duplicate_copy_in_vllm_is_what_a_plain_stack_cannot_see(tmp_path: Path) -> None:
    """The stream of ``tests/whatif/test_whatif_stack.py``'s duplicate case through
    vLLM's own pool of 3 blocks (4-token blocks): request 4 resends a
    block-aligned prompt, vLLM recomputes and caches its block a second
    time, and request 6 finds its first block evicted: 0 hit tokens, where a
    plain stack over the keys says 4. The one pass, which counts the stale
    copy, gives vLLM's hits."""
    from replay.whatif import stack
    from replay.whatif.sweep import sweep
    from tests.whatif.test_whatif_stack import DUPLICATE_PROMPTS

    v = _vllm()
    config = archetype_config("full", 4, 4, False)
    theirs, hashes = _vllm_hits(v, config, 3, DUPLICATE_PROMPTS)
    assert theirs == [0, 0, 0, 0, 0, 0]
    requests = _lookups(tmp_path / "dup.parquet", config, DUPLICATE_PROMPTS, hashes)
    plain = stack.run_stack(requests, [3], copies=False)
    assert plain.why.tolist() == [[stack.DUPLICATE, 3]]
    assert plain.hits[0].tolist() == [0, 0, 0, 0, 0, 4]
    specs = [RunSpec(cache="gpu", eviction="lru", capacity_blocks=c) for c in (3, 4)]
    (row, _) = sweep(requests, specs)
    assert row["method"] == "one-pass" and row["_hits"].tolist() == theirs


def test_one_lru_pass_with_second_copies_matches_vllm_on_random_streams(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Random full-attention streams with block-aligned resends (vLLM
    recomputes their last block and caches a second copy), four capacities
    each: every sweep row is vLLM's, request by request, and most come
    from the one pass (the second copies counted)."""
    from replay.whatif.sweep import sweep

    v = _vllm()
    rng = random.Random(2425)
    rows_checked = one_pass = 0
    for case in range(12):
        config = archetype_config("full", 16, 16, False)
        prompts = random_prompts(rng, 16, 60)
        longest = max(-(-len(p) // 16) for p in prompts)
        capacities = sorted({rng.randrange(longest, 6 * longest) for _ in range(4)})
        per_capacity = [_vllm_hits(v, config, c, prompts) for c in capacities]
        requests = _lookups(tmp_path / f"r{case}.parquet", config, prompts, per_capacity[0][1])
        specs = [RunSpec(cache="gpu", eviction="lru", capacity_blocks=c) for c in capacities]
        for c, row, (theirs, _) in zip(
            capacities, sweep(requests, specs), per_capacity, strict=True
        ):
            assert row["_hits"].tolist() == theirs, (case, c, row["method"])
            rows_checked += 1
            one_pass += row["method"] == "one-pass"
    with capsys.disabled():
        print(
            f"\nrandom dense streams: {rows_checked} capacities agree with vLLM, {one_pass} one-pass"
        )
    assert one_pass >= rows_checked // 2
