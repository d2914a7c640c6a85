"""Group the test files by layer, each named after its subject (issue 35
item 5): written down, not yet run (the branches in flight edit these
files; run it on main once they are merged).

    python tools/group_tests.py          # print the moves
    python tools/group_tests.py --apply  # git mv them and fix every reference

It moves ``tests/test_X.py`` to ``tests/<layer>/test_Y.py`` (``git mv``,
so history follows), adds an empty ``__init__.py`` to each folder (the
tests import ``tests.builders`` and ``tests.conftest``, which stay at the
top with ``tests/contracts/``), makes a moved file's ``Path(__file__)``
climb one folder more, and rewrites every ``tests/test_X.py`` cited in the
repository's text (docstrings, docs, the Makefile, traces/, mutants/).
A file of no known layer stops the script: add it to ``LAYERS``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

#: layer folder -> its test files' stems (without ``test_``), in the
#: floors of docs/architecture.md; a rename is ``old:new``.
LAYERS: dict[str, list[str]] = {
    "base": [
        "spec",
        "units",
        "limits",
        "limits_records:limits_of_record_readers",
        "deprecation",
        "private_names",
    ],
    "rules": [
        "blockpool",
        "cache",
        "coordinator",
        "store_rules",
        "mooncake_store",
        "releases",
        "release_stores",
        "compiled_fixed_point",
        "eviction_orders",
    ],
    "format": [
        "trace",
        "tracedir",
        "paths",
        "link",
        "format_doc",
        "outputs",
        "wide_keys",
        "jit",
        "segments",
        "repair",
    ],
    "engine": ["engine", "answers", "shard", "kernels", "cluster"],
    "whatif": [
        "whatif",
        "whatif_call",
        "whatif_kernel",
        "whatif_mooncake_kernel",
        "whatif_stack",
    ],
    "sources": [
        "archetypes",
        "dump",
        "hashing",
        "kv_config",
        "kv_rows",
        "kv_wire",
        "lookup_log",
        "mooncake",
        "record_extra",
        "record_ingest",
        "record_late",
        "record_lookups",
        "record_scheduler",
        "record_zmq",
        "record_faults",
        "synth",
        "workload",
    ],
    "analysis": [
        "flags",
        "selection",
        "diff",
        "diff_text",
        "bisect",
        "summary",
        "charts",
        "report_build",
        "report_data",
        "report_html",
        "report_markdown",
        "report_writer",
        "report_browser",
        "sweep_browser",
        "finder_cause",
    ],
    "adapters": ["adapters_private_names:private_names_table"],
    "tools": ["minimize", "render", "drift_render"],
    "watch": ["watch"],
    "faces": [
        "cli_common",
        "cli_edges",
        "cli_errors",
        "cli_guard",
        "cli_inspect",
        "cli_options",
        "cli_progress",
        "cli_run",
        "cli_usage",
        "json_shape",
        "pytest_plugin",
        "policy_choice",
        "wording",
        "signals",
        "hostile:hostile_inputs",
        "hostile_round3:hostile_inputs_found_later",
        "fuzz:hostile_inputs_generated",
        "paper_trail",
        "did_you_mean_36:did_you_mean",
        "ranges_36:ranges_refused",
        "text_style_36:text_style",
    ],
    # The differential tests against vLLM's own classes (make test-vllm).
    "vllm": [
        "vllm_differential",
        "engine_vllm",
        "eagle_groups_vllm",
        "guard_vllm",
        "record_vllm",
        "store_rules_vllm",
        "whatif_vllm",
        "adopt_vllm",
        "store_worker_vllm",
        "watch_vllm",
    ],
}


def moves() -> dict[str, str]:
    """``tests/test_X.py`` -> ``tests/<layer>/test_Y.py``."""
    out: dict[str, str] = {}
    for layer, stems in LAYERS.items():
        for stem in stems:
            old, _, new = stem.partition(":")
            out[f"tests/test_{old}.py"] = f"tests/{layer}/test_{new or old}.py"
    present = {str(p.relative_to(ROOT)) for p in TESTS.glob("test_*.py")}
    unplaced = sorted(present - set(out))
    if unplaced:
        sys.exit(f"no layer for {', '.join(unplaced)}: add them to LAYERS")
    return {old: new for old, new in out.items() if old in present}


def apply(planned: dict[str, str]) -> None:
    for layer in LAYERS:
        (TESTS / layer).mkdir(exist_ok=True)
        init = TESTS / layer / "__init__.py"
        if not init.exists():
            init.write_text("")
            subprocess.run(["git", "add", str(init)], cwd=ROOT, check=True)
    for old, new in planned.items():
        subprocess.run(["git", "mv", old, new], cwd=ROOT, check=True)
        path = ROOT / new
        text = path.read_text()
        # One folder deeper: a path built from this file climbs one more.
        text = re.sub(
            r"Path\(__file__\)\.resolve\(\)\.parent\b",
            "Path(__file__).resolve().parent.parent",
            text,
        )
        text = re.sub(r"Path\(__file__\)\.parent\b", "Path(__file__).parent.parent", text)
        text = re.sub(
            r"(Path\(__file__\)(?:\.resolve\(\))?\.parents\[)(\d+)\]",
            lambda m: f"{m[1]}{int(m[2]) + 1}]",
            text,
        )
        path.write_text(text)
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    cited = re.compile(r"tests/test_\w+\.py")
    # The tests import each other as modules too (tests.analysis.test_diff).
    modules = {o[:-3].replace("/", "."): n[:-3].replace("/", ".") for o, n in planned.items()}
    imported = re.compile(r"\btests\.test_\w+")
    for f in listed.stdout.split():
        p = ROOT / f
        if not p.is_file() or p.suffix in (".parquet", ".png"):
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        new_text = cited.sub(lambda m: planned.get(m[0], m[0]), text)
        new_text = imported.sub(lambda m: modules.get(m[0], m[0]), new_text)
        if new_text != text:
            p.write_text(new_text)


if __name__ == "__main__":
    planned = moves()
    for old, new in planned.items():
        print(f"git mv {old} {new}")
    if "--apply" in sys.argv:
        apply(planned)
