"""How the compiled kernels (the engine's fold, the what-if's pool) keep
their machine code: ``njit`` with an on-disk cache where there is a place to
keep it. Here, in the floor below everything, so that the rules' compiled
fixed point (``replay.rules.compiled``), the engine's fold and the what-if's
pool share it, and no kernel asks for ``cache=True`` itself (importing one
alone killed a read-only install).

numba caches beside the module (``__pycache__``), else in the user's cache
directory; when neither is writable (a system-wide or container install
run by a plain user with a read-only home) ``cache=True`` fails at import,
so every command would die, ``--version`` included. Then the cache goes to
a private directory of this user under the system's temporary directory,
and where even that cannot be made, the kernels compile in memory each run.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable
from typing import Any

from numba import njit
from numba.core import config


def _probe() -> None:
    """A function of this package: if numba can cache it, it can cache the
    kernels (they live beside it)."""


def _locator_found() -> bool:
    try:
        njit(cache=True)(_probe)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return False
    return True


def _private_dir() -> str | None:
    """This user's own directory for numba's cache under the temporary
    directory (made 0700 and checked to be ours), or None."""
    path = os.path.join(tempfile.gettempdir(), f"replay-numba-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        try:
            os.mkdir(path, 0o700)
        except OSError:
            return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return None  # someone else's, or writable by others: not a cache to trust
    return path if os.access(path, os.W_OK | os.X_OK) else None


def _choose() -> bool:
    if _locator_found():
        return True
    private = _private_dir()
    if private is not None:
        config.CACHE_DIR = private  # type: ignore[attr-defined]
        if _locator_found():
            return True
        config.CACHE_DIR = ""  # type: ignore[attr-defined]
    return False


#: Whether the kernels keep their machine code on disk.
CACHE = _choose()


def jit(*, refcounts: bool = True, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit`` with the on-disk cache when there is one.

    ``refcounts=False`` compiles without numba's runtime (its ``_nrt``
    flag), for a kernel that allocates nothing (numba refuses to compile
    one that does): numba counts a reference for every array a function
    binds, so each call of an inlined step over the caller's arrays costs
    two atomic counts per array where the counts do not cancel within one
    block, which made the what-if's pool over twice as slow per block. The
    arrays such a kernel is handed stay alive in its caller."""
    if not refcounts:
        options["_nrt"] = False
    return njit(cache=CACHE, **options)  # type: ignore[no-any-return]
