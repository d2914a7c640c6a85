"""The reference coordinator, one test per rule of coordinator-semantics.md.

Each test pins exact hit lengths and load masks. The ones decorated with
``@vllm_checked`` (the Hypothesis properties too) look only at lookup
outcomes, and
``tests/test_vllm_differential.py`` reruns them with ``BACKEND`` swapped for
vLLM's own coordinator, so every expectation here is vLLM 0.33.0's answer.

Hash units are ``H[i]``; a group's key for block ``j`` is the unit that ends
the block (``blocks(...)``), as in the trace format.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.rules.coordinator import (
    Coordinator,
    LookupOutcome,
    build_spec_groups,
    hit_alignment,
)
from replay.rules.coordinator.finders import block_view, cdiv
from tests.builders import CL, FA, MB, SW, cl, config, fa, mb, scenarios, sw

#: What ``lookup`` builds; the vLLM differential swaps in ``VllmCoordinator``.
BACKEND: Callable[[TraceConfig, str], Any] = Coordinator

H = [bytes([i]) * 32 for i in range(256)]
T, F = True, False

VLLM_CHECKED: list[Callable[[], None]] = []
Fn = TypeVar("Fn", bound=Callable[[], None])


def vllm_checked(test: Fn) -> Fn:
    VLLM_CHECKED.append(test)
    return test


# --- helpers ------------------------------------------------------------------


def blocks(cfg: TraceConfig, group_id: int, idx: Iterable[int]) -> list[int]:
    """The hash-unit indices that key blocks ``idx`` of a group."""
    k = cfg.groups[group_id].block_size // cfg.hash_block_size
    return [(j + 1) * k - 1 for j in idx]


def lookup(
    cfg: TraceConfig,
    units: int,
    max_length: int,
    present: Iterable[Iterable[int]],
    policy: str = "vllm-0.33",
    *,
    explain: bool = False,
) -> LookupOutcome:
    """``present[g]``: the hash-unit indices group ``g`` holds."""
    stores = [{H[i] for i in p} for p in present]
    coord = BACKEND(cfg, policy)
    contains = [s.__contains__ for s in stores]
    if explain:
        return coord.lookup(H[:units], max_length, contains, explain=True)  # type: ignore[no-any-return]
    return coord.lookup(H[:units], max_length, contains)  # type: ignore[no-any-return]


def masks(outcome: LookupOutcome) -> list[list[bool]]:
    return [g.mask() for g in outcome.groups]


# --- spec groups --------------------------------------------------------------


def test_equal_specs_merge_into_one_spec_group() -> None:
    cfg = config(fa(), sw(16, 96, extra=32), sw(16, 128), mb(), mb(32), sbs=32)
    sgs = build_spec_groups(cfg)
    # The sliding windows merge on their coverage window (window + retained tail).
    assert [(sg.kind, sg.group_ids) for sg in sgs] == [
        (FA, (0,)),
        (SW, (1, 2)),
        (MB, (3,)),
        (MB, (4,)),
    ]


@vllm_checked
def test_merged_spec_group_needs_every_member_to_hold_the_key() -> None:
    cfg = config(fa(), fa())
    out = lookup(cfg, 4, 64, [range(4), range(2)])
    assert out.hit_tokens == 32
    assert masks(out) == [[T, T], [T, T]]


@vllm_checked
def test_equal_specs_merge_so_the_hybrid_stays_simple() -> None:
    # Full attention + two equal chunked-local groups is one full-attention
    # spec group and one chunked spec group: a simple hybrid, one pass (see
    # test_simple_hybrid_stops_after_one_pass). Unmerged, a second pass would
    # load block 0 of the chunked groups.
    cfg = config(fa(), cl(16, 24), cl(16, 24))
    out = lookup(cfg, 2, 32, [[0, 1], [0], [0]])
    assert out.hit_tokens == 16
    assert masks(out) == [[T], [F], [F]]


def test_spec_groups_sort_full_attention_first() -> None:
    cfg = config(mb(), sw(16, 32), fa(), eagle=True)
    assert [sg.kind for sg in build_spec_groups(cfg)] == [FA, MB, SW]


@vllm_checked
def test_full_attention_sorts_first_even_when_listed_last_43559() -> None:
    # Mamba listed first still makes a simple hybrid, so #43559 reproduces
    # under pre-49502 with the groups in either order.
    cfg = config(mb(), fa(), eagle=True)
    present = [range(4), range(4)]
    assert lookup(cfg, 4, 64, present).hit_tokens == 48
    out = lookup(cfg, 4, 64, present, "pre-49502")
    assert out.hit_tokens == 64
    assert masks(out) == [[F, F, F, T], [T, T, T]]


def test_spec_group_is_eagle_when_any_member_is_flagged() -> None:
    cfg = config(fa(eagle=True), fa(), sw(16, 32))
    assert [(sg.group_ids, sg.eagle) for sg in build_spec_groups(cfg)] == [
        ((0, 1), True),
        ((2,), False),
    ]


@vllm_checked
def test_all_groups_eagle_when_none_flagged() -> None:
    cfg = config(fa(), sw(16, 17), eagle=True)
    assert all(sg.eagle for sg in build_spec_groups(cfg))
    # The window needs two blocks with the drop: blocks 1-2, popped to 32.
    out = lookup(cfg, 4, 64, [range(4), [1, 2]])
    assert out.hit_tokens == 32
    assert masks(out) == [[T, T], [F, T]]


@vllm_checked
def test_only_flagged_groups_drop_when_any_is_flagged() -> None:
    cfg = config(fa(eagle=True), sw(16, 17), eagle=True)
    assert [sg.eagle for sg in build_spec_groups(cfg)] == [True, False]
    out = lookup(cfg, 4, 64, [range(4), [1, 2]])
    assert out.hit_tokens == 48
    assert masks(out) == [[T, T, T], [F, F, T]]


@vllm_checked
def test_single_spec_group_drops_iff_use_eagle_or_flagged() -> None:
    present = [range(4)]
    assert lookup(config(fa()), 4, 64, present).hit_tokens == 64
    assert lookup(config(fa(), eagle=True), 4, 64, present).hit_tokens == 48
    assert lookup(config(fa(eagle=True)), 4, 64, present).hit_tokens == 48


# --- full attention -----------------------------------------------------------


@vllm_checked
def test_full_attention_counts_present_blocks_until_the_first_miss() -> None:
    out = lookup(config(fa()), 6, 96, [[0, 1, 3, 4, 5]])
    assert out.hit_tokens == 32
    assert masks(out) == [[T, T]]


@vllm_checked
def test_full_attention_counts_at_most_max_length_blocks() -> None:
    out = lookup(config(fa()), 6, 50, [range(6)])
    assert out.hit_tokens == 48
    assert masks(out) == [[T, T, T]]


@vllm_checked
def test_full_attention_partial_hit_probes_interior_units_high_to_low() -> None:
    # Block 32, hash unit 8: block 0 is unit 3; inside block 1 units 4 and 6
    # are present. Unit 6 (56 tokens) wins over unit 4. Unit 7 ends the block,
    # so it is not an interior probe: below 64 it cannot count.
    cfg = config(fa(32), hbs=8, partial=True)
    out = lookup(cfg, 8, 63, [[3, 4, 6, 7]])
    assert out.hit_tokens == 56
    assert masks(out) == [[T, T]]
    assert lookup(cfg, 8, 64, [[3, 4, 6, 7]]).hit_tokens == 64
    # max_length caps the probes: 50 tokens reach unit 5 at most.
    assert lookup(cfg, 8, 50, [[3, 4, 6, 7]]).hit_tokens == 40


@vllm_checked
def test_full_attention_eagle_drops_one_hash_unit_when_fine_grained() -> None:
    cfg = config(fa(32), hbs=8, partial=True, eagle=True)
    out = lookup(cfg, 8, 63, [[3, 4, 6]])
    assert out.hit_tokens == 48  # 56 matched, one 8-token unit dropped
    assert masks(out) == [[T, T]]  # the tail block still covers 48


@vllm_checked
def test_full_attention_eagle_drops_one_block_when_not_fine_grained() -> None:
    out = lookup(config(fa(32), hbs=8, eagle=True), 8, 64, [[3, 7]])
    assert out.hit_tokens == 32
    assert masks(out) == [[T]]


@vllm_checked
def test_full_attention_rounds_down_to_the_alignment() -> None:
    out = lookup(config(fa(), sbs=32), 4, 64, [range(3)])
    assert out.hit_tokens == 32
    assert masks(out) == [[T, T]]


# --- sliding window -----------------------------------------------------------


@vllm_checked
def test_sliding_window_needs_window_blocks_ending_at_the_hit() -> None:
    cfg = config(sw(16, 33))  # ceil(32 / 16) = 2 blocks
    out = lookup(cfg, 4, 64, [[2, 3]])
    assert out.hit_tokens == 64
    assert masks(out) == [[F, F, T, T]]
    # No two contiguous blocks and no block 0: no hit.
    out = lookup(cfg, 4, 64, [[1, 3]])
    assert out.hit_tokens == 0
    assert masks(out) == [[]]


@vllm_checked
def test_sliding_window_needs_one_more_block_with_eagle() -> None:
    cfg = config(sw(16, 33), eagle=True)
    out = lookup(cfg, 4, 64, [[1, 2, 3]])
    assert out.hit_tokens == 48  # blocks 1-3 matched, block 3 popped
    assert masks(out) == [[F, T, T]]
    assert lookup(cfg, 4, 64, [[2, 3]]).hit_tokens == 0


@vllm_checked
def test_sliding_window_extra_retained_tokens_widen_the_window() -> None:
    out = lookup(config(sw(16, 17)), 4, 64, [[3]])
    assert out.hit_tokens == 64
    assert masks(out) == [[F, F, F, T]]
    out = lookup(config(sw(16, 17, extra=16)), 4, 64, [[3]])
    assert out.hit_tokens == 0
    assert masks(out) == [[]]


@vllm_checked
def test_sliding_window_run_ends_only_at_an_aligned_length() -> None:
    # Alignment 32, block 16: a run may not end at block 2 (48 tokens).
    out = lookup(config(sw(16, 17), sbs=32), 4, 64, [[0, 1, 2]])
    assert out.hit_tokens == 32
    assert masks(out) == [[F, T]]


@vllm_checked
def test_sliding_window_with_eagle_run_ends_aligned_after_the_pop() -> None:
    # Blocks 1-2 matched (the run's length after the pop, 32, is aligned);
    # block 3 would leave 48 after the pop.
    out = lookup(config(sw(16, 17), sbs=32, eagle=True), 5, 80, [range(4)])
    assert out.hit_tokens == 32
    assert masks(out) == [[F, T]]


@vllm_checked
def test_sliding_window_without_a_full_window_takes_the_run_from_block_zero() -> None:
    cfg = config(sw(16, 64))  # 4 blocks needed
    out = lookup(cfg, 4, 64, [[0, 1]])
    assert out.hit_tokens == 32
    assert masks(out) == [[T, T]]


@vllm_checked
def test_sliding_window_run_from_block_zero_is_popped_and_realigned_for_eagle() -> None:
    # 48 tokens from block 0: 32 once aligned, then the EAGLE pop (16) and
    # re-alignment leave nothing.
    cfg = config(sw(16, 64), sbs=32, eagle=True)
    out = lookup(cfg, 5, 80, [range(4)])
    assert out.hit_tokens == 0
    assert masks(out) == [[]]


# --- chunked local attention --------------------------------------------------


@vllm_checked
def test_chunked_local_nulls_blocks_before_the_chunk() -> None:
    cfg = config(cl(16, 32))
    out = lookup(cfg, 4, 48, [[2]])
    assert out.hit_tokens == 48
    assert masks(out) == [[F, F, T]]
    assert lookup(cfg, 4, 63, [[2]]).hit_tokens == 48
    # Inside the chunk, counting stops at the first miss.
    out = lookup(config(cl(16, 64)), 4, 63, [[0, 2]])
    assert out.hit_tokens == 16
    assert masks(out) == [[T]]


@vllm_checked
def test_chunked_local_on_a_chunk_boundary_needs_no_block() -> None:
    out = lookup(config(cl(16, 32)), 4, 64, [[]])
    assert out.hit_tokens == 64
    assert masks(out) == [[F, F, F, F]]
    assert lookup(config(cl(16, 32)), 4, 0, [[]]).hit_tokens == 0


# --- mamba --------------------------------------------------------------------


@vllm_checked
def test_mamba_takes_the_rightmost_present_aligned_block() -> None:
    out = lookup(config(mb(), sbs=32), 4, 64, [[0, 1, 2]])
    assert out.hit_tokens == 32  # block 2 ends at 48, not a multiple of 32
    assert masks(out) == [[F, T]]
    assert out.mamba_state_tokens == 32


@vllm_checked
def test_mamba_partial_hits_take_the_rightmost_present_hash_unit() -> None:
    out = lookup(config(mb(32), hbs=8, partial=True), 8, 63, [[2, 5]])
    assert out.hit_tokens == 48
    assert masks(out) == [[F, T]]


@vllm_checked
def test_mamba_never_drops_for_eagle() -> None:
    out = lookup(config(mb(), eagle=True), 4, 64, [range(4)])
    assert out.hit_tokens == 64
    assert masks(out) == [[F, F, F, T]]


@vllm_checked
def test_mamba_gets_no_eagle_margin_43559() -> None:
    cfg = config(fa(), mb(), eagle=True)
    present = [range(4), range(4)]
    fixed = lookup(cfg, 4, 64, present)
    assert fixed.hit_tokens == 48
    assert masks(fixed) == [[T, T, T], [F, F, T]]
    assert (fixed.verified_tokens, fixed.mamba_state_tokens) == (48, 48)
    buggy = lookup(cfg, 4, 64, present, "pre-49502")
    assert buggy.hit_tokens == 64
    assert masks(buggy) == [[T, T, T], [F, F, F, T]]
    # Recurrent state resumed 16 tokens past what attention verified.
    assert (buggy.verified_tokens, buggy.mamba_state_tokens) == (48, 64)


@vllm_checked
def test_pre_49502_mamba_margin_can_leave_an_unaligned_hit() -> None:
    # With no full attention, Mamba groups peeking past the candidate never
    # shrink it: the hit stays at max_length, off the 32-token alignment.
    cfg = config(mb(), mb(32), eagle=True, sbs=32)
    present = [range(4), range(4)]
    assert lookup(cfg, 4, 51, present).hit_tokens == 32
    assert lookup(cfg, 4, 51, present, "pre-49502").hit_tokens == 51


# --- the fixed point ----------------------------------------------------------


@vllm_checked
def test_eagle_peek_margin_only_applies_in_hybrids() -> None:
    # Alone, full attention matches 4 blocks under max_length 64 and drops
    # one. In a hybrid it may peek one block further, so the drop lands on 64.
    present = [range(5), range(5)]
    assert lookup(config(fa(), eagle=True), 5, 64, present[:1]).hit_tokens == 48
    out = lookup(config(fa(), mb(), eagle=True), 5, 64, present)
    assert out.hit_tokens == 64
    assert masks(out) == [[T, T, T, T], [F, F, F, T]]


def test_eagle_margin_is_one_hash_unit_for_fine_grained_finders() -> None:
    cfg = config(fa(32), sw(32, 33), hbs=8, partial=False, eagle=True)
    fine = config(fa(32), mb(32), hbs=8, partial=True, eagle=True)
    coarse = lookup(cfg, 12, 64, [range(12), range(12)], explain=True)
    assert [(s.margin, s.bound) for s in coarse.steps] == [(32, 96), (32, 96)]
    out = lookup(fine, 12, 64, [range(12), range(12)], explain=True)
    assert [(s.margin, s.bound) for s in out.steps] == [(8, 72), (0, 64)]
    assert out.hit_tokens == 64
    assert masks(out) == [[T, T], [F, T]]


def test_eagle_peek_is_capped_at_the_hash_list() -> None:
    out = lookup(config(fa(), mb(), eagle=True), 4, 64, [range(4)] * 2, explain=True)
    assert [(s.margin, s.bound, s.hit_tokens) for s in out.steps] == [(16, 64, 48), (0, 48, 48)]


@vllm_checked
def test_simple_hybrid_stops_after_one_pass() -> None:
    # The chunk (24) is not a block multiple: at 32 the chunk starts in block
    # 1, which is missing, so the hit is 16. A second pass at 16 would load
    # block 0; the simple hybrid does not take it and block 0 stays null.
    cfg = config(fa(), cl(16, 24))
    out = lookup(cfg, 2, 32, [[0, 1], [0]])
    assert out.hit_tokens == 16
    assert masks(out) == [[T], [F]]


def test_simple_hybrid_explain_has_one_pass() -> None:
    out = lookup(config(fa(), cl(16, 24)), 2, 32, [[0, 1], [0]], explain=True)
    assert [(s.pass_no, s.kind, s.bound, s.hit_tokens) for s in out.steps] == [
        (1, FA, 32, 32),
        (1, CL, 32, 16),
    ]


@vllm_checked
def test_fixed_point_repeats_until_a_pass_does_not_shrink() -> None:
    # Not a simple hybrid (no full attention): the sliding window shrinks the
    # candidate to 48, then the second pass runs Mamba again at 48.
    cfg = config(mb(), sw(16, 33))
    out = lookup(cfg, 4, 64, [range(4), [1, 2]])
    assert out.hit_tokens == 48
    assert masks(out) == [[F, F, T], [F, T, T]]
    assert out.mamba_state_tokens == 48


def test_full_attention_only_shrinks_after_its_first_lookup() -> None:
    cfg = config(fa(), sw(16, 17), mb(), eagle=True)
    # Pass 1: full attention 80 (96 peeked, one block dropped), the window
    # 48, Mamba 48. Pass 2 only takes min(candidate, 80) for full attention.
    out = lookup(cfg, 6, 96, [range(6), range(4), range(6)], explain=True)
    assert out.hit_tokens == 48
    assert masks(out) == [[T, T, T], [F, F, T], [F, F, T]]
    assert [(s.pass_no, s.kind, s.reused) for s in out.steps if s.kind is FA] == [
        (1, FA, False),
        (2, FA, True),
    ]


def test_verification_holds_per_candidate_and_clears_on_a_shrink() -> None:
    # Two sliding windows, both EAGLE groups. Pass 2: the first is verified and
    # looks up without the drop; it shrinks the candidate to 16, which clears
    # every verification, so the second drops again and so, in pass 3, does
    # the first: 0.
    cfg = config(sw(16, 15, extra=8), sw(16, 33, extra=7), eagle=True)
    present = [[0, 2, 3, 4], [0, 1, 2, 3]]
    out = lookup(cfg, 5, 94, present, explain=True)
    assert [(s.pass_no, s.spec_group, s.drop, s.bound, s.hit_tokens) for s in out.steps] == [
        (1, 0, True, 80, 64),
        (1, 1, True, 80, 48),
        (2, 0, False, 48, 16),
        (2, 1, True, 32, 16),
        (3, 0, True, 32, 0),
        (3, 1, False, 0, 0),
        (4, 0, False, 0, 0),
        (4, 1, False, 0, 0),
    ]
    assert out.hit_tokens == 0
    assert masks(out) == [[], []]


@vllm_checked
def test_verification_clear_reaches_vllm_outcome() -> None:
    cfg = config(sw(16, 15, extra=8), sw(16, 33, extra=7), eagle=True)
    out = lookup(cfg, 5, 94, [[0, 2, 3, 4], [0, 1, 2, 3]])
    assert out.hit_tokens == 0
    assert masks(out) == [[], []]


@vllm_checked
def test_full_attention_keeps_the_partial_tail_block_of_the_converged_hit() -> None:
    # Full attention matches 2 blocks (64); Mamba's state is at unit 4 (40):
    # the hit lands inside block 1, which full attention keeps.
    cfg = config(fa(32), mb(32), hbs=8, partial=True)
    out = lookup(cfg, 8, 64, [range(8), [0, 4]])
    assert out.hit_tokens == 40
    assert masks(out) == [[T, T], [F, T]]


# --- the vLLM backend without vLLM ------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_backend_without_vllm_names_the_fix() -> None:
    from replay.format.backends.vllm import VllmCoordinator

    with pytest.raises(ReplayError) as info:
        VllmCoordinator(config(fa()))
    missing = "torch" if importlib.util.find_spec("torch") is None else "vllm"
    root = Path(__file__).resolve().parents[1]
    assert str(info.value) == (
        f"--coordinator vllm: vLLM does not import in this Python ({sys.executable}: "
        f"No module named '{missing}'); run the tool inside the Python that has vLLM 0.33, "
        f"e.g. `PYTHONPATH={root} /path/to/vllm-venv/bin/python -m replay ...` "
        "(or install vLLM here: `pip install vllm==0.33.0`)"
    )


# --- properties ---------------------------------------------------------------


PROPERTY_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@vllm_checked
@PROPERTY_SETTINGS
@given(scenarios(), st.sampled_from(["vllm-0.33", "pre-49502"]))
def test_hit_never_exceeds_max_length(
    scenario: tuple[TraceConfig, int, int, list[set[int]]], policy: str
) -> None:
    cfg, units, max_length, present = scenario
    assert lookup(cfg, units, max_length, present, policy).hit_tokens <= max_length


@vllm_checked
@PROPERTY_SETTINGS
@given(scenarios())
def test_hit_is_aligned_and_masks_are_skipped_then_loaded(
    scenario: tuple[TraceConfig, int, int, list[set[int]]],
) -> None:
    # Not under pre-49502: see test_pre_49502_mamba_margin_can_leave_an_unaligned_hit.
    cfg, units, max_length, present = scenario
    out = lookup(cfg, units, max_length, present)
    assert out.hit_tokens % hit_alignment(cfg, "mooncake") == 0
    for g in out.groups:
        assert 0 <= g.loaded_blocks <= g.mask_blocks


@vllm_checked
@PROPERTY_SETTINGS
@given(scenarios())
def test_full_attention_holds_every_block_below_the_hit(
    scenario: tuple[TraceConfig, int, int, list[set[int]]],
) -> None:
    cfg, units, max_length, present = scenario
    out = lookup(cfg, units, max_length, present)
    hit = out.hit_tokens
    for g in out.groups:
        if g.kind is not FA:
            continue
        bs = cfg.groups[g.group_id].block_size
        view = block_view(bytes(range(units)), cfg.hash_block_size, bs)
        assert set(view[: hit // bs]) <= present[g.group_id]
        # Loaded: exactly the blocks of the hit, the partial tail block included.
        assert (g.mask_blocks, g.loaded_blocks) == (cdiv(hit, bs), cdiv(hit, bs))


@vllm_checked
@PROPERTY_SETTINGS
@given(scenarios())
def test_mamba_state_is_at_the_hit(
    scenario: tuple[TraceConfig, int, int, list[set[int]]],
) -> None:
    # The default policy only: before #49502 the state could run ahead (#43559).
    cfg, units, max_length, present = scenario
    out = lookup(cfg, units, max_length, present)
    hit = out.hit_tokens
    for g in out.groups:
        if g.kind is not MB:
            continue
        assert g.state_tokens == hit
        if hit:
            assert hit // cfg.hash_block_size - 1 in present[g.group_id]
            bs = cfg.groups[g.group_id].block_size
            assert (g.mask_blocks, g.loaded_blocks) == (cdiv(hit, bs), 1)
        else:
            assert (g.mask_blocks, g.loaded_blocks) == (0, 0)
