"""Names from the file system as text every reader accepts.

A POSIX file name is bytes; Python hands names that are not UTF-8 over as
strings holding lone surrogates (``surrogateescape``), which no UTF-8 file,
JSON reader or Arrow call accepts. What a command records (a trace's
``source``, a results file's metadata) goes through :func:`readable`:
such bytes become ``\\xNN`` escapes, so the record is always readable back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def readable_name(name: str) -> str:
    """``name``, its undecodable bytes as ``\\xNN`` escapes."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raw = name.encode("utf-8", "surrogateescape")
        return raw.decode("utf-8", "backslashreplace")
    return name


def readable(value: Any) -> Any:
    """``value`` (JSON-like) with every string made :func:`readable_name`."""
    if isinstance(value, str):
        return readable_name(value)
    if isinstance(value, dict):
        return {readable(k): readable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [readable(v) for v in value]
    return value


def utf8_path(path: object) -> bool:
    """Whether Arrow can take ``path`` as a file name (it must be UTF-8)."""
    import os

    try:
        os.fsdecode(os.fspath(path)).encode("utf-8")  # type: ignore[call-overload]
    except UnicodeEncodeError:
        return False
    return True


def printable(text: str) -> str:
    """``text`` for a terminal: control characters (an escape sequence in a
    request id, a carriage return, a bell) as ``\\xNN`` escapes, so a
    user's data never drives the terminal; other text as it is."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


def edit_distance(a: str, b: str, most: int | None = None) -> int:
    """Levenshtein distance of ``a`` and ``b`` (insert, delete, substitute
    one character); past ``most`` it stops early and returns ``most + 1``."""
    if len(a) < len(b):
        a, b = b, a
    if most is not None and len(a) - len(b) > most:
        return most + 1
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
        if most is not None and min(row) > most:
            return most + 1
    return row[-1]


def nearest(
    word: str, names: Iterable[str], *, most: int = 3, within: int | None = None
) -> list[str]:
    """The ``most`` names closest to ``word`` by :func:`edit_distance`
    (ties in the order given), only those ``within`` edits when it is set."""
    best: list[tuple[int, int, str]] = []
    for order, name in enumerate(dict.fromkeys(names)):
        bound = within if len(best) < most else best[-1][0]
        if within is not None and bound is not None:
            bound = min(bound, within)
        d = edit_distance(word, name, bound)
        if (within is None or d <= within) and (len(best) < most or d < best[-1][0]):
            best.append((d, order, name))
            best.sort()
            del best[most:]
    return [name for _, _, name in best]


def close_names(word: str, names: Iterable[str]) -> list[str]:
    """The names a typo of ``word`` most likely meant: the closest by
    :func:`edit_distance`, when a few edits away (a third of its length, at
    least two); else those it begins."""
    names = list(names)
    within = max(2, len(word) // 3)
    distances = {n: edit_distance(word, n, within) for n in names}
    least = min(distances.values(), default=within + 1)
    if least <= within:
        return [n for n in names if distances[n] == least]
    return [n for n in names if len(word) >= 3 and n.startswith(word)][:3]


def did_you_mean(word: str, names: Iterable[str]) -> str:
    """The end of an unknown-name error: ``did you mean 'x'?`` when a known
    name is close (:func:`close_names`), else ``expected one of`` them all."""
    names = list(names)
    close = close_names(word, names)
    if close:
        return "did you mean " + " or ".join(repr(n) for n in close) + "?"
    return f"expected one of {', '.join(names)}"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """A count as every command's text writes one: thousands separated, the
    noun singular for exactly one (``1 lookup``, ``1,575 events``)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
