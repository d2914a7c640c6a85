"""The ``replay`` command line: click only. Each command parses options,
calls the library and prints what ``replay.tools.render`` words; library errors
become one line on stderr and exit status 2 (``replay.cli.common``).

One module per command group:

- ``inspect``: validate, info, state (what a trace holds)
- ``run``: run, check, explain, minimize (replay a trace and read its flags)
- ``analysis``: diff, report (compare replays, write reports)
- ``sources``: record and every ``ingest`` importer (traces from elsewhere)
- ``synth``: synth (synthetic traces)
- ``whatif``: whatif (other cache sizes and eviction orders)
- ``scale``: split, cat, and ``run --workers/--ray`` (beyond one file, one process)

and what they share: ``common`` (the error and signal rules), ``options``
(options several commands take), ``progress`` (the progress display).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from replay.base.limits import HASH_BYTES, LIMITS, MAX_HASH_BYTES
from replay.base.units import INT64_MAX
from replay.cli import analysis, guard, inspect, run, scale, sources, synth, watch, whatif
from replay.cli.common import Group, limit_flag, run_main
from replay.cli.options import count_type

# The sections of `replay --help`, in the order a user meets them.
SECTIONS: tuple[tuple[str, tuple[click.Command, ...]], ...] = (
    ("Inspect a trace", (inspect.validate, inspect.info, inspect.state, inspect.repair)),
    ("Replay and check", (run.run, run.check, run.explain, run.minimize)),
    ("Guard vLLM", (guard.test, watch.watch)),
    ("Compare and report", (analysis.diff, analysis.bisect, analysis.report, whatif.whatif)),
    ("Make a trace", (sources.record, sources.ingest, synth.synth)),
    ("Traces in several files", (scale.split, scale.cat)),
)


def _show_version(ctx: click.Context, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from replay import __version__

    click.echo(f"replay, version {__version__}")
    ctx.exit()


class _Replay(Group):
    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Every command, a group's with each of its own, with the whole
        first sentence of its help."""
        for title, commands in SECTIONS:
            rows: list[tuple[str, str]] = []
            for cmd in commands:
                subs = cmd.commands.values() if isinstance(cmd, click.Group) else [cmd]
                for sub in subs:
                    name = f"{cmd.name} {sub.name}" if sub is not cmd else str(cmd.name)
                    rows.append((name, sub.get_short_help_str(limit=1000)))
            with formatter.section(title):
                formatter.write_dl(rows)


def _set_limit(ctx: click.Context, param: click.Parameter, value: int | None) -> None:
    """A limit option: in the environment for this command (and the worker
    processes it starts), restored when it ends."""
    if value is None:
        return
    limit = next(lim for lim in LIMITS if limit_flag(lim) == param.opts[0])
    before = os.environ.get(limit.env)
    os.environ[limit.env] = str(value)

    def restore() -> None:
        if before is None:
            os.environ.pop(limit.env, None)
        else:
            os.environ[limit.env] = before

    ctx.call_on_close(restore)


def _limit_options(fn: Any) -> Any:
    for limit in reversed(LIMITS):
        fn = click.option(
            limit_flag(limit),
            type=count_type(1, MAX_HASH_BYTES if limit is HASH_BYTES else INT64_MAX),
            default=None,
            expose_value=False,
            is_eager=True,
            callback=_set_limit,
            metavar="N",
            help=f"Refuse inputs with more {limit.what} [default: {limit.default:,}].",
        )(fn)
    return fn


@click.group(cls=_Replay, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=lambda ctx, _param, value: _show_version(ctx, value),
    help="Show the version and exit.",
)
@_limit_options
def cli() -> None:
    """Replay KV-cache block events through vLLM's hybrid prefix-cache
    coordinator and flag every lookup whose hit is wrong.

    A trace is a Parquet event log (store / remove / clear / lookup rows,
    format v1). `replay run TRACE` replays it and writes a results file;
    `replay check` exits 1 when any lookup is flagged (for CI); `replay
    explain` shows how one request's hit was decided.
    """
    # A file name that is not UTF-8 is printed as the bytes it is, never a
    # UnicodeEncodeError in a UTF-8 terminal.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="surrogateescape")


for _title, _commands in SECTIONS:
    for _command in _commands:
        cli.add_command(_command)


def main() -> None:
    """The ``replay`` console script and ``python -m replay``."""
    run_main(cli, "replay")
