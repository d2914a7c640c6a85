"""The signal handler for a process with nothing to clean up: the console
script sets it before the command line is imported, and the CLI sets it again
once a command's output is complete (replay.cli.common)."""

from __future__ import annotations

import os
from types import FrameType


def exit_now(signum: int, frame: FrameType | None) -> None:
    """A signal handler for when there is nothing to clean up: 128 + signum."""
    os._exit(128 + signum)
