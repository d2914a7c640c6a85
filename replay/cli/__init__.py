"""The ``replay`` command line: click only. Each command parses options,
calls the library and prints what ``replay.tools.render`` words; library errors
become one line on stderr and exit status 2 (``replay.cli.common``).

One module per command group:

- ``inspect``: validate, info, state (what a trace holds)
- ``run``: run, check, explain, minimize (replay a trace and read its flags)
- ``analysis``: diff, report (compare replays, write reports)
- ``sources``: record and every ``ingest`` importer (traces from elsewhere)
- ``synth``: synth (synthetic traces)
- ``whatif``: whatif (other cache sizes and eviction policies)
- ``scale``: split, cat, and ``run --workers/--ray`` (beyond one file, one process)

and what they share: ``common`` (the error and signal rules), ``options``
(options several commands take), ``progress`` (the progress display).
"""

from __future__ import annotations

import click

from replay import __version__
from replay.cli import analysis, inspect, run, scale, sources, synth, whatif
from replay.cli.common import Group, run_main

# The sections of `replay --help`, in the order a user meets them.
SECTIONS: tuple[tuple[str, tuple[click.Command, ...]], ...] = (
    ("Inspect a trace", (inspect.validate, inspect.info, inspect.state)),
    ("Replay and check", (run.run, run.check, run.explain, run.minimize)),
    ("Compare and report", (analysis.diff, analysis.bisect, analysis.report, whatif.whatif)),
    ("Make a trace", (sources.record, sources.ingest, synth.synth)),
    ("Traces in several files", (scale.split, scale.cat)),
)


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


@click.group(cls=_Replay, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="replay")
def cli() -> None:
    """Replay KV-cache block events through vLLM's hybrid prefix-cache
    coordinator and flag every lookup whose hit is wrong.

    A trace is a Parquet event log (store / remove / clear / lookup rows,
    format v1). `replay run TRACE` replays it and writes a results file;
    `replay check` exits 1 when any lookup is flagged (for CI); `replay
    explain` shows how one request's hit was decided.
    """


for _title, _commands in SECTIONS:
    for _command in _commands:
        cli.add_command(_command)


def main() -> None:
    """The ``replay`` console script and ``python -m replay``."""
    run_main(cli, "replay")
