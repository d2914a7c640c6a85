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
    "minimize": (["minimize", "{trace}", "--request", "req-43559", "-o", "{out}"], "trace"),
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
    assert (
        run_cli(["report", str(inputs["results"]), "-o", str(md), "--format", "html"]).exit_code
        == 0
    )
    assert md.read_text().startswith("<!DOCTYPE html>")


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
