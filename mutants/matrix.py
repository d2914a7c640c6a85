"""``make mutants``: the kill matrix of the regression corpus against the
mutants of vLLM's lookup path, and the corpus's branch coverage of it.

For the unmutated vLLM and then each mutant (``mutants/vllm-0.33.toml``), a
process (``mutants.worker``) runs ``replay test --coordinator vllm`` on the
corpus and answers random configurations through vLLM's coordinators. A
mutant is *killed* when an expectation of the corpus fails; it is
*distinguishable* when a random answer differs from the unmutated vLLM's.
The run fails (exit 1) when a distinguishable mutant survives the corpus,
when a mutant listed as equivalent is distinguishable or killed, when a
mutant that is not listed as equivalent is not distinguishable either (list
it, with the reason, or widen the generator), or when the unmutated corpus
does not pass.

    python -m mutants.matrix [--corpus DIR]... [--jobs N] [--random N] [--only NAME]...
        [--json out/mutants.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mutants.loader import Mutant, MutantError, check_applies, load_mutants

ROOT = Path(__file__).resolve().parent.parent

# vLLM's lookup path, function by function: what the corpus's branch
# coverage is reported for (module file -> qualified names).
LOOKUP_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "vllm/v1/core/kv_cache_manager.py": ("KVCacheManager.get_computed_blocks",),
    "vllm/v1/core/kv_cache_coordinator.py": (
        "KVCacheCoordinator.__init__",
        "UnitaryKVCacheCoordinator.find_longest_cache_hit",
        "HybridKVCacheCoordinator._cache_hit_alignment_tokens",
        "HybridKVCacheCoordinator.verify_and_split_kv_cache_groups",
        "HybridKVCacheCoordinator.find_longest_cache_hit",
    ),
    "vllm/v1/core/single_type_kv_cache_manager.py": (
        "FullAttentionManager.find_longest_cache_hit",
        "SlidingWindowManager._contiguous_blocks_for_hit",
        "SlidingWindowManager.find_longest_cache_hit",
        "ChunkedLocalAttentionManager.find_longest_cache_hit",
        "MambaManager.find_longest_cache_hit",
    ),
    "vllm/v1/core/block_pool.py": (
        "BlockHashToBlockMap.get_one_block",
        "BlockPool.get_cached_block",
    ),
    "vllm/v1/core/kv_cache_utils.py": (
        "eagle_proof_margin",
        "partial_hash_hits_enabled",
        "resolve_block_hashes",
        "BlockHashListWithBlockSize._get_value_at",
    ),
    "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/coordinator.py": (
        "ExternalCachedBlockPool.get_cached_block",
        "MooncakeStoreCoordinator._verify_and_split_kv_cache_groups",
        "MooncakeStoreCoordinator.find_longest_cache_hit",
        "MooncakeStoreCoordinator._find_hit_blocks",
        "_coverage_spec",
    ),
}


def _run_worker(
    mutants: list[str], outdir: Path, corpus: list[str], scenarios: int, jobs: int
) -> None:
    """One process imports vLLM once and forks a child per mutant."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("REPLAY_MUTANT", None)
    cmd = [sys.executable, "-m", "mutants.worker", "--outdir", str(outdir)]
    cmd += ["--random", str(scenarios), "--jobs", str(jobs)]
    for path in corpus:
        cmd += ["--corpus", path]
    for name in mutants:
        cmd += ["--mutant", name]
    subprocess.run(cmd, env=env, cwd=ROOT, check=False)


def _killed_traces(corpus: dict[str, Any]) -> list[str]:
    return sorted(
        {Path(e["trace"]).name for e in corpus.get("expectations", []) if e["status"] == "failed"}
    )


def _coverage_rows(report: dict[str, Any]) -> list[tuple[str, int, int]]:
    rows = []
    for suffix, functions in LOOKUP_FUNCTIONS.items():
        files = [f for name, f in report["files"].items() if name.endswith(suffix)]
        if not files:
            continue
        for qualname in functions:
            summary = files[0]["functions"].get(qualname, {}).get("summary")
            if summary is None:
                rows.append((qualname, 0, -1))
                continue
            rows.append((qualname, summary["covered_branches"], summary["num_branches"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", action="append", default=None)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--random", type=int, default=1000, help="random scenarios")
    parser.add_argument("--only", action="append", default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the whole report here")
    args = parser.parse_args()
    corpus = args.corpus or [str(ROOT / "traces")]

    started = time.perf_counter()
    mutants: list[Mutant] = [m for m in load_mutants() if args.only is None or m.name in args.only]
    try:
        for m in mutants:
            check_applies(m)
    except MutantError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        tmpdir = Path(tmp)
        _run_worker([m.name for m in mutants], tmpdir, corpus, args.random, args.jobs)
        base = json.loads((tmpdir / "base.json").read_text())
        cov_path = tmpdir / "coverage.json"
        coverage = json.loads(cov_path.read_text()) if cov_path.exists() else None
        results = {m.name: json.loads((tmpdir / f"{m.name}.json").read_text()) for m in mutants}

    problems: list[str] = []
    if base.get("error") or base["corpus"].get("exit") != 0:
        # Nothing can be judged against a baseline that failed: say why, stop.
        print(
            f"error: the unmutated vLLM does not pass the corpus: "
            f"{base.get('error') or base['corpus']}",
            file=sys.stderr,
        )
        sys.exit(2)
    traces = sorted({Path(e["trace"]).name for e in base["corpus"].get("expectations", [])})
    rows: list[dict[str, Any]] = []
    for m in mutants:
        r = results[m.name]
        scenarios: list[int] = []
        if r.get("error"):
            killed, differ, note = ["(vLLM fails to import)"], -1, r["error"]
        else:
            killed = _killed_traces(r["corpus"])
            if r["corpus"].get("exit") not in (0, 1):
                killed = ["(replay test exit 2)"]
            differing = [
                base["scenario"][i]
                for i, (a, b) in enumerate(zip(base["random"], r["random"], strict=True))
                if a != b
            ]
            differ = len(differing)
            note = ""
            scenarios = sorted(set(differing))[:5]
        if m.equivalent:
            status = "equivalent"
            if differ or killed:
                problems.append(
                    f"{m.name}: listed as equivalent, yet {differ} random answers differ and it kills {killed}"
                )
        elif killed:
            status = "killed"
        elif differ > 0:
            status = "SURVIVED"
            problems.append(
                f"{m.name}: survives the corpus, yet changes {differ} random answers "
                f"(scenarios {scenarios}): {m.breaks}"
            )
        else:
            status = "UNDETECTED"
            problems.append(
                f"{m.name}: no random answer differs: list it as equivalent with the reason, or widen the generator"
            )
        rows.append(
            {
                "name": m.name,
                "status": status,
                "killed_by": killed,
                "random_differ": differ,
                "scenarios": scenarios,
                "note": note,
                "breaks": m.breaks,
                "equivalent": m.equivalent,
            }
        )

    # The kill matrix: a column per trace, X where the trace kills the mutant.
    width = max(len(m.name) for m in mutants) if mutants else 10
    print("kill matrix (X: an expectation of the trace fails under the mutant)")
    for i, t in enumerate(traces):
        print(f"  {chr(ord('a') + i) if i < 26 else str(i)}: {t}")
    header = " ".join(chr(ord("a") + i) if i < 26 else "?" for i in range(len(traces)))
    print(f"{'mutant':<{width}}  {header}  random-differ  status")
    for row in rows:
        cells = " ".join("X" if t in row["killed_by"] else "." for t in traces)
        if row["killed_by"] and row["killed_by"][0].startswith("("):
            cells = row["killed_by"][0]
        print(f"{row['name']:<{width}}  {cells}  {row['random_differ']:>13}  {row['status']}")
    counts = {
        s: sum(r["status"] == s for r in rows)
        for s in ("killed", "equivalent", "SURVIVED", "UNDETECTED")
    }
    print()
    print(
        f"mutants: {len(rows)} in all, {counts['killed']} killed, {counts['equivalent']} equivalent, "
        f"{counts['SURVIVED']} survived, {counts['UNDETECTED']} undetected by random configurations "
        f"({args.random} configurations, {len(base.get('random', []))} lookups)"
    )
    for row in rows:
        if row["status"] == "equivalent":
            print(f"  equivalent: {row['name']}: {row['equivalent']}")

    if coverage is not None:
        cov_rows = _coverage_rows(coverage)
        print()
        print("branch coverage of vLLM's lookup path by the corpus (coverage.py, unmutated run)")
        covered = total = 0
        for qualname, hit, n in cov_rows:
            if n < 0:
                print(f"  {qualname:<62} (not found)")
                continue
            covered, total = covered + hit, total + n
            pct = 100.0 * hit / n if n else 100.0
            print(f"  {qualname:<62} {hit:>3}/{n:<3} {pct:5.1f}%")
        if total:
            print(f"  {'all':<62} {covered:>3}/{total:<3} {100.0 * covered / total:5.1f}%")
    seconds = time.perf_counter() - started
    print(
        f"\nmake mutants took {seconds:.0f} s; corpus run unmutated {base.get('corpus_seconds')} s (under coverage, vLLM import included)"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "mutants": rows,
                    "traces": traces,
                    "seconds": seconds,
                    "coverage": coverage and _coverage_rows(coverage),
                },
                indent=1,
            )
        )
    for p in problems:
        print(f"problem: {p}", file=sys.stderr)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
