"""No module of the project reaches into another module's private names
(issue 35 item 2): every module of ``replay/`` imports the public names of
the others only (``from replay.x import _y`` and ``x._y`` on an imported
project module both fail here), so a kernel split into modules stays a set
of modules with interfaces, not one file in pieces, and a private name can
change without a search of the tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted((ROOT / "replay").rglob("*.py"))

#: Offenders left for another change, each with why (none left).
ALLOWED: dict[str, set[str]] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_module(dotted: str, root: Path) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _package(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1])


def private_uses(path: Path, root: Path = ROOT, package: str = "replay") -> list[str]:
    """Where ``path`` uses a private name of another project module: its
    ``from`` imports and its attribute accesses on names bound to a project
    module (``import replay.x as m``, ``from replay import x``, ``import
    replay.x`` then a private attribute down the chain from ``replay``)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    bound: dict[str, str] = {}  # local name -> the project module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package(path, root).split(".")
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            if base.split(".")[0] != package:
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: imports {base}.{alias.name}")
                if _is_module(f"{base}.{alias.name}", root):
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != package:
                    continue
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[package] = package
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain: list[str] = []
        value: ast.expr = node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not (isinstance(value, ast.Name) and value.id in bound):
            continue
        dotted = ".".join([bound[value.id], *reversed(chain)])
        if _is_module(dotted, root):
            found.append(f"{node.lineno}: uses {dotted}.{node.attr}")
    return sorted(found, key=lambda use: int(use.split(":")[0]))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_no_private_name_of_another_module(path: Path) -> None:
    allowed = ALLOWED.get(str(path.relative_to(ROOT)), set())
    uses = private_uses(path)
    assert [u for u in uses if u.split(": ", 1)[1] not in allowed] == []
    # An allowance that is no longer used goes (the offender was fixed).
    assert allowed <= {u.split(": ", 1)[1] for u in uses}


def test_the_check_finds_each_kind(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg" / "whatif"
    pkg.mkdir(parents=True)
    for name in ("__init__.py", "kernel.py", "stack.py"):
        (pkg / name).write_text("")
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "engine").mkdir()
    (tmp_path / "pkg" / "engine" / "kernels.py").write_text("")
    bad = pkg / "bad.py"
    bad.write_text(
        "import pkg.whatif.kernel\n"
        "import pkg.engine.kernels as ek\n"
        "from pkg.whatif import kernel as gk, stack\n"
        "from pkg.engine.kernels import _mix\n"
        "from .kernel import _cdiv, run_gpu\n"
        "from . import stack as st\n"
        "gk._lookup()\n"
        "ek._key_meta\n"
        "pkg.whatif.kernel._facts\n"
        "st._chunk_ends\n"
        "run_gpu._private_attribute_of_a_function\n"
        "stack.__doc__\n"
    )
    assert private_uses(bad, tmp_path, "pkg") == [
        "4: imports pkg.engine.kernels._mix",
        "5: imports pkg.whatif.kernel._cdiv",
        "7: uses pkg.whatif.kernel._lookup",
        "8: uses pkg.engine.kernels._key_meta",
        "9: uses pkg.whatif.kernel._facts",
        "10: uses pkg.whatif.stack._chunk_ends",
    ]
