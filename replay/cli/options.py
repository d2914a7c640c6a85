"""The options and arguments more than one command takes, declared once."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import click

from replay.cli.common import fail
from replay.rules.coordinator import CACHES
from replay.sources.archetypes import ARCHETYPES

F = TypeVar("F", bound=Callable[..., Any])

TRACE = click.argument("trace", type=click.Path(path_type=Path))


def output_option(help: str, *, required: bool = False) -> Callable[[F], F]:
    """``-o/--output PATH``, the file (or directory) a command writes."""
    return click.option(
        "-o", "--output", type=click.Path(path_type=Path), required=required, help=help
    )


def count_option(
    name: str, *, default: int | None = None, least: int = 0, **attrs: Any
) -> Callable[[F], F]:
    """An integer option of at least ``least``, its default shown when it has one."""
    return click.option(
        name,
        type=click.IntRange(min=least),
        default=default,
        show_default=default is not None,
        **attrs,
    )


def repeated_choice(name: str, dest: str, choices: Iterable[str], help: str) -> Callable[[F], F]:
    """An option given any number of times, each one of ``choices``; the
    command gets them as the tuple ``dest``."""
    return click.option(name, dest, type=click.Choice(list(choices)), multiple=True, help=help)


CAPACITY_BLOCKS = count_option(
    "--capacity-blocks",
    least=1,
    help="LRU store capacity in blocks across all groups [default: unbounded].",
)

MODEL_HELP = "Model archetype: " + "; ".join(f"{a.name}: {a.models}" for a in ARCHETYPES.values())


def retention_interval(text: str) -> int | None:
    """``--retention-interval N|none``: vLLM's prefix_cache_retention_interval."""
    if text.strip().lower() == "none":
        return None
    try:
        interval = int(text)
    except ValueError:
        interval = -1
    if interval < 0:
        raise fail(f"--retention-interval: expected an integer >= 0 or 'none', got {text!r}")
    return interval


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


def store_options(fn: F) -> F:
    """The store rules' options of a trace source (``replay.rules.store_rules.StorePolicy``)."""
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
