"""No module of the compiled paths reaches into another module's private
names (issue 35 item 2): the engine, the what-if and the rules' compiled
fixed point import each other's public helpers only, so a kernel split into
modules stays a set of modules with interfaces, not one file in pieces."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("replay/engine", "replay/whatif", "replay/rules/compiled")
MODULES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py"))


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    modules = set()  # names bound to a project module: ``from replay.x import y as z``
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("replay"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name.startswith("replay"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            found.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
    return found


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_no_private_name_of_another_module(path: Path) -> None:
    assert _private_uses(path) == []


def test_the_check_finds_one(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from replay.whatif import kernel as gk\n"
        "from replay.engine.kernels import _mix\n"
        "gk._lookup()\n"
    )
    assert _private_uses(bad) == [
        "bad.py:2 imports replay.engine.kernels._mix",
        "bad.py:3 uses gk._lookup",
    ]
