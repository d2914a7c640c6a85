"""Names from the file system as text every reader accepts.

A POSIX file name is bytes; Python hands names that are not UTF-8 over as
strings holding lone surrogates (``surrogateescape``), which no UTF-8 file,
JSON reader or Arrow call accepts. What a command records (a trace's
``source``, a results file's metadata) goes through :func:`readable`:
such bytes become ``\\xNN`` escapes, so the record is always readable back.
"""

from __future__ import annotations

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
