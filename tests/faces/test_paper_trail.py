"""The paper trail: every dotted ``replay.``/``analysis.`` name (and
``tests.``, ``benchmarks.``, ``mutants.``) in the repository's text
(docstrings, comments, docs, config) names a module, or a name defined in
one, that exists; every file path it gives (``replay/rules/facts.py``,
``whatif/kernel.py``) is a file of the repository; every ``*.md`` it cites
is in the repository (issue 35 item 5)."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
TEXT = (".py", ".md", ".toml", ".j2", ".sh", ".cfg", ".yml", ".yaml", ".txt")
DOTTED = re.compile(
    r"(?<![\w./-])((?:replay|analysis|tests|benchmarks|mutants)(?:\.[A-Za-z_]\w*)+)"
)
#: A cited document: a hyphenated name (a design note's) or one under docs/
#: (short names such as ``d.md`` are example outputs).
CITED_MD = re.compile(r"(?<![\w/.-])((?:docs/)?(?:[a-z]+(?:-[a-z]+)+|(?<=docs/)\w+)\.md)\b")
#: Dotted names that are not modules: keys and topics the files and the
#: wire carry, and a local variable named ``replay``.
NOT_MODULES = {
    "replay.trace",  # a trace's metadata key (replay.format.schema)
    "replay.results",  # a results file's metadata key
    "replay.expect",  # a regression trace's expectations key
    "replay.sweep",  # a sweep file's metadata key (replay.format.sweepfile)
    "replay.diff",  # a diff file's metadata key
    "replay.drift",  # a drift trace's metadata key (replay.tools.drift)
    "replay.segment",  # a segment's footer metadata key (replay.format.segments)
    "replay.lookups",  # the vLLM plugin's ZMQ topic (replay.adapters.vllm.plugin)
    "replay.notes",  # a click context's meta key (replay.cli.common)
    "replay.fetch",  # replay.sources.record: its replay-buffer variable
    "replay.close",
    # test_private_names's examples of what its check finds
    "replay.x",
    "replay.engine.kernels._mix",
    "tests.py",  # a file name (``conftest``'s ``tests.py``)
}


def _files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [
        ROOT / f
        for f in listed
        if (f.endswith(TEXT) or Path(f).name == "Makefile") and (ROOT / f).is_file()
    ]


def _resolves(name: str) -> bool:
    """A module, or a module and names defined in it (attributes, members)."""
    parts = name.split(".")
    if "__main__" in parts:  # importing it runs the command line
        return True
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except pytest.skip.Exception:
            return True  # a test module whose extra (Ray, vLLM) is missing here
        except ModuleNotFoundError as exc:
            if exc.name and module != exc.name and not module.startswith(exc.name + "."):
                return True  # the module exists; an optional dependency is missing
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_module_name_exists() -> None:
    stale: dict[str, list[str]] = {}
    for path in _files():
        text = path.read_text(errors="replace")
        for match in DOTTED.finditer(text):
            name = match.group(1)
            if name in NOT_MODULES or _resolves(name):
                continue
            stale.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert stale == {}


def test_every_cited_markdown_file_is_in_the_repository() -> None:
    present = {p.name for p in ROOT.rglob("*.md") if ".venv" not in p.parts}
    missing: dict[str, list[str]] = {}
    for path in _files():
        for match in CITED_MD.finditer(path.read_text(errors="replace")):
            if Path(match.group(1)).name not in present:
                missing.setdefault(match.group(1), []).append(str(path.relative_to(ROOT)))
    assert missing == {}


@pytest.mark.parametrize("name", ["replay.rules.coordinator.policy", "replay.analysis.flags.FLAGS"])
def test_a_real_name_resolves_and_a_moved_one_does_not(name: str) -> None:
    assert _resolves(name)
    assert not _resolves(name.replace("rules.", "").replace("flags.FLAGS", "flagz"))


#: A file path in the text: directories, then a file with an extension.
PATH = re.compile(
    r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)+[\w-]+\.(?:py|md|toml|sh|j2|json|cfg|yml|yaml))\b"
)


def _repository_paths() -> set[str]:
    """Every tracked file, also under the package's links (``replay/analysis``
    is ``analysis/``, ``replay/corpus`` is ``traces/``)."""
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    links = {"analysis/": "replay/analysis/", "traces/": "replay/corpus/"}
    return set(listed) | {
        to + f.removeprefix(at) for f in listed for at, to in links.items() if f.startswith(at)
    }


def _stale_paths(text: str, paths: set[str], roots: set[str]) -> list[str]:
    """The paths ``text`` gives that name no file of the repository: a path
    from the top (``replay/rules/facts.py``) or the tail of one
    (``whatif/kernel.py``). A path whose first directory is none of the
    repository's (an example output ``d/t.parquet``, vLLM's own
    ``sched/scheduler.py``) or is vLLM's tree (``vllm/v1/core/...``), or a
    placeholder in capitals (``traces/NAME.parquet``), is not checked."""
    stale = []
    for match in PATH.finditer(text):
        path = match.group(1)
        parts = path.split("/")
        if parts[0] not in roots or any(
            p.split(".")[0].isupper() or "X" in p.split(".")[0].split("_") for p in parts
        ):
            continue
        if path in paths or any(p.endswith("/" + path) for p in paths):
            continue
        if parts[0] == "vllm" and parts[1] in ("v1", "distributed", "config"):
            continue  # vLLM's own files (the adapters' ``vllm/`` package is ours)
        stale.append(path)
    return stale


def test_every_file_path_names_a_file_of_the_repository() -> None:
    paths = _repository_paths()
    # Every directory name of the repository: a path must start at one.
    roots = {d for p in paths for d in p.split("/")[:-1]} | {"shared"}
    stale: dict[str, list[str]] = {}
    for path in _files():
        if path == Path(__file__).resolve():
            continue  # its own examples of stale paths
        for name in _stale_paths(path.read_text(errors="replace"), paths, roots):
            stale.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert stale == {}
    assert "replay/analysis/flags.py" in paths and "whatif" in roots


def test_a_moved_path_is_stale_and_a_real_one_is_not() -> None:
    paths = _repository_paths()
    roots = {d for p in paths for d in p.split("/")[:-1]} | {"shared"}
    text = (
        "see replay/rules/facts.py, whatif/kernel.py and analysis/flags.py; "
        "not replay/blockpool.py, engine/flags.py or shared/design/notes.md; "
        "vllm/v1/core/block_pool.py is vLLM's, traces/NAME.parquet a placeholder"
    )
    assert _stale_paths(text, paths, roots) == [
        "replay/blockpool.py",
        "engine/flags.py",
        "shared/design/notes.md",
    ]
