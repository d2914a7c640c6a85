"""``replay record`` and ``replay ingest``: traces from elsewhere. Click
only, the work is in ``replay.sources``: a live vLLM KV-event stream, its
raw dumps, a lookup log merged into a trace, and the public Mooncake and
bailian traces."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from replay.base.text import counted
from replay.cli.common import command, exit_on_signal, fail, group
from replay.cli.options import (
    CAPACITY_BLOCKS,
    LOOKAHEAD_TOKENS,
    MODEL_HELP,
    SIZE_LIMIT,
    Names,
    count_option,
    output_option,
    seconds_type,
    segment_type,
    store_options,
    store_settings,
)
from replay.cli.progress import progress_bar
from replay.format.paths import KV_DUMP, PARQUET, check_outputs
from replay.sources.archetypes import ARCHETYPES
from replay.tools.render import ingest_summary_text, record_summary_text, recorded_text

if TYPE_CHECKING:
    from replay.base.spec import TraceConfig

F = TypeVar("F", bound=Callable[..., Any])

TRACE_OUTPUT = output_option("The trace to write (Parquet).", required=True, metavar="TRACE")


def config_options(func: F) -> F:
    """``--config FILE`` / ``--block-size N``: the KV-cache config of a trace."""
    func = count_option(
        "--block-size",
        least=1,
        most=SIZE_LIMIT,
        help="Instead of --config: one full-attention group with blocks of N tokens.",
    )(func)
    func = click.option(
        "--config",
        "config_path",
        metavar="FILE",
        help="KV-cache config: a JSON file holding the replay.trace metadata object "
        "(or a trace whose config to reuse).",
    )(func)
    return func


def _optional_config(
    config_path: str | None, block_size: int | None, lookups: str | None
) -> TraceConfig | None:
    """The config from the options; none given and ``--lookups`` named: the
    plugin's engine facts are the config (checked where they are read)."""
    if config_path is None and block_size is None and lookups is not None:
        return None
    from replay.sources.kv_config import load_config

    return load_config(config_path, block_size)


def _medium_option(func: F) -> F:
    return click.option(
        "--medium",
        "media",
        multiple=True,
        metavar="TIER",
        help="Keep only events of this storage tier (repeatable; GPU, CPU, ...; "
        "case-insensitive, no medium = GPU). Default: every tier.",
    )(func)


def _seconds(name: str, default: float, help: str) -> Callable[[F], F]:
    """A positive number of seconds, its default shown."""
    return click.option(
        name,
        type=seconds_type(most=3600),
        default=default,
        show_default=True,
        metavar="SECONDS",
        help=help,
    )


def _say(message: str) -> None:
    click.echo(message, err=True)


@command()
@click.option(
    "--endpoint",
    required=True,
    help="The publisher's ZMQ endpoint, e.g. tcp://host:5557 (vLLM's kv_events_config.endpoint).",
)
@click.option(
    "--replay-endpoint",
    help="The publisher's replay endpoint (kv_events_config.replay_endpoint), to fill gaps.",
)
@click.option("--topic", default="", show_default=True, help="Topic prefix to subscribe to.")
@click.option(
    "--bind/--connect",
    default=None,
    help="Bind the SUB socket (vLLM's endpoint names a concrete host: its publisher "
    "connects) or connect to it (vLLM's endpoint has '*' or '::': it binds). Default: bind "
    "when --endpoint itself has '*' or '::', else connect.",
)
@click.option(
    "--lookups",
    metavar="ENDPOINT",
    help="The vLLM plugin's lookup stream (REPLAY_LOOKUPS=tcp://HOST:PORT on the vLLM side): "
    "every lookup goes in its exact place with the hit vLLM gave it; the plugin's engine "
    "facts replace --config.",
)
@output_option(
    required=True,
    metavar="DIR|TRACE.parquet",
    help="Where to record: a new (or empty) directory is written as closed segments "
    "(a kill loses only the open one; every command reads the directory as one trace); "
    "a .parquet name is one file, complete only once the recording ends.",
)
@click.option(
    "--segment",
    type=segment_type(),
    metavar="SECONDS|Nevents",
    help="Close a segment of -o DIR this often: a duration (60, 30s, 10m) or a number of "
    "events (10000events). Default: 60s.",
)
@config_options
@_medium_option
@count_option("--max-batches", least=1, help="Stop once N batches (sequence numbers) were taken.")
@click.option(
    "--duration",
    type=seconds_type(),
    metavar="SECONDS",
    help="Stop after this many seconds.",
)
@click.option(
    "--dump",
    metavar="FILE",
    help="Also write the raw frames there (`replay ingest kv-events FILE` reads it).",
)
@_seconds(
    "--connect-timeout",
    10.0,
    "Give up (exit 2, no trace written) when no KV event arrives within this time.",
)
@_seconds("--replay-timeout", 2.0, "How long to wait for each replay reply.")
def record(
    endpoint: str,
    replay_endpoint: str | None,
    topic: str,
    bind: bool | None,
    lookups: str | None,
    output: Path,
    config_path: str | None,
    block_size: int | None,
    media: tuple[str, ...],
    max_batches: int | None,
    duration: float | None,
    dump: str | None,
    connect_timeout: float,
    replay_timeout: float,
    segment: tuple[float | None, int | None] | None,
) -> None:
    """Record a live vLLM KV-event stream into a trace.

    -o DIR writes closed segments every --segment (60 s by default): after a
    kill -9, an out-of-memory kill or a power loss every closed segment is
    readable and `replay run DIR` replays them. Stops on Ctrl-C / SIGTERM
    (closing the open segment, or the file), after --max-batches or after
    --duration. Gaps are filled from --replay-endpoint; what cannot be
    filled is reported and listed in the trace's source metadata. Ends with
    the KV events, lookups and gaps received. No KV event within
    --connect-timeout, or none at all by the end: exit status 2 and no trace.
    """
    from replay.format.segments import DEFAULT_SEGMENT_SECONDS
    from replay.sources.kv_config import GroupMismatch
    from replay.sources.record import EmptyRecording, segmented, stop_on_signals
    from replay.sources.record import record as record_stream

    if segmented(output):
        check_outputs(
            {"--dump": dump}, [config_path], formats={"--dump": KV_DUMP}, directories={"-o": output}
        )
    else:
        if segment is not None:
            raise fail(
                f"--segment: -o {output} is one file; name a directory "
                f"(e.g. -o {Path(output).with_suffix('')}) to record segments"
            )
        check_outputs(
            {"-o": output, "--dump": dump},
            [config_path],
            formats={"-o": PARQUET, "--dump": KV_DUMP},
        )
    segment_seconds, segment_events = segment or (DEFAULT_SEGMENT_SECONDS, None)
    config = _optional_config(config_path, block_size, lookups)
    stop = threading.Event()
    with progress_bar() as bar, stop_on_signals(stop) as received:
        say = _say if bar is None else bar.note
        try:
            summary = record_stream(
                endpoint=endpoint,
                output=output,
                config=config,
                replay_endpoint=replay_endpoint,
                topic=topic,
                bind=bind,
                lookups=lookups,
                max_batches=max_batches,
                duration=duration,
                dump=dump,
                media=media or None,
                replay_timeout=replay_timeout,
                connect_timeout=connect_timeout,
                segment_seconds=segment_seconds,
                segment_events=segment_events,
                stop=stop,
                announce=say,
                report=say,
                progress=None if bar is None else bar.status,
            )
        except GroupMismatch as exc:
            hint = (
                f"; the raw frames are in {dump}: `replay ingest kv-events {dump} --config ...`"
                if dump is not None
                else ""
            )
            raise fail(f"{exc}{hint}") from None
        except EmptyRecording as exc:
            if received:  # a signal ended a recording that heard nothing
                _say(str(exc))
                raise exit_on_signal(received[0]) from None
            raise fail(str(exc)) from None
    _say(recorded_text(summary, output))
    if received:
        # The trace is complete and valid; the status still says a signal ended it.
        raise exit_on_signal(received[0])


@group()
def ingest() -> None:
    """Import traces from other formats."""


@ingest.command("kv-events")
@click.argument("files", nargs=-1, required=True, metavar="DUMP...")
@TRACE_OUTPUT
@config_options
@_medium_option
@click.option(
    "--lookups",
    metavar="FILE",
    help="The vLLM plugin's lookup file (REPLAY_LOOKUPS=PATH): every lookup in its exact "
    "place, and its engine facts replace --config; or a JSONL lookup log, merged in by time "
    "(as `replay ingest merge` does).",
)
def ingest_kv_events(
    files: tuple[str, ...],
    output: Path,
    config_path: str | None,
    block_size: int | None,
    media: tuple[str, ...],
    lookups: str | None,
) -> None:
    """Build a trace from raw dumps written by `replay record --dump`.

    Several dumps are read in the order given, as one stream.
    """
    from replay.sources.record import ingest_dumps

    # What the import reports (skipped messages, gaps, a torn last record) is
    # shown once it succeeded: a failed import is its one error line.
    notes: list[str] = []
    check_outputs({"-o": output}, [*files, lookups, config_path], formats={"-o": PARQUET})
    config = _optional_config(config_path, block_size, lookups)
    summary = ingest_dumps(
        list(files), output, config, media=media or None, lookups=lookups, report=notes.append
    )
    for note in notes:
        _say(note)
    _say(f"wrote {output}: {record_summary_text(summary)}")


@ingest.command("merge")
@click.argument("trace", metavar="TRACE")
@click.argument("lookups", metavar="LOOKUPS.jsonl")
@TRACE_OUTPUT
def ingest_merge(trace: str, lookups: str, output: Path) -> None:
    """Merge a lookup log (JSONL) into a trace by time.

    One JSON object per line: request_id, ts (seconds or ISO 8601),
    block_hashes (unsigned 64-bit integers or hex strings, one per
    hash_block_size tokens), max_length (or num_tokens, giving
    num_tokens - 1), and optionally num_tokens and observed_hit_tokens.
    """
    from replay.sources.lookup_log import merge_lookups

    check_outputs({"-o": output}, [trace, lookups], formats={"-o": PARQUET})
    summary = merge_lookups(trace, lookups, output)
    _say(
        f"wrote {output}: {counted(summary.events, 'event')}, "
        f"{counted(summary.lookups, 'lookup')} merged"
    )


def _importer(format_name: str, doc: str) -> click.Command:
    """``replay ingest FORMAT``: one of ``replay.sources.mooncake``'s formats."""

    @ingest.command(format_name, help=doc)
    @click.argument("trace", type=click.Path(path_type=Path))
    @output_option("Trace file to write (Parquet).", required=True)
    @click.option(
        "--model",
        default="full",
        show_default=True,
        type=Names(ARCHETYPES, "model"),
        help=MODEL_HELP,
    )
    @count_option(
        "--block-size",
        default=16,
        least=1,
        most=SIZE_LIMIT,
        help="Tokens per trace block (and per lookup hash).",
    )
    @click.option("--eagle/--no-eagle", default=False, show_default=True)
    @LOOKAHEAD_TOKENS
    @CAPACITY_BLOCKS
    @store_options
    def command(
        trace: Path,
        output: Path,
        model: str,
        block_size: int,
        eagle: bool,
        lookahead_tokens: int,
        capacity_blocks: int | None,
        retention_interval: int | str | None,
        max_num_batched_tokens: int,
        cache: str,
        policy: str | None,
        vllm_version: str | None,
    ) -> None:
        from replay.sources.mooncake import ingest as run_ingest

        check_outputs({"-o": output}, [trace], formats={"-o": PARQUET})
        with progress_bar() as bar:
            summary = run_ingest(
                format_name,
                trace,
                output,
                model=model,
                block_size=block_size,
                eagle=eagle,
                lookahead_tokens=lookahead_tokens,
                capacity_blocks=capacity_blocks,
                store_settings=store_settings(
                    retention_interval, max_num_batched_tokens, cache, policy, vllm_version
                ),
                progress=None if bar is None else bar.steps("rows"),
            )
        click.echo(ingest_summary_text(summary))

    return command


mooncake = _importer("mooncake", "Import a Mooncake FAST'25 JSONL trace (512-token hash_ids).")
bailian = _importer("bailian", "Import a Qwen bailian JSONL trace (16-token hash_ids).")
