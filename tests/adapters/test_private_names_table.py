"""Issue 30: the vLLM adapters touch no name of vLLM's starting with an
underscore except those listed, with why and where checked, in
``replay.adapters.vllm.backend.PRIVATE_NAMES``. An AST scan of the package,
no vLLM needed: an attribute read on anything but the adapter's own
``self``/``cls``, or a string naming one (``getattr``/``setattr``/state
dicts), that is private and neither the package's own nor in the table,
fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from replay.adapters.vllm.backend import PRIVATE_NAMES

PACKAGE = Path(__file__).resolve().parent.parent.parent / "replay" / "adapters"
PRIVATE = re.compile(r"^_[A-Za-z]\w*$")


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _scan(source: str) -> tuple[set[str], dict[str, int]]:
    """The package's own private names (its functions, classes, module names,
    ``self``/``cls`` attributes and ``__slots__``), and every private name it
    touches otherwise, with a line."""
    tree = ast.parse(source)
    own: set[str] = set()
    touched: dict[str, int] = {}
    in_fstring: set[int] = set()
    table: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign | ast.Assign) and "PRIVATE_NAMES" in {
            t.id for t in ast.walk(node) if isinstance(t, ast.Name)
        }:
            table.update(id(n) for n in ast.walk(node))
        if isinstance(node, ast.JoinedStr):
            in_fstring.update(id(v) for v in node.values)
        if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            own.update(
                e.value
                for e in ast.walk(node.value)
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            )
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and PRIVATE.match(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                if isinstance(node.ctx, ast.Store):
                    own.add(node.attr)
                continue
            touched.setdefault(node.attr, node.lineno)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and PRIVATE.match(node.value)
            and id(node) not in in_fstring
            and id(node) not in table
        ):
            touched.setdefault(node.value, node.lineno)
    return own, touched


def _unlisted(source: str) -> dict[str, int]:
    own, touched = _scan(source)
    return {
        name: line
        for name, line in touched.items()
        if not _dunder(name) and name not in own and name not in PRIVATE_NAMES
    }


def test_the_adapters_touch_no_private_vllm_name_outside_the_table() -> None:
    unlisted = {
        f"{path.relative_to(PACKAGE.parent.parent)}:{line} {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, line in _unlisted(path.read_text(encoding="utf-8")).items()
    }
    assert unlisted == set()


def test_every_table_entry_is_used_and_says_where_it_was_checked() -> None:
    used: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        own, touched = _scan(path.read_text(encoding="utf-8"))
        used.update(name for name in touched if name not in own)
    assert set(PRIVATE_NAMES) <= used
    for name, (why, releases) in PRIVATE_NAMES.items():
        assert why and re.fullmatch(r"0\.\d+\.\d+(-0\.\d+\.\d+)?", releases), name


def test_the_scan_catches_a_private_read_a_private_string_and_not_the_own() -> None:
    source = (
        "class Mine:\n"
        "    __slots__ = ('_slot',)\n"
        "    def __init__(self, pool):\n"
        "        self._mine = pool.cached_block_hash_to_block._cache\n"
        "        getattr(pool, '_blocks')\n"
        "        print(f'{pool}_dp', pool.__class__, self._mine)\n"
    )
    assert _unlisted(source) == {"_cache": 4, "_blocks": 5}
