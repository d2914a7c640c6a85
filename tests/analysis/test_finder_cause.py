"""``finder_cause``: the one line a failure under ``--coordinator vllm``
names vLLM's function with (issue 31). vLLM's side is built here as its
backend records it (tests/vllm/test_adopt_vllm.py runs it on the real vLLM)."""

from __future__ import annotations

from replay.analysis.expectations import cause_shape, finder_cause
from replay.base.spec import GroupKind
from replay.rules.coordinator.hybrid import GroupOutcome, LookupOutcome, Step


def _step(group: int, kind: GroupKind, bound: int, hit: int, call: str | None = None) -> Step:
    return Step(
        pass_no=1,
        spec_group=group,
        kind=kind,
        group_ids=(group,),
        candidate_before=bound,
        bound=bound,
        margin=0,
        drop=False,
        matched_tokens=hit,
        hit_tokens=hit,
        candidate_after=hit,
        call=call,
    )


def _outcome(hit: int, *steps: Step) -> LookupOutcome:
    groups = (
        GroupOutcome(group_id=0, kind=GroupKind.FULL_ATTENTION, mask_blocks=hit // 16,
                     loaded_blocks=hit // 16, hit_tokens=hit),
    )  # fmt: skip
    return LookupOutcome(hit_tokens=hit, groups=groups, steps=steps)


FA = "FullAttentionManager.find_longest_cache_hit(max_length=640, drop_eagle_block=False)"


def test_same_arguments_another_answer_names_the_finder() -> None:
    mine = _outcome(320, _step(0, GroupKind.FULL_ATTENTION, 640, 320))
    theirs = _outcome(336, _step(0, GroupKind.FULL_ATTENTION, 640, 336, FA))
    assert finder_cause("vllm-0.33", mine, theirs) == (
        f"{FA} returned 336; vllm-0.33's full_attention finder returns 320 with the same arguments"
    )


def test_agreeing_calls_and_answers_have_no_cause() -> None:
    mine = _outcome(320, _step(0, GroupKind.FULL_ATTENTION, 640, 320))
    theirs = _outcome(320, _step(0, GroupKind.FULL_ATTENTION, 640, 320, FA))
    assert finder_cause("vllm-0.33", mine, theirs) is None


def test_agreeing_calls_another_answer_point_past_the_fixed_point() -> None:
    mine = _outcome(320, _step(0, GroupKind.FULL_ATTENTION, 640, 320))
    theirs = _outcome(336, _step(0, GroupKind.FULL_ATTENTION, 640, 320, FA))
    assert finder_cause("vllm-0.33", mine, theirs) == (
        "every finder call agrees with vllm-0.33's; vLLM's answer differs after the fixed "
        "point (hit 336 against 320, or a load mask): the final trim, or "
        "KVCacheManager.get_computed_blocks around it"
    )


def test_one_cause_at_other_lengths_is_one_group() -> None:
    """The heading of a group leaves the lengths out, never a release's digits."""
    assert cause_shape(
        "vLLM's fixed point called MambaManager.find_longest_cache_hit(max_length=1,040, "
        "drop_eagle_block=True) (spec group 1), which returned 1,040; vllm-0.33's calls its "
        "mamba finder (spec group 1) with max_length=1,024, drop=True, which returns 1,024"
    ) == (
        "vLLM's fixed point called MambaManager.find_longest_cache_hit(max_length=…, "
        "drop_eagle_block=True) (spec group …), which returned …; vllm-0.33's calls its "
        "mamba finder (spec group …) with max_length=…, drop=True, which returns …"
    )
