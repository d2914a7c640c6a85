"""Apply one mutant to the installed vLLM at import time, without touching
its files.

A meta-path finder takes over the import of the mutant's module: it reads
the module's source, replaces the mutant's ``original`` text by its
``mutated`` text (the original must occur exactly once, or the import
fails loudly) and compiles the result under the module's real filename, so
coverage and tracebacks point at vLLM's real lines. Install it before
anything imports that module (``REPLAY_MUTANT=NAME python -m mutants.replay
...`` does, for the ``replay`` command line).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, ModuleType

HERE = Path(__file__).parent
MUTANTS_FILE = HERE / "vllm-0.33.toml"
ENV = "REPLAY_MUTANT"


class MutantError(Exception):
    """A mutant that cannot be applied: unknown, or its original text does
    not occur exactly once in the installed module."""


@dataclass(frozen=True)
class Mutant:
    name: str
    module: str
    original: str
    mutated: str
    breaks: str
    equivalent: str | None = None

    def apply(self, source: str, filename: str) -> str:
        count = source.count(self.original)
        if count != 1:
            raise MutantError(
                f"mutant {self.name}: its original text occurs {count} times in {filename} "
                f"(expected exactly once): {self.original!r}"
            )
        return source.replace(self.original, self.mutated)


def load_mutants(path: Path = MUTANTS_FILE) -> list[Mutant]:
    with path.open("rb") as f:
        data = tomllib.load(f)
    mutants = [Mutant(**entry) for entry in data["mutant"]]
    names = [m.name for m in mutants]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise MutantError(f"{path}: mutant names used twice: {', '.join(duplicated)}")
    return mutants


def get_mutant(name: str, path: Path = MUTANTS_FILE) -> Mutant:
    for mutant in load_mutants(path):
        if mutant.name == name:
            return mutant
    raise MutantError(f"no mutant named {name!r} in {path}")


class _MutatingLoader(importlib.machinery.SourceFileLoader):
    """The module's own source loader, compiling the mutated source (never
    the cached bytecode) under the real filename."""

    def __init__(self, fullname: str, path: str, mutant: Mutant) -> None:
        super().__init__(fullname, path)
        self.mutant = mutant

    def get_code(self, fullname: str) -> CodeType:
        source = self.get_data(self.path).decode("utf-8")
        mutated = self.mutant.apply(source, self.path)
        return compile(mutated, self.path, "exec", dont_inherit=True)


class MutantFinder(importlib.abc.MetaPathFinder):
    def __init__(self, mutant: Mutant) -> None:
        self.mutant = mutant
        self.applied = False

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.mutant.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            raise MutantError(
                f"mutant {self.mutant.name}: {fullname} is not a Python source module here"
            )
        spec.loader = _MutatingLoader(fullname, spec.origin, self.mutant)
        self.applied = True
        return spec


def install(mutant: Mutant) -> MutantFinder:
    """Apply ``mutant`` to every later import of its module in this process."""
    if mutant.module in sys.modules:
        raise MutantError(
            f"mutant {mutant.name}: {mutant.module} is already imported; install the "
            "mutant before anything imports it"
        )
    finder = MutantFinder(mutant)
    sys.meta_path.insert(0, finder)
    return finder


def install_from_env() -> Mutant | None:
    """The mutant ``$REPLAY_MUTANT`` names, installed; ``None`` when unset."""
    name = os.environ.get(ENV, "").strip()
    if not name:
        return None
    mutant = get_mutant(name)
    install(mutant)
    return mutant


def check_applies(mutant: Mutant) -> None:
    """Fail unless ``mutant`` applies to the installed module's source (its
    original text occurs exactly once), without importing the module."""
    spec = importlib.util.find_spec(mutant.module.rsplit(".", 1)[0])
    if spec is None or not spec.submodule_search_locations:
        raise MutantError(f"mutant {mutant.name}: no package for {mutant.module}")
    path = importlib.machinery.PathFinder.find_spec(
        mutant.module, list(spec.submodule_search_locations)
    )
    if path is None or path.origin is None:
        raise MutantError(f"mutant {mutant.name}: no module {mutant.module}")
    mutant.apply(Path(path.origin).read_text(), path.origin)
