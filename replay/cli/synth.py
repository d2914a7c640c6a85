"""``replay synth``: a production-style synthetic trace
(``replay.sources.synth``), reproducible from its seed."""

from __future__ import annotations

from pathlib import Path

import click

from replay.cli.common import command
from replay.cli.options import (
    CAPACITY_BLOCKS,
    LOOKAHEAD_TOKENS,
    MODEL_HELP,
    SEED,
    SIZE_LIMIT,
    Names,
    count_option,
    output_option,
    store_options,
    store_settings,
)
from replay.cli.progress import progress_bar
from replay.format.paths import PARQUET, check_outputs
from replay.sources.archetypes import ARCHETYPES
from replay.tools.render import synth_summary_text


@command("synth")
@output_option("Trace file to write (Parquet).", required=True)
@click.option("--model", required=True, type=Names(ARCHETYPES, "model"), help=MODEL_HELP)
@count_option(
    "--requests",
    default=10_000,
    most=10**9,
    help="Workload requests (each injected scenario adds two).",
)
@click.option(
    "--seed", default=0, show_default=True, type=SEED, help="Random seed (0 to 2**64 - 1)."
)
@click.option(
    "--eagle/--no-eagle", default=False, show_default=True, help="EAGLE speculative decoding."
)
@LOOKAHEAD_TOKENS
@CAPACITY_BLOCKS
@count_option("--block-size", default=16, least=1, most=SIZE_LIMIT)
@count_option(
    "--hash-block-size",
    least=1,
    most=SIZE_LIMIT,
    help="Tokens per lookup hash [default: the block size].",
)
@count_option(
    "--inject-overrun",
    default=0,
    most=10**6,
    help="Add this many #43559 scenarios (needs --eagle and a Mamba model).",
)
@count_option("--clear-every", least=1, help="Emit a clear event before every N-th request.")
@store_options
def synth(
    output: Path,
    model: str,
    requests: int,
    seed: int,
    eagle: bool,
    lookahead_tokens: int,
    capacity_blocks: int | None,
    block_size: int,
    hash_block_size: int | None,
    inject_overrun: int,
    clear_every: int | None,
    retention_interval: int | str | None,
    max_num_batched_tokens: int,
    cache: str,
    policy: str | None,
    vllm_version: str | None,
) -> None:
    """Generate a production-style synthetic trace, reproducible from --seed."""
    from replay.sources.synth import synth_trace

    settings = store_settings(
        retention_interval, max_num_batched_tokens, cache, policy, vllm_version
    )

    check_outputs({"-o": output}, [], formats={"-o": PARQUET})
    with progress_bar() as bar:
        summary = synth_trace(
            output,
            model=model,
            requests=requests,
            seed=seed,
            eagle=eagle,
            lookahead_tokens=lookahead_tokens,
            capacity_blocks=capacity_blocks,
            block_size=block_size,
            hash_block_size=hash_block_size,
            inject_overrun=inject_overrun,
            clear_every=clear_every,
            settings=settings,
            progress=None if bar is None else bar.steps("requests", requests),
        )
    click.echo(synth_summary_text(summary))
