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
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from replay.base.errors import ReplayError
from replay.base.text import readable_name, utf8_path

PathLike = str | os.PathLike[str]

#: Names that mean standard output (text formats only).
STDOUT_NAMES = ("-", "/dev/stdout")
#: The signals that end a command; they are held back while a temporary
#: file is created or renamed, so either step completes or never starts.
EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: A test hook (``stage:marker``, or ``stage@N:marker`` for the N-th time
#: the process reaches it): at that stage of a write the process writes the
#: temporary file's path to ``marker`` and sleeps, so a test can deliver a
#: real signal while the write is in progress. Stages: ``rows`` (a trace
#: writer, after a row group) and ``publish`` (before the rename).
PAUSE_ENV = "REPLAY_TEST_PAUSE"


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in a message's words."""
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


def os_reason(exc: OSError) -> str:
    """What the system said, without Arrow's wrapping: ``No space left on
    device`` for an Arrow write error carrying errno 28."""
    found = re.search(r"\[errno (\d+)\]", str(exc))
    if found:
        return os.strerror(int(found.group(1)))
    return exc.strerror or " ".join(str(exc).split())


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
        raise ReplayError(f"{p}: is {file_kind(st.st_mode)}, expected {expected} (a regular file)")
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


#: What each output extension means: an output's format is named by its
#: extension (or by ``--format`` where a command offers several, and the
#: extension must agree). ``-``, ``/dev/stdout`` and ``/dev/null`` have no
#: extension and take the command's format.
PARQUET = {".parquet": "parquet"}
TEXT_REPORT = {".md": "md", ".markdown": "md", ".html": "html", ".htm": "html"}
KV_DUMP = {".kvdump": "kvdump"}
JUNIT = {".xml": "xml"}
NAMES = {
    "parquet": "Parquet",
    "md": "Markdown",
    "html": "HTML",
    "kvdump": "KV-event dump",
    "xml": "JUnit XML",
}
#: Extensions that name a file: never the name of an output directory.
FILE_EXTENSIONS = {
    **PARQUET,
    **TEXT_REPORT,
    **KV_DUMP,
    **JUNIT,
    ".json": "JSON",
    ".jsonl": "JSON lines",
}
_NO_EXTENSION = (*STDOUT_NAMES, os.devnull)


def output_format(
    option: str,
    path: PathLike | None,
    formats: Mapping[str, str],
    *,
    given: str | None = None,
    default: str,
) -> str:
    """The format ``path`` is written in: ``given`` (``--format``) or the one
    its extension names, else ``default`` for a path without one of its own
    (standard output, /dev/null, no ``-o``). Refused, before any work: an
    extension that names no format of the command, or another format than
    ``given``."""
    if path is None or os.fspath(path) in _NO_EXTENSION:
        return given or default
    p = Path(path)
    ext = p.suffix.lower()
    named = formats.get(ext)
    if named is None:
        choices = ", ".join(f"{e} ({NAMES[f]})" for e, f in formats.items())
        said = "has no extension" if not ext else f"{ext} is not an extension this command writes"
        raise ReplayError(f"{option} {p}: {said}; name it with one of {choices}")
    if given is not None and given != named:
        want = next(e for e, f in formats.items() if f == given)
        raise ReplayError(
            f"{option} {p}: a {ext} name for {NAMES[given]} (`format` {given}); "
            f"name it {p.with_suffix(want).name} or drop `format`"
        )
    return named


def _check_directory_name(option: str, path: PathLike) -> None:
    """An output directory's name does not say it is a file (``.parquet``,
    ``.md``, ...): ``split -o t.parquet`` would otherwise make a directory
    where a file was meant."""
    p = Path(path)
    ext = p.suffix.lower()
    if ext in FILE_EXTENSIONS:
        raise ReplayError(
            f"{option} {p}: {ext} names a file, this option writes a directory; "
            f"name it without an extension (e.g. {p.with_suffix('').name})"
        )


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
    st = _output_stat(p)
    if st is not None:
        if stat.S_ISREG(st.st_mode):
            return OutputTarget(given=given, kind="file", real=Path(os.path.realpath(p)))
        if _is_dev_null(st):
            return OutputTarget(given=given, kind="null", real=Path(os.devnull))
        if stat.S_ISDIR(st.st_mode):
            raise ReplayError(f"{p}: is a directory, expected a file path to write")
        raise ReplayError(
            f"{p}: is {file_kind(st.st_mode)}, expected a file path to write "
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


def _real(path: PathLike) -> Path:
    return Path(os.path.realpath(os.fspath(path)))


@dataclass(slots=True)
class _Claims:
    """What a command reads or already writes: files by (device, inode),
    directories by their real path, and output paths by their real path."""

    files: dict[tuple[int, int], str]
    dirs: list[tuple[Path, str]]
    paths: dict[Path, str]

    def inside(self, real: Path) -> tuple[Path, str] | None:
        """The claimed directory ``real`` is (or lies inside), if any."""
        for d, label in self.dirs:
            if real == d or d in real.parents:
                return d, label
        return None


def _claim_inputs(inputs: Sequence[PathLike | None]) -> _Claims:
    claims = _Claims(files={}, dirs=[], paths={})
    for path in inputs:
        if path is None or os.fspath(path) in STDOUT_NAMES:
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue  # the command's reader says what is wrong with it
        label = f"the input {os.fspath(path)}"
        if stat.S_ISREG(st.st_mode):
            claims.files.setdefault((st.st_dev, st.st_ino), label)
            claims.paths.setdefault(_real(path), label)
        elif stat.S_ISDIR(st.st_mode):
            real = _real(path)
            claims.dirs.append((real, f"the input directory {os.fspath(path)}"))
            # A hard link to a part of the directory is a part of it too.
            with contextlib.suppress(OSError), os.scandir(real) as entries:
                for entry in entries:
                    with contextlib.suppress(OSError):
                        est = entry.stat()
                        if stat.S_ISREG(est.st_mode):
                            where = f"{os.fspath(path)}/{entry.name}"
                            claims.files.setdefault((est.st_dev, est.st_ino), f"the input {where}")
    return claims


def _refuse(option: str, path: PathLike, what: str, verb: str = "overwrite it") -> ReplayError:
    return ReplayError(
        f"{option} {os.fspath(path)}: {what}; refusing to {verb} (give another output path)"
    )


def refuse_overwriting_inputs(
    outputs: Mapping[str, PathLike | None],
    inputs: Sequence[PathLike | None],
    directories: Mapping[str, PathLike | None] | None = None,
) -> None:
    """Before anything is written: an output (named by its option, e.g.
    ``-o``) that is one of the inputs, lies inside an input directory, or is
    another output of the command is refused. Files are compared by (device,
    inode), so a hard link or a symlink to an input is the input; paths not
    yet created by their real path. ``directories`` are outputs that are
    whole directories (``split -o``, ``--emit-traces``): they may neither
    be, lie inside nor hold an input or another output."""
    claims = _claim_inputs(inputs)
    input_paths = dict(claims.paths)
    made: list[tuple[Path, str]] = []  # the output directories so far
    for option, path in (directories or {}).items():
        if path is None:
            continue
        real = _real(path)
        hit = claims.inside(real)
        if hit is not None:
            raise _refuse(
                option,
                path,
                f"is {hit[1]}" if hit[0] == real else f"lies inside {hit[1]}",
                "write there",
            )
        for inner, label in input_paths.items():
            if real in inner.parents:
                raise _refuse(option, path, f"holds {label}", "write there")
        for other, label in claims.paths.items():
            if other == real or real in other.parents:
                raise _refuse(option, path, f"is {label}", "write there")
        made.append((real, f"the output directory of {option}"))
        claims.dirs.append((real, f"the output directory of {option}"))
    for option, path in outputs.items():
        if path is None or os.fspath(path) in STDOUT_NAMES:
            continue
        ident = _identity(path)
        if ident is not None and ident in claims.files:
            raise _refuse(option, path, f"is {claims.files[ident]}")
        try:
            null = stat.S_ISCHR(os.stat(path).st_mode)
        except OSError:
            null = False
        if null:
            continue  # /dev/null (output_target refuses the other devices)
        real = _real(path)
        if real in claims.paths:
            raise _refuse(option, path, f"is {claims.paths[real]}")
        hit = claims.inside(real)
        if hit is not None:
            where = "is" if hit[0] == real else "lies inside"
            raise _refuse(option, path, f"{where} {hit[1]}", "write there")
        label = f"also the output of {option}"
        if ident is not None:
            claims.files[ident] = label
        claims.paths[real] = label


def _output_stat(p: Path) -> os.stat_result | None:
    """What is at an output path (None: nothing); one line when it cannot be looked at."""
    try:
        return os.stat(p)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ReplayError(f"{p}: cannot write here ({exc.strerror or exc})") from None


def check_new_directory(option: str, path: PathLike) -> None:
    """An output directory is new or empty, and its parent exists (it is
    never created)."""
    p = Path(path)
    st = _output_stat(p)
    if st is None:
        if os.path.islink(p):
            raise ReplayError(f"{p}: is a dangling symlink, expected a new or empty directory")
        real = _real(p)
        if not real.parent.is_dir():
            shown = p.parent if p.parent != Path() else real.parent
            raise ReplayError(f"{p}: no such directory {shown} (it is not created)")
        return
    if not stat.S_ISDIR(st.st_mode):
        raise ReplayError(f"{p}: exists and is not a directory, expected a new directory")
    try:
        with os.scandir(p) as entries:
            empty = next(entries, None) is None
    except OSError as exc:
        raise ReplayError(f"{p}: cannot list the directory ({exc.strerror or exc})") from None
    if not empty:
        raise ReplayError(f"{p}: directory is not empty, expected a new or empty directory")


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
    want, _, nth = want.partition("@")
    if want != stage or not marker:
        return
    _reached[stage] = _reached.get(stage, 0) + 1
    if nth and _reached[stage] != int(nth):
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
_reached: dict[str, int] = {}
_signalled = threading.Event()


def note_signal() -> None:
    """Called by the CLI's signal handler; ends a :func:`pause_point`."""
    _signalled.set()


@contextlib.contextmanager
def atomic_output(
    path: PathLike, *, text: bool = False, what: str = "Parquet", durable: bool = False
) -> Iterator[Path]:
    """Yield the path to write ``path``'s content to. A regular file: a hidden
    temporary file beside it, renamed over it on success and deleted on any
    error or signal. ``/dev/null``: itself. Standard output is refused
    (binary formats; text goes through :func:`write_text`). ``durable``: the
    file is synced to disk before the rename and the directory after, so a
    power loss leaves the old name or the whole new file (a segment)."""
    target = output_target(path, text=False, what=what)
    if target.kind == "null":
        yield target.real
        return
    real = target.real
    try:
        mode = os.stat(real).st_mode & 0o7777
    except FileNotFoundError:
        mode = new_file_mode()  # mkstemp makes the file private
    with signals_held():
        try:
            fd, name = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent)
        except OSError as exc:
            raise ReplayError(f"{path}: cannot write here ({os_reason(exc)})") from None
        os.close(fd)
        tmp = Path(name)
        _LIVE[tmp] = False
    try:
        try:
            yield tmp
        except OSError as exc:  # a full disk, a quota: name the file the user gave
            raise ReplayError(f"{path}: cannot write here ({os_reason(exc)})") from None
        os.chmod(tmp, mode)
        if durable:
            _sync(tmp)
        pause_point("publish", tmp)
        with signals_held():
            try:
                os.replace(tmp, real)
            except OSError as exc:
                raise ReplayError(f"{path}: cannot write here ({os_reason(exc)})") from None
            _LIVE.pop(tmp, None)
        if durable:
            _sync(real.parent)
    except BaseException:
        with signals_held():
            tmp.unlink(missing_ok=True)
            _LIVE.pop(tmp, None)
        raise


def _sync(path: Path) -> None:
    """fsync a file or a directory (a rename is durable once its directory is)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ReplayError(f"{path}: cannot write here ({os_reason(exc)})") from None
    try:
        os.fsync(fd)
    except OSError as exc:
        raise ReplayError(f"{path}: cannot write here ({os_reason(exc)})") from None
    finally:
        os.close(fd)


#: Every temporary file (False) or directory (True) not yet published or
#: removed. A signal can arrive between two statements of any writer (after
#: a temporary file is made, before the ``try`` that removes it is
#: entered): the CLI removes what is left here when a command ends.
_LIVE: dict[Path, bool] = {}


def remove_leftovers() -> None:
    """Remove every temporary output still registered (see :data:`_LIVE`)."""
    with signals_held():
        for tmp, is_dir in list(_LIVE.items()):
            if is_dir:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
            _LIVE.pop(tmp, None)


def new_file_mode(directory: bool = False) -> int:
    """The mode ``open`` or ``mkdir`` gives a new file or directory."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


class Staging:
    """Several outputs of one command, published all or nothing: each file
    is written to a hidden temporary file beside it, each directory built
    in a hidden temporary directory beside it, and all are renamed into
    place at the end (signals held); any error or signal before removes
    every one of them, unless the command publishes the finished part of
    its work first (``whatif`` on a signal: the README's one rule, "Outputs
    on a signal"). Used through :func:`staged_outputs`."""

    def __init__(self) -> None:
        # (temporary, target, the path the user gave, a directory?, mode)
        self._items: list[tuple[Path, Path, str, bool, int]] = []

    def file(self, path: PathLike, *, what: str = "Parquet") -> Path:
        """The temporary file to write ``path``'s content to (``/dev/null``:
        itself)."""
        target = output_target(path, text=False, what=what)
        if target.kind == "null":
            return target.real
        real = target.real
        try:
            mode = os.stat(real).st_mode & 0o7777
        except FileNotFoundError:
            mode = new_file_mode()
        with signals_held():
            try:
                fd, name = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent)
            except OSError as exc:
                raise ReplayError(f"{path}: cannot write here ({os_reason(exc)})") from None
            os.close(fd)
            self._items.append((Path(name), real, os.fspath(path), False, mode))
            _LIVE[Path(name)] = False
        return Path(name)

    def directory(self, path: PathLike, option: str = "-o") -> Path:
        """The temporary directory to build the new (or empty) directory
        ``path`` in; its parent must exist."""
        check_new_directory(option, path)
        real = _real(path)
        with signals_held():
            try:
                name = tempfile.mkdtemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent)
            except OSError as exc:
                raise ReplayError(f"{path}: cannot write here ({os_reason(exc)})") from None
            # A directory's mode has its x bits (a 0644 directory cannot be
            # entered: its parts were unreadable to anyone but root).
            self._items.append((Path(name), real, os.fspath(path), True, new_file_mode(True)))
            _LIVE[Path(name)] = True
        return Path(name)

    def named(self, message: str) -> str:
        """``message`` with every temporary path replaced by the user's."""
        for tmp, _, given, _, _ in self._items:
            message = message.replace(str(tmp), given)
        return message

    def publish(self) -> None:
        if self._items:
            pause_point("publish", self._items[0][0])
        with signals_held():
            for tmp, real, given, is_dir, mode in self._items:
                try:
                    os.chmod(tmp, mode)
                    if is_dir:
                        with contextlib.suppress(FileNotFoundError):
                            real.rmdir()  # empty (checked): the rename replaces it
                        os.rename(tmp, real)
                    else:
                        os.replace(tmp, real)
                    _LIVE.pop(tmp, None)
                except OSError as exc:
                    raise ReplayError(
                        f"{given}: cannot write here ({exc.strerror or exc})"
                    ) from None
            self._items.clear()

    def discard(self) -> None:
        with signals_held():
            for tmp, _, _, is_dir, _ in self._items:
                if is_dir:
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    tmp.unlink(missing_ok=True)
                _LIVE.pop(tmp, None)
            self._items.clear()


@contextlib.contextmanager
def staged_outputs() -> Iterator[Staging]:
    """A :class:`Staging` whose outputs are published when the block ends
    normally and removed on any error or signal; errors name the user's
    paths, never a temporary one."""
    stage = Staging()
    try:
        try:
            yield stage
        except ReplayError as exc:
            raise type(exc)(stage.named(str(exc))) from None
        except OSError as exc:  # a full disk, a quota: name the output
            first = stage._items[0][2] if stage._items else ""
            where = stage.named(exc.filename) if exc.filename else first
            raise ReplayError(
                f"{where}: cannot write here ({stage.named(os_reason(exc))})"
            ) from None
        stage.publish()
    except BaseException:
        stage.discard()
        raise


@contextlib.contextmanager
def arrow_file(path: PathLike, mode: str = "rb") -> Iterator[Any]:
    """``path`` as Arrow takes it: its name when the name is UTF-8, else the
    file opened by Python (Arrow cannot take a name that is not UTF-8)."""
    if utf8_path(path):
        yield os.fspath(path)
        return
    with open(path, mode) as fh:
        yield fh


def write_text(path: PathLike, text: str, *, what: str = "text") -> OutputTarget:
    """Write ``text`` to ``path``: atomically to a file, to standard output for
    ``-`` or ``/dev/stdout``, nowhere for ``/dev/null``."""
    target = output_target(path, text=True, what=what)
    text = readable_name(text)  # a file name that is not UTF-8, escaped
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
    directories: Mapping[str, PathLike | None] | None = None,
    formats: Mapping[str, Mapping[str, str]] | None = None,
) -> None:
    """Everything a command checks before it does any work: no output
    (keyed by its option) is an input, lies inside an input directory or is
    another output (:func:`refuse_overwriting_inputs`); each is a place it
    can write (:func:`output_target`; ``directories``: a new or empty
    directory whose parent exists) and is named for a format it writes
    (``formats``, by option: :func:`output_format`; ``directories``: a
    name without a file's extension)."""
    refuse_overwriting_inputs(outputs, inputs, directories)
    for option, path in (directories or {}).items():
        if path is not None:
            check_new_directory(option, path)
            _check_directory_name(option, path)
    for option, path in outputs.items():
        if path is not None:
            output_target(path, text=text, what=what)
            if formats is not None and option in formats:
                output_format(
                    option, path, formats[option], default=next(iter(formats[option].values()))
                )
