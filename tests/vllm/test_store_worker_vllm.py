"""Issue 30: the Mooncake store worker's own lookup
(``MooncakeStoreWorker.lookup(num_tokens, block_hashes)``), where
``VllmCoordinator`` enters a Mooncake lookup: vLLM's length alignment, store
queries and retry below the prompt's end, its store answered from the
trace's keys, against the policy that models it (the reference
``Coordinator``) and against the mirror one level below
(``VllmStoreMirror``, the fixed point at ``max_length``). Runs only where
vLLM imports (``make test-vllm``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker",
    reason="vLLM's Mooncake store worker not importable: run make test-vllm",
)

from replay.adapters.vllm.backend import (
    VllmCoordinator,
    VllmStoreMirror,
    installed_vllm_version,
    worker_entry_missing,
)
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.rules.coordinator import Coordinator, LookupOutcome, policy_for_version
from replay.sources.scenarios import make_config, prompt_hashes
from tests.builders import fa, sw

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(worker_entry_missing() is not None, reason=str(worker_entry_missing())),
]

POLICY = policy_for_version(installed_vllm_version()).name
UNITS = [bytes([i]) * 8 for i in range(1, 7)]
HASHES: list[Hashable] = list(UNITS)


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


def _answer(outcome: LookupOutcome) -> tuple[int, list[tuple[int, int]]]:
    return outcome.hit_tokens, [(g.mask_blocks, g.loaded_blocks) for g in outcome.groups]


def _three(
    config: TraceConfig, hashes: Sequence[Hashable], max_length: int, contains: list[Any]
) -> tuple[Any, Any, Any]:
    """The worker's answer (vLLM's, where ``VllmCoordinator`` enters), the
    policy's, and the mirror's at ``max_length`` (one level below)."""
    worker = VllmCoordinator(config, POLICY, "mooncake")
    assert worker.entry_note is None  # the worker's lookup answers, not the mirror
    return (
        _answer(worker.lookup(hashes, max_length, contains)),
        _answer(Coordinator(config, POLICY, "mooncake").lookup(hashes, max_length, contains)),
        _answer(VllmStoreMirror(config, POLICY, "mooncake").lookup(hashes, max_length, contains)),
    )


def test_the_worker_retries_below_the_prompts_end() -> None:
    """A 64-token prompt fully stored: the worker's aligned length (64)
    hits the whole prompt, so it looks up again at 48, the mirror's answer
    at max_length 63."""
    assert _three(_config(False), HASHES[:4], 63, _present(4)) == ((48, [(3, 3)]),) * 3


def test_the_worker_asks_the_store_only_within_the_aligned_prompt() -> None:
    """A lookup from the corpus (engine-evictions-between-lookups): a
    209-token prompt whose trace carries 20 hashes (320 tokens). The mirror's
    sliding-window finder at max_length 208 reads block 3 (tokens 192-255);
    the worker asked the store only up to the aligned prompt length 192, so
    it sees that block absent and answers 128, as the policy does. With the
    prompt's own 13 hashes, as a vLLM request has, all three answer alike."""
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
    worker, policy, mirror = _three(config, hashes, 208, contains)
    assert (worker[0], policy[0], mirror[0]) == (128, 128, 192)
    assert worker == policy
    prompt = hashes[: 209 // 16]
    worker, policy, mirror = _three(config, prompt, 208, contains)
    assert worker == policy == mirror


def test_the_worker_looks_up_the_aligned_prompt_before_its_end() -> None:
    """A request's own hashes, a 64-token prompt fully stored, one
    EAGLE-flagged full-attention group: the engine and the mirror at
    max_length 63 find 48 and drop a block (32); the worker asks at the
    aligned prompt length 64 first, finds 64, drops a block (48) and, 48
    being below the prompt's end, keeps it: a block more than the mirror
    (0.33.0 and 0.34.0), as the policy answers."""
    config = make_config(fa(eagle=True), eagle=True)
    hashes = prompt_hashes(UNITS, 63, config)
    contains = [set(hashes).__contains__]
    assert len(hashes) == 4
    worker, policy, mirror = _three(config, hashes, 63, contains)
    assert worker == policy == (48, [(3, 3)])
    assert mirror == (32, [(2, 2)])


def test_the_worker_never_asks_for_the_eagle_peek_past_the_aligned_prompt() -> None:
    """An 81-token prompt (a request's own 10 hashes of 8 tokens), every key
    stored, full attention (64-token blocks) beside an EAGLE-flagged sliding
    window: the mirror at max_length 80 finds 64 in full attention and
    verifies the window's EAGLE block by peeking at tokens 64-72 (64 hit
    tokens, as the engine); the worker asks the store only within the
    aligned prompt length 64, so the peeked key reads absent and the whole
    hit is lost (0), as the policy answers. From the corpus
    (mutant-simple-hybrid-pass, request s459-l7)."""
    config = make_config(fa(64), sw(8, 8, eagle=True), hbs=8, eagle=True)
    chain = [bytes([i]) * 8 for i in range(1, 11)]
    hashes = prompt_hashes(chain, 80, config)
    contains = [set(hashes).__contains__] * 2
    assert len(hashes) == 10
    worker, policy, mirror = _three(config, hashes, 80, contains)
    assert mirror == (64, [(1, 1), (8, 1)])
    assert worker == policy == (0, [(0, 0), (0, 0)])


@pytest.mark.skipif(
    not installed_vllm_version().startswith("0.34."),
    reason="the lookahead reaches the Mooncake worker from vLLM 0.34.0",
)
def test_the_worker_indexes_past_a_lookahead_requests_hashes() -> None:
    """vLLM 0.34.0 gives the Mooncake connector lookahead hashes
    (num_hash_lookahead_tokens 1, EAGLE): a 64-token prompt carries 3
    hashes, yet the worker aligns the lookup to 64 tokens and its sliding-
    window finder reads a fourth hash: IndexError (in the connector's
    lookup server thread, which has no handler). The mirror at max_length
    63 answers 48. Fails, and says so, when a vLLM fixes it."""
    config = TraceConfig(
        groups=(
            GroupSpec(
                kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=20, is_eagle_group=True
            ),
        ),
        hash_block_size=16,
        scheduler_block_size=16,
        use_eagle=True,
        enable_partial_hash_hits=False,
        num_hash_lookahead_tokens=1,
    )
    hashes = prompt_hashes(UNITS, 63, config)
    contains = [set(UNITS).__contains__]
    assert len(hashes) == 3
    assert VllmStoreMirror(config, POLICY, "mooncake").lookup(hashes, 63, contains).hit_tokens == 48
    with pytest.raises(IndexError, match="list index out of range"):
        VllmCoordinator(config, POLICY, "mooncake").lookup(hashes, 63, contains)
