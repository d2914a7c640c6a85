"""Which flags fail a check: ``--fail-on`` and ``--ignore``, as ruff's
``--select`` and ``--ignore``. One pure function, :func:`select_flags`, that
``replay check``, the pytest plugin and ``replay test`` share.

``--fail-on`` names severities (``corruption``, ``inconsistent``,
``performance``, ``observed``), flags (``mamba_overrun``) or ``all``,
comma-separated; ``--ignore`` names flags or severities, taken away from
what ``--fail-on`` selected. The default fails on ``corruption``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from replay.analysis.flags import FLAG_KINDS, SEVERITIES, severity
from replay.base.errors import ReplayError
from replay.base.text import close_names, did_you_mean

DEFAULT_FAIL_ON = ("corruption",)


def _names(option: str, given: str | Iterable[str] | None) -> list[str]:
    if given is None:
        return []
    items = given.split(",") if isinstance(given, str) else [p for g in given for p in g.split(",")]
    names = [n.strip() for n in items if n.strip()]
    known = ("all", *SEVERITIES, *FLAG_KINDS)
    for n in names:
        if n not in known:
            if close_names(n, known):
                raise ReplayError(
                    f"{option}: unknown flag or severity {n!r}, {did_you_mean(n, known)}"
                )
            raise ReplayError(
                f"{option}: unknown flag or severity {n!r}, expected a comma-separated list of "
                f"{', '.join(known)}"
            )
    return names


def _expand(names: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for n in names:
        if n == "all":
            out |= set(FLAG_KINDS)
        elif n in SEVERITIES:
            out |= {f for f in FLAG_KINDS if severity(f) == n}
        else:
            out.add(n)
    return out


def select_flags(
    fail_on: str | Iterable[str] | None = None, ignore: str | Iterable[str] | None = None
) -> frozenset[str]:
    """The flags that fail: those ``fail_on`` names (default: every
    ``corruption`` flag) minus those ``ignore`` names. Each argument is a
    comma-separated string or several of them; an unknown name is an error
    that lists the known ones."""
    chosen = _names("--fail-on", fail_on) or list(DEFAULT_FAIL_ON)
    return frozenset(_expand(chosen) - _expand(_names("--ignore", ignore)))


def failing(counts: Mapping[str, int], selected: frozenset[str]) -> dict[str, int]:
    """The part of per-flag ``counts`` that fails under ``selected``."""
    return {f: n for f, n in counts.items() if n and f in selected}


def selection_text(fail_on: str | Iterable[str] | None, ignore: str | Iterable[str] | None) -> str:
    """The selection as the options that give it: ``--fail-on corruption``."""
    text = "--fail-on " + ",".join(_names("--fail-on", fail_on) or DEFAULT_FAIL_ON)
    ignored = _names("--ignore", ignore)
    return text + (" --ignore " + ",".join(ignored) if ignored else "")
