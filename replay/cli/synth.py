"""Click commands for trace sources: ``synth`` and the ``mooncake`` / ``bailian``
importers (wired under ``replay ingest`` by ``replay.cli.sources``).

Click only: each command calls one library function and prints its summary.
Library errors are ``ReplayError`` (one line); the main entry point prints
them and exits with status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from replay.cli.common import fail, handles_user_errors, retention_interval
from replay.coordinator import CACHES
from replay.paths import check_outputs
from replay.sources.archetypes import ARCHETYPES
from replay.sources.mooncake import ingest
from replay.sources.synth import synth_trace
from replay.store_rules import StorePolicy


@contextmanager
def _progress(total: int, label: str) -> Iterator[Callable[[int], None] | None]:
    """A progress bar on a terminal, nothing when stderr is piped."""
    if total <= 0 or not sys.stderr.isatty():
        yield None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield bar.update


def _store_text(capacity: int | None) -> str:
    return "unbounded store" if capacity is None else f"LRU store of {capacity:,} blocks"


def _events_text(s: dict[str, Any]) -> str:
    return (
        f"{s['events']:,} events ({s['lookups']:,} lookups, {s['stores']:,} stores, "
        f"{s['removes']:,} removes, {s['clears']:,} clears), "
        f"{s['hash_entries']:,} hash entries, {s['bytes']:,} bytes"
    )


def _rules_text(s: dict[str, Any]) -> str:
    r = s["retention_interval"]
    retention = "dense retention" if r is None else f"retention interval {r}"
    return f"{s['cache']} stores ({retention}, {s['max_num_batched_tokens']:,}-token steps)"


def synth_summary_text(s: dict[str, Any]) -> str:
    text = (
        f"Wrote {s['path']}: model {s['model']}, EAGLE {'on' if s['eagle'] else 'off'}, "
        f"{_store_text(s['capacity_blocks'])}, {_rules_text(s)}, seed {s['seed']}, "
        f"{s['requests']:,} requests: "
        f"{_events_text(s)}."
    )
    injected = s["injected_overruns"]
    if injected:
        first = injected[0]
        text += (
            f" Injected {len(injected)} #43559 overrun(s) (request ids overrun-NNNN-resend), "
            f"e.g. {first['request_id']}: hit {first['hit_tokens_pre_49502']} tokens under "
            f"pre-49502, {first['hit_tokens_vllm_033']} under vllm-0.33."
        )
    return text


def ingest_summary_text(s: dict[str, Any]) -> str:
    return (
        f"Wrote {s['path']} from {s['source']} ({s['format']}, {s['rows']:,} rows): "
        f"model {s['model']}, EAGLE {'on' if s['eagle'] else 'off'}, "
        f"{_store_text(s['capacity_blocks'])}, {_rules_text(s)}, block size {s['block_size']}: "
        f"{_events_text(s)}. Prefix reuse ratio {s['reuse_ratio']:.4f} "
        f"({s['reused_tokens']:,} of {s['input_tokens']:,} input tokens, counted from hash_ids)."
    )


def _retention(_ctx: click.Context, _param: click.Parameter, value: str) -> int | None:
    return retention_interval(value)


def _budget(_ctx: click.Context, _param: click.Parameter, value: str) -> int:
    try:
        tokens = int(value)
    except ValueError:
        tokens = 0
    if tokens <= 0:
        raise fail(f"--max-num-batched-tokens: expected a positive integer, got {value!r}")
    return tokens


def _cache(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    if value not in CACHES:
        raise fail(f"--cache: expected one of {', '.join(CACHES)}, got {value!r}")
    return value


def _store_options(fn: Callable[..., None]) -> Callable[..., None]:
    """The store rules' options (``replay.store_rules.StorePolicy``)."""
    for decorator in reversed(
        [
            click.option(
                "--retention-interval",
                default="0",
                show_default=True,
                callback=_retention,
                metavar="N|none",
                help="vLLM's prefix_cache_retention_interval: 0 keeps only the states and "
                "sliding-window tails a replay can resume at (vLLM's default), N also one "
                "per N tokens, none all of them (dense).",
            ),
            click.option(
                "--max-num-batched-tokens",
                default="8192",
                show_default=True,
                callback=_budget,
                metavar="N",
                help="vLLM's token budget per step: the longest prefill chunk (Mamba "
                "states are kept only at chunk ends).",
            ),
            click.option(
                "--cache",
                default="mooncake",
                show_default=True,
                callback=_cache,
                metavar="|".join(CACHES),
                help="Which cache's stores to emit: the Mooncake store connector's, or the "
                "GPU block pool's BlockStored events.",
            ),
        ]
    ):
        fn = decorator(fn)
    return fn


def _policy(retention_interval: int | None, max_num_batched_tokens: int, cache: str) -> StorePolicy:
    return StorePolicy(
        retention_interval=retention_interval,
        max_num_batched_tokens=max_num_batched_tokens,
        cache=cache,
    )


_MODEL_HELP = "Model archetype: " + "; ".join(f"{a.name}: {a.models}" for a in ARCHETYPES.values())


@click.command("synth")
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(path_type=Path),
    help="Trace file to write (Parquet).",
)
@click.option("--model", required=True, type=click.Choice(list(ARCHETYPES)), help=_MODEL_HELP)
@click.option(
    "--requests",
    default=10_000,
    show_default=True,
    type=click.IntRange(min=0),
    help="Workload requests (each injected scenario adds two).",
)
@click.option("--seed", default=0, show_default=True, type=int, help="Random seed.")
@click.option(
    "--eagle/--no-eagle", default=False, show_default=True, help="EAGLE speculative decoding."
)
@click.option(
    "--capacity-blocks",
    default=None,
    type=click.IntRange(min=1),
    help="LRU store capacity in blocks across all groups [default: unbounded].",
)
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--hash-block-size",
    default=None,
    type=click.IntRange(min=1),
    help="Tokens per lookup hash [default: the block size].",
)
@click.option(
    "--inject-overrun",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Add this many #43559 scenarios (needs --eagle and a Mamba model).",
)
@click.option(
    "--clear-every",
    default=None,
    type=click.IntRange(min=1),
    help="Emit a clear event before every N-th request.",
)
@_store_options
@handles_user_errors
def synth(
    output: Path,
    model: str,
    requests: int,
    seed: int,
    eagle: bool,
    capacity_blocks: int | None,
    block_size: int,
    hash_block_size: int | None,
    inject_overrun: int,
    clear_every: int | None,
    retention_interval: int | None,
    max_num_batched_tokens: int,
    cache: str,
) -> None:
    """Generate a production-style synthetic trace, reproducible from --seed."""
    check_outputs({"-o": output}, [])
    with _progress(requests, "synth") as progress:
        summary = synth_trace(
            output,
            model=model,
            requests=requests,
            seed=seed,
            eagle=eagle,
            capacity_blocks=capacity_blocks,
            block_size=block_size,
            hash_block_size=hash_block_size,
            inject_overrun=inject_overrun,
            clear_every=clear_every,
            retention_interval=retention_interval,
            max_num_batched_tokens=max_num_batched_tokens,
            cache=cache,
            progress=progress,
        )
    click.echo(synth_summary_text(summary))


def _ingest_options(fn: Callable[..., None]) -> Callable[..., None]:
    for decorator in reversed(
        [
            click.argument("trace", type=click.Path(path_type=Path)),
            click.option(
                "-o",
                "--output",
                required=True,
                type=click.Path(path_type=Path),
                help="Trace file to write (Parquet).",
            ),
            click.option(
                "--model",
                default="full",
                show_default=True,
                type=click.Choice(list(ARCHETYPES)),
                help=_MODEL_HELP,
            ),
            click.option(
                "--block-size",
                default=16,
                show_default=True,
                type=click.IntRange(min=1),
                help="Tokens per trace block (and per lookup hash).",
            ),
            click.option("--eagle/--no-eagle", default=False, show_default=True),
            click.option(
                "--capacity-blocks",
                default=None,
                type=click.IntRange(min=1),
                help="LRU store capacity in blocks across all groups [default: unbounded].",
            ),
        ]
    ):
        fn = decorator(fn)
    return fn


def _ingest_command(format_name: str, doc: str) -> click.Command:
    @click.command(format_name, help=doc)
    @_ingest_options
    @_store_options
    @handles_user_errors
    def command(
        trace: Path,
        output: Path,
        model: str,
        block_size: int,
        eagle: bool,
        capacity_blocks: int | None,
        retention_interval: int | None,
        max_num_batched_tokens: int,
        cache: str,
    ) -> None:
        check_outputs({"-o": output}, [trace])
        summary = ingest(
            format_name,
            trace,
            output,
            model=model,
            block_size=block_size,
            eagle=eagle,
            capacity_blocks=capacity_blocks,
            policy=_policy(retention_interval, max_num_batched_tokens, cache),
        )
        click.echo(ingest_summary_text(summary))

    return command


mooncake = _ingest_command(
    "mooncake", "Import a Mooncake FAST'25 JSONL trace (512-token hash_ids)."
)
bailian = _ingest_command("bailian", "Import a Qwen bailian JSONL trace (16-token hash_ids).")
