"""The project's error types.

Every error a user's input can trigger is a ``ReplayError`` whose message is
one line naming the file, the row (``seq``) or column, and what was expected.
The CLI turns them into exit status 2 without a traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


class ReplayError(Exception):
    """A user-facing error: bad input, bad configuration, bad request."""


def named(registry: Mapping[str, T], name: str, what: str) -> T:
    """``registry[name]``, or the one-line error listing the known names."""
    try:
        return registry[name]
    except KeyError:
        raise ReplayError(
            f"unknown {what} {name!r}, expected one of {', '.join(registry)}"
        ) from None


class ConfigError(ReplayError):
    """A KV-cache configuration that vLLM would reject."""


class TraceError(ReplayError):
    """A trace or results file that does not follow format v1."""
