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
import random
import sys
import time
import traceback
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

LOOKUP_MODULES = (
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
    result: dict[str, Any] = json.loads(out.getvalue().strip().splitlines()[-1])
    result["exit"] = code
    return result


def _random_answers(scenarios: int, seed: int) -> list[str]:
    """Every answer (hit, masks, per-group hits, Mamba positions) of vLLM's
    coordinators, default policy, on seeded random configurations and
    stores; an exception is an answer too. The random stream never depends
    on an answer, so every run sees the same lookups."""
    from replay.base.errors import ConfigError
    from replay.format.backends.vllm import VllmCoordinator
    from replay.rules.coordinator import check_config
    from tests.builders import mutate_store, random_chain, random_hybrid_config, random_max_length

    rng = random.Random(seed)
    answers: list[str] = []
    done = 0
    while done < scenarios:
        try:
            config = random_hybrid_config(rng)
        except ConfigError:
            continue
        chain = random_chain(rng, config, 48)
        valid = []
        for cache in ("gpu", "mooncake"):
            try:
                check_config(config, cache)
                valid.append(cache)
            except ConfigError:
                pass
        if not valid:
            continue
        done += 1
        coords: dict[str, Any] = {}
        for cache in valid:
            try:
                coords[cache] = VllmCoordinator(config, "vllm-0.33", cache)
            except Exception as exc:
                coords[cache] = f"raise {type(exc).__name__}"
        store: list[set[bytes]] = [set() for _ in config.groups]
        for _ in range(LOOKUPS_PER_SCENARIO):
            for _ in range(rng.randint(1, 3)):
                mutate_store(rng, store, chain)
            hashes = chain if rng.random() < 0.7 else chain[: rng.randint(0, len(chain))]
            max_length = random_max_length(rng, config, len(hashes))
            contains: list[Callable[[Hashable], bool]] = [s.__contains__ for s in store]
            for cache in valid:
                coord = coords[cache]
                if isinstance(coord, str):
                    answers.append(coord)
                    continue
                try:
                    o = coord.lookup(hashes, max_length, contains)
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
    return answers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--corpus", action="append", default=[])
    parser.add_argument("--random", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0x49502)
    parser.add_argument("--coverage", type=Path, default=None)
    args = parser.parse_args()

    from mutants.loader import MutantError, install_from_env

    report: dict[str, Any] = {"mutant": os.environ.get("REPLAY_MUTANT") or None}
    cov = None
    if args.coverage is not None:
        import coverage

        cov = coverage.Coverage(
            branch=True, data_file=None, include=[f"*/{m}" for m in LOOKUP_MODULES]
        )
        cov.start()
    try:
        install_from_env()
        t0 = time.perf_counter()
        report["corpus"] = _corpus(args.corpus)
        report["corpus_seconds"] = round(time.perf_counter() - t0, 2)
        if cov is not None:
            cov.stop()
            cov.json_report(outfile=str(args.coverage), pretty_print=False)
            cov = None
        t0 = time.perf_counter()
        report["random"] = _random_answers(args.random, args.seed)
        report["random_seconds"] = round(time.perf_counter() - t0, 2)
    except MutantError as exc:
        report["error"] = str(exc)
    except Exception as exc:  # a mutant that breaks vLLM's import is a finding
        report["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    finally:
        if cov is not None:
            cov.stop()
    args.out.write_text(json.dumps(report))
    sys.exit(0)


if __name__ == "__main__":
    main()
