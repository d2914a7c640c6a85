"""The one answering loop: every variant from the same presence bytes, the
store state kept when asked, and the explain selection."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from replay.analysis.flags import lookup_flags
from replay.engine.answers import Answers, Variant
from replay.engine.kernels import LOOKUP, REMOVE, STORE
from replay.engine.run import ReplayOptions, replay
from replay.engine.shard import ShardFold, ShardPiece, replay_answers
from replay.format.tracedir import open_trace
from replay.format.writer import write_trace
from tests.builders import (
    answerable,
    chain,
    full_mamba,
    issue_43559_rows,
    random_config,
    random_rows,
    replay_trace,
    seeds,
)

VARIANTS = [
    Variant(policy=p, cache=c) for p in ("vllm-0.33", "pre-49502") for c in ("mooncake", "gpu")
]


@pytest.mark.parametrize("seed", seeds(15))
@pytest.mark.parametrize("shards", [1, 3])
def test_every_variant_from_one_fold_is_its_own_replay(
    tmp_path: Path, seed: int, shards: int
) -> None:
    rng = random.Random(900 + seed)
    config = random_config(rng)
    path = write_trace(tmp_path / "r.parquet", config, random_rows(rng, config, 25))
    reader = open_trace(path)
    # pre-49502 where its releases take the configuration (they refuse some).
    variants = [v for v in VARIANTS if answerable(config, v.policy, v.cache)]
    assert len(variants) >= 2
    answers = Answers(config, variants, unit_present=True, where=reader.name)
    got = replay_answers(reader, answers, shards=shards)
    assert [(r.policy, r.cache, r.coordinator) for r in got] == [
        (v.policy, v.cache, "reference") for v in variants
    ]
    for r in got:
        options = ReplayOptions(policies=(r.policy,), caches=(r.cache,), unit_present=True)
        (want,) = replay(path, options)
        assert r.results.equals(want.results)
        assert (r.events, r.events_by_kind) == (want.events, want.events_by_kind)


def test_explain_answers_only_the_selected_lookups_with_their_steps(tmp_path: Path) -> None:
    rows = issue_43559_rows()
    other = chain(2, "other")
    rows += [
        {"kind": "store", "group_id": 0, "block_hashes": other},
        {"kind": "lookup", "request_id": "other", "block_hashes": other, "max_length": 31},
    ]
    path = write_trace(tmp_path / "t.parquet", full_mamba(), rows)
    answers = Answers(
        full_mamba(),
        [Variant(policy="pre-49502", cache="mooncake")],
        explain=lambda e: e.request_id == "req-43559",
    )
    (result,) = replay_answers(open_trace(path), answers)
    # Explaining keeps the selected lookups, not results.
    assert result.results.height == 0
    ((event, outcome, facts),) = answers.explained
    assert (event.seq, event.request_id, event.max_length, event.num_tokens) == (
        2,
        "req-43559",
        64,
        65,
    )
    assert list(event.hashes) == chain(4, "43559")
    assert (outcome.hit_tokens, outcome.verified_tokens, outcome.mamba_state_tokens) == (64, 48, 64)
    assert [(g.mask_blocks, g.loaded_blocks) for g in outcome.groups] == [(3, 3), (4, 1)]
    assert outcome.steps, "explain records the coordinator's steps"
    assert facts.state_tokens == (None, 64)
    assert (facts.attention_tokens, facts.first_absent_block) == (48, (None, None))
    assert facts.eagle_unit_present == (False, None)
    flags = lookup_flags(full_mamba(), "mooncake", outcome, facts, 64, None)
    assert [f.flag for f in flags] == ["mamba_overrun", "eagle_not_dropped"]
    # The same answer the replay gives, flags included.
    replayed = replay_trace(path, policy="pre-49502", cache="mooncake").results.row(0, named=True)
    assert (replayed["hit_tokens"], replayed["flags"]) == (
        64,
        ["mamba_overrun", "eagle_not_dropped"],
    )


def test_probe_stop_ends_a_lookup_past_what_its_answer_reads() -> None:
    """Full attention + Mamba, 16-token blocks and hash units, EAGLE: the
    hit ends at full attention's first absent block, so the fold probes
    that unit's one-block EAGLE margin, two blocks and one unit more (4
    units) and no further; the units past stay 0. The unit_present
    column, or the Python reference, needs every unit: no stop."""
    config = full_mamba(16, source={"cache": "gpu"})
    variants = [Variant(policy="vllm-0.33", cache="gpu")]
    stop = Answers(config, variants).probe_stop()
    assert stop == (0, 1, 4)
    assert Answers(config, variants, unit_present=True).probe_stop() is None
    assert Answers(config, variants, compiled=False).probe_stop() is None
    hashes = chain(12)
    kinds = np.array([STORE, STORE, REMOVE, LOOKUP], dtype=np.int8)
    gids = np.array([0, 1, 0, -1], dtype=np.int32)

    def presence(stop: tuple[int, int, int] | None, removed: int = 3) -> list[list[int]]:
        rows = pa.array([hashes, hashes, [hashes[removed]], hashes], pa.list_(pa.binary()))
        fold = ShardFold(2, stop)
        out = fold.fold(ShardPiece(kinds=kinds, group_ids=gids, hashes=rows))
        return [out[:12].tolist(), out[12:].tolist()]

    assert presence(None) == [[1, 1, 1, 0] + [1] * 8, [1] * 12]
    assert presence(stop) == [[1, 1, 1, 0, 1, 1, 1, 1] + [0] * 4, [1] * 8 + [0] * 4]
    # Blocks of two units: a block is present when its last unit is, so
    # only an absent last unit ends the probes (unit 3: units 4 and 5 are
    # probed, no more); an absent first unit (unit 2) ends nothing.
    assert presence((0, 2, 2), removed=3) == [[1, 1, 1, 0, 1, 1] + [0] * 6, [1] * 6 + [0] * 6]
    assert presence((0, 2, 2), removed=2) == [[1, 1, 0] + [1] * 9, [1] * 12]
