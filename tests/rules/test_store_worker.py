"""The Mooncake store worker's entry in the reference (``Cache.store_worker_entry``,
vLLM 0.27.0 on): ``MooncakeStoreWorker.lookup(num_tokens, block_hashes)`` for a
prompt of ``max_length + 1`` tokens. The same lookups through vLLM's own worker
are ``tests/vllm/test_store_worker_vllm.py``; these need no vLLM."""

from __future__ import annotations

from replay.base.spec import TraceConfig
from replay.rules.coordinator import Coordinator, LookupOutcome, get_policy, policy_rules
from replay.rules.coordinator.hybrid import AskedBlocks, asked_blocks
from tests.builders import config, fa, sw
from tests.contracts.coordinator import FixedPoint, H

M33 = policy_rules(get_policy("vllm-0.33"), "mooncake")


def _answer(outcome: LookupOutcome) -> tuple[int, list[tuple[int, int]]]:
    return outcome.hit_tokens, [(g.mask_blocks, g.loaded_blocks) for g in outcome.groups]


def _both(
    cfg: TraceConfig, units: int, max_length: int, present: list[range], policy: str = "vllm-0.33"
) -> tuple[tuple[int, list[tuple[int, int]]], tuple[int, list[tuple[int, int]]]]:
    """The worker's answer and the fixed point's at ``max_length``."""
    contains = [{H[i] for i in p}.__contains__ for p in present]
    worker = Coordinator(cfg, policy, "mooncake").lookup(H[:units], max_length, contains)
    fixed = FixedPoint(cfg, policy, "mooncake").lookup(H[:units], max_length, contains)
    return _answer(worker), _answer(fixed)


def test_a_whole_prompt_hit_is_looked_up_again_below_the_prompts_end() -> None:
    """A 64-token prompt, every key stored, one EAGLE-flagged group: at the
    aligned length 64 the group finds 64 and drops a block (48), which is
    below the prompt's end and stands; the fixed point at 63 drops to 32."""
    cfg = config(fa(eagle=True), eagle=True)
    assert _both(cfg, 4, 63, [range(4)]) == ((48, [(3, 3)]), (32, [(2, 2)]))
    # Without EAGLE the whole prompt (64) is hit, so the worker looks again
    # at 48: the fixed point's answer.
    plain = config(fa(), eagle=False)
    assert _both(plain, 4, 63, [range(4)]) == ((48, [(3, 3)]),) * 2


def test_the_store_is_asked_only_within_the_aligned_prompt() -> None:
    """An 81-token prompt's 10 hashes, full attention with 64-token blocks
    beside an EAGLE-flagged sliding window of 8-token blocks: the window's
    drop peeks at tokens 64-72, past the aligned prompt (64), which the
    worker never asks the store about: no hit, nothing loaded."""
    cfg = config(fa(64), sw(8, 8, eagle=True), hbs=8, eagle=True)
    assert _both(cfg, 10, 80, [range(10)] * 2) == ((0, [(0, 0), (0, 0)]), (64, [(1, 1), (8, 1)]))


def test_a_sliding_windows_lookup_mask_names_the_tails_a_hit_can_end_on() -> None:
    """A window of 33 tokens in 16-token blocks needs 2 blocks before a
    boundary every 64 tokens (4 blocks a segment): the worker asks for
    blocks 2-3 of each segment; an EAGLE group needs one block more and
    peeks one on (blocks 2-4); a window needing the whole segment, every
    block (no mask)."""
    plain = config(fa(), sw(16, 33), sbs=64)
    assert asked_blocks(plain, M33) == (AskedBlocks(), AskedBlocks(4, 2, 0))
    assert [c for c in range(9) if asked_blocks(plain, M33)[1].asks(c)] == [2, 3, 6, 7]
    eagle = config(fa(), sw(16, 33), sbs=64, eagle=True)
    assert asked_blocks(eagle, M33) == (AskedBlocks(), AskedBlocks(4, 3, 1))
    assert [c for c in range(9) if asked_blocks(eagle, M33)[1].asks(c)] == [2, 3, 4, 6, 7, 8]
    wide = config(fa(), sw(16, 65), sbs=64)
    assert asked_blocks(wide, M33) == (AskedBlocks(), AskedBlocks())
    # The tails are all a hit needs: the blocks never asked for change no
    # answer (a 128-token prompt, every key stored: hit 64 either way, the
    # worker after its whole-prompt hit, the fixed point aligned below 127).
    assert _both(plain, 8, 127, [range(8), range(8)]) == ((64, [(4, 4), (4, 2)]),) * 2


def test_the_engine_and_releases_before_0_27_take_the_fixed_point() -> None:
    cfg = config(fa(), eagle=True)
    assert Coordinator(cfg, "vllm-0.33", "gpu").asked is None
    assert Coordinator(cfg, "vllm-0.26", "mooncake").asked is None
    assert Coordinator(cfg, "vllm-0.27", "mooncake").asked is not None
