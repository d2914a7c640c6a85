"""`replay bisect`: every modelled release's answer per lookup, from one fold,
and the releases where a lookup's hit, masks or flags change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.analysis.bisect import releases_between
from replay.base.errors import ReplayError
from tests.conftest import run_cli

TRACES = Path(__file__).resolve().parents[2] / "traces"
ISSUE = TRACES / "issue-43559.parquet"


def _bisect(*args: str) -> dict:  # type: ignore[type-arg]
    result = run_cli(["bisect", ISSUE, "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_43559_overrun_until_the_gate_in_each_cache() -> None:
    report = _bisect()
    gpu, mooncake = report["caches"]
    assert (gpu["cache"], mooncake["cache"]) == ("gpu", "mooncake")
    [lookup] = gpu["lookups"]
    assert {k: v["hit_tokens"] for k, v in lookup["answers"].items()} == {
        "vllm-0.16": 48,
        "vllm-0.20": 64,
        "vllm-0.22": 64,
        "vllm-0.23": 64,
        "vllm-0.24": 64,
        "vllm-0.26": 48,
        "vllm-0.27": 48,
        "vllm-0.28": 48,
        "vllm-0.29": 48,
        "vllm-0.30": 48,
        "vllm-0.32": 48,
        "vllm-0.33": 48,
        "vllm-0.34": 48,
    }
    # The engine's overrun comes with the peek margin (#40860) and goes with
    # its Mamba gate in 0.26.0 (#46384).
    assert lookup["changes"] == [
        {
            "policy": "vllm-0.20",
            "release": "0.20.0",
            "changes": [
                "hit 48 -> 64",
                "masks 0+3 2+1 -> 0+3 3+1",
                "flags +mamba_overrun +eagle_not_dropped",
            ],
        },
        {
            "policy": "vllm-0.26",
            "release": "0.26.0",
            "changes": [
                "hit 64 -> 48",
                "masks 0+3 3+1 -> 0+3 2+1",
                "flags -mamba_overrun -eagle_not_dropped",
            ],
        },
    ]
    # The mirror overruns from its creation to 0.26 and is fixed in 0.27.0 (#49502).
    assert sorted(mooncake["not_modelled"]) == ["vllm-0.16", "vllm-0.20"]
    [lookup] = mooncake["lookups"]
    assert lookup["answers"]["vllm-0.26"] == {
        "hit_tokens": 64,
        "masks": [[0, 3], [3, 1]],
        "flags": ["mamba_overrun", "eagle_not_dropped"],
    }
    assert [(c["policy"], c["changes"][0]) for c in lookup["changes"]] == [
        ("vllm-0.27", "hit 64 -> 48")
    ]


def test_range_request_and_cache_options() -> None:
    report = _bisect(
        "--from", "0.25.0", "--to", "0.27.1", "--cache", "mooncake", "--request", "req-43559"
    )
    [mooncake] = report["caches"]
    assert [r["policy"] for r in mooncake["releases"]] == ["vllm-0.24", "vllm-0.26", "vllm-0.27"]
    assert mooncake["changing_lookups"] == 1


OVER, FIXED = "64 [0+3 3+1] mamba_overrun,eagle_not_dropped", "48 [0+3 2+1]"


def test_markdown_is_the_whole_report() -> None:
    """The Markdown of issue-43559, every line: a table per cache whose rows
    have one cell per header, the releases each cache did not have, and
    where the answer changes (the engine's overrun from 0.20 to 0.23, the
    mirror's from its creation to 0.26)."""
    result = run_cli(["bisect", ISSUE])
    assert (result.exit_code, result.stderr) == (0, "")
    gpu = ["vllm-0.16", "vllm-0.20", "vllm-0.22", "vllm-0.23", "vllm-0.24", "vllm-0.26"]
    gpu += ["vllm-0.27"]
    gpu += ["vllm-0.28", "vllm-0.29", "vllm-0.30", "vllm-0.32", "vllm-0.33", "vllm-0.34"]
    mirror = gpu[2:]
    # The gpu cache is answered above: no advice to bisect it (issue 36).
    no_mirror = "has no Mooncake store mirror: it came with #42828 in vLLM 0.22.0"
    change = "hit {} -> {}, masks 0+3 {}+1 -> 0+3 {}+1, flags {}mamba_overrun {}eagle_not_dropped"
    assert result.stdout.splitlines() == [
        f"# replay bisect {ISSUE}",
        "",
        "## gpu cache",
        "",
        "1 lookup, 1 changing between 0.16.0 and 0.34.0 in 1 pattern (cells: hit "
        "[skipped+loaded blocks per group] flags)",
        "",
        "| lookups | seq | request | " + " | ".join(gpu) + " |",
        "|---|---|---|" + "---|" * 13,
        "| 1 | 2 | req-43559 | " + " | ".join([FIXED] + [OVER] * 4 + [FIXED] * 8) + " |",
        "",
        "- seq 2 (req-43559): at vllm-0.20 (vLLM 0.20.0): "
        + change.format(48, 64, 2, 3, "+", "+")
        + "; at vllm-0.26 (vLLM 0.26.0): "
        + change.format(64, 48, 3, 2, "-", "-"),
        "",
        "## mooncake cache",
        "",
        f"- vllm-0.16: not answered: policy vllm-0.16 (vLLM 0.16.0 - 0.19.1) {no_mirror}",
        f"- vllm-0.20: not answered: policy vllm-0.20 (vLLM 0.20.0 - 0.21.0) {no_mirror}",
        "",
        "1 lookup, 1 changing between 0.22.0 and 0.34.0 in 1 pattern (cells: hit "
        "[skipped+loaded blocks per group] flags)",
        "",
        "| lookups | seq | request | " + " | ".join(mirror) + " |",
        "|---|---|---|" + "---|" * 11,
        "| 1 | 2 | req-43559 | " + " | ".join([OVER] * 4 + [FIXED] * 7) + " |",
        "",
        "- seq 2 (req-43559): at vllm-0.27 (vLLM 0.27.0): " + change.format(64, 48, 3, 2, "-", "-"),
        "",
    ]
    # Each table's rows are as wide as its header: valid Markdown.
    tables = [t for t in result.stdout.split("\n\n") if t.startswith("|")]
    assert [{row.count("|") for row in t.splitlines()} for t in tables] == [{17}, {15}]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--request", "nope"],
            f"error: {ISSUE}: no lookup with request_id 'nope'; nearest: 'req-43559' "
            f"(replay info {ISSUE} --requests lists them all)",
        ),
        (["--from", "0.30.0", "--to", "0.26.0"], "error: --from 0.30.0 is after --to 0.26.0"),
        (
            ["--from", "0.40.0"],
            "error: --from 0.40.0 is outside the modelled vLLM releases, 0.16.0 to 0.34.0",
        ),
        (
            ["--from", "0.10.0"],
            "error: --from 0.10.0 is outside the modelled vLLM releases, 0.16.0 to 0.34.0",
        ),
        (
            ["--to", "0.35.0"],
            "error: --to 0.35.0 is outside the modelled vLLM releases, 0.16.0 to 0.34.0",
        ),
        (["--to", "0.x"], "error: --to: vLLM version '0.x': expected MAJOR.MINOR[.PATCH]"),
    ],
)
def test_bad_options_are_one_line(args: list[str], message: str) -> None:
    result = run_cli(["bisect", ISSUE, *args])
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", message + "\n")


def test_releases_between_bounds() -> None:
    assert [p.name for p in releases_between("0.21.0", "0.22.1")] == ["vllm-0.20", "vllm-0.22"]
    with pytest.raises(ReplayError):
        releases_between("0.35.0", None)
