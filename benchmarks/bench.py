"""`make bench`: replay throughput against the loop a user would write.

Builds a production-shaped trace once with `replay synth` (multi-turn chat,
~12k-token prompts as 16-token blocks, 32-byte hashes, full attention + Mamba
with EAGLE; the shape of shared/design/performance-notes.md), then times in
the same run:

- the bare read of the trace with pyarrow (the floor),
- `replay run` (engine + flags, as users run it, and the engine alone),
- the naive loop: rows via pyarrow, a Python set of (group, bytes) keys,
  the reference coordinator per lookup; and the same loop over vLLM's own
  coordinator when vLLM imports,

and prints lookups/s, hash entries/s, peak memory and the ratios.
Sizes: BENCH_REQUESTS (default 12000), BENCH_TOKENS (default 12000).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

DATA = Path("bench-data")


def build_trace(path: Path, requests: int, tokens: int, seed: int = 7) -> dict[str, Any]:
    """The synthetic generator, tuned to the notes' shape: multi-turn chat
    whose prompts average about ``tokens`` tokens, 32-byte hashes, full
    attention + Mamba with EAGLE, an unbounded store."""
    from replay.sources.synth import SessionModel, synth_trace

    scale = tokens / 12_000
    model = SessionModel(
        system_tokens_median=5000 * scale,
        system_tokens_sigma=0.5,
        user_tokens_median=3000 * scale,
        user_tokens_sigma=0.6,
        answer_tokens_median=600 * scale,
        mean_turns=3.0,
    )
    return synth_trace(
        path,
        model="full+mamba",
        requests=requests,
        seed=seed,
        eagle=True,
        session_model=model,
        hash_bytes=32,
    )


def _timed(fn: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def naive_loop(path: Path, backend: str) -> tuple[float, list[int], int]:
    """In a child process (for a clean peak-RSS figure): what a user writes by hand."""
    code = f"""
import json, resource, sys, time
import pyarrow.parquet as pq
sys.path.insert(0, {str(Path.cwd())!r})
from replay.trace import open_trace
t = time.perf_counter()
reader = open_trace({str(path)!r})
config = reader.config
if {backend!r} == "vllm":
    from replay.backends.vllm import VllmCoordinator as C
else:
    from replay.coordinator import Coordinator as C
coord = C(config, "vllm-0.33")
keys = set()
hits = []
tests = [(lambda g: (lambda h: (g, h) in keys))(g) for g in range(config.num_groups)]
table = pq.read_table({str(path)!r}, columns=["kind", "group_id", "block_hashes", "max_length"])
for row in table.to_pylist():
    kind = row["kind"]
    if kind == "store":
        keys.update((row["group_id"], h) for h in row["block_hashes"])
    elif kind == "remove":
        keys.difference_update((row["group_id"], h) for h in row["block_hashes"])
    elif kind == "lookup":
        hits.append(coord.lookup(row["block_hashes"], row["max_length"], tests).hit_tokens)
secs = time.perf_counter() - t
print(json.dumps({{"seconds": secs, "hits": hits, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
"""
    python = sys.executable
    if backend == "vllm":
        python = str(Path(".venv-vllm/bin/python").absolute())
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return data["seconds"], data["hits"], data["rss"] * 1024


def run_child(args: list[str]) -> tuple[float, int, dict[str, Any]]:
    code = (
        "import json, resource, sys, time\n"
        "from replay.cli import cli\n"
        "t = time.perf_counter()\n"
        "try:\n"
        f"    cli({args!r}, standalone_mode=False)\n"
        "finally:\n"
        "    sys.stderr.write(json.dumps({'seconds': time.perf_counter() - t, "
        "'rss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}) + '\\n')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    meta = json.loads(out.stderr.strip().splitlines()[-1])
    summary = json.loads(out.stdout) if out.stdout.strip().startswith("{") else {}
    return meta["seconds"], meta["rss"] * 1024, summary


def engine_only(path: Path) -> tuple[float, list[int], int]:
    code = f"""
import json, resource, time
from replay.engine import replay_trace
t = time.perf_counter()
r = replay_trace({str(path)!r})
print(json.dumps({{"seconds": time.perf_counter() - t, "hits": r.results["hit_tokens"].to_list(),
  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return data["seconds"], data["hits"], data["rss"] * 1024


def main() -> None:
    requests = int(os.environ.get("BENCH_REQUESTS", "12000"))
    tokens = int(os.environ.get("BENCH_TOKENS", "12000"))
    DATA.mkdir(exist_ok=True)
    path = DATA / f"bench-{requests}x{tokens}.parquet"
    if not path.exists():
        secs, info = _timed(lambda: build_trace(path, requests, tokens))
        print(
            f"built {path}: {info['events']} events, {info['hash_entries']} hash entries in {secs:.1f} s"
        )
    meta = pq.ParquetFile(str(path)).metadata
    size = path.stat().st_size
    entries = int(
        pq.read_table(str(path), columns=["block_hashes"])
        .column("block_hashes")
        .combine_chunks()
        .value_lengths()
        .sum()
        .as_py()
    )
    lookups = int(
        pq.read_table(str(path), columns=["kind"]).column("kind").to_pylist().count("lookup")
    )
    print(
        f"trace: {path} ({size / 1e6:.0f} MB, {meta.num_rows} events, {entries} hash entries, {lookups} lookups)"
    )

    read_s, _ = _timed(lambda: pq.read_table(str(path)))
    eng_s, eng_hits, eng_rss = engine_only(path)
    out = DATA / "bench.results.parquet"
    run_s, run_rss, summary = run_child(["run", str(path), "-o", str(out), "--json"])
    naive_s, naive_hits, naive_rss = naive_loop(path, "reference")
    rows = [
        ("pyarrow read_table (floor)", read_s, None),
        ("replay engine (no flags)", eng_s, eng_rss),
        ("replay run (engine + flags + write)", run_s, run_rss),
        ("naive loop, reference coordinator", naive_s, naive_rss),
    ]
    vllm_s = None
    if Path(".venv-vllm/bin/python").exists():
        try:
            vllm_s, vllm_hits, vllm_rss = naive_loop(path, "vllm")
            rows.append(("naive loop, vLLM 0.33 coordinator", vllm_s, vllm_rss))
            print(f"hits identical to vLLM's: {vllm_hits == eng_hits}")
        except subprocess.CalledProcessError as exc:
            print(f"vLLM loop failed: {exc.stderr.strip().splitlines()[-1:]}")
    print(f"hits identical (engine vs naive reference loop): {naive_hits == eng_hits}")
    print()
    print(
        f"{'step':40} {'seconds':>8} {'lookups/s':>10} {'entries/s':>12} {'peak RSS':>9} {'x read':>7}"
    )
    for name, secs, rss in rows:
        rss_s = f"{rss / 2**30:.2f} GB" if rss else "-"
        print(
            f"{name:40} {secs:8.2f} {lookups / secs:10.0f} {entries / secs:12.0f} {rss_s:>9} {secs / read_s:7.2f}"
        )
    print()
    print(
        f"replay run vs bare read: {run_s / read_s:.2f}x (goal <= 3x); engine alone {eng_s / read_s:.2f}x"
    )
    print(
        f"speedup of replay run over the naive reference loop: {naive_s / run_s:.1f}x (goal >= 10x)"
    )
    if vllm_s is not None:
        print(f"speedup of replay run over the naive vLLM loop: {vllm_s / run_s:.1f}x")
    if summary:
        print(f"flags under vllm-0.33: {summary.get('flags') or 'none'}")


if __name__ == "__main__":
    main()
