"""The console script's first code: signals are set before the command line
is imported (polars, pyarrow and the rest take a while to load), so a
signal at any moment ends the process with 128 + its number. Nothing can
have been written yet, so there is nothing to clean up either."""

from __future__ import annotations

import signal

from replay.base.signals import exit_now


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, exit_now)
    from replay.cli import main as run

    run()
