"""What every `replay` command shares: a user's mistake is one line on stderr
(``error: ...``) and exit status 2, never a traceback; SIGINT, SIGTERM and
SIGHUP end a command through the same cleanup as an error (no temporary
file is left) with exit status 128 + the signal number, never 1 (which
means "flags found").

The one way an error becomes a message: a command is a :class:`Command`
(made by :func:`command`), whose callback runs under :func:`command_guard`;
the guard turns the library's ``ReplayError`` and the system's refusals into
a :class:`UserError`, and a check of the CLI's own raises :func:`fail`."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import IO, Any

import click

from replay.base.errors import Interrupted, ReplayError, worded
from replay.base.limits import LIMITS, Limit
from replay.base.text import printable, readable_name
from replay.format.paths import EXIT_SIGNALS, note_signal, remove_leftovers


class UserError(click.ClickException):
    """A one-line error about the user's input: exit status 2."""

    exit_code = 2

    def show(self, file: IO[Any] | None = None) -> None:
        # A file name that is not UTF-8 is shown escaped (\xNN), as recorded.
        # and a control character (a request id's escape sequence) too.
        click.echo(f"error: {printable(readable_name(self.format_message()))}", err=True)


class UsageLine(click.UsageError):
    """click's own usage error (an unknown option, a missing argument, a bad
    choice, an extra argument, no such command) as one line naming the
    command, with the hint where its options are listed: exit status 2."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where

    def show(self, file: IO[Any] | None = None) -> None:
        where = self.where
        message = " ".join(self.format_message().split()).rstrip(".")
        message = message[:1].lower() + message[1:]
        line = f"{where}: {message} (try '{where} --help')"
        click.echo(f"error: {printable(readable_name(line))}", err=True)


def _one_line(
    exc: click.UsageError, info_name: str | None, parent: click.Context | None
) -> click.UsageError:
    """``exc``, raised while the command ``info_name`` under ``parent`` was
    parsed, as a :class:`UsageLine`; a group given no command still shows
    its help."""
    if isinstance(exc, (UsageLine, click.exceptions.NoArgsIsHelpError)):
        return exc
    where = " ".join(n for n in (parent.command_path if parent else "", info_name or "") if n)
    return UsageLine(exc.format_message(), where or "replay")


def fail(message: str) -> UserError:
    """The error to raise; whitespace is folded so it stays on one line."""
    return UserError(" ".join(message.split()))


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """While a command runs, the first SIGINT, SIGTERM or SIGHUP raises
    :class:`Interrupted` wherever the command is, so every ``finally`` and
    ``except BaseException`` cleans up; later signals are ignored until the
    cleanup is done. Not ``KeyboardInterrupt`` for SIGINT: click turns that
    into "Aborted!" and exit status 1. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def later(signum: int, frame: FrameType | None) -> None:
        pass

    def first(signum: int, frame: FrameType | None) -> None:
        for sig in EXIT_SIGNALS:
            signal.signal(sig, later)
        note_signal()
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, first) for sig in EXIT_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def exit_on_signal(signum: int) -> click.exceptions.Exit:
    """The exit of a command a signal ended: one line, status 128 + signum."""
    click.echo(f"interrupted by {signal.Signals(signum).name}", err=True)
    return click.exceptions.Exit(128 + signum)


#: The exit status of a filter whose reader went away (128 + SIGPIPE), as
#: `head` leaves a shell pipeline under ``set -o pipefail``.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def broken_pipe() -> click.exceptions.Exit:
    """Standard output's reader is gone (``replay ... | head -1``): nothing
    more can be said there, and nothing needs saying on stderr. What is
    still buffered goes to /dev/null so that the interpreter's own last flush
    does not complain."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return click.exceptions.Exit(EXIT_BROKEN_PIPE)


def run_main(command: click.Command, prog_name: str) -> None:
    """The console script: the signal rules hold from the first argument
    parsed to the process's exit."""
    try:
        with signals_raise():
            try:
                command(prog_name=prog_name)
            except Interrupted as exc:  # arrived outside a command (parsing, exiting)
                remove_leftovers()
                raise exit_on_signal(exc.signum) from None
    except click.exceptions.Exit as exc:
        code: int | str | None = exc.exit_code
    except SystemExit as exc:
        code = exc.code
    # The outputs are complete: a signal from here on ends the process at
    # once, with the status a signal gives.
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = broken_pipe().exit_code
    sys.stderr.flush()
    from replay.base.signals import exit_now

    for sig in EXIT_SIGNALS:
        signal.signal(sig, exit_now)
    sys.exit(code)


@contextlib.contextmanager
def command_guard() -> Iterator[None]:
    """Around a command's callback: the library's errors, and files or
    sockets the system refused (permissions, a full disk), become one-line
    user errors; a signal ends the command with its exit status."""
    with signals_raise():
        try:
            try:
                yield
            except BaseException:
                # What a signal between two statements of a writer left.
                remove_leftovers()
                raise
        except ReplayError as exc:
            raise fail(reworded(exc)) from None
        except BrokenPipeError as exc:
            if exc.filename is not None:  # a file or socket of the command's, not stdout
                raise fail(f"{exc.filename}: {exc.strerror or exc}") from None
            raise broken_pipe() from None
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            raise fail(f"{where}{exc.strerror or exc}") from None
        except KeyboardInterrupt:
            raise exit_on_signal(signal.SIGINT) from None
        except Interrupted as exc:
            raise exit_on_signal(exc.signum) from None


def limit_flag(limit: Limit) -> str:
    """The ``replay`` group's option that sets a limit (``--max-row-hashes``)."""
    return "--" + limit.name.replace("_", "-")


#: The library's parameters, as the command line names them: a library error
#: names a parameter in backquotes (``replay.base.errors.worded``).
FLAGS: dict[str, str] = {
    "block_size": "--block-size",
    "cache": "--cache",
    "config": "--config",
    "coordinator": "--coordinator",
    "files": "--files",
    "first": "--from",
    "format": "--format",
    "last": "--to",
    "max": "--max",
    "min": "--min",
    "model_config": "--model-config",
    "page_bytes": "--page-bytes",
    "points": "--points",
    "policy": "--policy",
    "ray_address": "--ray",
    "retention_interval": "--retention-interval",
    "sample": "--sample",
    "seq": "--seq",
    "unit_present": "--unit-present",
    "vllm": "--vllm",
    "workers": "--workers",
    **{limit.env: f"`replay {limit_flag(limit)} N ...`" for limit in LIMITS},
}


def reworded(exc: ReplayError) -> str:
    """A library error in the command line's words (its flags)."""
    return worded(str(exc), FLAGS)


class _UsageInOneLine(click.Command):
    """click's usage errors, raised while a command's arguments are parsed,
    as :class:`UsageLine`."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            raise _one_line(exc, info_name, parent) from None


class Command(_UsageInOneLine):
    """A `replay` command: its callback runs under :func:`command_guard`, so
    it behaves the same on its own (a test, ``python -c``) as under the
    ``replay`` group."""

    def invoke(self, ctx: click.Context) -> Any:
        # polars replaces the process's SIGINT handler when it is imported: it
        # comes in before the guard installs the command's own handlers (the
        # command line imports it lazily, so that `--help` stays fast).
        import polars  # noqa: F401

        from replay.format.schema import take_read_notes

        take_read_notes()  # a note is the command's own, never a previous one's
        with command_guard():
            try:
                result = super().invoke(ctx)
            except SystemExit:  # `replay check` failing is a result too
                _say_notes(ctx)
                raise
            _say_notes(ctx)
            return result


_NOTES = "replay.notes"


def note_at_end(*lines: str) -> None:
    """Lines for standard error once the command has done its work (what
    was inferred, e.g. the policy of the trace's release): after the
    output, and never before an error, which stays the one line."""
    click.get_current_context().find_root().meta.setdefault(_NOTES, []).extend(lines)


def _say_notes(ctx: click.Context) -> None:
    from replay.format.schema import take_read_notes

    lines = [*take_read_notes(), *ctx.find_root().meta.pop(_NOTES, [])]
    for line in dict.fromkeys(lines):
        click.echo(line, err=True)


class Group(_UsageInOneLine, click.Group):
    """A group of `replay` commands; the commands and groups it makes are
    of these classes too."""

    command_class = Command
    group_class = type

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            raise _one_line(exc, ctx.info_name, ctx.parent) from None


def command(name: str | None = None, **attrs: Any) -> Callable[[Callable[..., Any]], Command]:
    """``@click.command`` for a `replay` command."""
    return click.command(name, cls=Command, **attrs)


def group(name: str | None = None, **attrs: Any) -> Callable[[Callable[..., Any]], Group]:
    """``@click.group`` for a group of `replay` commands."""
    return click.group(name, cls=Group, **attrs)
