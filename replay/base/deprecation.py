"""Old names kept for outside callers: each warns (``DeprecationWarning``)
when used, naming its replacement; the project's own code never uses them
(``tests/base/test_deprecation.py``)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def renamed(module: str, names: Mapping[str, tuple[str, object]]) -> Callable[[str], object]:
    """A module's ``__getattr__`` serving each old name of ``names`` (old ->
    (new, the object)) with a warning; any other name is missing, as usual."""

    def __getattr__(name: str) -> object:
        if name in names:
            new, value = names[name]
            warnings.warn(
                f"{module}.{name} is deprecated: use {module}.{new}",
                DeprecationWarning,
                stacklevel=2,
            )
            return value
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def renamed_keyword(old: str, new: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A function's keyword argument renamed ``old`` -> ``new``: a call that
    still passes ``old`` warns and is served as ``new``."""

    def wrap(function: Callable[P, R]) -> Callable[P, R]:
        where = f"{function.__module__}.{function.__qualname__}"

        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{where}() got both {old}= and {new}= (the same argument)")
                warnings.warn(
                    f"{where}({old}=) is deprecated: use {where}({new}=)",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return call

    return wrap
