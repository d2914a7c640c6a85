"""How a results file leads back to its trace: the trace's path relative to
the results file (so a folder of both can move together), its absolute path
(so the results alone can be copied elsewhere on the machine) and a
fingerprint of the trace, kept in the results' ``replay.results`` metadata
as ``trace_path``, ``trace_abspath`` and ``trace_fingerprint``. Commands that take a results file
where they replay or explain a trace (``explain``, ``report``, ``diff``,
``minimize``) follow it with :func:`trace_of`, and refuse a trace whose
fingerprint is not the one recorded.

The fingerprint is a SHA-256 over each file's size and its last 64 KiB,
which hold the Parquet footer (schema, metadata, every row group's offsets
and statistics): any rewrite of the events changes it, and a trace of
gigabytes is fingerprinted in milliseconds. A trace directory's files are
taken in name order."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import polars as pl

from replay.base.errors import ReplayError
from replay.format.results import is_results_file, results_info, write_results
from replay.format.tracedir import trace_files

_TAIL = 64 * 1024


def fingerprint(trace: str | os.PathLike[str]) -> str:
    """``sha256:HEX`` of a trace file or directory (module docstring)."""
    path = Path(trace)
    files = trace_files(path) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name if path.is_dir() else ''}:{size}:".encode())
        with f.open("rb") as fh:
            fh.seek(max(size - _TAIL, 0))
            digest.update(fh.read())
    return "sha256:" + digest.hexdigest()


def link(trace: str | os.PathLike[str], results: str | os.PathLike[str]) -> dict[str, str]:
    """The metadata that leads ``results`` back to ``trace``; nothing when
    the trace is no file (read from a stream) or the results go nowhere a
    path can lead from (``/dev/null``)."""
    path, out = Path(trace), Path(results)
    if not path.exists() or not out.parent.is_dir() or str(out) == os.devnull:
        return {}
    where = os.path.relpath(path.resolve(), out.resolve().parent)
    return {
        "trace_path": Path(where).as_posix(),
        "trace_abspath": str(path.resolve()),
        "trace_fingerprint": fingerprint(path),
    }


def linked_trace(
    results: str | os.PathLike[str], info: Mapping[str, Any], *, missing_ok: bool = False
) -> Path | None:
    """The trace ``results`` lead to (relative to the results file, else at
    its absolute path), checked against its fingerprint; None when the
    results do not record one (or, with ``missing_ok``, when it is not
    there)."""
    rel = info.get("trace_path")
    if not isinstance(rel, str) or not rel:
        return None
    path = Path(os.path.normpath(Path(results).parent / rel))
    absolute = info.get("trace_abspath")
    if not path.exists() and isinstance(absolute, str) and Path(absolute).exists():
        path = Path(absolute)
    if not path.exists() and missing_ok:
        return None
    if not path.exists():
        raise ReplayError(
            f"{results}: its trace {path} is not there (the results record it as {rel!r}, "
            "relative to the results file); move the trace back or give the trace itself"
        )
    want = info.get("trace_fingerprint")
    if want is not None and fingerprint(path) != want:
        raise ReplayError(
            f"{results}: its trace {path} has changed since these results were made "
            f"(fingerprint {fingerprint(path)[:19]}, recorded {str(want)[:19]}); "
            f"replay it again (replay run {path}) or give the trace itself"
        )
    return path


def trace_of(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any] | None]:
    """``path`` itself when it is a trace; when it is a results file, the
    trace it leads to and the results' metadata (an error when the results
    record no trace, or a changed one)."""
    p = Path(path)
    if p.is_dir() or not is_results_file(p):
        return p, None
    info = results_info(p)
    trace = linked_trace(p, info)
    if trace is None:
        raise ReplayError(
            f"{p}: these results do not record where their trace is (made before results "
            f"led back to traces); give the trace ({info.get('trace', 'its name unknown')})"
        )
    return trace, info


class Replayed(Protocol):
    """What a results file is written from (``replay.engine.answers.ReplayResult``)."""

    @property
    def results(self) -> pl.DataFrame: ...

    @property
    def trace_path(self) -> str: ...

    def metadata(self) -> dict[str, Any]: ...


def save_results(result: Replayed, out: str | os.PathLike[str]) -> Path:
    """Write a replay's results file: its answers, facts and flags (the
    analyses add them: ``replay.analysis.flags.flag_results``), with the path
    (relative to ``out``) and the fingerprint of the trace they came from."""
    meta = {**result.metadata(), **link(result.trace_path, out)}
    return write_results(out, result.results.to_arrow(), meta)
