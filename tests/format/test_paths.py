"""replay.format.paths: where a command may read and write. An output that is an
input is refused before anything is written, ``/dev/null`` discards,
``-`` is standard output, a missing directory is an error, a FIFO never
blocks, and a failed write leaves nothing behind (through the CLI, as a
user meets it)."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import run_cli


@pytest.mark.parametrize("command", ["run", "state", "synth"])
def test_output_path_is_a_directory(tmp_path: Path, trace_43559: Path, command: str) -> None:
    target = tmp_path / "out"
    target.mkdir()
    args = {
        "run": ["run", str(trace_43559), "-o", str(target), "-q"],
        "state": ["state", str(trace_43559), "-o", str(target)],
        "synth": ["synth", "-o", str(target), "--model", "full", "--requests", "5"],
    }[command]
    result = run_cli(args)
    assert result.exit_code == 2
    assert result.stderr == f"error: {target}: is a directory, expected a file path to write\n"
    assert list(target.iterdir()) == []


def test_output_in_an_unwritable_place(trace_43559: Path) -> None:
    result = run_cli(["run", str(trace_43559), "-o", "/proc/nope/r.parquet", "-q"])
    assert result.exit_code == 2
    assert (
        result.stderr
        == "error: /proc/nope/r.parquet: no such directory /proc/nope (it is not created)\n"
    )


def _digests(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# (command line with {out} for the output, the input {out} may be made equal to)
WRITERS = {
    "run": (["run", "{trace}", "-o", "{out}", "-q"], "trace"),
    "state": (["state", "{trace}", "-o", "{out}"], "trace"),
    "minimize": (["minimize", "{trace}", "--request", "req-43559", "--policy", "pre-49502", "-o", "{out}"], "trace"),
    "diff-trace": (["diff", "{trace}", "--policy", "vllm-0.33", "--policy", "pre-49502", "-o", "{out}"], "trace"),
    "diff-results": (["diff", "{results}", "{results}", "-o", "{out}"], "results"),
    "report-results": (["report", "{results}", "-o", "{out}"], "results"),
    "report-trace": (["report", "{results}", "--trace", "{trace}", "-o", "{out}"], "trace"),
    "kv-events-dump": (["ingest", "kv-events", "{dump}", "-o", "{out}", "--block-size", "16"], "dump"),
    "kv-events-lookups": (["ingest", "kv-events", "{dump}", "--lookups", "{lookups}", "-o", "{out}", "--block-size", "16"], "lookups"),
    "kv-events-config": (["ingest", "kv-events", "{dump}", "-o", "{out}", "--config", "{config}"], "config"),
    "merge-trace": (["ingest", "merge", "{trace}", "{lookups}", "-o", "{out}"], "trace"),
    "merge-lookups": (["ingest", "merge", "{trace}", "{lookups}", "-o", "{out}"], "lookups"),
    "mooncake": (["ingest", "mooncake", "{mooncake}", "-o", "{out}"], "mooncake"),
    "record-config": (["record", "--endpoint", "tcp://127.0.0.1:1", "-o", "{out}", "--config", "{config}"], "config"),
}  # fmt: skip


def _args(template: list[str], inputs: dict[str, Path], out: str | Path) -> list[str]:
    return [a.format(out=out, **{k: str(v) for k, v in inputs.items()}) for a in template]


@pytest.mark.parametrize("how", ["same path", "symlink", "hard link"])
@pytest.mark.parametrize("command", sorted(WRITERS))
def test_an_output_that_is_an_input_is_refused_before_anything_is_written(
    tmp_path: Path, inputs: dict[str, Path], command: str, how: str
) -> None:
    template, victim = WRITERS[command]
    target = inputs[victim]
    out = {"same path": target, "symlink": tmp_path / "link", "hard link": tmp_path / "hard"}[how]
    if how == "symlink":
        out.symlink_to(target)
    elif how == "hard link":
        os.link(target, out)
    before = _digests(target.parent)
    result = run_cli(_args(template, inputs, out))
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        f"error: -o {out}: is the input {target}; refusing to overwrite it (give another output path)\n"
    )
    assert _digests(target.parent) == before


def test_record_refuses_a_dump_that_is_its_trace(tmp_path: Path) -> None:
    out = tmp_path / "t.parquet"
    out.write_bytes(b"old")
    result = run_cli(["record", "--endpoint", "tcp://127.0.0.1:1", "-o", str(out), "--dump", str(out), "--block-size", "16"])  # fmt: skip
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: --dump {out}: is also the output of -o; refusing to overwrite it (give another output path)\n",
    )
    assert out.read_bytes() == b"old"


NULL_OK = [
    "run", "state", "minimize", "diff-trace", "diff-results", "report-results", "kv-events-dump",
    "mooncake",
]  # fmt: skip


@pytest.mark.parametrize("command", NULL_OK)
def test_dev_null_discards_the_output_and_stays_a_device(
    inputs: dict[str, Path], command: str
) -> None:
    before = os.stat("/dev/null")
    result = run_cli(_args(WRITERS[command][0], inputs, "/dev/null"))
    assert result.exit_code == 0, result.output
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (
        before.st_ino,
        before.st_rdev,
    )


@pytest.mark.parametrize("command", ["kv-events-dump", "mooncake", "run"])
def test_a_failed_write_to_dev_null_leaves_the_device_alone(
    tmp_path: Path, inputs: dict[str, Path], command: str
) -> None:
    """Run as root, an aborted write once removed /dev/null itself."""
    broken = {"kv-events-dump": "dump", "mooncake": "mooncake", "run": "trace"}[command]
    data = inputs[broken].read_bytes()
    inputs[broken].write_bytes(data[: len(data) // 2] + (b"x" if command == "mooncake" else b""))
    before = os.stat("/dev/null")
    args = _args(WRITERS[command][0], inputs, "/dev/null")
    if command == "kv-events-dump":  # a group the config lacks: fatal after the writer opened
        from replay.sources.dump import DumpWriter
        from tests.kvpayloads import T0, payload, stored

        with DumpWriter(inputs["dump"]) as w:
            w.write([b"", (0).to_bytes(8, "big"), payload(T0, stored([1], group=5))], "live", T0)
    result = run_cli(args)
    assert result.exit_code == 2, result.output
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (
        before.st_ino,
        before.st_rdev,
    )


@pytest.mark.parametrize("name", ["-", "/dev/stdout"])
def test_text_goes_to_standard_output_and_parquet_is_refused_there(
    inputs: dict[str, Path], name: str
) -> None:
    result = run_cli(["report", str(inputs["results"]), "-o", name, "--format", "md"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("## Replay report: t.parquet\n")
    assert "wrote" not in result.output
    for command in ("run", "state", "diff-trace", "mooncake", "kv-events-dump"):
        result = run_cli(_args(WRITERS[command][0], inputs, name))
        assert (result.exit_code, result.stderr) == (
            2,
            f"error: {name}: standard output takes text only, this output is Parquet; give a file path (or /dev/null to discard it)\n",
        ), command


def test_an_output_symlink_is_followed_and_the_mode_kept(
    tmp_path: Path, inputs: dict[str, Path]
) -> None:
    real = tmp_path / "real.parquet"
    real.write_bytes(b"old")
    real.chmod(0o640)
    link = tmp_path / "link.parquet"
    link.symlink_to(real)
    result = run_cli(["run", str(inputs["trace"]), "-o", str(link), "-q"])
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and link.resolve() == real
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    assert real.read_bytes()[:4] == b"PAR1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "link.parquet", "real.parquet"]


def test_report_format_follows_the_extension(inputs: dict[str, Path], tmp_path: Path) -> None:
    md, html = tmp_path / "r.md", tmp_path / "r.html"
    assert run_cli(["report", str(inputs["results"]), "-o", str(md)]).exit_code == 0
    assert md.read_text().startswith("## Replay report: t.parquet\n")
    assert run_cli(["report", str(inputs["results"]), "-o", str(html)]).exit_code == 0
    assert html.read_text().startswith("<!DOCTYPE html>")
    # An HTML page in a file named .md is refused (issue 26: every -o honours
    # its extension), and the Markdown already there is left as it was.
    refused = run_cli(["report", str(inputs["results"]), "-o", str(md), "--format", "html"])
    assert (refused.exit_code, refused.stderr) == (
        2,
        f"error: -o {md}: a .md name for HTML (--format html); name it r.html or drop --format\n",
    )
    assert md.read_text().startswith("## Replay report: t.parquet\n")


@contextlib.contextmanager
def _no_blocking(seconds: int = 10) -> Iterator[None]:
    def fire(signum: int, frame: object) -> None:
        raise AssertionError("blocked on a FIFO")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_fifos_are_refused_without_blocking(tmp_path: Path, inputs: dict[str, Path]) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases = {
        ("validate", str(fifo)): f"error: {fifo}: is a FIFO, expected a Parquet file (a regular file)",
        ("ingest", "kv-events", str(fifo), "-o", str(tmp_path / "o.parquet"), "--block-size", "16"): f"error: {fifo}: is a FIFO, expected a KV-event dump (a regular file)",
        ("ingest", "mooncake", str(fifo), "-o", str(tmp_path / "o.parquet")): f"error: {fifo}: is a FIFO, expected a mooncake JSONL file (a regular file)",
        ("ingest", "merge", str(inputs["trace"]), str(fifo), "-o", str(tmp_path / "o.parquet")): f"error: {fifo}: is a FIFO, expected a JSONL lookup log (a regular file)",
        ("ingest", "kv-events", str(inputs["dump"]), "-o", str(tmp_path / "o.parquet"), "--config", str(fifo)): f"error: {fifo}: is a FIFO, expected a KV-cache config JSON (a regular file)",
        ("run", str(inputs["trace"]), "-o", str(fifo)): f"error: {fifo}: is a FIFO, expected a file path to write (or /dev/null to discard the output)",
        ("report", str(inputs["results"]), "-o", str(fifo)): f"error: {fifo}: is a FIFO, expected a file path to write (or /dev/null to discard the output)",
    }  # fmt: skip
    with _no_blocking():
        for args, message in cases.items():
            result = run_cli(list(args))
            assert (result.exit_code, result.stderr) == (2, message + "\n"), args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "in"]


@pytest.mark.parametrize(
    "command", ["run", "state", "report-results", "kv-events-dump", "mooncake", "diff-trace"]
)
def test_a_missing_output_directory_is_an_error_not_created(
    tmp_path: Path, inputs: dict[str, Path], command: str
) -> None:
    out = tmp_path / "nope" / "deeper" / "o.out"
    result = run_cli(_args(WRITERS[command][0], inputs, out))
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {out}: no such directory {out.parent} (it is not created)\n",
    )
    assert not (tmp_path / "nope").exists()


def test_directories_given_as_inputs_are_one_line_errors(
    tmp_path: Path, inputs: dict[str, Path]
) -> None:
    d, out = inputs["trace"].parent, tmp_path / "o.parquet"
    # A directory is a trace when its Parquet files are (a trace directory):
    # here one of them is a results file, and the error names it.
    results = inputs["results"]
    cases = {
        ("validate", str(d)): f"{results}: missing 'replay.trace' metadata (not a replay trace v1)",
        ("ingest", "kv-events", str(d), "-o", str(out), "--block-size", "16"): f"{d}: is a directory, expected a KV-event dump",
        ("ingest", "bailian", str(d), "-o", str(out)): f"{d}: is a directory, expected a bailian JSONL file",
        ("ingest", "kv-events", str(inputs["dump"]), "-o", str(out), "--lookups", str(d), "--block-size", "16"): f"{d}: is a directory, expected a JSONL lookup log",
        ("record", "--endpoint", "tcp://127.0.0.1:1", "-o", str(out), "--config", str(d)): f"{d}: is a directory, expected a KV-cache config JSON",
    }  # fmt: skip
    for args, message in cases.items():
        result = run_cli(list(args))
        assert (result.exit_code, result.stderr) == (2, f"error: {message}\n"), args
    assert not out.exists()


# ---------------------------------------------- hashes of different widths


# ---------------------------------------------- one output guard (issue 25)


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder`` (hidden ones too), files by content."""
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture
def trace_dir(tmp_path: Path, inputs: dict[str, Path]) -> Path:
    d = tmp_path / "D"
    assert run_cli(["split", str(inputs["trace"]), "-o", str(d), "--files", "2"]).exit_code == 0
    return d


INSIDE = "lies inside the input directory {d}; refusing to write there"
OVER = "is the input {d}/part-000001.parquet; refusing to overwrite it"
# (command line, the output, what it is)
DIR_CASES = {
    "run-part": (["run", "{d}", "-o", "{d}/part-000001.parquet", "-q"], "-o {d}/part-000001.parquet", OVER),
    "run-new": (["run", "{d}", "-o", "{d}/zz.results.parquet", "-q"], "-o {d}/zz.results.parquet", INSIDE),
    "state": (["state", "{d}", "-o", "{d}/part-000001.parquet"], "-o {d}/part-000001.parquet", OVER),
    "diff": (["diff", "{d}", "--policy", "vllm-0.33", "--policy", "pre-49502", "-o", "{d}/x.parquet"], "-o {d}/x.parquet", INSIDE),
    "minimize": (["minimize", "{d}", "--request", "req-43559", "-o", "{d}/m.parquet"], "-o {d}/m.parquet", INSIDE),
    "whatif": (["whatif", "{d}", "--capacity-blocks", "10", "-o", "{d}/w.parquet"], "-o {d}/w.parquet", INSIDE),
    "whatif-emit": (["whatif", "{d}", "--capacity-blocks", "10", "-o", "{tmp}/w.parquet", "--emit-traces", "{d}"], "--emit-traces {d}", "is the input directory {d}; refusing to write there"),
    "whatif-emit-inside": (["whatif", "{d}", "--capacity-blocks", "10", "-o", "{tmp}/w.parquet", "--emit-traces", "{d}/e"], "--emit-traces {d}/e", INSIDE),
    "merge": (["ingest", "merge", "{d}", "{lookups}", "-o", "{d}/m.parquet"], "-o {d}/m.parquet", INSIDE),
    "report-trace": (["report", "{results}", "--trace", "{d}", "-o", "{d}/r.html"], "-o {d}/r.html", INSIDE),
    "cat": (["cat", "{d}", "-o", "{d}/all.parquet"], "-o {d}/all.parquet", INSIDE),
    "split": (["split", "{d}", "-o", "{d}/sub", "--files", "2"], "-o {d}/sub", INSIDE),
    "hard-link-to-a-part": (["run", "{d}", "-o", "{tmp}/hard", "-q"], "-o {tmp}/hard", "is the input {d}/part-000000.parquet; refusing to overwrite it"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(DIR_CASES))
def test_an_output_in_or_over_an_input_directory_is_refused_before_any_work(
    tmp_path: Path, inputs: dict[str, Path], trace_dir: Path, case: str
) -> None:
    template, option, what = DIR_CASES[case]
    names = {"d": str(trace_dir), "tmp": str(tmp_path), "lookups": str(inputs["lookups"])}
    names["results"] = str(inputs["results"])
    if case == "hard-link-to-a-part":
        os.link(trace_dir / "part-000000.parquet", tmp_path / "hard")
    before = _snapshot(tmp_path)
    result = run_cli([a.format(**names) for a in template])
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {option.format(**names)}: {what.format(**names)} (give another output path)\n",
    )
    assert _snapshot(tmp_path) == before


def test_an_output_directory_holding_an_input_is_refused(
    tmp_path: Path, inputs: dict[str, Path]
) -> None:
    folder = inputs["trace"].parent
    before = _snapshot(tmp_path)
    result = run_cli(["whatif", str(inputs["trace"]), "--capacity-blocks", "10", "-o", str(tmp_path / "w.parquet"), "--emit-traces", str(tmp_path)])  # fmt: skip
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: --emit-traces {tmp_path}: holds the input {inputs['trace']}; refusing to "
        "write there (give another output path)\n",
    )
    out = tmp_path / "E"
    result = run_cli(["whatif", str(inputs["trace"]), "--capacity-blocks", "10", "-o", str(out / "w.parquet"), "--emit-traces", str(out)])  # fmt: skip
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: -o {out}/w.parquet: lies inside the output directory of --emit-traces; "
        "refusing to write there (give another output path)\n",
    )
    assert _snapshot(tmp_path) == before and folder.is_dir()


def test_two_new_outputs_at_one_path_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "x.parquet"
    for other in (out, tmp_path / "." / "x.parquet"):
        result = run_cli(["record", "--endpoint", "tcp://127.0.0.1:1", "-o", str(out), "--dump", str(other), "--block-size", "16"])  # fmt: skip
        assert (result.exit_code, result.stderr) == (
            2,
            f"error: --dump {other}: is also the output of -o; refusing to overwrite it "
            "(give another output path)\n",
        )
    assert list(tmp_path.iterdir()) == []


def test_split_never_creates_a_missing_parent(tmp_path: Path, inputs: dict[str, Path]) -> None:
    out = tmp_path / "nope" / "deeper" / "parts"
    result = run_cli(["split", str(inputs["trace"]), "-o", str(out), "--files", "2"])
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {out}: no such directory {out.parent} (it is not created)\n",
    )
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere" / "parts")
    result = run_cli(["split", str(inputs["trace"]), "-o", str(link), "--files", "2"])
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {link}: is a dangling symlink, expected a new or empty directory\n",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "in"]


def test_split_files_are_bounded_by_the_rows(tmp_path: Path, inputs: dict[str, Path]) -> None:
    out = tmp_path / "parts"
    result = run_cli(["split", str(inputs["trace"]), "-o", str(out), "--files", "1000000000000"])
    assert result.exit_code == 0, result.output
    from replay.format.tracedir import open_trace

    rows = open_trace(inputs["trace"]).num_rows
    assert result.stdout == f"{inputs['trace']} -> {out}: {rows} files\n"
    assert len(list(out.iterdir())) == rows


# ---------------------------------------------- names that are not UTF-8 (issue 25)


def _bytes_name(folder: Path, raw: bytes) -> Path:
    """A path whose last part is the bytes ``raw`` (Python's surrogateescape)."""
    path = folder / os.fsdecode(raw)
    try:
        path.touch()
        path.unlink()
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system takes no names that are not UTF-8")
    return path


def test_names_that_are_not_utf8_work_as_inputs_and_outputs(
    tmp_path: Path, inputs: dict[str, Path]
) -> None:
    import json as jsonlib

    import pyarrow.parquet as pq

    from replay.format.tracedir import open_trace

    trace = _bytes_name(tmp_path, b"caf\xe9.parquet")
    trace.write_bytes(inputs["trace"].read_bytes())
    results = _bytes_name(tmp_path, b"r\xff.results.parquet")
    folder = _bytes_name(tmp_path, b"d\xe9")
    jsonl = _bytes_name(tmp_path, b"m\xe9.jsonl")
    jsonl.write_bytes(inputs["mooncake"].read_bytes())
    imported = tmp_path / "m.parquet"
    commands: list[list[str | Path]] = [
        ["validate", trace],
        ["run", trace, "-o", results, "-q"],
        ["report", results, "-o", _bytes_name(tmp_path, b"r\xe9.md")],
        ["split", trace, "-o", folder, "--files", "2"],
        ["run", folder, "-o", "/dev/null", "-q"],
        [
            "whatif",
            trace,
            "--capacity-blocks",
            "10",
            "-o",
            _bytes_name(tmp_path, b"w\xe9.parquet"),
            "-q",
        ],
        ["ingest", "mooncake", jsonl, "-o", imported],
        ["info", imported, "--json"],
    ]
    for args in commands:
        result = run_cli(args)
        assert result.exit_code == 0, (args, result.output)
    # What a trace records of a file name is text any reader takes back.
    assert (open_trace(imported).config.source or {})["file"] == "m\\xe9.jsonl"
    meta = pq.read_schema(str(imported)).metadata[b"replay.trace"]
    assert jsonlib.loads(meta.decode("utf-8"))["source"]["file"] == "m\\xe9.jsonl"
    assert (tmp_path / os.fsdecode(b"r\xe9.md")).read_text().startswith("## Replay report: ")
    missing = _bytes_name(tmp_path, b"gone\xe9.parquet")
    result = run_cli(["validate", missing])
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {tmp_path}/gone\\xe9.parquet: no such file\n",
    )
