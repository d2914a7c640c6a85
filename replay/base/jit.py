"""How the compiled kernels (the engine's fold, the what-if's pool) keep
their machine code: ``njit`` with an on-disk cache where there is a place to
keep it. Here, in the floor below everything, so that the rules' compiled
fixed point (``replay.rules.compiled``), the engine's fold and the what-if's
pool share it, and no kernel asks for ``cache=True`` itself (importing one
alone killed a read-only install).

numba checks a cached kernel only against its own file's timestamp: a
kernel that inlines a function or a constant of another file kept the old
machine code when only that file changed (an editable install after a
``git pull``, a developer's edit), and ran it. So the cache lives in a
directory named by a fingerprint of every source the kernels compile from
(``kernel_sources``: the files that use numba and, transitively, the
package modules they import): under ``NUMBA_CACHE_DIR`` when it is set,
else under the user's cache directory (``$XDG_CACHE_HOME`` or ``~/.cache``,
``cache-trace-replay/numba/``). A changed source starts an empty
directory; the ones no run has used for a day, beyond the newest few, are
removed. When neither can be written (a system-wide or container install
run by a plain user with a read-only home; ``cache=True`` once failed at
import there, so every command died, ``--version`` included), the cache
goes to a private directory of this user under the system's temporary
directory, and where even that cannot be made, the kernels compile in
memory each run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import tempfile
import time
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


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: A module that compiles kernels, and an import of one of the package's modules.
_USES_NUMBA = re.compile(r"^\s*(?:from replay\.base\.jit import|from numba|import numba)", re.M)
_IMPORTS = re.compile(r"^\s*(?:from|import) (replay(?:\.\w+)+)", re.M)
#: Fingerprint directories kept whatever their age, the newest first.
_KEEP = 8
_STALE_SECONDS = 24 * 3600


def kernel_sources(package: str = _PACKAGE) -> list[str]:
    """The package's source files the kernels compile from, relative to the
    package's parent: every module that uses numba, and every package module
    those import (at any depth, inside functions too: a constant or a
    function read by a kernel is frozen into its machine code)."""
    parent = os.path.dirname(package)
    texts: dict[str, str] = {}
    for folder, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    texts[os.path.relpath(path, parent)] = f.read()

    def module_file(module: str) -> str | None:
        base = os.path.join(*module.split("."))
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if candidate in texts:
                return candidate
        return None

    todo = [path for path, text in texts.items() if _USES_NUMBA.search(text)]
    seen = set(todo)
    while todo:
        for module in _IMPORTS.findall(texts[todo.pop()]):
            found = module_file(module)
            if found is not None and found not in seen:
                seen.add(found)
                todo.append(found)
    return sorted(seen)


def fingerprint(package: str = _PACKAGE) -> str:
    """A digest of ``kernel_sources``: their names and their bytes."""
    parent = os.path.dirname(package)
    digest = hashlib.sha256()
    for rel in kernel_sources(package):
        digest.update(rel.encode() + b"\0")
        with open(os.path.join(parent, rel), "rb") as f:
            digest.update(f.read())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _user_cache_dir() -> str | None:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(root, "cache-trace-replay", "numba")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK | os.X_OK) else None


def _prune(base: str, keep: str) -> None:
    """Remove the fingerprint directories under ``base`` that no run has used
    for a day, beyond the ``_KEEP`` newest (a developer's edits each leave
    one); ``keep`` (this run's) stays."""
    try:
        entries = [e for e in os.scandir(base) if e.is_dir(follow_symlinks=False)]
        entries.sort(key=lambda e: e.stat().st_mtime, reverse=True)
        now = time.time()
        for entry in entries[_KEEP:]:
            if entry.path != keep and now - entry.stat().st_mtime > _STALE_SECONDS:
                shutil.rmtree(entry.path, ignore_errors=True)
    except OSError:
        pass


def _try(base: str, prune: bool, sources: str) -> bool:
    """Cache under ``base``, in the directory of ``sources`` (a fingerprint), if numba can."""
    path = os.path.join(base, sources)
    try:
        fresh = not os.path.isdir(path)
        os.makedirs(path, exist_ok=True)
        os.utime(path)  # used now: pruning goes by the last use
    except OSError:
        return False
    config.CACHE_DIR = path  # type: ignore[attr-defined]
    if not _locator_found():
        return False
    if fresh and prune:
        _prune(base, path)
    return True


def _choose() -> bool:
    own = config.CACHE_DIR  # type: ignore[attr-defined]  # NUMBA_CACHE_DIR, when set
    sources = fingerprint()  # read once: each directory tried is named by it
    # Each place made only when the one before it failed.
    places = ((lambda: own, False), (_user_cache_dir, True), (_private_dir, True))
    for place, prune in places:
        base = place()
        if base and _try(base, prune, sources):
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
