"""Issue 30: the Mooncake store worker's own lookup
(``MooncakeStoreWorker.lookup(num_tokens, block_hashes)``), entered by
``VllmStoreWorker``: vLLM's length alignment, store queries and retry below
the prompt's end, its store answered from the trace's keys;
``VllmCoordinator`` calls the mirror one level below. Runs only where vLLM
imports (``make test-vllm``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker",
    reason="vLLM's Mooncake store worker not importable: run make test-vllm",
)

from replay.adapters.vllm.backend import VllmCoordinator, VllmStoreWorker, installed_vllm_version
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.rules.coordinator import policy_for_version

pytestmark = pytest.mark.vllm

POLICY = policy_for_version(installed_vllm_version()).name
HASHES: list[Hashable] = [bytes([i]) * 8 for i in range(1, 7)]


def _config(use_eagle: bool) -> TraceConfig:
    return TraceConfig(
        groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),),
        hash_block_size=16,
        scheduler_block_size=16,
        use_eagle=use_eagle,
        enable_partial_hash_hits=False,
    )


def _present(n: int) -> list[Callable[[Hashable], bool]]:
    held = set(HASHES[:n])
    return [held.__contains__]


def test_the_worker_retries_below_the_prompts_end() -> None:
    """A 64-token prompt fully stored: the worker's aligned length (64)
    hits the whole prompt, so it looks up again at 48, the mirror's answer
    at max_length 63."""
    worker = VllmStoreWorker(_config(False), POLICY, "mooncake")
    assert worker._worker is not None  # the worker's lookup answers, not the mirror
    got = worker.lookup(HASHES[:4], 63, _present(4))
    mirror = VllmCoordinator(_config(False), POLICY, "mooncake").lookup(HASHES[:4], 63, _present(4))
    assert (got.hit_tokens, got.groups[0].loaded_blocks) == (48, 3)
    assert (mirror.hit_tokens, mirror.groups[0].loaded_blocks) == (48, 3)


def test_the_worker_asks_the_store_only_within_the_aligned_prompt() -> None:
    """A lookup from the corpus (engine-evictions-between-lookups): a
    209-token prompt whose trace carries 20 hashes (320 tokens). The mirror's
    sliding-window finder at max_length 208 reads block 3 (tokens 192-255);
    the worker asked the store only up to the aligned prompt length 192, so
    it sees that block absent and answers 128, not 192. With the prompt's
    own 13 hashes, as a vLLM request has, both answer alike."""
    swa = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=64, sliding_window=191)
    config = TraceConfig(
        groups=(
            GroupSpec(
                kind=GroupKind.SLIDING_WINDOW,
                block_size=64,
                sliding_window=191,
                is_eagle_group=True,
            ),
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=32),
            swa,
        ),
        hash_block_size=16,
        scheduler_block_size=64,
        use_eagle=False,
        enable_partial_hash_hits=False,
    )
    hashes: list[Hashable] = [bytes([i]) * 8 for i in range(1, 21)]
    held = [set(hashes), set(hashes[:19]), set(hashes)]
    contains = [h.__contains__ for h in held]
    worker = VllmStoreWorker(config, POLICY, "mooncake")
    mirror = VllmCoordinator(config, POLICY, "mooncake")
    got = worker.lookup(hashes, 208, contains)
    want = mirror.lookup(hashes, 208, contains)
    assert (got.hit_tokens, want.hit_tokens) == (128, 192)
    prompt = hashes[: 209 // 16]
    assert worker.lookup(prompt, 208, contains) == mirror.lookup(prompt, 208, contains)
