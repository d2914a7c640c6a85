"""Old names kept for outside callers: each warns (``DeprecationWarning``)
when used, naming its replacement; the project's own code never uses them
(``tests/test_deprecation.py``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping


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
