"""The reference coordinator: it passes the coordinators' contract
(``tests/contracts/coordinator.py``: every rule of the coordinator's
semantics (the design notes, kept outside this repository) that looks only at lookup outcomes, with vLLM 0.33.0's exact answers, which
``tests/vllm/test_vllm_differential.py`` runs against vLLM's own coordinator), and
here the rules that look at its own workings: spec groups, explain steps.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.rules.coordinator import Coordinator, LookupOutcome, build_spec_groups
from tests.builders import CL, FA, MB, SW, cl, config, fa, mb, sw
from tests.contracts.coordinator import CoordinatorContract, F, FixedPoint, H, T, masks


class TestReferenceCoordinator(CoordinatorContract):
    def make(self, cfg: TraceConfig, policy: str) -> Coordinator:
        return FixedPoint(cfg, policy)


def lookup(
    cfg: TraceConfig,
    units: int,
    max_length: int,
    present: Iterable[Iterable[int]],
    *,
    explain: bool = False,
) -> LookupOutcome:
    """The reference's fixed point at ``max_length``; ``present[g]``: the
    hash-unit indices group ``g`` holds."""
    contains = [{H[i] for i in p}.__contains__ for p in present]
    return FixedPoint(cfg).lookup(H[:units], max_length, contains, explain=explain)


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


def test_spec_groups_sort_full_attention_first() -> None:
    cfg = config(mb(), sw(16, 32), fa(), eagle=True)
    assert [sg.kind for sg in build_spec_groups(cfg)] == [FA, MB, SW]


def test_spec_group_is_eagle_when_any_member_is_flagged() -> None:
    cfg = config(fa(eagle=True), fa(), sw(16, 32))
    assert [(sg.group_ids, sg.eagle) for sg in build_spec_groups(cfg)] == [
        ((0, 1), True),
        ((2,), False),
    ]


# --- the fixed point ----------------------------------------------------------


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


def test_simple_hybrid_explain_has_one_pass() -> None:
    out = lookup(config(fa(), cl(16, 24)), 2, 32, [[0, 1], [0]], explain=True)
    assert [(s.pass_no, s.kind, s.bound, s.hit_tokens) for s in out.steps] == [
        (1, FA, 32, 32),
        (1, CL, 32, 16),
    ]


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


# --- the vLLM backend without vLLM ------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_backend_without_vllm_names_the_fix() -> None:
    from replay.adapters.vllm.backend import VllmCoordinator

    with pytest.raises(ReplayError) as info:
        VllmCoordinator(config(fa()))
    missing = "torch" if importlib.util.find_spec("torch") is None else "vllm"
    root = Path(__file__).resolve().parents[2]
    assert str(info.value) == (
        f"`coordinator` vllm: vLLM does not import in this Python ({sys.executable}: "
        f"No module named '{missing}'); run the tool inside the Python that has vLLM, "
        f"e.g. `PYTHONPATH={root} /path/to/vllm-venv/bin/python -m replay ...` "
        "(or install vLLM here: `pip install 'cache-trace-replay[vllm]'`)"
    )
