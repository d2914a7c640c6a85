"""Every ``-o`` honours its extension or refuses it: an output's format is
named by its extension (``.parquet``, ``.md``, ``.html``), or by ``--format``
where a command offers several, and a name that says another format (or
none) is refused before anything is read. ``-``, ``/dev/stdout`` and
``/dev/null`` have no extension and take the command's format."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from replay.cli.common import fail

#: What each output extension means.
PARQUET = {".parquet": "parquet"}
TEXT_REPORT = {".md": "md", ".markdown": "md", ".html": "html", ".htm": "html"}
NAMES = {"parquet": "Parquet", "md": "Markdown", "html": "HTML"}
_NO_EXTENSION = ("-", "/dev/stdout", os.devnull)


def output_format(
    option: str,
    path: Path | None,
    formats: Mapping[str, str],
    *,
    given: str | None = None,
    default: str,
) -> str:
    """The format ``path`` is written in: ``given`` (``--format``) or the one
    its extension names, else ``default`` for a path without one of its own
    (standard output, /dev/null, no ``-o``). Refused: an extension that names
    no format of the command, or another format than ``given``."""
    if path is None or str(path) in _NO_EXTENSION:
        return given or default
    ext = path.suffix.lower()
    choices = ", ".join(f"{e} ({NAMES[f]})" for e, f in formats.items())
    named = formats.get(ext)
    if named is None:
        raise fail(
            f"{option} {path}: {'no extension' if not ext else f'{ext} is not an extension'} "
            f"this command writes; name it with one of {choices}"
        )
    if given is not None and given != named:
        want = next(e for e, f in formats.items() if f == given)
        raise fail(
            f"{option} {path}: a {ext} name for {NAMES[given]} (--format {given}); "
            f"name it {path.with_suffix(want).name} or drop --format"
        )
    return named
