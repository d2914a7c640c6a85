"""``replay validate``, ``replay info`` and ``replay state``: what a trace
holds, without replaying its lookups."""

from __future__ import annotations

from pathlib import Path

import click

from replay.base.text import counted
from replay.cli.common import command, fail
from replay.cli.options import TRACE, count_option, integer_type, output_option
from replay.cli.sources import config_options
from replay.tools.render import group_label, info_lines, validate_line


@command()
@TRACE
def validate(trace: Path) -> None:
    """Check TRACE against format v1; print ok and the counts, or the first problem."""
    from replay.analysis.summary import trace_info

    click.echo(validate_line(trace, trace_info(trace)))


@command()
@click.argument("file", type=click.Path(path_type=Path))
@output_option("The trace file to write (new; FILE is never changed).", required=True)
@config_options
def repair(file: Path, output: Path, config_path: str | None, block_size: int | None) -> None:
    """Salvage the complete row groups of a trace file cut short (a recorder
    killed before it wrote the footer, a copy cut short) into a valid trace.

    The footer held the trace's config: --config or --block-size give it,
    else a complete trace beside FILE does (the closed segments of the
    recording whose open segment FILE was)."""
    from replay.format.repair import repair_trace

    config = None
    if config_path is not None or block_size is not None:
        from replay.sources.kv_config import load_config

        config = load_config(config_path, block_size)
    done = repair_trace(file, output, config)
    bytes_said = (
        f"{done.kept_bytes:,} of {done.file_bytes:,} bytes; the rest was cut short"
        if done.kept_bytes < done.file_bytes
        else f"all {done.file_bytes:,} bytes; only the footer was missing"
    )
    click.echo(
        f"{file} -> {output}: kept {done.rows:,} rows in {done.row_groups:,} complete row "
        f"group{'s' if done.row_groups != 1 else ''} ({bytes_said})"
    )


@command()
@TRACE
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--requests",
    is_flag=True,
    help="Instead: every lookup's seq and request_id, one per line (what explain "
    "--request and --seq take).",
)
def info(trace: Path, as_json: bool, requests: bool) -> None:
    """KV-cache groups and config, event counts, time span, distinct keys, lookups."""
    from replay.analysis.summary import trace_info
    from replay.rules.coordinator import resolve_cache

    if requests:
        if as_json:
            raise fail("--requests and --json: give one")
        from replay.base.text import printable
        from replay.format.tracedir import open_trace

        for frame in open_trace(trace).iter_frames(["kind", "seq", "request_id"]):
            for seq, request_id in (
                frame.filter(frame["kind"] == "lookup").select("seq", "request_id").iter_rows()
            ):
                click.echo(f"{seq}\t{printable(request_id or '')}")
        return
    data = trace_info(trace)
    if as_json:
        from replay.cli import payloads

        payloads.echo("info", payloads.info(data))
        return
    from replay.base.spec import TraceConfig

    config = TraceConfig.from_json(data["config"])
    # The cache the trace's events describe, which replays answer by default.
    for line in info_lines(trace, data, config, resolve_cache(config, None)):
        click.echo(line)


@command()
@TRACE
@click.option(
    "--at",
    "at",
    type=integer_type(),
    default=None,
    help="A seq: the state a lookup at SEQ sees (every event before it). Default: the end of the trace.",
)
@click.option("--group", "group", type=integer_type(), default=None, help="Only this group_id.")
@output_option("Write the keys as Parquet (group_id int32, hash binary).")
@count_option("--show", default=5, help="Keys to print per group.")
def state(trace: Path, at: int | None, group: int | None, output: Path | None, show: int) -> None:
    """Present (group_id, hash) keys at a point of the log."""
    from replay.engine.replay import state_at
    from replay.format.paths import PARQUET, check_outputs

    check_outputs({"-o": output}, [trace], formats={"-o": PARQUET})
    config, store = state_at(trace, at)
    if group is not None and not 0 <= group < config.num_groups:
        raise fail(f"--group {group}: the trace has groups 0..{config.num_groups - 1}")
    groups = [group] if group is not None else list(range(config.num_groups))
    where = f"before seq {at}" if at is not None else "at the end of the trace"
    click.echo(f"state {where}: {trace}")
    for gid in groups:
        keys = sorted(store.keys(gid))
        click.echo(f"group {group_label(config, gid)}: {counted(len(keys), 'key')}")
        for key in keys[:show]:
            click.echo(f"  {key.hex()}")
        if len(keys) > show:
            click.echo(f"  … {len(keys) - show:,} more")
    if output is not None:
        from replay.format.writer import write_keys

        n = write_keys(output, [(gid, sorted(store.keys(gid))) for gid in groups])
        click.echo(f"wrote {counted(n, 'key')} to {output}")
