"""Where a ``replay run`` spends its time, stage by stage and thread by
thread (issue 34: the day's run against reading the trace).

``python -m benchmarks.timeline TRACE`` runs ``replay run TRACE -o
/dev/null -q`` in this process with each stage of the pipeline timed as it
runs (``replay.engine.shard.replay_answers``: the reader's thread decodes,
validates and scatters, the fold's thread folds, the main thread answers;
then the results, their flags and the file), and prints one JSON object:
the imports' seconds, and for each stage its calls, wall seconds, CPU
seconds of its own thread, and the span of the thread it ran on; the
fold's idle gaps (waiting for the reader); the serial end after the last
fold; and the process's CPU seconds. The bench prints it for the day
(``benchmarks.bench``, ``BENCH_ONLY=day``). Nothing here judges: the
figures are a shared machine's, read them as shares of one run.
"""

from __future__ import annotations

import itertools
import json
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

_T0 = time.perf_counter()

#: Each stage: the module, the attribute, and its name in the output.
STAGES = (
    ("replay.format.trace", "validate_rows", "validate"),
    ("replay.engine.shard", "scatter", "scatter"),
    ("replay.engine.shard", "ShardFold.fold", "fold"),
    ("replay.engine.answers", "Answers.add", "answers"),
    ("replay.engine.answers", "Answers.results", "results"),
    ("replay.analysis.flags", "flag_results", "flags"),
    ("replay.format.link", "save_results", "write"),
    ("replay.analysis.summary", "run_summary", "summary"),
)

Span = tuple[str, str, float, float, float]  # stage, thread, start, end, thread CPU


def _timed(spans: list[Span], stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            end = time.perf_counter()
            spans.append((stage, _thread(), start, end, time.thread_time() - cpu))

    return timed


def _timed_iter(spans: list[Span], stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Iterator[Any]:
        it = fn(*args, **kwargs)
        while True:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                end = time.perf_counter()
                spans.append((stage, _thread(), start, end, time.thread_time() - cpu))
            yield item

    return timed


def _thread() -> str:
    t = threading.current_thread()
    return "main" if t is threading.main_thread() else f"{t.name}-{t.ident}"


def timeline(trace: str) -> dict[str, Any]:
    """Run ``replay run TRACE -o /dev/null -q`` with its stages timed."""
    import importlib

    import pyarrow.parquet as pq

    from replay.cli import cli

    spans: list[Span] = []
    pq.ParquetFile.iter_batches = _timed_iter(spans, "decode", pq.ParquetFile.iter_batches)
    for module, attr, stage in STAGES:
        owner: Any = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, name, _timed(spans, stage, getattr(owner, name)))
    imports = time.perf_counter() - _T0
    start = time.perf_counter()
    cli(["run", trace, "-o", "/dev/null", "-q"], standalone_mode=False)
    seconds = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    stages: dict[str, dict[str, Any]] = {}
    threads: dict[str, list[Span]] = {}
    for stage, thread, a, b, cpu in spans:
        s = stages.setdefault(stage, {"calls": 0, "wall": 0.0, "cpu": 0.0, "thread": thread})
        s["calls"] += 1
        s["wall"] += b - a
        s["cpu"] += cpu
        threads.setdefault(thread, []).append((stage, thread, a, b, cpu))
    names = {}
    for thread, ss in threads.items():
        ss.sort(key=lambda s: s[2])
        names[thread] = "+".join(dict.fromkeys(s[0] for s in ss))
        for stage in dict.fromkeys(s[0] for s in ss):
            stages[stage]["thread"] = names[thread]
    folds = sorted((a, b) for stage, _, a, b, _ in spans if stage == "fold")
    gaps = sum(max(0.0, n[0] - p[1]) for p, n in itertools.pairwise(folds))
    return {
        "imports": round(imports, 3),
        "seconds": round(seconds, 3),
        "cpu": round(usage.ru_utime + usage.ru_stime, 3),
        "stages": {
            k: {**v, "wall": round(v["wall"], 3), "cpu": round(v["cpu"], 3)}
            for k, v in stages.items()
        },
        "threads": {
            names[t]: {
                "first": round(ss[0][2] - start, 3),
                "last": round(max(s[3] for s in ss) - start, 3),
                "cpu": round(sum(s[4] for s in ss), 3),
            }
            for t, ss in threads.items()
        },
        "fold_first": round(folds[0][0] - start, 3) if folds else None,
        "fold_gaps": round(gaps, 3),
        "after_fold": round(start + seconds - folds[-1][1], 3) if folds else None,
    }


if __name__ == "__main__":
    print(json.dumps(timeline(sys.argv[1])))
