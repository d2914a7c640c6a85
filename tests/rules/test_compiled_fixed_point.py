"""The compiled fixed point (``replay.rules.compiled``) against the Python
reference it ports (``Coordinator.lookup_present`` and ``FactRules.facts``):
on random scenarios (random hybrid and EAGLE configurations, stores,
removes and clears between lookups, every bound), on random property-test
traces and on the whole corpus, under every policy in both caches, with and
without ``unit_present``, every results column of every lookup must be
identical. ``replay explain`` keeps the reference's step-by-step answer; it
must equal the compiled one on every lookup of the corpus."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest

from replay.base.spec import GroupKind
from replay.engine.answers import Answers, Variant
from replay.engine.replay import explain_lookups
from replay.engine.shard import replay_answers
from replay.format.tracedir import open_trace
from replay.format.writer import write_trace
from replay.rules.compiled import supported
from replay.rules.coordinator import POLICIES, pinned_policies, trace_cache
from tests.builders import answerable, random_config, random_rows, random_scenarios, scenario_rows
from tests.builders import seeds as seeded

CORPUS = sorted((Path(__file__).resolve().parents[2] / "replay" / "corpus").glob("*.parquet"))


def _variants(path: Path, caches: tuple[str, ...], policies: tuple[str, ...]) -> list[Variant]:
    config = open_trace(path).config
    return [
        Variant(policy=p, cache=c) for c in caches for p in policies if answerable(config, p, c)
    ]


def _tables(
    path: Path, variants: list[Variant], *, compiled: bool, unit_present: bool
) -> list[pa.Table]:
    reader = open_trace(path)
    answers = Answers(reader.config, variants, unit_present=unit_present, compiled=compiled)
    assert answers.fallbacks == [None if compiled else "asked for the reference"] * len(variants)
    return [r.results.to_arrow() for r in replay_answers(reader, answers)]


def _assert_same(path: Path, variants: list[Variant], *, unit_present: bool) -> int:
    """Every column of every variant's results equal; returns the lookups compared."""
    mine = _tables(path, variants, compiled=True, unit_present=unit_present)
    theirs = _tables(path, variants, compiled=False, unit_present=unit_present)
    lookups = 0
    for v, a, b in zip(variants, mine, theirs, strict=True):
        assert a.schema == b.schema, (path.name, v)
        for name in a.column_names:
            assert a.column(name).equals(b.column(name)), (path.name, v, name)
        lookups += a.num_rows
    return lookups


@pytest.mark.parametrize("seed", seeded(8))
def test_random_scenarios_compiled_equals_reference(seed: int, tmp_path: Path) -> None:
    compared = 0
    for scenario in random_scenarios(seed, 16, lookups=10):
        # A configuration only the engine takes is the engine's trace (a
        # trace without source.cache is read as the Mooncake store's).
        config = scenario.config
        if scenario.caches == ("gpu",):
            config = replace(config, source={**(config.source or {}), "cache": "gpu"})
        path = write_trace(tmp_path / f"s{scenario.index}.parquet", config, scenario_rows(scenario))
        variants = _variants(path, scenario.caches, tuple(POLICIES))
        compared += _assert_same(path, variants, unit_present=scenario.index % 2 == 0)
    assert compared > 16 * 10


@pytest.mark.parametrize("seed", seeded(8))
def test_random_traces_compiled_equals_reference(seed: int, tmp_path: Path) -> None:
    rng = random.Random(1000 + seed)
    compared = 0
    for k in range(10):
        config = random_config(rng)
        path = write_trace(tmp_path / f"t{k}.parquet", config, random_rows(rng, config, 16))
        variants = _variants(path, ("gpu", "mooncake"), tuple(POLICIES))
        compared += _assert_same(path, variants, unit_present=k % 2 == 1)
    assert compared > 10 * 16


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_corpus_compiled_equals_reference(path: Path) -> None:
    """The policies each regression trace pins, in its own cache."""
    cache = trace_cache(open_trace(path).config.source)
    variants = _variants(path, (cache,), pinned_policies(cache))
    assert _assert_same(path, variants, unit_present=True) > 0


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_corpus_probe_stop_equals_reference(path: Path) -> None:
    """Without the ``unit_present`` column the serial fold stops probing a
    lookup past where any answer reads (``probe_stop``): every column still
    equals the reference's, which reads every unit."""
    config = open_trace(path).config
    cache = trace_cache(config.source)
    variants = _variants(path, (cache,), pinned_policies(cache))
    answers = Answers(config, variants)
    # Full attention is looked up first wherever there is some.
    full = any(g.kind is GroupKind.FULL_ATTENTION for g in config.groups)
    assert (answers.probe_stop() is not None) == full
    assert _assert_same(path, variants, unit_present=False) > 0


@pytest.mark.slow
@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_corpus_every_policy_both_caches(path: Path) -> None:
    variants = _variants(path, ("gpu", "mooncake"), tuple(POLICIES))
    assert _assert_same(path, variants, unit_present=False) > 0


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_explain_equals_the_compiled_answer(path: Path) -> None:
    """``replay explain``'s Python answer and facts, lookup by lookup, equal
    the compiled results ``replay run`` writes."""
    config = open_trace(path).config
    cache = trace_cache(config.source)
    (variant,) = _variants(path, (cache,), ("vllm-0.33",)) or [
        Variant(policy="pre-49502", cache=cache)
    ]
    reader = open_trace(path)
    answers = Answers(config, [variant])
    (result,) = replay_answers(reader, answers)
    rows = result.results.to_dicts()
    _, explained = explain_lookups(path, lambda _: True, variant.policy, cache=cache)
    assert len(explained) == len(rows) > 0
    for row, (event, outcome, facts) in zip(rows, explained, strict=True):
        assert event.seq == row["seq"]
        assert outcome.hit_tokens == row["hit_tokens"]
        assert outcome.verified_tokens == row["verified_tokens"]
        assert outcome.mamba_state_tokens == row["mamba_state_tokens"]
        assert [g.mask_blocks for g in outcome.groups] == row["mask_blocks"]
        assert [g.loaded_blocks for g in outcome.groups] == row["loaded_blocks"]
        assert [g.hit_tokens for g in outcome.groups] == row["group_hit_tokens"]
        assert list(facts.state_tokens) == row["group_state_tokens"]
        assert facts.attention_tokens == row["attention_tokens"]
        assert list(facts.first_absent_block) == row["first_absent_block"]
        assert list(facts.eagle_unit_present) == row["eagle_unit_present"]


def test_only_another_coordinator_falls_back() -> None:
    assert supported("reference") is None
    assert supported("vllm") == "the vllm coordinator answers through its own code"
