"""Record vLLM 0.33.0's real scheduler with the plugin and replay every hit.

A real ``Scheduler`` (with its ``KVCacheManager``, block pool and
``ZmqEventPublisher``) runs on CPU over local ``config.json`` models with no
weights (a tiny Llama, a tiny NemotronH hybrid with an MTP layer), the
KV-cache config built by hand with few blocks so that blocks are evicted
and requests preempted. About 200 multi-turn requests are driven with fake
model outputs (random tokens, random draft acceptance), as vLLM's own
scheduler tests do. ``replay record`` (with ``--lookups``) records the run
over real ZMQ sockets on 127.0.0.1, and the test requires:

- every lookup's replayed hit (``--cache gpu``) equals the hit vLLM gave it,
  and every admitted request's hit equals the ``num_computed_tokens`` the
  scheduler scheduled it with (read from the ``SchedulerOutput``, not from
  the plugin);
- ``replay ingest kv-events DUMP --lookups FILE`` builds the same trace;
- the same run without the plugin schedules the same hits and publishes the
  same KV events (the plugin is a neutral observer).

Run: ``PYTHONPATH=$PWD /work/main/.venv-vllm/bin/pytest -q -m vllm -p no:cacheprovider
tests/sources/test_record_scheduler.py``.
"""

from __future__ import annotations

import functools
import json
import os
import random
import socket
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from replay.base.spec import GroupKind, TraceConfig
from replay.format.tracedir import open_trace
from replay.sources.dump import read_dump
from replay.sources.kv_wire import AllBlocksCleared, BlockStored, decode_batch
from replay.sources.record import ingest_dumps, record
from replay.sources.stream import RecordSummary
from tests.builders import replay_trace

pytestmark = pytest.mark.vllm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm.v1.core.sched.scheduler")

import torch  # noqa: E402  (after vLLM, which configures it)
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from replay.adapters.vllm import plugin as vllm_plugin  # noqa: E402
from replay.adapters.vllm import wire  # noqa: E402

VOCAB = 1000
MAX_MODEL_LEN = 2048
MODELS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "nemotron_h": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "hybrid_override_pattern": "M*M-",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "expand": 1,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
        "num_nextn_predict_layers": 1,
        "mtp_hybrid_override_pattern": "*-",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}
# An EAGLE draft for the Llama: one layer of the same shape.
MODELS["eagle"] = {
    **MODELS["llama"],
    "architectures": ["EagleLlamaForCausalLM"],
    "num_hidden_layers": 1,
}


@dataclass(frozen=True)
class Setup:
    name: str
    model: str
    #: None, or the speculative method: "eagle" (a draft model) or "mtp"
    spec: str | None
    num_blocks: int
    #: vLLM's default with EAGLE/MTP hashes lookahead tokens and drops no
    #: block; without lookahead hashes the EAGLE drop is on.
    lookahead_hashes: bool = True
    #: vLLM's AsyncScheduler as the engine drives it with a batch queue: the
    #: next step is scheduled before the previous one's output is in.
    async_scheduling: bool = False


SETUPS = [
    Setup(name="full-attention", model="llama", spec=None, num_blocks=80),
    # One group, EAGLE drafts, lookahead hashes off: vLLM drops the last block.
    Setup(
        name="full-attention+eagle",
        model="llama",
        spec="eagle",
        num_blocks=80,
        lookahead_hashes=False,
    ),
    Setup(name="full-attention+mamba", model="nemotron_h", spec=None, num_blocks=150),
    # FA + Mamba + the MTP layer's own (EAGLE-flagged) group, vLLM's defaults.
    Setup(name="full-attention+mamba+mtp", model="nemotron_h", spec="mtp", num_blocks=170),
    Setup(
        name="full-attention+mamba, async scheduling",
        model="nemotron_h",
        spec=None,
        num_blocks=150,
        async_scheduling=True,
    ),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for name, config in MODELS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    return root


@functools.cache
def model_config(path: str) -> Any:
    return ModelConfig(
        model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_MODEL_LEN
    )


@functools.cache
def speculative_config(models: Path, setup: Setup) -> Any:
    if setup.spec is None:
        return None
    target = model_config(str(models / setup.model))
    return SpeculativeConfig(
        method=setup.spec,
        model=str(models / "eagle") if setup.spec == "eagle" else None,
        num_speculative_tokens=2 if setup.spec == "eagle" else 1,
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
        disable_lookahead_block_hashes=not setup.lookahead_hashes,
    )


def kv_cache_groups(setup: Setup) -> list[Any]:
    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    if setup.model == "llama":
        layers = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        if setup.spec == "eagle":
            layers.append("draft_model.model.layers.0.self_attn")
        return [KVCacheGroupSpec(layers, attention)]
    mamba = MambaSpec(
        block_size=16,
        shapes=((3, 64), (4, 16, 16)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
    )
    groups = [
        KVCacheGroupSpec(["model.layers.1.mixer"], attention),
        KVCacheGroupSpec(["model.layers.0.mixer", "model.layers.2.mixer"], mamba),
    ]
    if setup.spec == "mtp":
        groups.append(KVCacheGroupSpec(["mtp.layers.0.mixer"], attention, is_eagle_group=True))
    return groups


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_scheduler(models: Path, setup: Setup, events: KVEventsConfig) -> tuple[Any, Any]:
    mc = model_config(str(models / setup.model))
    cache = CacheConfig(
        block_size=16,
        enable_prefix_caching=True,
        mamba_cache_mode="align" if setup.model == "nemotron_h" else "none",
    )
    cache.num_gpu_blocks = setup.num_blocks
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=setup.async_scheduling,
        ),
        cache_config=cache,
        device_config=DeviceConfig("cpu"),
        speculative_config=speculative_config(models, setup),
        kv_events_config=events,
    )
    kv = KVCacheConfig(
        num_blocks=setup.num_blocks, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups(setup)
    )
    scheduler = (AsyncScheduler if setup.async_scheduling else Scheduler)(
        vllm_config=vc,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=16,
        log_stats=True,
    )
    hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return scheduler, get_request_block_hasher(16, hash_fn, vc.num_hash_lookahead_tokens)


def drive(
    scheduler: Any,
    hasher: Any,
    seed: int,
    *,
    depth: int = 1,
    n_requests: int = 200,
    more: Callable[[], bool] | None = None,
) -> dict[str, list[int]]:
    """Multi-turn conversations sharing a system prompt, with fake outputs.
    Returns, per request, the hit it was scheduled with at each admission
    (``num_computed_tokens`` of the ``SchedulerOutput``). ``depth`` 2 runs
    the engine's batch queue: a step's output comes after the next step is
    scheduled. With ``more``, requests keep coming after ``n_requests``
    (up to ten times as many) while ``more()`` says so, asked every 50
    steps."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    system = tokens(40)
    convs = [system + tokens(rng.randrange(4, 100)) for _ in range(20)]
    busy: dict[str, int] = {}
    generated: dict[str, list[int]] = defaultdict(list)
    admitted: dict[str, list[int]] = defaultdict(list)
    num_spec = scheduler.num_spec_tokens
    submitted = 0
    steps = 0
    inflight: deque[tuple[Any, list[str], list[list[int]]]] = deque()
    limit = n_requests
    while submitted < limit or scheduler.has_unfinished_requests() or inflight:
        steps += 1
        assert steps < 20_000 * (limit // n_requests), "the scheduler made no progress"
        if more is not None and steps % 50 == 0:
            limit = 10 * n_requests if more() else min(limit, max(submitted, n_requests))
        while submitted < limit and len(scheduler.requests) < 10 and rng.random() < 0.6:
            free = [c for c in range(len(convs)) if c not in busy.values()]
            ci = rng.choice(free)
            if len(convs[ci]) > 700:
                convs[ci] = system + tokens(rng.randrange(4, 60))  # a new conversation
            rid = f"c{ci}-r{submitted}"
            params = SamplingParams(max_tokens=rng.randrange(2, 30), ignore_eos=True)
            if rng.random() < 0.15 and len(convs[ci]) >= 32:
                # A retry of the conversation so far, cut to whole blocks: its
                # last block cannot hit (vLLM recomputes the last token) and is
                # stored again, a second copy of a cached hash.
                prompt = convs[ci][: len(convs[ci]) // 16 * 16]
            else:
                convs[ci] = convs[ci] + tokens(rng.randrange(4, 60))  # the user's turn
                prompt = convs[ci]
                busy[rid] = ci
            scheduler.add_request(Request(rid, list(prompt), params, None, block_hasher=hasher))
            submitted += 1
        out = scheduler.schedule()
        for new in out.scheduled_new_reqs:
            admitted[new.req_id].append(new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            if rid in cached.resumed_req_ids:
                admitted[rid].append(computed)
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            if scheduler.requests[rid].is_prefill_chunk:
                sampled.append([])  # a prefill chunk that does not end the prompt
                continue
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            accepted = rng.randrange(len(drafts) + 1)
            sampled.append(list(drafts[:accepted]) + tokens(1))
        inflight.append((out, req_ids, sampled))
        # The engine waits for the oldest step once the queue is full, or when
        # nothing new could be scheduled.
        while inflight and (len(inflight) >= depth or not req_ids):
            done, done_ids, done_sampled = inflight.popleft()
            result = scheduler.update_from_output(
                done,
                ModelRunnerOutput(
                    req_ids=done_ids,
                    req_id_to_index={r: i for i, r in enumerate(done_ids)},
                    sampled_token_ids=done_sampled,
                ),
            )
            if num_spec:
                live = [r for r in done_ids if r in scheduler.requests]
                drafts = DraftTokenIds(live, [tokens(num_spec) for _ in live])
                scheduler.update_draft_token_ids(drafts)
            for outputs in result.values():
                for o in outputs.outputs:
                    generated[o.request_id].extend(o.new_token_ids)
                    if o.finish_reason is not None and o.request_id in busy:
                        ci = busy.pop(o.request_id)
                        convs[ci] = convs[ci] + generated.pop(o.request_id)
    return dict(admitted)


@dataclass
class Run:
    admitted: dict[str, list[int]]
    summary: RecordSummary
    messages: list[str]
    published: int


def run(
    models: Path,
    setup: Setup,
    tmp: Path,
    *,
    plugin: bool,
    config: TraceConfig | None = None,
    vllm_binds: bool = True,
) -> Run:
    port, rport, lport = free_port(), free_port(), free_port()
    tag = "on" if plugin else "off"
    if vllm_binds:  # vLLM binds, the recorder connects
        vllm_endpoint, endpoint = f"tcp://*:{port}", f"tcp://127.0.0.1:{port}"
    else:  # vLLM connects to a concrete host, the recorder binds (detected from '*')
        vllm_endpoint, endpoint = f"tcp://127.0.0.1:{port}", f"tcp://*:{port}"
    if plugin:
        vllm_plugin.install(f"tcp://127.0.0.1:{lport},{tmp / f'{tag}.lookups.jsonl'}")
    messages: list[str] = []
    stop = threading.Event()
    box: dict[str, Any] = {}

    def recorder() -> None:
        try:
            box["summary"] = record(
                endpoint=endpoint,
                replay_endpoint=f"tcp://127.0.0.1:{rport}",
                lookups=f"tcp://127.0.0.1:{lport}" if plugin else None,
                config=config,
                output=tmp / f"{tag}.parquet",
                dump=tmp / f"{tag}.kvdump",
                duration=120,
                stop=stop,
                report=messages.append,
            )
        except BaseException as exc:
            box["error"] = exc

    try:
        scheduler, hasher = build_scheduler(
            models,
            setup,
            KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=vllm_endpoint,
                replay_endpoint=f"tcp://*:{rport}",
            ),
        )
        thread = threading.Thread(target=recorder, daemon=True)
        thread.start()
        time.sleep(1.5)  # both subscriptions are up (PUB drops what precedes them)
        try:
            admitted = drive(
                scheduler,
                hasher,
                seed=sum(map(ord, setup.name)),
                depth=2 if setup.async_scheduling else 1,
            )
            publisher = scheduler.kv_event_publisher
            publisher._event_queue.join()  # everything published is sent
            published = next(publisher._seq_gen)
            time.sleep(1.0)
        finally:
            stop.set()
            thread.join(30)
            scheduler.kv_event_publisher.shutdown()
    finally:
        if plugin:
            vllm_plugin.uninstall()
    if "error" in box:
        raise box["error"]
    return Run(admitted=admitted, summary=box["summary"], messages=messages, published=published)


def lookups_of(path: Path) -> list[dict[str, Any]]:
    return [r for r in open_trace(path).read_frame().to_dicts() if r["kind"] == "lookup"]


def events_of(path: Path) -> list[tuple[Any, ...]]:
    rows = open_trace(path).read_frame().to_dicts()
    return [
        (r["kind"], r["group_id"], tuple(r["block_hashes"] or ()), r["medium"])
        for r in rows
        if r["kind"] != "lookup"
    ]


@pytest.mark.parametrize("setup", SETUPS, ids=[s.name for s in SETUPS])
def test_every_recorded_hit_replays(models: Path, setup: Setup, tmp_path: Path) -> None:
    on = run(models, setup, tmp_path, plugin=True, vllm_binds=setup.spec is None)
    trace_path = tmp_path / "on.parquet"
    trace = open_trace(trace_path)
    source = dict(trace.config.source or {})
    assert source["gaps"] == [] and source["restarts"] == [], on.messages
    assert on.summary.batches == on.published > 0
    assert source["cache"] == "gpu"
    assert source["lookups"]["late"] == 0 and source["lookups"]["lost_messages"] == 0

    # The engine facts became the trace's config.
    config = trace.config
    assert [g.kind.value for g in config.groups] == (
        ["full_attention"]
        if setup.model == "llama"
        else ["full_attention", "mamba"] + (["full_attention"] if setup.spec == "mtp" else [])
    )
    assert config.use_eagle is (setup.spec is not None and not setup.lookahead_hashes)
    engine = source["engine"][0]
    assert engine["speculative_method"] == setup.spec
    assert engine["eagle_drop"] is config.use_eagle

    # Every lookup replays to the hit vLLM gave it, on vLLM's engine cache.
    lookups = lookups_of(trace_path)
    results = replay_trace(trace_path).results
    assert results["cache"].unique().to_list() == ["gpu"]
    assert results["hit_tokens"].to_list() == [r["observed_hit_tokens"] for r in lookups]
    assert results["observed_match"].all()
    assert not any("observed_mismatch" in flags for flags in results["flags"].to_list())

    # The admitted lookups are the admissions the scheduler output shows,
    # with the hits it scheduled them with.
    not_admitted = set(source["lookups"]["not_admitted_seqs"])
    from_trace: dict[str, list[int]] = defaultdict(list)
    for r in lookups:
        if r["seq"] not in not_admitted:
            from_trace[r["request_id"]].append(r["observed_hit_tokens"])
    assert dict(from_trace) == on.admitted
    hits = sum(1 for hs in on.admitted.values() for h in hs if h > 0)
    assert hits > 50  # prefix caching did hit
    print(
        f"{setup.name}: {len(lookups)} lookups recorded ({len(lookups) - len(not_admitted)} "
        f"admitted, {hits} with a hit); {int(results['observed_match'].sum())} replay to "
        f"vLLM's hit"
    )

    check_copies_as_vllm_sends_them(tmp_path, config, mamba=setup.model == "nemotron_h")

    # Offline: the dump and the plugin's file give the same trace.
    offline = ingest_dumps(
        [tmp_path / "on.kvdump"],
        tmp_path / "offline.parquet",
        None,
        lookups=tmp_path / "on.lookups.jsonl",
        report=on.messages.append,
    )
    assert offline.lookups == len(lookups)
    assert (
        open_trace(tmp_path / "offline.parquet").read_frame().drop("ts").to_dicts()
        == trace.read_frame().drop("ts").to_dicts()
    )

    # The place matters: each lookup before its step's events (where a merge
    # by the batch's timestamp puts it) misses what earlier requests of the
    # same step stored or evicted.
    step_start = tmp_path / "step-start.lookups.jsonl"
    with open(tmp_path / "on.lookups.jsonl") as src, open(step_start, "w") as dst:
        for line in src:
            rec = json.loads(line)
            if rec["type"] == "lookup":
                rec["position"] = 0
            dst.write(json.dumps(rec) + "\n")
    ingest_dumps(
        [tmp_path / "on.kvdump"],
        tmp_path / "step-start.parquet",
        None,
        lookups=step_start,
        report=on.messages.append,
    )
    wrong = replay_trace(tmp_path / "step-start.parquet").results["observed_match"]
    assert (~wrong).sum() > 0
    print(f"  placed at the start of their step instead: {(~wrong).sum()} of {len(wrong)} wrong")

    # Without the plugin: the same hits and the same KV events.
    off = run(models, setup, tmp_path, plugin=False, config=config)
    assert off.admitted == on.admitted
    assert off.published == on.published
    assert events_of(tmp_path / "off.parquet") == events_of(trace_path)


def check_copies_as_vllm_sends_them(tmp_path: Path, config: TraceConfig, mamba: bool) -> None:
    """vLLM's real events hold the same hash stored by two blocks at once,
    and (Mamba, align mode) stores whose token_ids span more than their one
    hash; the trace keeps a key while a copy is left, and every hit replays."""
    copies: Counter[tuple[int, bytes | int]] = Counter()
    doubled = 0
    long_mamba = 0
    for rec in read_dump(tmp_path / "on.kvdump"):
        for event in decode_batch(rec.frames[2]).events:
            if isinstance(event, AllBlocksCleared):
                copies.clear()
                continue
            gid = event.group_idx or 0
            for h in event.block_hashes:
                if isinstance(event, BlockStored):
                    copies[gid, h] += 1
                    doubled += copies[gid, h] == 2
                else:
                    copies[gid, h] -= 1
            group = config.groups[gid]
            if (
                isinstance(event, BlockStored)
                and group.kind is GroupKind.MAMBA
                and len(event.token_ids or ()) > len(event.block_hashes) * group.block_size
            ):
                long_mamba += 1
    assert doubled > 0
    assert (long_mamba > 0) is mamba


def test_the_plugin_is_inert_unless_replay_lookups_is_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    monkeypatch.delenv(wire.ENV, raising=False)
    vllm_plugin.register()
    assert not vllm_plugin.installed()
    assert not hasattr(Scheduler.schedule, "__wrapped__")
    assert not hasattr(KVCacheManager.get_computed_blocks, "__wrapped__")
    monkeypatch.setenv(wire.ENV, str(tmp_path / "lookups.jsonl"))
    vllm_plugin.register()
    try:
        assert vllm_plugin.installed()
        assert hasattr(KVCacheManager.get_computed_blocks, "__wrapped__")
    finally:
        vllm_plugin.uninstall()
    assert not hasattr(KVCacheManager.get_computed_blocks, "__wrapped__")
