"""Every -o honours its extension or refuses it (issue 26: `diff -o d.md`
wrote Parquet into a .md file); `replay diff` writes Markdown and HTML
like `replay report`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "issue-43559.parquet"
BOTH = ["--policy", "vllm-0.33", "--policy", "pre-49502"]


def test_diff_writes_markdown_and_html_by_extension(tmp_path: Path) -> None:
    md = tmp_path / "d.md"
    result = run_cli(["diff", TRACE, *BOTH, "-o", md])
    assert (result.exit_code, result.stdout.splitlines()[-1]) == (
        0,
        f"wrote the diff (Markdown) to {md}",
    )
    assert md.read_text().splitlines()[:12] == [
        "## Diff of trace issue-43559.parquet",
        "",
        f"- A = vllm-0.33: policy vllm-0.33, coordinator reference, cache mooncake ({TRACE})",
        f"- B = pre-49502: policy pre-49502, coordinator reference, cache mooncake ({TRACE})",
        "- lookups: 1 compared, 1 with a different hit (B higher on 1, lower on 0)",
        "- hit tokens: A 48, B 64: net +16 (B gains 16, loses 0)",
        "",
        "### Explained by",
        "",
        "| reason | where | lookups | gained | lost | net |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
        "| flag mamba_overrun (corruption) | only in B | 1 | 16 | 0 | +16 |",
    ]
    page = tmp_path / "d.html"
    assert run_cli(["diff", TRACE, *BOTH, "-o", page]).exit_code == 0
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert "<h1>Diff of trace issue-43559.parquet</h1>" in text
    assert "<h2>Changed lookups</h2>" in text
    assert "<td>flag mamba_overrun (corruption)</td><td>only in B</td>" in text
    # -o - with --format md: standard output holds the Markdown alone.
    out = run_cli(["diff", TRACE, *BOTH, "-o", "-", "--format", "md"])
    assert out.stdout == md.read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["diff", str(TRACE), *BOTH, "-o", "{d}/d.txt"], "-o {d}/d.txt: .txt is not an extension this command writes; name it with one of .parquet (Parquet), .md (Markdown), .markdown (Markdown), .html (HTML), .htm (HTML)"),
        (["diff", str(TRACE), *BOTH, "-o", "{d}/d.parquet", "--format", "md"], "-o {d}/d.parquet: a .parquet name for Markdown (--format md); name it d.md or drop --format"),
        (["run", str(TRACE), "-o", "{d}/r.md"], "-o {d}/r.md: .md is not an extension this command writes; name it with one of .parquet (Parquet)"),
        (["state", str(TRACE), "-o", "{d}/keys"], "-o {d}/keys: no extension this command writes; name it with one of .parquet (Parquet)"),
        (["minimize", str(TRACE), "--request", "req-43559", "--policy", "pre-49502", "-o", "{d}/m.html"], "-o {d}/m.html: .html is not an extension this command writes; name it with one of .parquet (Parquet)"),
    ],
)  # fmt: skip
def test_an_output_named_for_another_format_is_refused(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = run_cli([a.format(d=tmp_path) for a in args])
    assert (result.exit_code, result.stdout, result.stderr) == (
        2,
        "",
        f"error: {message.format(d=tmp_path)}\n",
    )
    assert list(tmp_path.iterdir()) == []


def test_report_refuses_an_extension_it_does_not_write(tmp_path: Path) -> None:
    results = tmp_path / "r.results.parquet"
    assert run_cli(["run", TRACE, "-o", results, "-q"]).exit_code == 0
    result = run_cli(["report", results, "-o", tmp_path / "r.pdf"])
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: -o {tmp_path / 'r.pdf'}: .pdf is not an extension this command writes; name "
        "it with one of .md (Markdown), .markdown (Markdown), .html (HTML), .htm (HTML)\n",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.results.parquet"]
