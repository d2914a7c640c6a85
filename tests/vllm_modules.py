"""vLLM's own classes the vLLM-marked tests drive, imported on first use (the
module imports without vLLM; the tests that call it are skipped there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from replay.base.spec import GroupKind, TraceConfig


def vllm_modules() -> SimpleNamespace:
    """The KV-cache manager, scheduler, request and spec classes of the vLLM
    in this environment, with the block hasher's seed set as the engine does."""
    import importlib
    import warnings

    with warnings.catch_warnings():
        # torch and vLLM warn about their own deprecations on import
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch

        try:  # the Mooncake store exists from vLLM 0.22.0
            coordinator: Any = importlib.import_module(
                "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator"
            )
        except ModuleNotFoundError:
            coordinator = None
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1 import kv_cache_interface as iface
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.request import Request

    kv_cache_utils.init_none_hash(sha256)
    return SimpleNamespace(
        torch=torch,
        iface=iface,
        utils=kv_cache_utils,
        sha256=sha256,
        KVCacheManager=KVCacheManager,
        Scheduler=Scheduler,
        Request=Request,
        SamplingParams=SamplingParams,
        Mooncake=None if coordinator is None else coordinator.MooncakeStoreCoordinator,
    )


def overreads_lookahead_hashes(config: TraceConfig, num_tokens: int) -> bool:
    """Whether vLLM's engine fails this prompt's lookup (0.33.0, 0.34.0): with
    lookahead hashes a prompt carries ``(N - L) // hbs`` hashes, yet with no
    full-attention group to cap the hit first, the sliding-window finder
    reads blocks up to ``N - 1`` and indexes past them (IndexError)."""
    lookahead = config.num_hash_lookahead_tokens
    if not lookahead or any(g.kind is GroupKind.FULL_ATTENTION for g in config.groups):
        return False
    hashed = config.hashed_units(num_tokens) * config.hash_block_size
    return any(
        (num_tokens - 1) // g.block_size > hashed // g.block_size
        for g in config.groups
        if g.kind is GroupKind.SLIDING_WINDOW
    )


def split_state(config: TraceConfig, budget: int) -> SimpleNamespace:
    """The scheduler state ``Scheduler._mamba_block_aligned_split`` reads, as
    vLLM sets it for these specs (no partial hits, no checkpoint blocks) with
    ``budget`` tokens a step."""
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=config.scheduler_block_size),
        block_size=config.scheduler_block_size,
        hash_block_size=config.hash_block_size,
        mamba_partial_cache_hit=False,
        # With lookahead hashes the scheduler clears its EAGLE block drop (0.33.0 on).
        use_eagle_block_drop=config.use_eagle and not config.num_hash_lookahead_tokens,
        use_eagle=config.use_eagle,  # the name before 0.30.0
        num_hash_lookahead_tokens=config.num_hash_lookahead_tokens,
        mamba_has_prefill_checkpoint_blocks=False,
        mamba_prefill_checkpoint_alignment=None,
        max_num_scheduled_tokens=budget,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        mamba_shared_prefix_checkpoint=False,
        mamba_fine_grained_prefix_cache=False,  # 0.30-0.31 read it (off by default)
    )


def replay_under_mutant(
    *args: str, cwd: Path, mutant: str | None = None, timeout: int = 900
) -> subprocess.CompletedProcess[str]:
    """``replay ARGS`` in a subprocess of this Python, with vLLM's lookup path
    carrying the one-line ``mutant`` of mutants/ (applied at import time,
    vLLM's files untouched), or unmodified."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("REPLAY_MUTANT", None)
    if mutant:
        env["REPLAY_MUTANT"] = mutant
    return subprocess.run(
        [sys.executable, "-m", "mutants.replay", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )
