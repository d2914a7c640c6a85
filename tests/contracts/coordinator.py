"""The contract every lookup coordinator passes: one test per rule of
the coordinator's semantics (the design notes, kept outside this repository) that looks only at lookup outcomes, with exact hit
lengths and load masks (vLLM 0.33.0's answers), and the properties every
answer keeps.

The rules are those of the fixed point at the lookup's ``max_length`` (vLLM's
``find_longest_cache_hit``): in the Mooncake cache, one level below the store
worker's entry (``FixedPoint``; ``VllmStoreMirror`` on vLLM's side), whose
alignment, store queries and retry ``tests/rules/test_store_worker.py`` pins.
A coordinator subclasses ``CoordinatorContract`` and says how to build one
(``make``): the reference in ``tests/rules/test_coordinator.py``, vLLM's own
coordinator (``VllmCoordinator``, ``make test-vllm``) in
``tests/vllm/test_vllm_differential.py``. Rules that look at the reference's
internals (its spec groups, its explain steps) stay in
``tests/rules/test_coordinator.py``.

Hash units are ``H[i]``; ``present[g]`` lists the units group ``g`` holds a
key for (a group's key for block ``j`` is the unit that ends the block, as
in the trace format).
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from replay.base.errors import ConfigError
from replay.base.spec import TraceConfig
from replay.rules.coordinator import (
    Coordinator,
    LookupCoordinator,
    LookupOutcome,
    build_spec_groups,
    hit_alignment,
)
from replay.rules.coordinator.finders import block_view, cdiv
from tests.builders import FA, MB, cl, config, fa, mb, scenarios, sw

H = [bytes([i]) * 32 for i in range(256)]
T, F = True, False

PROPERTY_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class FixedPoint(Coordinator):
    """The reference's fixed point at each lookup's ``max_length`` over every
    key the store holds: the Mooncake cache without its store worker's entry
    (``Coordinator.converge``)."""

    def _prepare(self) -> None:
        super()._prepare()
        self.asked = None


def masks(outcome: LookupOutcome) -> list[list[bool]]:
    return [g.mask() for g in outcome.groups]


class CoordinatorContract:
    """What every ``LookupCoordinator`` answers; subclasses define ``make``."""

    def make(self, cfg: TraceConfig, policy: str) -> LookupCoordinator:
        raise NotImplementedError

    def made(self, cfg: TraceConfig, policy: str) -> LookupCoordinator:
        """``make``, for a property over random configurations: one that the
        policy's releases refuse (``ConfigError``) is not an example."""
        try:
            return self.make(cfg, policy)
        except ConfigError:
            assume(False)
            raise

    def lookup(
        self,
        cfg: TraceConfig,
        units: int,
        max_length: int,
        present: Iterable[Iterable[int]],
        policy: str = "vllm-0.33",
    ) -> LookupOutcome:
        """``present[g]``: the hash-unit indices group ``g`` holds."""
        stores = [{H[i] for i in p} for p in present]
        coord = self.make(cfg, policy)
        return coord.lookup(H[:units], max_length, [s.__contains__ for s in stores])

    # --- the two ways to ask ------------------------------------------------------

    @pytest.mark.slow
    @PROPERTY_SETTINGS
    @given(scenarios(), st.sampled_from(["vllm-0.33", "pre-49502", "vllm-0.33-no-mamba-gate"]))
    def test_answer_from_presence_bytes_is_the_lookup(
        self, scenario: tuple[TraceConfig, int, int, list[set[int]]], policy: str
    ) -> None:
        # The engine asks with the lookup's presence bytes (``answer``), the
        # explain and the differential tests by hash (``lookup``): one answer.
        cfg, units, max_length, present = scenario
        coord = self.made(cfg, policy)
        by_hash = coord.lookup(
            H[:units], max_length, [{H[i] for i in p}.__contains__ for p in present]
        )
        rows = [bytes(int(u in p) for u in range(units)) for p in present]
        by_bytes = coord.answer(rows, max_length, H[:units])
        assert by_bytes.hit_tokens == by_hash.hit_tokens
        assert masks(by_bytes) == masks(by_hash)
        assert [g.state_tokens for g in by_bytes.groups] == [g.state_tokens for g in by_hash.groups]

    # --- spec groups --------------------------------------------------------------

    def test_merged_spec_group_needs_every_member_to_hold_the_key(self) -> None:
        cfg = config(fa(), fa())
        out = self.lookup(cfg, 4, 64, [range(4), range(2)])
        assert out.hit_tokens == 32
        assert masks(out) == [[T, T], [T, T]]

    def test_equal_specs_merge_so_the_hybrid_stays_simple(self) -> None:
        # Full attention + two equal chunked-local groups is one full-attention
        # spec group and one chunked spec group: a simple hybrid, one pass (see
        # test_simple_hybrid_stops_after_one_pass). Unmerged, a second pass would
        # load block 0 of the chunked groups.
        cfg = config(fa(), cl(16, 24), cl(16, 24))
        out = self.lookup(cfg, 2, 32, [[0, 1], [0], [0]])
        assert out.hit_tokens == 16
        assert masks(out) == [[T], [F], [F]]

    def test_full_attention_sorts_first_even_when_listed_last_43559(self) -> None:
        # Mamba listed first still makes a simple hybrid, so #43559 reproduces
        # under pre-49502 with the groups in either order.
        cfg = config(mb(), fa(), eagle=True)
        present = [range(4), range(4)]
        assert self.lookup(cfg, 4, 64, present).hit_tokens == 48
        out = self.lookup(cfg, 4, 64, present, "pre-49502")
        assert out.hit_tokens == 64
        assert masks(out) == [[F, F, F, T], [T, T, T]]

    def test_all_groups_eagle_when_none_flagged(self) -> None:
        cfg = config(fa(), sw(16, 17), eagle=True)
        assert all(sg.eagle for sg in build_spec_groups(cfg))
        # The window needs two blocks with the drop: blocks 1-2, popped to 32.
        out = self.lookup(cfg, 4, 64, [range(4), [1, 2]])
        assert out.hit_tokens == 32
        assert masks(out) == [[T, T], [F, T]]

    def test_only_flagged_groups_drop_when_any_is_flagged(self) -> None:
        cfg = config(fa(eagle=True), sw(16, 17), eagle=True)
        assert [sg.eagle for sg in build_spec_groups(cfg)] == [True, False]
        out = self.lookup(cfg, 4, 64, [range(4), [1, 2]])
        assert out.hit_tokens == 48
        assert masks(out) == [[T, T, T], [F, F, T]]

    def test_single_spec_group_drops_iff_use_eagle_or_flagged(self) -> None:
        present = [range(4)]
        assert self.lookup(config(fa()), 4, 64, present).hit_tokens == 64
        assert self.lookup(config(fa(), eagle=True), 4, 64, present).hit_tokens == 48
        assert self.lookup(config(fa(eagle=True)), 4, 64, present).hit_tokens == 48

    # --- full attention -----------------------------------------------------------

    def test_full_attention_counts_present_blocks_until_the_first_miss(self) -> None:
        out = self.lookup(config(fa()), 6, 96, [[0, 1, 3, 4, 5]])
        assert out.hit_tokens == 32
        assert masks(out) == [[T, T]]

    def test_full_attention_counts_at_most_max_length_blocks(self) -> None:
        out = self.lookup(config(fa()), 6, 50, [range(6)])
        assert out.hit_tokens == 48
        assert masks(out) == [[T, T, T]]

    def test_full_attention_partial_hit_probes_interior_units_high_to_low(self) -> None:
        # Block 32, hash unit 8: block 0 is unit 3; inside block 1 units 4 and 6
        # are present. Unit 6 (56 tokens) wins over unit 4. Unit 7 ends the block,
        # so it is not an interior probe: below 64 it cannot count.
        cfg = config(fa(32), hbs=8, partial=True)
        out = self.lookup(cfg, 8, 63, [[3, 4, 6, 7]])
        assert out.hit_tokens == 56
        assert masks(out) == [[T, T]]
        assert self.lookup(cfg, 8, 64, [[3, 4, 6, 7]]).hit_tokens == 64
        # max_length caps the probes: 50 tokens reach unit 5 at most.
        assert self.lookup(cfg, 8, 50, [[3, 4, 6, 7]]).hit_tokens == 40

    def test_full_attention_eagle_drops_one_hash_unit_when_fine_grained(self) -> None:
        cfg = config(fa(32), hbs=8, partial=True, eagle=True)
        out = self.lookup(cfg, 8, 63, [[3, 4, 6]])
        assert out.hit_tokens == 48  # 56 matched, one 8-token unit dropped
        assert masks(out) == [[T, T]]  # the tail block still covers 48

    def test_full_attention_eagle_drops_one_block_when_not_fine_grained(self) -> None:
        out = self.lookup(config(fa(32), hbs=8, eagle=True), 8, 64, [[3, 7]])
        assert out.hit_tokens == 32
        assert masks(out) == [[T]]

    def test_full_attention_rounds_down_to_the_alignment(self) -> None:
        out = self.lookup(config(fa(), sbs=32), 4, 64, [range(3)])
        assert out.hit_tokens == 32
        assert masks(out) == [[T, T]]

    # --- sliding window -----------------------------------------------------------

    def test_sliding_window_needs_window_blocks_ending_at_the_hit(self) -> None:
        cfg = config(sw(16, 33))  # ceil(32 / 16) = 2 blocks
        out = self.lookup(cfg, 4, 64, [[2, 3]])
        assert out.hit_tokens == 64
        assert masks(out) == [[F, F, T, T]]
        # No two contiguous blocks and no block 0: no hit.
        out = self.lookup(cfg, 4, 64, [[1, 3]])
        assert out.hit_tokens == 0
        assert masks(out) == [[]]

    def test_sliding_window_needs_one_more_block_with_eagle(self) -> None:
        cfg = config(sw(16, 33), eagle=True)
        out = self.lookup(cfg, 4, 64, [[1, 2, 3]])
        assert out.hit_tokens == 48  # blocks 1-3 matched, block 3 popped
        assert masks(out) == [[F, T, T]]
        assert self.lookup(cfg, 4, 64, [[2, 3]]).hit_tokens == 0

    def test_sliding_window_extra_retained_tokens_widen_the_window(self) -> None:
        out = self.lookup(config(sw(16, 17)), 4, 64, [[3]])
        assert out.hit_tokens == 64
        assert masks(out) == [[F, F, F, T]]
        out = self.lookup(config(sw(16, 17, extra=16)), 4, 64, [[3]])
        assert out.hit_tokens == 0
        assert masks(out) == [[]]

    def test_sliding_window_run_ends_only_at_an_aligned_length(self) -> None:
        # Alignment 32, block 16: a run may not end at block 2 (48 tokens).
        out = self.lookup(config(sw(16, 17), sbs=32), 4, 64, [[0, 1, 2]])
        assert out.hit_tokens == 32
        assert masks(out) == [[F, T]]

    def test_sliding_window_with_eagle_run_ends_aligned_after_the_pop(self) -> None:
        # Blocks 1-2 matched (the run's length after the pop, 32, is aligned);
        # block 3 would leave 48 after the pop.
        out = self.lookup(config(sw(16, 17), sbs=32, eagle=True), 5, 80, [range(4)])
        assert out.hit_tokens == 32
        assert masks(out) == [[F, T]]

    def test_sliding_window_without_a_full_window_takes_the_run_from_block_zero(self) -> None:
        cfg = config(sw(16, 64))  # 4 blocks needed
        out = self.lookup(cfg, 4, 64, [[0, 1]])
        assert out.hit_tokens == 32
        assert masks(out) == [[T, T]]

    def test_sliding_window_run_from_block_zero_is_popped_and_realigned_for_eagle(self) -> None:
        # 48 tokens from block 0: 32 once aligned, then the EAGLE pop (16) and
        # re-alignment leave nothing.
        cfg = config(sw(16, 64), sbs=32, eagle=True)
        out = self.lookup(cfg, 5, 80, [range(4)])
        assert out.hit_tokens == 0
        assert masks(out) == [[]]

    # --- chunked local attention --------------------------------------------------

    def test_chunked_local_nulls_blocks_before_the_chunk(self) -> None:
        cfg = config(cl(16, 32))
        out = self.lookup(cfg, 4, 48, [[2]])
        assert out.hit_tokens == 48
        assert masks(out) == [[F, F, T]]
        assert self.lookup(cfg, 4, 63, [[2]]).hit_tokens == 48
        # Inside the chunk, counting stops at the first miss.
        out = self.lookup(config(cl(16, 64)), 4, 63, [[0, 2]])
        assert out.hit_tokens == 16
        assert masks(out) == [[T]]

    def test_chunked_local_on_a_chunk_boundary_needs_no_block(self) -> None:
        out = self.lookup(config(cl(16, 32)), 4, 64, [[]])
        assert out.hit_tokens == 64
        assert masks(out) == [[F, F, F, F]]
        assert self.lookup(config(cl(16, 32)), 4, 0, [[]]).hit_tokens == 0

    # --- mamba --------------------------------------------------------------------

    def test_mamba_takes_the_rightmost_present_aligned_block(self) -> None:
        out = self.lookup(config(mb(), sbs=32), 4, 64, [[0, 1, 2]])
        assert out.hit_tokens == 32  # block 2 ends at 48, not a multiple of 32
        assert masks(out) == [[F, T]]
        assert out.mamba_state_tokens == 32

    def test_mamba_partial_hits_take_the_rightmost_present_hash_unit(self) -> None:
        out = self.lookup(config(mb(32), hbs=8, partial=True), 8, 63, [[2, 5]])
        assert out.hit_tokens == 48
        assert masks(out) == [[F, T]]

    def test_mamba_never_drops_for_eagle(self) -> None:
        out = self.lookup(config(mb(), eagle=True), 4, 64, [range(4)])
        assert out.hit_tokens == 64
        assert masks(out) == [[F, F, F, T]]

    def test_mamba_gets_no_eagle_margin_43559(self) -> None:
        cfg = config(fa(), mb(), eagle=True)
        present = [range(4), range(4)]
        fixed = self.lookup(cfg, 4, 64, present)
        assert fixed.hit_tokens == 48
        assert masks(fixed) == [[T, T, T], [F, F, T]]
        assert (fixed.verified_tokens, fixed.mamba_state_tokens) == (48, 48)
        buggy = self.lookup(cfg, 4, 64, present, "pre-49502")
        assert buggy.hit_tokens == 64
        assert masks(buggy) == [[T, T, T], [F, F, F, T]]
        # Recurrent state resumed 16 tokens past what attention verified.
        assert (buggy.verified_tokens, buggy.mamba_state_tokens) == (48, 64)

    def test_no_mamba_gate_on_033_can_leave_an_unaligned_hit(self) -> None:
        # vLLM 0.33.0 with the Mamba gate removed (the mutants' emulation):
        # with no full attention, Mamba groups peeking past the candidate
        # never shrink it: the hit stays at max_length, off the 32-token
        # alignment. The releases that had the margin (pre-49502) capped the
        # peek at max_length and stay aligned.
        cfg = config(mb(), mb(32), eagle=True, sbs=32)
        present = [range(4), range(4)]
        assert self.lookup(cfg, 4, 51, present).hit_tokens == 32
        assert self.lookup(cfg, 4, 51, present, "pre-49502").hit_tokens == 32
        assert self.lookup(cfg, 4, 51, present, "vllm-0.33-no-mamba-gate").hit_tokens == 51

    # --- the fixed point ----------------------------------------------------------

    def test_eagle_peek_margin_only_applies_in_hybrids(self) -> None:
        # Alone, full attention matches 4 blocks under max_length 64 and drops
        # one. In a hybrid it may peek one block further, so the drop lands on 64.
        present = [range(5), range(5)]
        assert self.lookup(config(fa(), eagle=True), 5, 64, present[:1]).hit_tokens == 48
        out = self.lookup(config(fa(), mb(), eagle=True), 5, 64, present)
        assert out.hit_tokens == 64
        assert masks(out) == [[T, T, T, T], [F, F, F, T]]

    def test_simple_hybrid_stops_after_one_pass(self) -> None:
        # The chunk (24) is not a block multiple: at 32 the chunk starts in block
        # 1, which is missing, so the hit is 16. A second pass at 16 would load
        # block 0; the simple hybrid does not take it and block 0 stays null.
        cfg = config(fa(), cl(16, 24))
        out = self.lookup(cfg, 2, 32, [[0, 1], [0]])
        assert out.hit_tokens == 16
        assert masks(out) == [[T], [F]]

    def test_fixed_point_repeats_until_a_pass_does_not_shrink(self) -> None:
        # Not a simple hybrid (no full attention): the sliding window shrinks the
        # candidate to 48, then the second pass runs Mamba again at 48.
        cfg = config(mb(), sw(16, 33))
        out = self.lookup(cfg, 4, 64, [range(4), [1, 2]])
        assert out.hit_tokens == 48
        assert masks(out) == [[F, F, T], [F, T, T]]
        assert out.mamba_state_tokens == 48

    def test_verification_clear_reaches_vllm_outcome(self) -> None:
        cfg = config(sw(16, 15, extra=8), sw(16, 33, extra=7), eagle=True)
        out = self.lookup(cfg, 5, 94, [[0, 2, 3, 4], [0, 1, 2, 3]])
        assert out.hit_tokens == 0
        assert masks(out) == [[], []]

    def test_full_attention_keeps_the_partial_tail_block_of_the_converged_hit(self) -> None:
        # Full attention matches 2 blocks (64); Mamba's state is at unit 4 (40):
        # the hit lands inside block 1, which full attention keeps.
        cfg = config(fa(32), mb(32), hbs=8, partial=True)
        out = self.lookup(cfg, 8, 64, [range(8), [0, 4]])
        assert out.hit_tokens == 40
        assert masks(out) == [[T, T], [F, T]]

    # --- properties -----------------------------------------------------------------

    @pytest.mark.slow
    @PROPERTY_SETTINGS
    @given(scenarios(), st.sampled_from(["vllm-0.33", "pre-49502", "vllm-0.33-no-mamba-gate"]))
    def test_hit_never_exceeds_max_length(
        self, scenario: tuple[TraceConfig, int, int, list[set[int]]], policy: str
    ) -> None:
        cfg, units, max_length, present = scenario
        self.made(cfg, policy)
        assert self.lookup(cfg, units, max_length, present, policy).hit_tokens <= max_length

    @pytest.mark.slow
    @PROPERTY_SETTINGS
    @given(scenarios())
    def test_hit_is_aligned_and_masks_are_skipped_then_loaded(
        self,
        scenario: tuple[TraceConfig, int, int, list[set[int]]],
    ) -> None:
        # Not without the Mamba gate: see test_no_mamba_gate_on_033_can_leave_an_unaligned_hit.
        cfg, units, max_length, present = scenario
        out = self.lookup(cfg, units, max_length, present)
        assert out.hit_tokens % hit_alignment(cfg, "mooncake") == 0
        for g in out.groups:
            assert 0 <= g.loaded_blocks <= g.mask_blocks

    @pytest.mark.slow
    @PROPERTY_SETTINGS
    @given(scenarios())
    def test_full_attention_holds_every_block_below_the_hit(
        self,
        scenario: tuple[TraceConfig, int, int, list[set[int]]],
    ) -> None:
        cfg, units, max_length, present = scenario
        out = self.lookup(cfg, units, max_length, present)
        hit = out.hit_tokens
        for g in out.groups:
            if g.kind is not FA:
                continue
            bs = cfg.groups[g.group_id].block_size
            view = block_view(bytes(range(units)), cfg.hash_block_size, bs)
            assert set(view[: hit // bs]) <= present[g.group_id]
            # Loaded: exactly the blocks of the hit, the partial tail block included.
            assert (g.mask_blocks, g.loaded_blocks) == (cdiv(hit, bs), cdiv(hit, bs))

    @pytest.mark.slow
    @PROPERTY_SETTINGS
    @given(scenarios())
    def test_mamba_state_is_at_the_hit(
        self,
        scenario: tuple[TraceConfig, int, int, list[set[int]]],
    ) -> None:
        # The default policy only: before #49502 the state could run ahead (#43559).
        cfg, units, max_length, present = scenario
        out = self.lookup(cfg, units, max_length, present)
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
