"""Every -o honours its extension or refuses it (issue 26: `diff -o d.md`
wrote Parquet into a .md file); `replay diff` writes Markdown and HTML
like `replay report`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]
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
        f"- B = pre-49502: policy pre-49502 (here vllm-0.26), coordinator reference, cache "
        f"mooncake ({TRACE})",
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
        (["state", str(TRACE), "-o", "{d}/keys"], "-o {d}/keys: has no extension; name it with one of .parquet (Parquet)"),
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


# Every output option of every command, with a name it refuses: (the
# command line, the option, the wrong name, the formats it names instead).
# {t} trace, {r} results, {k} dump, {l} lookups, {c} config, {m} Mooncake
# trace, {o} the wrong name. Directories refuse a name that says a file.
PARQUET_ONLY = ".parquet (Parquet)"
TEXT = ".md (Markdown), .markdown (Markdown), .html (HTML), .htm (HTML)"
WRONG: dict[tuple[str, str], tuple[list[str], str, str]] = {
    ("run", "-o"): (["{t}", "-q", "-o", "{o}"], "r.md", PARQUET_ONLY),
    ("state", "-o"): (["{t}", "-o", "{o}"], "keys.json", PARQUET_ONLY),
    ("minimize", "-o"): (["{t}", "--request", "req-43559", "-o", "{o}"], "small", PARQUET_ONLY),
    ("diff", "-o"): (["{t}", *BOTH, "-o", "{o}"], "d.txt", f"{PARQUET_ONLY}, {TEXT}"),
    ("report", "-o"): (["{r}", "-o", "{o}"], "r.parquet", TEXT),
    ("whatif", "-o"): (["{t}", "--capacity-blocks", "10", "-q", "-o", "{o}"], "sweep.md", PARQUET_ONLY),
    ("whatif", "--emit-traces"): (["{t}", "--capacity-blocks", "10", "-q", "-o", "{d}/s.parquet", "--emit-traces", "{o}"], "runs.parquet", ""),
    ("record", "-o"): (["--endpoint", "tcp://127.0.0.1:1", "--block-size", "16", "-o", "{o}"], "t.kvdump", PARQUET_ONLY),
    ("record", "--dump"): (["--endpoint", "tcp://127.0.0.1:1", "--block-size", "16", "-o", "{d}/t.parquet", "--dump", "{o}"], "frames.parquet", ".kvdump (KV-event dump)"),
    ("ingest kv-events", "-o"): (["{k}", "--block-size", "16", "-o", "{o}"], "t.jsonl", PARQUET_ONLY),
    ("ingest merge", "-o"): (["{t}", "{l}", "-o", "{o}"], "t.html", PARQUET_ONLY),
    ("ingest mooncake", "-o"): (["{m}", "-o", "{o}"], "t.csv", PARQUET_ONLY),
    ("ingest bailian", "-o"): (["{m}", "-o", "{o}"], "t", PARQUET_ONLY),
    ("synth", "-o"): (["--model", "full", "--requests", "10", "-o", "{o}"], "t.md", PARQUET_ONLY),
    ("split", "-o"): (["{t}", "--files", "2", "-o", "{o}"], "parts.parquet", ""),
    ("cat", "-o"): (["{t}", "-o", "{o}"], "one.md", PARQUET_ONLY),
    ("watch", "-o"): (["--engine", "kv=tcp://127.0.0.1:1,lookups=tcp://127.0.0.1:2", "-o", "{o}"], "rolling.parquet", ""),
    ("repair", "-o"): (["{t}", "-o", "{o}"], "fixed.md", PARQUET_ONLY),
    ("test", "-o"): (["--coordinator", "vllm", "--random", "1", "-o", "{o}"], "drift.md", PARQUET_ONLY),
    ("test", "--junit-xml"): (["{t}", "--junit-xml", "{o}"], "junit.json", ".xml (JUnit XML)"),
}  # fmt: skip
OUTPUT_OPTIONS = {"-o", "--dump", "--emit-traces", "--junit-xml"}


def test_the_table_holds_every_output_option() -> None:
    from tests.faces.test_cli_common import LEAVES

    every = {
        (" ".join(path), opt)
        for path, cmd in LEAVES.items()
        for param in cmd.params
        for opt in param.opts
        if opt in OUTPUT_OPTIONS
    }
    assert sorted(every) == sorted(WRONG)


def _refusal(option: str, path: Path, formats: str) -> str:
    if not formats:  # a directory
        return (
            f"{option} {path}: {path.suffix} names a file, this option writes a directory; "
            f"name it without an extension (e.g. {path.stem})"
        )
    said = (
        f"{path.suffix} is not an extension this command writes"
        if path.suffix
        else "has no extension"
    )
    return f"{option} {path}: {said}; name it with one of {formats}"


@pytest.mark.parametrize("case", sorted(WRONG), ids=" ".join)
def test_every_output_refuses_a_name_for_another_format(
    tmp_path: Path, inputs: dict[str, Path], case: tuple[str, str]
) -> None:
    args, name, formats = WRONG[case]
    out = tmp_path / "out"
    out.mkdir()
    places = {"t": TRACE, "r": inputs["results"], "k": inputs["dump"], "l": inputs["lookups"]}
    places |= {"c": inputs["config"], "m": inputs["mooncake"], "d": out, "o": out / name}
    before = sorted(p.name for p in inputs["trace"].parent.iterdir())
    result = run_cli([*case[0].split(), *(a.format(**places) for a in args)])
    assert (result.exit_code, result.stdout, result.stderr) == (
        2,
        "",
        f"error: {_refusal(case[1], out / name, formats)}\n",
    )
    assert list(out.iterdir()) == []
    assert sorted(p.name for p in inputs["trace"].parent.iterdir()) == before
