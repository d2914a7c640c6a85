"""One JSON shape per command (docs/json.md): the frame, the variants list
(even for one replay), the same keys for the same things, numbers as
numbers; every key a command prints is documented."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "traces" / "issue-43559.parquet"
DOC = (ROOT / "docs" / "json.md").read_text()

VARIANT = ["policy", "cache", "coordinator"]
FLAG = ["flag", "severity", "lookups"]
FLAGGED = [
    "seq",
    "request_id",
    "flag",
    "group_id",
    "hit_tokens",
    "max_length",
    "actual",
    "expected",
    "detail",
    "severity",
]


def _json(args: list[Any], status: int = 0) -> dict[str, Any]:
    result = run_cli(args)
    assert result.exit_code == status, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def _documented(command: str) -> set[str]:
    """Every `key` named in the doc's frame and in the command's section."""
    frame = DOC.split("\n## ")[0]
    section = DOC.split(f"## `replay {command} --json`")[1].split("\n## ")[0]
    return set(re.findall(r"`([a-z_]+)`", frame + section))


def _keys(obj: Any) -> set[str]:
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in _keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in _keys(v)}
    return set()


def test_run_one_policy_is_a_list_of_one_variant(tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    data = _json(["run", TRACE, "--policy", "pre-49502", "-o", out, "--json"])
    assert list(data) == ["version", "command", "trace", "variants"]
    assert (data["version"], data["command"], data["trace"]) == (1, "run", str(TRACE))
    (v,) = data["variants"]
    assert list(v) == [
        *VARIANT,
        "results",
        "events",
        "events_by_kind",
        "lookups",
        "lookups_with_hit",
        "prompt_tokens",
        "hit_tokens",
        "hit_ratio",
        "observed",
        "groups",
        "flags",
        "seconds",
        "events_per_second",
        "lookups_per_second",
        "answered",
        "flagged",
    ]
    assert (v["policy"], v["results"], v["hit_ratio"]) == ("pre-49502", str(out), 0.984615)
    assert v["answered"] == "compiled"
    assert [list(f) for f in v["flags"]] == [FLAG, FLAG]
    assert [f["severity"] for f in v["flags"]] == ["corruption", "performance"]
    assert [list(r) for r in v["flagged"]] == [FLAGGED, FLAGGED]
    assert _keys(data) - {"store", "remove", "clear", "lookup"} <= _documented("run")


def test_run_two_policies_is_the_same_shape(tmp_path: Path) -> None:
    data = _json(["run", TRACE, "--policy", "vllm-0.33", "--policy", "pre-49502", "-o", tmp_path / "r.parquet", "--json"])  # fmt: skip
    assert list(data) == ["version", "command", "trace", "variants"]
    assert [(v["policy"], v["results"]) for v in data["variants"]] == [
        ("vllm-0.33", str(tmp_path / "r.vllm-0.33.parquet")),
        ("pre-49502", str(tmp_path / "r.pre-49502.parquet")),
    ]


@pytest.mark.parametrize("given", ["trace", "results"])
def test_check(tmp_path: Path, given: str) -> None:
    path = TRACE
    if given == "results":
        path = tmp_path / "r.results.parquet"
        assert run_cli(["run", TRACE, "--policy", "pre-49502", "-o", path, "-q"]).exit_code == 0
    data = _json(["check", path, "--policy", "pre-49502", "--json"], status=1)
    assert list(data) == [
        "version",
        "command",
        "trace",
        "results",
        "fail_on",
        "failed",
        "variants",
    ]
    assert (data["command"], data["failed"], data["fail_on"]) == (
        "check",
        True,
        ["mamba_overrun", "missing_block"],
    )
    assert (data["trace"], data["results"]) == (
        (str(TRACE), None) if given == "trace" else ("issue-43559.parquet", str(path))
    )
    (v,) = data["variants"]
    assert list(v) == [*VARIANT, "flagged_lookups", "flags", "flagged"]
    assert v["flags"] == [
        {"flag": "mamba_overrun", "severity": "corruption", "lookups": 1, "fails": True},
        {"flag": "eagle_not_dropped", "severity": "performance", "lookups": 1, "fails": False},
    ]
    assert [list(r) for r in v["flagged"]] == [FLAGGED, FLAGGED]
    assert _keys(data) <= _documented("check")


def test_info() -> None:
    data = _json(["info", TRACE, "--json"])
    assert list(data) == [
        "version",
        "command",
        "trace",
        "config",
        "events",
        "events_by_kind",
        "seq_range",
        "time_span",
        "hash_entries",
        "distinct_keys_per_group",
        "lookups",
        "prompt_tokens",
        "max_length_tokens",
    ]
    assert data["time_span"] == {"first": None, "last": None, "seconds": None, "relative": False}
    assert (data["lookups"], data["prompt_tokens"]) == (1, 65)
    top = set(data) | set(data["time_span"])
    assert top - {"store", "remove", "clear", "lookup"} <= _documented("info")


def test_diff_of_a_trace_and_of_two_results(tmp_path: Path) -> None:
    data = _json(["diff", TRACE, "--policy", "vllm-0.33", "--policy", "pre-49502", "--json"])
    assert list(data)[:5] == ["version", "command", "trace", "output", "variants"]
    assert [list(v) for v in data["variants"]] == [[*VARIANT, "label", "results", "hit_tokens"]] * 2
    assert [(v["policy"], v["hit_tokens"], v["results"]) for v in data["variants"]] == [
        ("vllm-0.33", 48, None),
        ("pre-49502", 64, None),
    ]
    assert data["reasons"][0]["severity"] == "corruption"
    assert _keys(data) <= _documented("diff")
    a, b = tmp_path / "a.results.parquet", tmp_path / "b.results.parquet"
    for out, policy in ((a, "vllm-0.33"), (b, "pre-49502")):
        assert run_cli(["run", TRACE, "--policy", policy, "-o", out, "-q"]).exit_code == 0
    files = _json(["diff", a, b, "--json"])
    assert list(files) == list(data)
    assert files["trace"] == "issue-43559.parquet"
    assert [v["results"] for v in files["variants"]] == [str(a), str(b)]


def test_bisect() -> None:
    data = _json(["bisect", TRACE, "--json", "--from", "0.26.0", "--to", "0.27.1"])
    assert list(data) == [
        "version",
        "command",
        "trace",
        "request_id",
        "trace_vllm_version",
        "trace_release",
        "caches",
    ]
    assert (data["version"], data["command"], data["trace"]) == (1, "bisect", str(TRACE))
    assert (data["request_id"], data["trace_vllm_version"], data["trace_release"]) == (None,) * 3
    gpu, mooncake = data["caches"]
    assert list(mooncake) == [
        "cache",
        "releases",
        "not_modelled",
        "lookups",
        "changing_lookups",
    ]
    assert mooncake["releases"] == [
        {"policy": "vllm-0.26", "first": "0.26.0", "last": "0.26.0", "prs": "#46384"},
        {"policy": "vllm-0.27", "first": "0.27.0", "last": "0.27.1", "prs": "#49502"},
    ]
    (lookup,) = mooncake["lookups"]
    assert list(lookup) == ["seq", "request_id", "answers", "cells", "changes"]
    assert lookup["answers"] == {
        "vllm-0.26": {
            "hit_tokens": 64,
            "masks": [[0, 3], [3, 1]],
            "flags": ["mamba_overrun", "eagle_not_dropped"],
        },
        "vllm-0.27": {"hit_tokens": 48, "masks": [[0, 3], [2, 1]], "flags": []},
    }
    assert lookup["cells"] == {
        "vllm-0.26": "64 [0+3 3+1] mamba_overrun,eagle_not_dropped",
        "vllm-0.27": "48 [0+3 2+1]",
    }
    assert lookup["changes"] == [
        {
            "policy": "vllm-0.27",
            "release": "0.27.0",
            "changes": [
                "hit 64 -> 48",
                "masks 0+3 3+1 -> 0+3 2+1",
                "flags -mamba_overrun -eagle_not_dropped",
            ],
        }
    ]
    # The engine's gate came with 0.26.0: nothing changes in this range.
    assert (gpu["cache"], gpu["changing_lookups"], gpu["not_modelled"]) == ("gpu", 0, {})
    # Every key but the policy names keying answers, cells and not_modelled.
    named = {p["policy"] for c in data["caches"] for p in c["releases"]}
    assert _keys(data) - named <= _documented("bisect")


def test_test(tmp_path: Path) -> None:
    """``replay test --json``: the versioned frame, then the counts and one
    entry per trace x policy x cache (issue 31)."""
    data = _json(["test", TRACE, "--json"])
    assert list(data)[:3] == ["version", "command", "trace"]
    assert (data["version"], data["command"], data["trace"]) == (1, "test", None)
    assert data["traces"] == [str(TRACE)]
    assert (data["passed"], data["failed"], data["skipped"]) == (7, 0, 0)
    assert data["expectations_total"] == 7
    first = data["expectations"][0]
    assert list(first)[:4] == ["trace", *VARIANT]
    assert (first["status"], first["lookups"], first["cause"], first["problems"]) == (
        "passed",
        0,
        None,
        [],
    )
    assert isinstance(data["seconds"], float)
    assert _keys(data) <= _documented("test")
