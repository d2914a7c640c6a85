"""The store rules (replay.rules.store_rules) on hand-checked cases.

Block size, hash block and scheduler block are 16 tokens unless a case says
otherwise, so block ``i`` ends at token ``16 * (i + 1)``. The broad check
against vLLM itself is tests/vllm/test_store_rules_vllm.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from replay.base.errors import ReplayError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.rules.store_rules import (
    StoreRules,
    StoreSettings,
    checkpoint_position,
    replay_boundaries,
    request_stores,
)
from replay.sources.archetypes import archetype_config


def stores(
    model: str,
    eagle: bool,
    num_tokens: int,
    hit: int = 0,
    junction: int = 0,
    *,
    config: dict[str, Any] | None = None,
    **settings: Any,
) -> list[list[int]]:
    cfg = archetype_config(model, use_eagle=eagle, **(config or {}))
    got = request_stores(
        cfg,
        StoreSettings(**settings),
        num_tokens=num_tokens,
        hit_tokens=hit,
        junction_tokens=junction,
    )
    return [[int(b) for b in g] for g in got]


def test_replay_boundaries_and_checkpoint() -> None:
    assert replay_boundaries(100, 16, False) == (99,)
    assert replay_boundaries(100, 16, True) == (80,)
    assert replay_boundaries(96, 16, True) == (64, 80)
    assert checkpoint_position(100, 16, False) == 96
    assert checkpoint_position(96, 16, False) == 80
    assert checkpoint_position(96, 16, True) == 80
    assert checkpoint_position(100, 16, True) == 80
    assert checkpoint_position(10, 16, True) == 0


def test_block_aligned_prompt_with_eagle_has_no_state_two_blocks_down() -> None:
    # 96 tokens with EAGLE: the prefill stops at the checkpoint 80 and ends at
    # 96. Retention 0 keeps the state at 80 (a replay boundary) only; nothing
    # was ever computed at 64 = N - 2 blocks, though 64 is a replay boundary.
    assert stores("full+mamba", True, 96) == [[0, 1, 2, 3, 4, 5], [4]]
    # Dense retention keeps every chunk end's state, the one at 96 too.
    assert stores("full+mamba", True, 96, retention_interval=None) == [list(range(6)), [4, 5]]


def test_mamba_states_sit_at_prefill_chunk_ends() -> None:
    # No EAGLE, 100 tokens: the checkpoint is 96; the last chunk ends at 100,
    # inside a block, so it leaves no state.
    assert stores("full+mamba", False, 100)[1] == [5]
    assert stores("full+mamba", False, 100, retention_interval=None)[1] == [5]
    # 32-token chunks: states at 32, 64 and 96; retention 0 keeps the last.
    assert stores("full+mamba", False, 100, retention_interval=None, max_num_batched_tokens=32)[
        1
    ] == [1, 3, 5]
    assert stores("full+mamba", False, 100, max_num_batched_tokens=32)[1] == [5]
    # A 48-token interval keeps the states at multiples of 48 that a chunk
    # ended at: with 16-token chunks, 48 and 96.
    assert stores("full+mamba", False, 100, retention_interval=48, max_num_batched_tokens=16)[
        1
    ] == [2, 5]


def test_prefill_starts_at_the_hit() -> None:
    # 200 tokens with EAGLE, a 64-token hit: the store gets the blocks past the
    # hit up to the last whole scheduler block (192), and the state at 176.
    assert stores("full+mamba", True, 200, hit=64) == [list(range(4, 12)), [10]]
    rules = StoreRules(archetype_config("full+mamba", use_eagle=True))
    assert rules.chunk_ends(200, 64) == [176, 200]


def test_shared_prefix_junction_is_pinned() -> None:
    # A 96-token junction (a longer hit full attention found alone): the
    # scheduler ends a chunk there and the Mamba state is kept.
    rules = StoreRules(archetype_config("full+mamba", use_eagle=True))
    assert rules.chunk_ends(200, 32, junction=96) == [96, 176, 200]
    assert stores("full+mamba", True, 200, hit=32, junction=96)[1] == [5, 10]


def test_sliding_window_tails() -> None:
    # Window 32 needs 2 blocks ending at each kept boundary; 170 tokens, so the
    # resend's boundary is 169 -> 160, the tail blocks 8 and 9.
    swa = {"sliding_window": 32}
    assert stores("full+swa", False, 170, config=swa) == [list(range(10)), [8, 9]]
    # Dense, and 16-token segments: every block ends a window.
    assert stores("full+swa", False, 170, config=swa, retention_interval=None)[1] == list(range(10))
    # A 64-token interval: the tails at 64 and 128, plus the replay boundary's.
    assert stores("full+swa", False, 170, config=swa, retention_interval=64)[1] == [
        2,
        3,
        6,
        7,
        8,
        9,
    ]
    # EAGLE: 3 blocks, one block up, at the boundary 144.
    assert stores("full+swa", True, 170, config=swa)[1] == [7, 8, 9]


def test_the_store_widens_the_window_the_engine_does_not() -> None:
    # extra_retained_tokens = 16: the store covers a 48-token window (3 blocks),
    # the GPU pool caches for the bare 32-token one (2 blocks).
    swa = {"sliding_window": 32, "extra_retained_tokens": 16}
    assert stores("full+swa", False, 170, config=swa)[1] == [7, 8, 9]
    assert stores("full+swa", False, 170, config=swa, cache="gpu")[1] == [8, 9]


def test_engine_eagle_group_caches_one_block_past_the_scheduler_block() -> None:
    # 16-token attention blocks, 32-token Mamba blocks (scheduler block 32),
    # 8-token hash units (partial hits stay off: the sliding window cannot use
    # them). 180 tokens: the store saves whole scheduler blocks (160 tokens,
    # 10 blocks); the engine's EAGLE attention group one block more (176).
    config = {"block_size": 16, "hash_block_size": 8, "mamba_block_size": 32}
    mooncake = stores("full+swa+mamba", True, 180, config=config)
    gpu = stores("full+swa+mamba", True, 180, config=config, cache="gpu")
    assert mooncake[0] == list(range(10))
    assert gpu[0] == list(range(11))


def test_partial_hash_hits_are_refused() -> None:
    # A Mamba block above the hash unit with only fine-grained groups: vLLM
    # turns partial hits on, which the rules do not model.
    config = archetype_config("full+mamba", hash_block_size=8)
    with pytest.raises(ReplayError, match="the store rules do not model partial hash hits"):
        StoreRules(config)


def test_flagged_group_without_eagle_is_flagged_only_in_the_store() -> None:
    # is_eagle_group with use_eagle off: the store's mirror still treats the
    # group as EAGLE, the engine drops nothing.
    config = TraceConfig(
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
            GroupSpec(
                kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=32, is_eagle_group=True
            ),
        ),
        hash_block_size=16,
        scheduler_block_size=16,
    )
    mooncake = request_stores(config, num_tokens=170, hit_tokens=0)[1]
    gpu = request_stores(config, StoreSettings(cache="gpu"), num_tokens=170, hit_tokens=0)[1]
    assert [int(b) for b in mooncake] == [7, 8, 9]
    assert [int(b) for b in gpu] == [8, 9]


@pytest.mark.parametrize(
    ("model", "settings", "message"),
    [
        (
            "full+mamba",
            {"retention_interval": 24},
            "retention interval 24 must be a multiple of the scheduler block size 16",
        ),
        (
            "full",
            {"retention_interval": 32},
            "retention interval 32 has no effect without a sliding-window or Mamba group "
            "(vLLM refuses it): use 0",
        ),
        (
            "full+mamba",
            {"max_num_batched_tokens": 8},
            "max_num_batched_tokens 8 must be at least the scheduler block size 16: a Mamba "
            "prefill chunk ends on a block",
        ),
    ],
)
def test_configurations_vllm_refuses(model: str, settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ReplayError) as err:
        StoreRules(archetype_config(model), StoreSettings(**settings))
    assert str(err.value) == message


def test_store_settings_validation() -> None:
    with pytest.raises(ReplayError, match="retention interval must be an integer >= 0"):
        StoreSettings(retention_interval=-16)
    with pytest.raises(ReplayError, match="max_num_batched_tokens must be a positive"):
        StoreSettings(max_num_batched_tokens=0)
    with pytest.raises(ReplayError, match="unknown cache 'disk', expected one of mooncake, gpu"):
        StoreSettings(cache="disk")
    assert StoreSettings().as_source() == {
        "cache": "mooncake",
        "retention_interval": 0,
        "max_num_batched_tokens": 8192,
    }


def test_hit_must_lie_inside_the_prompt() -> None:
    rules = StoreRules(archetype_config("full"))
    with pytest.raises(ReplayError, match=r"hit_tokens must be in \[0, 32\)"):
        rules.stores(num_tokens=32, hit_tokens=32)


def test_engine_pins_a_sliding_window_tail_at_the_junction() -> None:
    # A 96-token junction: the engine's pool keeps the 2-block tail ending
    # there (blocks 4, 5) besides the replay boundary's (8, 9); the store's
    # mask knows no junction.
    swa = {"sliding_window": 32}
    assert stores("full+swa", False, 170, junction=96, config=swa, cache="gpu")[1] == [4, 5, 8, 9]
    assert stores("full+swa", False, 170, junction=96, config=swa)[1] == [8, 9]


def test_chunks_without_mamba_are_budget_sized() -> None:
    rules = StoreRules(archetype_config("full"), StoreSettings(max_num_batched_tokens=64))
    assert rules.chunk_ends(150, 32) == [96, 150]
    assert not rules.uses_junction


def test_lookahead_moves_the_checkpoint_and_the_hashed_blocks() -> None:
    """vLLM's ``get_mamba_prefill_checkpoint_position`` with lookahead L:
    below ``N - L`` (``N - 1`` at most), no EAGLE back-off (the scheduler
    clears the drop); and only the ``(N - L) // 16`` hashed blocks are
    cached. A 65-token prompt: L 1 keeps 4 blocks and the state at 64, L 3
    hashes 3 blocks (62 tokens) and keeps the state at 48."""
    assert checkpoint_position(65, 16, False, 1) == 64
    assert checkpoint_position(65, 16, False, 3) == 48
    assert checkpoint_position(64, 16, False, 0) == 48
    assert checkpoint_position(65, 16, True, 3) == 48  # the drop ignores it
    got = {}
    for lookahead in (1, 3):
        config = replace(
            archetype_config("full+mamba", use_eagle=True), num_hash_lookahead_tokens=lookahead
        )
        rules = StoreRules(config, StoreSettings(cache="gpu", policy="vllm-0.34"))
        got[lookahead] = (
            [[int(b) for b in s] for s in rules.stores(num_tokens=65, hit_tokens=0)],
            rules.chunk_ends(65, 0),
        )
    assert got[1] == ([[0, 1, 2, 3], [3]], [64, 65])
    assert got[3] == ([[0, 1, 2], [2]], [48, 65])
    # Without lookahead, EAGLE's drop: the checkpoint one block below 64.
    plain = StoreRules(archetype_config("full+mamba", use_eagle=True), StoreSettings(cache="gpu"))
    assert [[int(b) for b in s] for s in plain.stores(num_tokens=65, hit_tokens=0)] == [
        [0, 1, 2, 3],
        [2],
    ]
