"""Build the committed regression traces (`make traces`).

Hand-made traces pin known truths, so their expectations are written here by
hand, not computed; the synthetic ones pin the replay of a seeded generator
run (review the diff of `traces/README.md` when they change).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.format.trace import TraceReader
from replay.format.tracedir import TraceSource
from replay.format.writer import write_trace
from replay.tools.minimize import valid_caches
from tests.builders import (
    Scenario,
    answerable,
    chain,
    full_mamba,
    issue_43559_rows,
    scenario_rows,
)

HERE = Path(__file__).parent


def hand_made_config() -> TraceConfig:
    return full_mamba(
        names=("model.layers.attn", "model.layers.mamba"),
        source={"tool": "traces/build.py", "kind": "hand-made"},
    )


def clean(hits: dict[str, int]) -> dict[str, Any]:
    return {"policy": "vllm-0.33", "flags": {}, "hits": hits}


# name -> (rows, expect list, what it pins)
def hand_made() -> dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]], str]]:
    hs5 = chain(5, "unaligned")
    mamba_only, both = chain(3, "mamba-only"), chain(3, "both-groups")
    return {
        "issue-43559": (
            issue_43559_rows(),
            [
                clean({"req-43559": 48}),
                # A simple hybrid stops after one pass: nothing to spiral.
                {"policy": "pre-32802", "flags": {}, "hits": {"req-43559": 48}},
                {
                    "policy": "pre-49502",
                    "flags": {"mamba_overrun": 1, "eagle_not_dropped": 1},
                    "hits": {"req-43559": 64},
                },
            ],
            "#43559 as in vLLM's own test: full attention matches 64 and drops to 48; the Mamba peek margin puts the state at 64",
        ),
        "observed-43559-in-production": (
            issue_43559_rows("prod-1", observed_hit_tokens=64),
            [
                {"policy": "vllm-0.33", "flags": {"observed_mismatch": 1}, "hits": {"prod-1": 48}},
                {"policy": "pre-32802", "flags": {"observed_mismatch": 1}, "hits": {"prod-1": 48}},
                {
                    "policy": "pre-49502",
                    "flags": {"mamba_overrun": 1, "eagle_not_dropped": 1},
                    "hits": {"prod-1": 64},
                },
            ],
            "production (pre-#49502) reported a 64-token hit; the fixed coordinator gives 48: observed_mismatch",
        ),
        "unaligned-break": (
            [
                {"kind": "store", "group_id": 0, "block_hashes": hs5},
                {"kind": "store", "group_id": 1, "block_hashes": hs5},
                {
                    "kind": "lookup",
                    "request_id": "r79",
                    "block_hashes": hs5,
                    "max_length": 79,
                    "num_tokens": 80,
                },
            ],
            [
                clean({"r79": 64}),
                # No peek margin before #32802: full attention's bound is 79, it
                # matches four blocks and drops one, 48.
                {"policy": "pre-32802", "flags": {}, "hits": {"r79": 48}},
                # The releases with the overrun cap the peek at max_length: the
                # margin takes Mamba's state at 64 past attention's 48.
                {
                    "policy": "pre-49502",
                    "flags": {"mamba_overrun": 1},
                    "hits": {"r79": 64},
                },
            ],
            "an unaligned max_length (79): vllm-0.33 hits 64; the releases with #43559 (pre-49502) peek up to max_length and give Mamba's state at 64 past attention's 48, an overrun",
        ),
        "mamba-state-without-attention": (
            [
                {"kind": "store", "group_id": 1, "block_hashes": mamba_only},
                {
                    "kind": "lookup",
                    "request_id": "m1",
                    "block_hashes": mamba_only,
                    "max_length": 47,
                    "num_tokens": 48,
                },
                # A request that does hit, beside it: attention holds three
                # blocks, Mamba its states at 16 and 32. vllm-0.33 peeks to
                # the hashed 48 and its drop lands on a stored state (no
                # flag); the older releases bound at max_length 47, so
                # attention keeps 16: pre-32802 drops a second block (16),
                # pre-49502's margin puts Mamba's state at 32 (an overrun).
                {"kind": "store", "group_id": 0, "block_hashes": both},
                {"kind": "store", "group_id": 1, "block_hashes": both[:2]},
                {
                    "kind": "lookup",
                    "request_id": "m2",
                    "block_hashes": both,
                    "max_length": 47,
                    "num_tokens": 48,
                },
            ],
            [
                clean({"m1": 0, "m2": 32}),
                {"policy": "pre-32802", "flags": {}, "hits": {"m1": 0, "m2": 16}},
                {
                    "policy": "pre-49502",
                    "flags": {"mamba_overrun": 2, "eagle_not_dropped": 1},
                    "hits": {"m1": 16, "m2": 32},
                },
            ],
            "pre-#49502: no attention block stored, yet Mamba's peek finds a state and the hit relies on absent attention blocks",
        ),
    }


def full_swa_mamba() -> TraceConfig:
    return TraceConfig(
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16, name="attn"),
            GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=17, name="swa"),
            GroupSpec(kind=GroupKind.MAMBA, block_size=16, mamba_cache_mode="align", name="mamba"),
        ),
        hash_block_size=16,
        scheduler_block_size=16,
        use_eagle=True,
        source={"tool": "hand-made"},
    )


def spiral_32802() -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """Before #32802 every pass of the fixed point dropped the window's last
    block again: with three spec groups each pass shrinks the candidate,
    so the hit spirals from 112 to 0 (``replay explain --policy pre-32802``
    shows the passes)."""
    hs8 = chain(8, "spiral-32802")
    rows: list[dict[str, Any]] = [
        {"kind": "store", "group_id": g, "block_hashes": hs8} for g in range(3)
    ]
    rows.append(
        {
            "kind": "lookup",
            "request_id": "s1",
            "block_hashes": hs8,
            "max_length": 128,
            "num_tokens": 129,
        }
    )
    expect = [
        clean({"s1": 112}),
        {"policy": "pre-32802", "flags": {}, "hits": {"s1": 0}},
    ]
    return (
        rows,
        expect,
        (
            "pre-#32802: full attention + sliding window + Mamba with EAGLE, the drop re-applied "
            "on every pass spirals the hit from 112 to 0"
        ),
    )


def reverified_after_shrink() -> tuple[
    TraceConfig, list[dict[str, Any]], list[dict[str, Any]], str
]:
    """A flagged sliding window (a draft's) beside an unflagged Mamba group,
    EAGLE on. r1: the window drops at 96 and keeps 80; Mamba, without the
    drop, shrinks the candidate to its state at 32, which clears the
    window's verification; re-checked at 32 with the drop (margin 16, the
    block at 32 absent) the window keeps only 16, and Mamba has no state at
    16: no hit. A coordinator that keeps the verification across the
    shrink re-checks the window at 32 without the drop and answers 32. r2:
    everything stored, both agree on Mamba's state at 64."""
    config = TraceConfig(
        groups=(
            GroupSpec(
                kind=GroupKind.SLIDING_WINDOW,
                block_size=16,
                sliding_window=17,
                is_eagle_group=True,
                name="draft.swa",
            ),
            GroupSpec(kind=GroupKind.MAMBA, block_size=16, mamba_cache_mode="align", name="mamba"),
        ),
        hash_block_size=16,
        scheduler_block_size=16,
        use_eagle=True,
        source={"tool": "hand-made"},
    )
    hs = chain(6, "reverify")
    rows: list[dict[str, Any]] = [
        {"kind": "store", "group_id": 0, "block_hashes": [hs[i] for i in (0, 1, 4, 5)]},
        {"kind": "store", "group_id": 1, "block_hashes": [hs[1]]},
        {"kind": "lookup", "request_id": "r1", "block_hashes": hs, "max_length": 96},
        {"kind": "store", "group_id": 0, "block_hashes": [hs[2], hs[3]]},
        {"kind": "store", "group_id": 1, "block_hashes": [hs[3]]},
        {"kind": "lookup", "request_id": "r2", "block_hashes": hs, "max_length": 96},
    ]
    expect = [
        clean({"r1": 0, "r2": 64}),
        {"policy": "pre-49502", "flags": {}, "hits": {"r1": 0, "r2": 64}},
    ]
    what = (
        "an EAGLE verification is cleared when an unflagged group shrinks the candidate: the "
        "flagged window is re-checked with the drop (r1: no hit, not 32)"
    )
    return config, rows, expect, what


def build_hand_made() -> list[tuple[str, str, list[dict[str, Any]]]]:
    built = []
    cases = {name: (hand_made_config(), *case) for name, case in hand_made().items()}
    cases["spiral-32802"] = (full_swa_mamba(), *spiral_32802())
    cases["eagle-reverified-after-shrink"] = reverified_after_shrink()
    from replay.rules.coordinator import DEFAULT_POLICY, RELEASES

    newest = RELEASES[-1].name
    for name, (config, rows, by_hand, what) in cases.items():
        # The default release's truths are the newest release's too (what a
        # vLLM no policy models yet is checked as); replayed below like the rest.
        by_hand = [
            *by_hand,
            *({**e, "policy": newest} for e in by_hand if e["policy"] == DEFAULT_POLICY),
        ]
        # The hand-written truths hold in both of vLLM's caches: each entry
        # is pinned for every cache the configuration is valid for and its
        # policy answers in (pre-32802's releases had no Mooncake mirror).
        expect = [
            {**e, "cache": c}
            for c in valid_caches(config)
            for e in by_hand
            if answerable(config, e["policy"], c)
        ]
        for entry in expect:
            # One lookup per request in these traces: the total is their sum.
            entry["hit_tokens"] = sum(entry["hits"].values())
        path = HERE / f"{name}.parquet"
        # Pinned at build time, like the synthetic traces: each group's own
        # hits, so that a zero hit is told apart from a coordinator that
        # never hits (review the diff of the trace when they change). The
        # rows are replayed from memory; the file is written once.
        draft = io.BytesIO()
        write_trace(draft, config, rows)
        replayed = replayed_results(TraceReader(draft), config)
        for entry in expect:
            result = replayed[(entry["policy"], entry["cache"])]
            got = dict(zip(result.results["request_id"], result.results["hit_tokens"], strict=True))
            if any(got[r] != h for r, h in entry["hits"].items()):
                raise SystemExit(f"{name}: {entry} does not replay in the {entry['cache']} cache")
            entry["group_hit_tokens"] = _group_totals(result.results)
        write_trace(path, config, rows, expect={"expect": expect, "pins": what})
        built.append((path.name, what, expect))
    return built


# name -> synth options, what it pins
SYNTH: dict[str, tuple[dict[str, Any], str]] = {
    "demo-full-mamba-eagle": (
        {
            "model": "full+mamba",
            "requests": 400,
            "seed": 1,
            "eagle": True,
            "capacity_blocks": 6000,
            "inject_overrun": 2,
        },
        "the `make demo` trace: Nemotron-H-style full attention + Mamba with EAGLE, LRU store, two injected #43559 resends",
    ),
    "archetype-full": (
        {"model": "full", "requests": 200, "seed": 2, "capacity_blocks": 4000},
        "full attention only, LRU eviction: hits follow the present prefix",
    ),
    "archetype-full-mamba": (
        {"model": "full+mamba", "requests": 200, "seed": 3, "eagle": True, "capacity_blocks": 4000},
        "full attention + Mamba with EAGLE (Nemotron-H / Jamba): natural overruns before #49502",
    ),
    "archetype-full-swa": (
        {"model": "full+swa", "requests": 200, "seed": 4, "eagle": True, "capacity_blocks": 4000},
        "full attention + sliding window with EAGLE (Gemma-3 / GPT-OSS style)",
    ),
    "archetype-full-chunked": (
        {"model": "full+chunked", "requests": 200, "seed": 5, "capacity_blocks": 4000},
        "full attention + chunked local attention (Llama-4 style), no EAGLE",
    ),
    "archetype-swa-mamba": (
        {"model": "swa+mamba", "requests": 200, "seed": 8, "eagle": True, "capacity_blocks": 4000},
        "sliding window + Mamba with EAGLE: before #49502 the window re-checks Mamba's grown candidate without the drop, so hit, state and loaded KV agree (eagle_not_dropped, no overrun)",
    ),
    "archetype-full-swa-mamba": (
        {
            "model": "full+swa+mamba",
            "requests": 200,
            "seed": 7,
            "eagle": True,
            "capacity_blocks": 6000,
        },
        "three groups: not a simple hybrid, so every lookup runs a second, confirming pass of the fixed point",
    ),
    "lookahead-full-swa-mamba": (
        {
            "model": "full+swa+mamba",
            "requests": 200,
            "seed": 9,
            "eagle": True,
            "lookahead_tokens": 3,
            "cache": "gpu",
            "capacity_blocks": 6000,
        },
        "the engine's stores with MTP's lookahead block hashes (num_hash_lookahead_tokens 3): prompts hash their units less the lookahead, no EAGLE drop, the Mamba checkpoint below N - 3",
    ),
}


def _group_totals(results: Any) -> list[int]:
    """Per group_id, the sum over every lookup of that group's own hit."""
    per_lookup = results["group_hit_tokens"].to_list()
    return [sum(col) for col in zip(*per_lookup, strict=True)] if per_lookup else []


def replayed_results(
    trace: TraceSource, config: TraceConfig, policies: Sequence[str] | None = None
) -> dict[tuple[str, str], Any]:
    """Each (policy, cache)'s ``ReplayResult``, every valid cache the policy
    answers in, from one fold of ``trace``."""
    from replay.engine.run import ReplayOptions, Variant, replay
    from replay.rules.coordinator import POLICIES

    variants = tuple(
        Variant(policy=p, cache=c)
        for p in (policies or POLICIES)
        for c in valid_caches(config)
        if answerable(config, p, c)
    )
    return {(r.policy, r.cache): r for r in replay(trace, ReplayOptions(variants=variants))}


def replayed_expectation(trace: TraceSource, config: TraceConfig) -> list[dict[str, Any]]:
    """Pin what the replay gives now, per policy and cache: flag counts, the total hit
    tokens and every request's hit, so a coordinator that answers wrongly
    fails every item, not only those with flags."""
    from replay.analysis.flags import flag_counts, result_flags
    from replay.rules.coordinator import pinned_policies

    # The current release and the aliases (the releases of the bugs the
    # corpus pins), in order; each where it answers.
    pinned = pinned_policies("gpu")
    out = []
    for (policy, cache), result in replayed_results(trace, config, pinned).items():
        res = result.results
        hits = dict(zip(res["request_id"].to_list(), res["hit_tokens"].to_list(), strict=True))
        masks = {
            rid: [[m, n] for m, n in zip(mb, lb, strict=True)]
            for rid, mb, lb in zip(
                res["request_id"].to_list(),
                res["mask_blocks"].to_list(),
                res["loaded_blocks"].to_list(),
                strict=True,
            )
        }
        out.append(
            {
                "policy": policy,
                "cache": cache,
                "flags": flag_counts(result_flags(result)),
                "hit_tokens": int(res["hit_tokens"].sum()),
                "group_hit_tokens": _group_totals(res),
                "hits": hits,
                "masks": masks,
            }
        )
    return out


def build_synth() -> list[tuple[str, str, list[dict[str, Any]]]]:
    import tempfile

    import pyarrow.parquet as pq

    from replay.sources.synth import synth_trace

    built = []
    for name, (options, what) in SYNTH.items():
        path = HERE / f"{name}.parquet"
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "raw.parquet"
            synth_trace(raw, **options)
            reader = TraceReader(raw)
            expect = replayed_expectation(reader, reader.config)
            write_trace(
                path,
                reader.config,
                pq.read_table(raw),
                expect={"expect": expect, "pins": what, "synth": options},
            )
        built.append((path.name, what, expect))
    return built


def _flags_text(entry: dict[str, Any]) -> str:
    flags = entry.get("flags") or {}
    text = ", ".join(f"{k} {v}" for k, v in sorted(flags.items())) or "clean"
    return f"{text}; {entry['hit_tokens']} hit tokens"


def _policy_cell(expect: list[dict[str, Any]], policy: str) -> str:
    """One policy's pins: one text when both caches agree, else each cache's."""
    texts = {e["cache"]: _flags_text(e) for e in expect if e["policy"] == policy}
    if not texts:
        return "(not pinned)"
    if len(set(texts.values())) == 1:
        return next(iter(texts.values())) + f" ({', '.join(sorted(texts))})"
    return "; ".join(f"{c}: {t}" for c, t in sorted(texts.items()))


def write_readme(built: list[tuple[str, str, list[dict[str, Any]]]]) -> None:
    lines = [
        "# Regression traces",
        "",
        "Each trace here is a test per policy and cache: `replay test traces/` (or",
        "`replay test` for the copy shipped in the package), `pytest traces/` (the",
        "`replay.pytest_plugin` plugin); `--coordinator vllm` /",
        "`--replay-coordinator vllm` checks the installed vLLM's answers instead.",
        "Every trace pins both of vLLM's caches (`gpu`: the engine's prefix cache,",
        "`mooncake`: the store's mirror) wherever its configuration is valid for",
        "both, under `vllm-0.33` and the aliases `pre-49502` (`vllm-0.24` in the",
        "engine, `vllm-0.26` in the mirror: the releases with the #43559 overrun)",
        "and `pre-32802` (`vllm-0.16`, engine only), each where its releases answer",
        "the configuration (else the cell says `(not pinned)`). Rebuild with `make traces`; the hand-made expectations are written",
        "by hand in `build.py` (and must replay in each cache they pin), the synthetic ones",
        "pin the replay at build time (review the diff of this table when they change).",
        "",
        "## The `expect` schema",
        "",
        "Arrow metadata key `replay.expect`, a JSON object:",
        "",
        "```json",
        '{"expect": [',
        '  {"policy": "vllm-0.33", "cache": "gpu", "flags": {}},',
        '  {"policy": "pre-49502", "cache": "mooncake", "flags": {"mamba_overrun": 1},',
        '   "hits": {"req-43559": 64}}',
        '], "pins": "what the trace is for"}',
        "```",
        "",
        "- `policy`: a policy name (`replay run --help` lists them); when left out,",
        "  the release that recorded the trace (`source.vllm_version`), else `vllm-0.33`.",
        "- `flags`: the exact number of flagged lookups per flag kind; `{}` means clean.",
        "- `hit_tokens`: the total replayed hit over every lookup.",
        "- `group_hit_tokens`: per group_id, the total of that group's own finder hit",
        "  (tells a true zero hit from a coordinator that never hits).",
        "- `hits`: the replayed hit, in tokens, of each request (its last lookup); the",
        "  synthetic traces pin every request.",
        "- `masks`: per request, each group's `[mask blocks, loaded blocks]` (the load",
        "  mask a coordinator returns: a wrong mask loads the wrong KV at the right hit).",
        "- `cache`: the cache that answers (`gpu` or `mooncake`); when left out, the",
        "  trace's `source.cache`.",
        "- Other keys (`pins`, `synth`, `minimized_from`) are notes for people.",
        "",
        "`replay minimize TRACE --request ID -o traces/NAME.parquet` writes a trace",
        "with its `expect` entry, ready to commit here.",
        "",
        "## What each trace pins",
        "",
        "| trace | vllm-0.33 | pre-49502 | pre-32802 | what it pins |",
        "|---|---|---|---|---|",
    ]
    for name, what, expect in built:
        cells = [_policy_cell(expect, p) for p in ("vllm-0.33", "pre-49502", "pre-32802")]
        lines.append(f"| `{name}` | {' | '.join(cells)} | {what} |")
    lines += [
        "",
        "`hit_beyond_max_length` has no trace: no policy can produce it (the",
        "fixed point starts at `max_length` and only shrinks). It guards against a",
        "wrong coordinator; `tests/analysis/test_flags.py` feeds it one.",
        "",
    ]
    (HERE / "README.md").write_text("\n".join(lines))


# Random scenarios of the mutants' judge (tests.builders.random_scenarios):
# the engine-only shapes, chosen by what they hold, and the scenarios
# `make mutants` found to tell a mutant apart that the corpus had missed.
RANDOM_SEED = 0x49502


def _partial(sc: Scenario) -> bool:
    from replay.rules.coordinator import engine_derives_partial_hits

    return "gpu" in sc.caches and engine_derives_partial_hits(sc.config)


def _spec_groups(sc: Scenario) -> bool:
    from replay.rules.coordinator import build_spec_groups

    return "gpu" in sc.caches and len(build_spec_groups(sc.config, "gpu")) >= 3


def _draft(sc: Scenario) -> bool:
    return "gpu" in sc.caches and any((g.name or "").startswith("draft") for g in sc.config.groups)


def _evictions(sc: Scenario) -> bool:
    rows = scenario_rows(sc)
    first = next(i for i, r in enumerate(rows) if r["kind"] == "lookup")
    removes = sum(r["kind"] == "remove" for r in rows[first:])
    hits = "gpu" in sc.caches and len(sc.config.groups) >= 2
    return hits and removes >= 3


#: name -> (the shape it has, its scenario index, what it pins). The
#: scenarios are frozen as first chosen (the first of the stream with the
#: shape that hit in every group under every policy and cache of then), so
#: the corpus does not move when a policy is added or an alias changes
#: meaning; the build checks each still has its shape.
ENGINE_SHAPES: dict[str, tuple[Any, int, str]] = {
    "engine-partial-hits": (
        _partial,
        6,
        "the engine derives hash-unit partial hits (a Mamba block above the hash unit): hits "
        "inside a block, the fine-grained EAGLE margin",
    ),
    "engine-spec-groups": (
        _spec_groups,
        14,
        "three or more spec groups: the fixed point's later passes",
    ),
    "engine-draft-shares-target": (
        _draft,
        2,
        "an EAGLE draft group with the target's full-attention spec: one spec group, the drop "
        "decided for both",
    ),
    "engine-evictions-between-lookups": (
        _evictions,
        21,
        "blocks removed between lookups of one request's prefix: hits shrink and regrow",
    ),
}

#: name -> (scenario index, what it pins): scenarios that tell a mutant apart.
RANDOM: dict[str, tuple[int, str]] = {
    "mutant-alignment": (
        50,
        "tells apart hits aligned to the scheduler block with partial hits on",
    ),
    "mutant-drop-every-call": (81, "tells apart the engine's EAGLE drop on every finder call"),
    "mutant-merged-eagle-bit": (
        25,
        "tells apart a merged spec group that drops only when its first member is flagged",
    ),
    "mutant-final-trim": (1, "tells apart full-attention blocks loaded past the converged hit"),
    "mutant-fine-grained-margin": (
        412,
        "tells apart a whole-block EAGLE margin under partial hits; a partial tail block trimmed by floor",
    ),
    "mutant-simple-hybrid-pass": (459, "tells apart a second pass of a simple hybrid"),
    "mutant-mirror-drop-every-call": (
        41,
        "tells apart the mirror's EAGLE drop on every finder call",
    ),
    "mutant-window-widening": (
        12,
        "tells apart the mirror's window not widened by extra_retained_tokens",
    ),
    "mutant-trim-floor": (54, "tells apart full attention trimmed to floor(hit / block)"),
    "mutant-chunk-start": (27, "tells apart short chunked-local lookups starting their chunk at 0"),
    "mutant-mamba-alignment": (144, "tells apart a Mamba state whose end is not aligned"),
    "mutant-window-blocks": (17, "tells apart a window that needs ceil(window / block) blocks"),
    "mutant-partial-hits-switch": (
        71,
        "tells apart partial hits turned on by a Mamba block equal to the hash unit",
    ),
}

#: Traces whose lookups keep the drawn hash lists (more hashes than the
#: prompt, or fewer), as the first generator made them: the engine answers
#: any hashes a request carries, and a request's own hashes reach the
#: fine-grained EAGLE margin only rarely (none of 4,000 scenarios of this
#: seed told engine-no-fine-grained-margin apart: the peek is capped at the
#: hashes, a unit past the prompt's last whole unit at most).
DRAWN_HASHES = frozenset({"mutant-fine-grained-margin"})

#: Beside them, the first 24 scenarios of the stream that hit in every group
#: under every policy and cache when the batch was chosen (vllm-0.33 and the
#: two emulations the aliases replaced), frozen like the shapes above: the
#: mutants' random judge in small (each a few kilobytes, a fraction of a
#: second through vLLM).
RANDOM_BATCH = (
    1,
    2,
    6,
    8,
    10,
    12,
    13,
    14,
    16,
    20,
    21,
    23,
    24,
    26,
    27,
    28,
    29,
    30,
    33,
    34,
    36,
    40,
    42,
    44,
)


def build_random() -> list[tuple[str, str, list[dict[str, Any]]]]:
    import io

    from tests.builders import random_scenarios

    wanted = {name: index for name, (_, index, _) in ENGINE_SHAPES.items()}
    wanted |= {name: index for name, (index, _) in RANDOM.items()}
    wanted |= {f"random-{index:04d}": index for index in RANDOM_BATCH}
    notes = {name: what for name, (_, _, what) in ENGINE_SHAPES.items()}
    notes.update({name: what for name, (_, what) in RANDOM.items()})
    for index in RANDOM_BATCH:
        notes[f"random-{index:04d}"] = (
            f"random scenario {index} of the mutants' judge (seed {RANDOM_SEED:#x})"
        )
    by_index: dict[int, Scenario] = {}
    for sc in random_scenarios(RANDOM_SEED, max(wanted.values()) + 1):
        by_index[sc.index] = sc
    drawn = {
        sc.index: sc
        for sc in random_scenarios(
            RANDOM_SEED, max(RANDOM[n][0] for n in DRAWN_HASHES) + 1, request_hashes=False
        )
        if sc.index in {RANDOM[n][0] for n in DRAWN_HASHES}
    }
    built = []
    for name, index in wanted.items():
        sc = drawn[index] if name in DRAWN_HASHES else by_index[index]
        shape = ENGINE_SHAPES.get(name)
        if shape is not None and not shape[0](sc):
            raise SystemExit(f"{name}: scenario {index} no longer has its shape")
        rows = scenario_rows(sc)
        config = replace(sc.config, source={"tool": "traces/build.py", "kind": "random"})
        draft = io.BytesIO()
        write_trace(draft, config, rows)
        expect = replayed_expectation(TraceReader(draft), config)
        what = notes[name]
        write_trace(
            HERE / f"{name}.parquet",
            config,
            rows,
            expect={
                "expect": expect,
                "pins": what,
                "random": {"seed": RANDOM_SEED, "scenario": sc.index},
            },
        )
        built.append((f"{name}.parquet", what, expect))
    return built


def main() -> None:
    built = build_hand_made() + build_synth() + build_random()
    for name, what, _ in built:
        print(f"wrote traces/{name}: {what}")
    write_readme(built)
    print("wrote traces/README.md")


if __name__ == "__main__":
    main()
