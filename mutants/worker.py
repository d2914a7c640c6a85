"""One mutant's run, in its own process (``REPLAY_MUTANT=NAME``, unset for
the unmutated baseline): ``replay test --coordinator vllm --json`` on the
corpus, in process, then random configurations through vLLM's coordinators
(the differential tests' generator), answer by answer. Writes one JSON
file. ``--coverage`` records coverage.py branch coverage of vLLM's lookup
modules while the corpus runs (not the random part).

    python -m mutants.worker --out RESULT.json [--corpus DIR] [--random N]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

LOOKUP_MODULES = (
    "vllm/v1/core/kv_cache_manager.py",
    "vllm/v1/core/kv_cache_coordinator.py",
    "vllm/v1/core/single_type_kv_cache_manager.py",
    "vllm/v1/core/block_pool.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/coordinator.py",
)
LOOKUPS_PER_SCENARIO = 8


def _corpus(paths: list[str]) -> dict[str, Any]:
    """``replay test --coordinator vllm --json PATHS``, in this process."""
    from replay.cli import cli

    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(["test", "--coordinator", "vllm", "--json", *paths], prog_name="replay")
        except SystemExit as exc:
            code = exc.code
    if code not in (0, 1):
        return {"exit": code, "error": (err.getvalue() or out.getvalue()).strip()[-2000:]}
    # Its stdout is the one JSON document (indented: read it whole).
    result: dict[str, Any] = json.loads(out.getvalue())
    result["exit"] = code
    return result


def _random_answers(scenarios: int, seed: int) -> tuple[list[str], list[int]]:
    """Every answer (hit, masks, per-group hits, Mamba positions) of vLLM's
    coordinators, default policy, on the seeded random scenarios
    (``tests.builders.random_scenarios``), with the scenario of each; an
    exception is an answer too."""
    from replay.adapters.vllm.backend import VllmCoordinator
    from tests.builders import random_scenarios

    answers: list[str] = []
    where: list[int] = []
    for scenario in random_scenarios(seed, scenarios):
        coords: dict[str, Any] = {}
        for cache in scenario.caches:
            try:
                coords[cache] = VllmCoordinator(scenario.config, "vllm-0.33", cache)
            except Exception as exc:
                coords[cache] = f"raise {type(exc).__name__}"
        for store, hashes, max_length in scenario.steps:
            contains: list[Callable[[Hashable], bool]] = [s.__contains__ for s in store]
            for cache in scenario.caches:
                coord = coords[cache]
                where.append(scenario.index)
                if isinstance(coord, str):
                    answers.append(coord)
                    continue
                try:
                    o = coord.lookup(list(hashes), max_length, contains)
                    answers.append(
                        repr(
                            (
                                o.hit_tokens,
                                [(g.mask_blocks, g.loaded_blocks) for g in o.groups],
                                [g.hit_tokens for g in o.groups],
                                [g.state_tokens for g in o.groups],
                            )
                        )
                    )
                except Exception as exc:
                    answers.append(f"raise {type(exc).__name__}")
    return answers, where


#: What a child process drops before applying its mutant: vLLM's lookup
#: modules (and the packages' modules that import them), imported afresh.
PURGED = ("vllm.v1.core", "vllm.distributed.kv_transfer.kv_connector.v1.mooncake")


def _one(mutant: str | None, out: Path, args: argparse.Namespace, coverage_to: Path | None) -> None:
    """In a forked child: forget the lookup modules, apply the mutant, run."""
    from mutants.loader import MutantError, get_mutant, install

    for name in [m for m in sys.modules if m.startswith(PURGED)]:
        del sys.modules[name]
    report: dict[str, Any] = {"mutant": mutant}
    cov = None
    if coverage_to is not None:
        import coverage

        cov = coverage.Coverage(
            branch=True, data_file=None, include=[f"*/{m}" for m in LOOKUP_MODULES]
        )
        cov.start()
    try:
        if mutant:
            install(get_mutant(mutant))
        t0 = time.perf_counter()
        report["corpus"] = _corpus(args.corpus)
        report["corpus_seconds"] = round(time.perf_counter() - t0, 2)
        if cov is not None:
            cov.stop()
            cov.json_report(outfile=str(coverage_to), pretty_print=False)
            cov = None
        t0 = time.perf_counter()
        report["random"], report["scenario"] = _random_answers(args.random, args.seed)
        report["random_seconds"] = round(time.perf_counter() - t0, 2)
    except MutantError as exc:
        report["error"] = str(exc)
    except Exception as exc:  # a mutant that breaks vLLM's import is a finding
        report["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    finally:
        if cov is not None:
            cov.stop()
    out.write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--outdir", required=True, type=Path)
    parser.add_argument("--mutant", action="append", default=[])
    parser.add_argument("--corpus", action="append", default=[])
    parser.add_argument("--random", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0x49502)
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()

    # vLLM and torch load once, here; each mutant runs in a forked child
    # that re-imports only the lookup modules, mutated. Nothing runs here
    # before the forks: a thread pool started in this process (polars,
    # torch) would be dead in every child.
    import importlib

    for module in (
        "torch",
        "vllm.v1.kv_cache_interface",
        "vllm.v1.core.kv_cache_coordinator",
        "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator",
    ):
        importlib.import_module(module)

    jobs: list[tuple[str | None, Path, Path | None]] = [
        (None, args.outdir / "base.json", args.outdir / "coverage.json")
    ] + [(m, args.outdir / f"{m}.json", None) for m in args.mutant]
    running: dict[int, str] = {}
    done = 0
    while jobs or running:
        while jobs and len(running) < max(1, args.jobs):
            name, out, cov = jobs.pop(0)
            pid = os.fork()
            if pid == 0:
                try:
                    _one(name, out, args, cov)
                finally:
                    os._exit(0)
            running[pid] = name or "(unmutated)"
        pid, _status = os.wait()
        done += 1
        print(f"[{done}/{len(args.mutant) + 1}] {running.pop(pid)}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
