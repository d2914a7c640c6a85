"""Old names warn, and the project's own code never uses them (issue 35
item 3: one word, one meaning)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from replay.rules import mooncake_store, store_rules

ROOT = Path(__file__).resolve().parent.parent
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
        if f != "tests/test_deprecation.py" and (ROOT / f).is_file()
    }
    # Only the two modules' own renaming tables name them.
    assert {f: w for f, w in used.items() if w} == {
        "replay/rules/mooncake_store.py": ["MooncakeStore"],
        "replay/rules/store_rules.py": ["StorePolicy"],
    }
