"""Issue 36 item 6: one style for counts in every command's text. The
bundled demo's commands, as ``make demo`` runs them (and bisect, whatif and
validate on the same trace), are scanned for the two slips a reader trips
on; the rule, precisely:

- **plurals**: a count of exactly one takes the singular noun: no
  ``1 <word ending in s>`` (``1 lookups``; ``group 1 resumes`` names a
  group, and a few words that end in s but are no plural, such as
  ``1 pass``, are exempt) and no ``lookup(s)``;
- **thousands**: a number of 1,000 or more is written with comma
  separators (``1,575 events``, ``hit 1,040``, ``+1,392``) unless it
  identifies rather than counts: a seq (after ``seq``/``seqs``/``--at``, a
  ``seq`` column of a table, a ``seq A..B`` range), and anything joined to
  letters or to ``. _ : / # = -`` without a space (versions ``0.33.0``,
  dates ``2025-01-01T00:00``, PRs ``#43559``, settings
  ``hash_block_size=16``, ids ``s18-t1``, file names, hex hashes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from replay.cli import cli

DEMO = Path(__file__).parents[2] / "traces" / "demo-full-mamba-eagle.parquet"

#: The commands of ``make demo`` (its Makefile target), then the other
#: commands that print text about the same trace.
COMMANDS = [
    "info {t}",
    "run {t} -o out/demo.vllm-0.33.results.parquet",
    "run {t} --policy pre-49502 -o out/demo.pre-49502.results.parquet --examples 2",
    "check out/demo.pre-49502.results.parquet --examples 1",
    "explain {t} --request s18-t1 --policy pre-49502",
    "state {t} --at 54 --show 2",
    "explain {t} --request s18-t1",
    "diff {t} --policy vllm-0.33 --policy pre-49502 --limit 3",
    "report out/demo.pre-49502.results.parquet --trace {t} -o out/demo-report.html",
    "validate {t}",
    "state {t}",
    "bisect {t}",
    "whatif {t} --capacity 10%,50%,100% -o out/sweep.parquet --jobs 1",
]

_NOT_PLURAL = {"is", "was", "has", "pass", "does", "this", "its", "as", "us", "always"}
_ONE_PLURAL = re.compile(r"(?<![\d.,+-])\b1 ([a-z][a-z_]*s)\b")
_MAYBE_PLURAL = re.compile(r"\w\((?:s|es)\)")
_NUMBER = re.compile(r"(?<![\w.:/#=,-])[+-]?(\d{4,})(?![\w.:/,]|-\w)")
_SEQ = re.compile(r"\b(?:seqs?|--at|--seq) [+-]?\d+(?:\.\.\d+)?")


def _seq_columns(lines: list[str], i: int) -> list[tuple[int, int]]:
    """The character spans of the ``seq`` columns of the table line ``i``
    belongs to (a header over a rule of dashes, or a Markdown table)."""
    spans: list[tuple[int, int]] = []
    for j in range(i, -1, -1):
        if j + 1 < len(lines) and re.fullmatch(r"[- ]+", lines[j + 1] or "x"):
            header, rule = lines[j], lines[j + 1]
            for m in re.finditer(r"-+", rule):
                if header[m.start() : m.end()].strip() == "seq":
                    spans.append((m.start(), m.end()))
            return spans
        if lines[j].startswith("|") and j + 1 < len(lines) and lines[j + 1].startswith("|---"):
            cells = [c.strip() for c in lines[j].split("|")]
            if "seq" in cells:
                k = cells.index("seq")
                spans.append((-k, -k))  # a Markdown column, by its index
            return spans
        if not lines[j].strip():
            return spans
    return spans


def slips(text: str) -> list[str]:
    """Every slip of the rule above in ``text``, as ``line: what``."""
    found = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        for m in _ONE_PLURAL.finditer(line):
            if m[1] not in _NOT_PLURAL and not line[: m.start()].endswith("group "):
                found.append(f"{line!r}: '1 {m[1]}'")
        for m in _MAYBE_PLURAL.finditer(line):
            found.append(f"{line!r}: '{m[0]}'")
        ids = {p for s in _SEQ.finditer(line) for p in range(s.start(), s.end())}
        columns = _seq_columns(lines, i)
        markdown = [-a for a, b in columns if a == b and a <= 0]
        cells = line.split("|") if line.startswith("|") else []
        for m in _NUMBER.finditer(line):
            if m.start(1) in ids:
                continue
            if any(a <= m.start(1) < b for a, b in columns if a != b):
                continue
            if cells and any(
                k < len(cells) and cells[k].strip() == m[0]
                for k in markdown
                if line[: m.start()].count("|") == k
            ):
                continue
            found.append(f"{line!r}: '{m[0]}'")
    return found


def test_the_rule_catches_what_it_says() -> None:
    assert slips("loaded 1 blocks, 1 traces, 2 lookup(s)") == [
        "'loaded 1 blocks, 1 traces, 2 lookup(s)': '1 blocks'",
        "'loaded 1 blocks, 1 traces, 2 lookup(s)': '1 traces'",
        "'loaded 1 blocks, 1 traces, 2 lookup(s)': 'p(s)'",
    ]
    assert slips("group 0: 5885 keys, net +1392") == [
        "'group 0: 5885 keys, net +1392': '5885'",
        "'group 0: 5885 keys, net +1392': '+1392'",
    ]
    # Identifiers are not counts.
    assert (
        slips(
            "seq 1574, seqs 0..1574, --at 1574, vLLM 0.33.0, #43559, 2025-01-01T00:00, "
            "block=1024 s1234-t1 file-2024.parquet 1 pass, 1,575 events, 1 lookup, "
            "group 1 resumes"
        )
        == []
    )
    table = "seq   hit\n----  -----\n1574  1,040\n2000  1040"
    assert slips(table) == ["'2000  1040': '1040'"]
    assert slips("| lookups | seq | hit |\n|---|---|---|\n| 1,087 | 1574 | 1040 |") == [
        "'| 1,087 | 1574 | 1040 |': '1040'"
    ]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each command's standard output and error, run in one directory as
    ``make demo`` runs them."""
    import os

    where = tmp_path_factory.mktemp("demo")
    (where / "out").mkdir()
    before = Path.cwd()
    os.chdir(where)
    try:
        out = {}
        for command in COMMANDS:
            args = command.format(t=DEMO).split()
            result = CliRunner().invoke(cli, args, prog_name="replay", catch_exceptions=False)
            assert result.exit_code in (0, 1), (command, result.output)
            out[command] = result.stdout + result.stderr
        return out
    finally:
        os.chdir(before)


def test_counts_are_one_style_in_every_command(outputs: dict[str, str]) -> None:
    found = {c: s for c, text in outputs.items() if (s := slips(text))}
    assert found == {}


def test_the_alias_note_is_said_once(outputs: dict[str, str]) -> None:
    from replay.rules.coordinator import get_policy

    note = get_policy("pre-49502").alias_note
    said = [c for c, text in outputs.items() if note in text]
    assert said == ["run {t} --policy pre-49502 -o out/demo.pre-49502.results.parquet --examples 2"]


def test_bisect_groups_the_lookups_that_change_alike(outputs: dict[str, str]) -> None:
    lines = outputs["bisect {t}"].splitlines()
    changes = [line for line in lines if line.startswith("- ")]
    assert [line.split(":")[0] for line in changes] == [
        "- 87 lookups like seq 54 (s18-t1)",  # gpu: at 0.20 and at 0.26
        "- vllm-0.16",
        "- vllm-0.20",
        "- 87 lookups like seq 54 (s18-t1)",  # mooncake: at 0.27
    ]
    assert not any("--cache gpu" in line for line in lines)


def test_separated_numbers_stay_right_aligned(outputs: dict[str, str]) -> None:
    lines = outputs["explain {t} --request s18-t1 --policy pre-49502"].splitlines()
    assert lines[0] == (
        "request s18-t1 (seq 54): max_length 1,139, 71 hashes of 16 tokens, "
        "policy pre-49502 (here vllm-0.26), cache mooncake"
    )
    assert (
        "   1  0 [0]                full_attention  1,139     +16    1,040  yes       1,024      1,024"
        in lines
    )
    assert "hit: 1,040 tokens (attention-verified 1,024)" in lines
