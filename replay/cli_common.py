"""What every `replay` command shares: a user's mistake is one line on stderr
(``error: ...``) and exit status 2, never a traceback."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import IO, Any, TypeVar

import click

from replay.errors import ReplayError

F = TypeVar("F", bound=Callable[..., Any])


class UserError(click.ClickException):
    """A one-line error about the user's input: exit status 2."""

    exit_code = 2

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def fail(message: str) -> UserError:
    """The error to raise; whitespace is folded so it stays on one line."""
    return UserError(" ".join(message.split()))


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn the library's errors, and files or sockets the system refused
    (permissions, a full disk), into one-line user errors."""
    try:
        yield
    except ReplayError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        raise fail(f"{where}{exc.strerror or exc}") from None


def handles_user_errors(fn: F) -> F:
    """The same for one command, so it behaves alike outside the `replay` group."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with user_errors():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
