"""Build the committed regression traces (`make traces`).

Hand-made traces pin known truths, so their expectations are written here by
hand, not computed; the synthetic ones pin the replay of a seeded generator
run (review the diff of `traces/README.md` when they change).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from replay.spec import GroupKind, GroupSpec, TraceConfig
from replay.trace import write_trace

HERE = Path(__file__).parent
FULL, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA


def chain(n: int, tag: str) -> list[bytes]:
    out, parent = [], tag.encode()
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "big")).digest()
        out.append(parent)
    return out


def full_mamba(block: int = 16, source: str = "hand-made") -> TraceConfig:
    return TraceConfig(
        groups=(
            GroupSpec(kind=FULL, block_size=block, name="model.layers.attn"),
            GroupSpec(
                kind=MAMBA, block_size=block, mamba_cache_mode="align", name="model.layers.mamba"
            ),
        ),
        hash_block_size=block,
        scheduler_block_size=block,
        use_eagle=True,
        source={"tool": "traces/build.py", "kind": source},
    )


def clean(hits: dict[str, int]) -> dict[str, Any]:
    return {"policy": "vllm-0.33", "flags": {}, "hits": hits}


# name -> (rows, expect list, what it pins)
def hand_made() -> dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]], str]]:
    hs4, hs5 = chain(4, "43559"), chain(5, "unaligned")
    mamba_only = chain(3, "mamba-only")
    return {
        "issue-43559": (
            [
                {"kind": "store", "group_id": 0, "block_hashes": hs4},
                {"kind": "store", "group_id": 1, "block_hashes": hs4},
                {
                    "kind": "lookup",
                    "request_id": "req-43559",
                    "block_hashes": hs4,
                    "max_length": 64,
                    "num_tokens": 65,
                },
            ],
            [
                clean({"req-43559": 48}),
                {
                    "policy": "pre-49502",
                    "flags": {"mamba_overrun": 1, "eagle_not_dropped": 1},
                    "hits": {"req-43559": 64},
                },
            ],
            "#43559 as in vLLM's own test: full attention matches 64 and drops to 48; the Mamba peek margin puts the state at 64",
        ),
        "observed-43559-in-production": (
            [
                {"kind": "store", "group_id": 0, "block_hashes": hs4},
                {"kind": "store", "group_id": 1, "block_hashes": hs4},
                {
                    "kind": "lookup",
                    "request_id": "prod-1",
                    "block_hashes": hs4,
                    "max_length": 64,
                    "num_tokens": 65,
                    "observed_hit_tokens": 64,
                },
            ],
            [
                {"policy": "vllm-0.33", "flags": {"observed_mismatch": 1}, "hits": {"prod-1": 48}},
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
            ],
            [
                clean({"m1": 0}),
                {
                    "policy": "pre-49502",
                    "flags": {"mamba_overrun": 1, "missing_block": 1, "eagle_not_dropped": 1},
                    "hits": {"m1": 16},
                },
            ],
            "pre-#49502: no attention block stored, yet Mamba's peek finds a state and the hit relies on absent attention blocks",
        ),
    }


def build_hand_made() -> list[tuple[str, str, list[dict[str, Any]]]]:
    built = []
    for name, (rows, expect, what) in hand_made().items():
        path = HERE / f"{name}.parquet"
        write_trace(path, full_mamba(), rows, expect={"expect": expect, "pins": what})
        built.append((path.name, what, expect))
    return built


def main() -> None:
    built = build_hand_made()
    for name, what, _ in built:
        print(f"wrote traces/{name}: {what}")


if __name__ == "__main__":
    main()
