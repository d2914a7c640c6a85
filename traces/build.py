"""Build the committed regression traces (`make traces`).

Hand-made traces pin known truths, so their expectations are written here by
hand, not computed; the synthetic ones pin the replay of a seeded generator
run (review the diff of `traces/README.md` when they change).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.format.trace import TraceReader
from replay.format.tracedir import TraceSource
from replay.format.writer import write_trace
from tests.builders import chain, full_mamba, issue_43559_rows

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
                {
                    "policy": "pre-49502",
                    "flags": {"mamba_overrun": 1, "mamba_state_mismatch": 1, "hit_misaligned": 1},
                    "hits": {"r79": 79},
                },
            ],
            "pre-#49502: Mamba peeks to 80 > max_length 79, the loop breaks and keeps the unaligned bound 79 as the hit",
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
                # blocks, Mamba its states at 16 and 32. Its drop lands on a
                # stored state under every policy (no flag); pre-32802's
                # bound of 47 drops a second block.
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
                    "flags": {"mamba_overrun": 1, "eagle_not_dropped": 1},
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


def build_hand_made() -> list[tuple[str, str, list[dict[str, Any]]]]:
    built = []
    cases = {name: (hand_made_config(), *case) for name, case in hand_made().items()}
    cases["spiral-32802"] = (full_swa_mamba(), *spiral_32802())
    for name, (config, rows, expect, what) in cases.items():
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
        replayed = replayed_results(TraceReader(draft), [e["policy"] for e in expect])
        for entry in expect:
            entry["group_hit_tokens"] = _group_totals(replayed[entry["policy"]].results)
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
}


def _group_totals(results: Any) -> list[int]:
    """Per group_id, the sum over every lookup of that group's own hit."""
    per_lookup = results["group_hit_tokens"].to_list()
    return [sum(col) for col in zip(*per_lookup, strict=True)] if per_lookup else []


def replayed_results(trace: TraceSource, policies: Sequence[str]) -> dict[str, Any]:
    """Each policy's ``ReplayResult``, from one fold of ``trace``."""
    from replay.engine.run import ReplayOptions, replay

    results = replay(trace, ReplayOptions(policies=tuple(dict.fromkeys(policies))))
    return {r.policy: r for r in results}


def replayed_expectation(trace: TraceSource) -> list[dict[str, Any]]:
    """Pin what the replay gives now, per policy: flag counts, the total hit
    tokens and every request's hit, so a coordinator that answers wrongly
    fails every item, not only those with flags."""
    from analysis.flags import flag_counts, result_flags
    from replay.rules.coordinator import ALIASES, DEFAULT_POLICY

    # The current release and the emulations of the bugs the corpus pins.
    pinned = [DEFAULT_POLICY, *(p.name for p in ALIASES)]
    out = []
    for policy, result in replayed_results(trace, pinned).items():
        res = result.results
        hits = dict(zip(res["request_id"].to_list(), res["hit_tokens"].to_list(), strict=True))
        out.append(
            {
                "policy": policy,
                "flags": flag_counts(result_flags(result)),
                "hit_tokens": int(res["hit_tokens"].sum()),
                "group_hit_tokens": _group_totals(res),
                "hits": hits,
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
            expect = replayed_expectation(reader)
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


def write_readme(built: list[tuple[str, str, list[dict[str, Any]]]]) -> None:
    lines = [
        "# Regression traces",
        "",
        "Each trace here is a pytest test per policy (the `replay.pytest_plugin`",
        "plugin): `pytest traces/`. Rebuild with `make traces`; the hand-made",
        "expectations are written by hand in `build.py`, the synthetic ones pin the",
        "replay at build time (review the diff of this table when they change).",
        "",
        "## The `expect` schema",
        "",
        "Arrow metadata key `replay.expect`, a JSON object:",
        "",
        "```json",
        '{"expect": [',
        '  {"policy": "vllm-0.33", "flags": {}},',
        '  {"policy": "pre-49502", "flags": {"mamba_overrun": 1}, "hits": {"req-43559": 64}}',
        '], "pins": "what the trace is for"}',
        "```",
        "",
        "- `policy`: a policy name (`replay run --help` lists them).",
        "- `flags`: the exact number of flagged lookups per flag kind; `{}` means clean.",
        "- `hit_tokens`: the total replayed hit over every lookup.",
        "- `group_hit_tokens`: per group_id, the total of that group's own finder hit",
        "  (tells a true zero hit from a coordinator that never hits).",
        "- `hits`: the replayed hit, in tokens, of each request (its last lookup); the",
        "  synthetic traces pin every request.",
        "- `cache` (optional): the cache that answers; default the trace's `source.cache`.",
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
        by = {e["policy"]: e for e in expect}
        cells = [
            _flags_text(by[p]) if p in by else "(not pinned)"
            for p in ("vllm-0.33", "pre-49502", "pre-32802")
        ]
        lines.append(f"| `{name}` | {' | '.join(cells)} | {what} |")
    lines += [
        "",
        "`hit_beyond_max_length` has no trace: no policy can produce it (the",
        "fixed point starts at `max_length` and only shrinks). It guards against a",
        "wrong coordinator; `tests/test_flags.py` feeds it one.",
        "",
    ]
    (HERE / "README.md").write_text("\n".join(lines))


def main() -> None:
    built = build_hand_made() + build_synth()
    for name, what, _ in built:
        print(f"wrote traces/{name}: {what}")
    write_readme(built)
    print("wrote traces/README.md")


if __name__ == "__main__":
    main()
