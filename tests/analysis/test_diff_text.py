"""``replay diff`` as text (analysis/diff_text.py): the totals, what explains
the changes, and the first changed lookups."""

from __future__ import annotations

from pathlib import Path

from replay.analysis.diff import diff_inputs
from replay.analysis.diff_text import render_text
from tests.analysis.test_diff import write_workload


def test_no_change_says_so(trace_43559: Path) -> None:
    d = diff_inputs([trace_43559], ["vllm-0.33", "vllm-0.33"])
    lines = render_text(d).splitlines()
    assert lines[3:] == [
        "lookups: 1 compared, 0 with a different hit (B higher on 0, lower on 0)",
        "hit tokens: A 48, B 48: net 0 (B gains 0, loses 0)",
        "no lookup's hit differs",
    ]


def test_limit_cuts_the_changed_lookups(tmp_path: Path) -> None:
    d = diff_inputs([write_workload(tmp_path / "w.parquet")], ["vllm-0.33", "pre-49502"])
    assert d.changed == 56
    lines = render_text(d, limit=2).splitlines()
    at = lines.index("changed lookups (first 2 of 56):")
    # The header, its rule, then two rows, the last line of the text.
    assert len(lines) == at + 5
    assert [line.split()[1] for line in lines[at + 3 :]] == ["req-001", "req-002"]
    # Mamba state every second block: the peek margin resumes it 2 blocks on.
    assert lines[at + 3].split() == [
        "3",
        "req-001",
        "120",
        "32",
        "64",
        "+32",
        "mamba_overrun",
        "-",
        "mamba_overrun,eagle_not_dropped",
        "0,1",
    ]
    assert render_text(d, limit=56).splitlines()[at] == "changed lookups:"
