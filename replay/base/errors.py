"""The project's error types, and the registries an unknown name is an error of.

Every error a user's input can trigger is a ``ReplayError`` whose message is
one line naming the file, the row (``seq``) or column, and what was expected.
The CLI turns them into exit status 2 without a traceback.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class ReplayError(Exception):
    """A user-facing error: bad input, bad configuration, bad request.

    The library words it in its own terms: a parameter (or the environment
    variable of a limit) in backquotes, `page_bytes`; a face rewords those
    into its own (``worded``): the CLI into its flags, the pytest plugin
    into its options."""


def worded(message: str, names: Mapping[str, str]) -> str:
    """``message`` with each backquoted parameter that ``names`` knows
    replaced by the face's word for it (the others left as they are)."""
    return re.sub(r"`([A-Za-z_][\w.]*)`", lambda m: names.get(m[1], m[0]), message)


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """An entry of a registry (a policy, a cache): chosen by name on the
    command line, described in ``--help``."""

    name: str
    description: str


N = TypeVar("N", bound=Entry)


def by_name(*items: N) -> dict[str, N]:
    """A registry (policies, caches) keyed by each entry's name, in order."""
    return {item.name: item for item in items}


def named(registry: Mapping[str, T], name: str, what: str) -> T:
    """``registry[name]``, or the one-line error naming the close names
    (``did you mean``), else every known one."""
    try:
        return registry[name]
    except KeyError:
        from replay.base.text import did_you_mean

        raise ReplayError(f"unknown {what} {name!r}, {did_you_mean(name, registry)}") from None


class ConfigError(ReplayError):
    """A KV-cache configuration that vLLM would reject."""


class TraceError(ReplayError):
    """A trace or results file that does not follow format v1."""


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived (SIGINT is ``KeyboardInterrupt``). A
    ``BaseException`` like ``KeyboardInterrupt``: only cleanup code sees it,
    and the CLI exits with status 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
