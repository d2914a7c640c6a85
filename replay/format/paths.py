"""Where commands read and write: the one place that decides what a path is.

A user's file is sacred. Every output goes through :func:`atomic_output` or
:func:`write_text`: a regular file is written to a hidden temporary file
beside it and renamed over it only once complete, so an error or a signal
never leaves a partial file and never damages the previous one. Nothing
that is not a regular file is ever renamed over: ``/dev/null`` is written
to directly (the output is discarded), ``-`` and ``/dev/stdout`` mean
standard output for text, anything else (a FIFO, a device, a socket) is
refused. A missing output directory is an error: a typo in a path should
not silently grow a directory tree.

:func:`refuse_overwriting_inputs` runs before a command writes anything: an
output that is one of its inputs (the same file, a hard link or a symlink
to it) is refused. :func:`check_input` refuses what is not a regular file
before it is opened, so a FIFO never blocks a command.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from replay.base.errors import ReplayError

PathLike = str | os.PathLike[str]

#: Names that mean standard output (text formats only).
STDOUT_NAMES = ("-", "/dev/stdout")
#: The signals that end a command; they are held back while a temporary
#: file is created or renamed, so either step completes or never starts.
EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: A test hook (``stage:marker``): at that stage of a write the process
#: writes the temporary file's path to ``marker`` and sleeps, so a test can
#: deliver a real signal while the write is in progress. Stages: ``rows``
#: (a trace writer, after a row group) and ``publish`` (before the rename).
PAUSE_ENV = "REPLAY_TEST_PAUSE"


def _file_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


def check_input(path: PathLike, expected: str) -> Path:
    """``path`` if it is a regular file to read, else a one-line error.
    ``expected`` says what the command wanted (e.g. ``a Parquet file``)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise ReplayError(f"{p}: no such file") from None
    except OSError as exc:
        raise ReplayError(f"{p}: cannot read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ReplayError(f"{p}: is a directory, expected {expected}")
    if not stat.S_ISREG(st.st_mode):
        raise ReplayError(f"{p}: is {_file_kind(st.st_mode)}, expected {expected} (a regular file)")
    if not os.access(p, os.R_OK):
        raise ReplayError(f"{p}: cannot read (Permission denied)")
    return p


@dataclass(frozen=True, slots=True)
class OutputTarget:
    """What an output path names: a regular file (``real`` is the file a
    symlink leads to, which is what gets replaced), ``/dev/null``, or
    standard output."""

    given: str
    kind: Literal["file", "null", "stdout"]
    real: Path


def _is_dev_null(st: os.stat_result) -> bool:
    try:
        null = os.stat(os.devnull)
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == null.st_rdev


def output_target(path: PathLike, *, text: bool, what: str = "Parquet") -> OutputTarget:
    """Classify an output path (see the module docstring); a one-line error
    for what cannot be written."""
    given = os.fspath(path)
    if given in STDOUT_NAMES:
        if not text:
            raise ReplayError(
                f"{given}: standard output takes text only, this output is {what}; "
                "give a file path (or /dev/null to discard it)"
            )
        return OutputTarget(given=given, kind="stdout", real=Path(given))
    p = Path(given)
    try:
        st: os.stat_result | None = os.stat(p)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise ReplayError(f"{p}: cannot write here ({exc.strerror or exc})") from None
    if st is not None:
        if stat.S_ISREG(st.st_mode):
            return OutputTarget(given=given, kind="file", real=Path(os.path.realpath(p)))
        if _is_dev_null(st):
            return OutputTarget(given=given, kind="null", real=Path(os.devnull))
        if stat.S_ISDIR(st.st_mode):
            raise ReplayError(f"{p}: is a directory, expected a file path to write")
        raise ReplayError(
            f"{p}: is {_file_kind(st.st_mode)}, expected a file path to write "
            "(or /dev/null to discard the output)"
        )
    real = Path(os.path.realpath(p))
    parent = real.parent
    if not parent.is_dir():
        shown = p.parent if p.parent != Path() else parent
        raise ReplayError(f"{p}: no such directory {shown} (it is not created)")
    return OutputTarget(given=given, kind="file", real=real)


def _identity(path: PathLike) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return st.st_dev, st.st_ino


def refuse_overwriting_inputs(
    outputs: Mapping[str, PathLike | None], inputs: Sequence[PathLike | None]
) -> None:
    """Before anything is written: an output (named by its option, e.g.
    ``-o``) that is one of the inputs, or another output, is refused.
    Files are compared by (device, inode), so a hard link or a symlink to an
    input is the input."""
    seen: dict[tuple[int, int], str] = {}
    for path in inputs:
        if path is not None:
            ident = _identity(path)
            if ident is not None:
                seen.setdefault(ident, f"the input {os.fspath(path)}")
    for option, path in outputs.items():
        if path is None or os.fspath(path) in STDOUT_NAMES:
            continue
        ident = _identity(path)
        if ident is None:
            continue
        if ident in seen:
            raise ReplayError(
                f"{option} {os.fspath(path)}: is {seen[ident]}; refusing to overwrite it "
                "(give another output path)"
            )
        seen[ident] = f"also the output of {option}"


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold back SIGINT/SIGTERM/SIGHUP for a step that must complete or not
    start (creating or renaming a temporary file); they are delivered after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, EXIT_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def pause_point(stage: str, tmp: Path) -> None:
    """The test hook of :data:`PAUSE_ENV` (a no-op unless it is set)."""
    hook = os.environ.get(PAUSE_ENV)
    if not hook or _paused:
        return
    want, _, marker = hook.partition(":")
    if want != stage or not marker:
        return
    _paused.append(stage)  # once: cleanup after the signal may write again
    Path(marker).write_text(str(tmp))
    # A writer thread cannot see the signal: it waits for the main thread's
    # handler to say one came (the main thread itself is interrupted anyway).
    # Short waits: the kernel may deliver the signal to a library's thread,
    # and the main thread runs Python's handler only when it wakes up.
    deadline = time.monotonic() + 60
    while not _signalled.wait(0.05) and time.monotonic() < deadline:
        pass


_paused: list[str] = []
_signalled = threading.Event()


def note_signal() -> None:
    """Called by the CLI's signal handler; ends a :func:`pause_point`."""
    _signalled.set()


@contextlib.contextmanager
def atomic_output(path: PathLike, *, text: bool = False, what: str = "Parquet") -> Iterator[Path]:
    """Yield the path to write ``path``'s content to. A regular file: a hidden
    temporary file beside it, renamed over it on success and deleted on any
    error or signal. ``/dev/null``: itself. Standard output is refused
    (binary formats; text goes through :func:`write_text`)."""
    target = output_target(path, text=False, what=what)
    if target.kind == "null":
        yield target.real
        return
    real = target.real
    try:
        mode = os.stat(real).st_mode & 0o7777
    except FileNotFoundError:
        # mkstemp makes the file private; give it the mode any new file gets.
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    with signals_held():
        try:
            fd, name = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent)
        except OSError as exc:
            raise ReplayError(f"{path}: cannot write here ({exc.strerror or exc})") from None
        os.close(fd)
    tmp = Path(name)
    try:
        try:
            yield tmp
        except OSError as exc:  # a full disk, a quota: name the file the user gave
            raise ReplayError(f"{path}: cannot write here ({exc.strerror or exc})") from None
        os.chmod(tmp, mode)
        pause_point("publish", tmp)
        with signals_held():
            try:
                os.replace(tmp, real)
            except OSError as exc:
                raise ReplayError(f"{path}: cannot write here ({exc.strerror or exc})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: PathLike, text: str, *, what: str = "text") -> OutputTarget:
    """Write ``text`` to ``path``: atomically to a file, to standard output for
    ``-`` or ``/dev/stdout``, nowhere for ``/dev/null``."""
    target = output_target(path, text=True, what=what)
    if target.kind == "stdout":
        sys.stdout.write(text)
        sys.stdout.flush()
        return target
    with atomic_output(path) as tmp:
        if target.kind == "file":
            tmp.write_text(text, encoding="utf-8")
    return target


def check_outputs(
    outputs: Mapping[str, PathLike | None],
    inputs: Sequence[PathLike | None],
    *,
    text: bool = False,
    what: str = "Parquet",
) -> None:
    """Everything a command checks before it writes: each output (keyed by
    its option) is a place it can write (:func:`output_target`) and none is
    one of the inputs (:func:`refuse_overwriting_inputs`)."""
    for path in outputs.values():
        if path is not None:
            output_target(path, text=text, what=what)
    refuse_overwriting_inputs(outputs, inputs)
