"""Old names warn, and the project's own code never uses them (issue 35
item 3: one word, one meaning)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from replay.rules import mooncake_store, store_rules
from replay.rules.store_rules import StoreSettings
from replay.sources.mooncake import ingest
from tests.sources.test_mooncake import MOONCAKE_ROWS, _write

ROOT = Path(__file__).resolve().parent.parent.parent
#: old name -> (module, new name)
OLD = {
    "StorePolicy": (store_rules, "StoreSettings"),
    "MooncakeStore": (mooncake_store, "MooncakeCache"),
}


@pytest.mark.parametrize("old", sorted(OLD))
def test_an_old_name_warns_and_is_the_new_one(old: str) -> None:
    module, new = OLD[old]
    with pytest.warns(DeprecationWarning, match=rf"\.{old} is deprecated: use .*\.{new}$"):
        value = getattr(module, old)
    assert value is getattr(module, new)
    with pytest.raises(AttributeError):
        module.NoSuchName  # noqa: B018


def test_the_project_never_uses_an_old_name() -> None:
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    words = re.compile(r"\b(StorePolicy|MooncakeStore|store_policy)\b")
    used = {
        f: sorted(set(words.findall((ROOT / f).read_text())))
        for f in files
        if f != "tests/base/test_deprecation.py" and (ROOT / f).is_file()
    }
    # Only the two modules' own renaming tables name them.
    assert {f: w for f, w in used.items() if w} == {
        "replay/rules/mooncake_store.py": ["MooncakeStore"],
        "replay/rules/store_rules.py": ["StorePolicy"],
    }


def test_an_old_keyword_warns_and_is_the_new_one(tmp_path: Path) -> None:
    """``ingest(policy=)`` (store settings, not a release) is ``store_settings=``:
    the same trace, byte for byte, with a warning naming the new keyword."""
    src = _write(tmp_path / "mooncake.jsonl", MOONCAKE_ROWS)
    settings = StoreSettings(retention_interval=None, max_num_batched_tokens=64)
    ingest("mooncake", src, tmp_path / "new.parquet", store_settings=settings)
    with pytest.warns(
        DeprecationWarning,
        match=r"^replay\.sources\.mooncake\.ingest\(policy=\) is deprecated: "
        r"use replay\.sources\.mooncake\.ingest\(store_settings=\)$",
    ):
        ingest("mooncake", src, tmp_path / "old.parquet", policy=settings)  # type: ignore[call-arg]
    assert (tmp_path / "old.parquet").read_bytes() == (tmp_path / "new.parquet").read_bytes()
    with pytest.raises(TypeError, match="both policy= and store_settings="):
        ingest(  # type: ignore[call-arg]
            "mooncake", src, tmp_path / "x.parquet", policy=settings, store_settings=settings
        )
    assert not (tmp_path / "x.parquet").exists()


#: Imports every module of the package with the old names' warnings as
#: errors: a module that takes an old name at import time fails to import.
IMPORT_ALL = """
import importlib, pkgutil, warnings
import replay
warnings.filterwarnings("error", message=r".* is deprecated: use ")
walked = pkgutil.walk_packages(replay.__path__, "replay.")
names = sorted(m.name for m in walked if not m.name.endswith("__main__"))  # runs the CLI
missing = []
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:  # an extra that is not installed (vllm, ray)
        if (exc.name or "").startswith("replay"):
            raise
        missing.append(name)
print(len(names), len(missing))
"""


def test_every_module_imports_with_the_old_names_as_errors() -> None:
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    imported, missing = map(int, done.stdout.split())
    # Every module but those of extras missing here (vLLM's plugin and
    # adapters, Ray's cluster) imported.
    assert imported > 100 and missing <= 8, done.stdout
