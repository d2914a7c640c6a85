"""replay.cli.progress: the long commands draw a bar when stderr is a
terminal, and write nothing there when it is not or when they are quiet."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import select
import subprocess
import sys
import threading
import tty
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from replay.cli import cli
from replay.cli.progress import progress_bar

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "traces" / "demo-full-mamba-eagle.parquet"


@contextlib.contextmanager
def terminal() -> Iterator[Callable[[], str]]:
    """sys.stderr on a raw pseudo-terminal (no newline translation) while
    the block runs (pytest puts its own back between a fixture and the
    test); it yields what reads the terminal's other end."""
    master, slave = os.openpty()
    tty.setraw(slave)
    err = os.fdopen(slave, "w")

    def drawn() -> str:
        # Linux hands a pty's bytes to the other end asynchronously: read
        # until nothing more arrives, not once.
        err.flush()
        chunks = []
        while select.select([master], [], [], 0.3)[0]:
            chunk = os.read(master, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode()

    saved, sys.stderr = sys.stderr, err
    try:
        yield drawn
    finally:
        sys.stderr = saved
        err.close()
        os.close(master)


def test_a_bar_with_its_percentage_then_the_line_ends() -> None:
    with terminal() as drawn:
        with progress_bar() as bar:
            assert bar is not None
            # Within its first second a display shows no time left (however
            # slowly this machine gets here).
            bar.started += 3600
            bar.count(1, 4, "1/4 runs")
            bar.steps("requests", 10)(5)
            bar.count(9, 0, "nothing to do")
        text = drawn()
    assert text == (
        "\r[######..................]  25.0%  1/4 runs\x1b[K"
        "\r[############............]  50.0%  5/10 requests\x1b[K"
        "\r[########################] 100.0%  nothing to do\x1b[K"
        "\n"
    )


def test_the_time_left_at_the_rate_so_far() -> None:
    with terminal() as drawn:
        with progress_bar() as bar:
            assert bar is not None
            bar.started -= 10  # a quarter done in 10 s: 30 s to go
            bar.count(1, 4, "1/4 runs")
            bar.started -= 3590  # a half in an hour: an hour to go
            bar.count(2, 4, "2/4 runs")
        text = drawn()
    assert re.fullmatch(
        r"\r\[######\.{18}\]  25\.0%  1/4 runs  ETA 0:(29|30)\x1b\[K"
        r"\r\[#{12}\.{12}\]  50\.0%  2/4 runs  ETA 1:00:0\d\x1b\[K\n",
        text,
    ), text


def test_a_count_without_a_total_and_notes_on_their_own_lines() -> None:
    with terminal() as drawn:
        with progress_bar() as bar:
            assert bar is not None
            bar.note("listening")
            rows = bar.steps("rows")
            rows(1000)
            rows(500)
            bar.note("gap at seq 4")
            bar.status("3 batches")
        text = drawn()
    assert re.fullmatch(
        r"listening\n\r1,000 rows  \d+\.\d s\x1b\[K\r1,500 rows  \d+\.\d s\x1b\[K"
        r"\ngap at seq 4\n\r3 batches\x1b\[K\n",
        text,
    ), text


def test_nothing_when_quiet_or_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    with terminal() as drawn:
        with progress_bar(quiet=True) as bar:
            assert bar is None
        assert drawn() == ""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress_bar() as bar:
        assert bar is None


def _on_a_terminal(args: list[str]) -> tuple[int, str, str]:
    """``python -m replay ARGS`` with stderr on a terminal: the status, its
    stdout and what the terminal showed."""
    master, slave = os.openpty()
    tty.setraw(slave)
    proc = subprocess.Popen(
        [sys.executable, "-m", "replay", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    os.close(slave)
    shown: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the process closed the terminal
                return
            if not chunk:
                return
            shown.append(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    out, _ = proc.communicate(timeout=120)
    reader.join(10)
    os.close(master)
    return proc.returncode, out.decode(), b"".join(shown).decode()


LONG = {
    "run": (["run", str(DEMO), "-o", "{d}/r.parquet"], "1,575/1,575 events ", "replayed 1,575 events"),
    "synth": (["synth", "-o", "{d}/s.parquet", "--model", "full", "--requests", "300"], "300/300 requests", "wrote "),
    "whatif": (["whatif", str(DEMO), "--capacity-blocks", "100,200", "--jobs", "1", "-o", "{d}/w.parquet"], "1,212/1,212 requests  3/3 runs", f"{DEMO}: 404 lookups"),
    "check": (["check", str(DEMO)], "1,575/1,575 events ", f"{DEMO}: clean under vllm-0.33"),
    "diff": (["diff", str(DEMO), "--policy", "vllm-0.33", "--policy", "pre-49502"], "1,575/1,575 events ", "diff of trace"),
}  # fmt: skip


# One real terminal per command (a process each): `run` in `make test`.
@pytest.mark.parametrize(
    "name", [n if n == "run" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(LONG)]
)
def test_long_commands_show_the_bar_on_a_terminal_only(tmp_path: Path, name: str) -> None:
    template, shown, first = LONG[name]
    args = [a.format(d=tmp_path) for a in template]
    status, out, terminal = _on_a_terminal(args)
    assert status == 0 and out.startswith(first)
    assert "] 100.0%  " in terminal and shown in terminal and terminal.endswith("\n")
    # The same command with stderr captured (not a terminal) writes there
    # nothing but what an alias typed on its command line means (diff names
    # the alias's release in its header instead: issue 36).
    piped = CliRunner().invoke(cli, args, catch_exceptions=False)
    notes = "" if name == "diff" else _alias_notes(args)
    assert (piped.exit_code, piped.stderr) == (0, notes)
    assert piped.stdout.splitlines()[0] == out.splitlines()[0]


def _alias_notes(args: list[str]) -> str:
    """What the aliases among ``args`` mean, a line each (on stderr)."""
    from replay.rules.coordinator import ALIASES

    return "".join(f"{a.alias_note}\n" for a in ALIASES if a.name in args)


@pytest.mark.slow
def test_report_and_minimize_show_their_progress_on_a_terminal_only(tmp_path: Path) -> None:
    results = tmp_path / "demo.results.parquet"
    run = CliRunner().invoke(cli, ["run", str(DEMO), "--policy", "pre-49502", "-o", str(results), "-q"])  # fmt: skip
    assert run.exit_code == 0
    report = ["report", str(results), "--trace", str(DEMO), "-o", str(tmp_path / "r.md")]
    status, out, terminal = _on_a_terminal(report)
    assert status == 0 and out.startswith(f"wrote {tmp_path / 'r.md'}")
    # The explain tables' pass over the trace stops at the last example.
    assert re.search(r"\] +\d+\.\d%  [\d,]+/1,575 events ", terminal) and terminal.endswith("\n")
    flagged = json.loads(run_json(results))
    # Given the results, minimize shrinks their trace under their policy.
    minimize = [
        "minimize",
        str(results),
        "--request",
        flagged,
        "-o",
        str(tmp_path / "small.parquet"),
    ]
    status, out, terminal = _on_a_terminal(minimize)
    assert status == 0 and out.startswith(f"{DEMO}: 1,575 events -> ")
    assert re.search(
        r"\rshrinking: \d+ replays, \d[\d,]* -> \d+ events  \d+\.\d s\x1b\[K", terminal
    )
    # Piped, nothing on stderr: minimize answers under the results' policy,
    # an alias the user did not type here, so it is not explained again.
    for args in (report, minimize):
        piped = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert (piped.exit_code, piped.stderr) == (0, "")


def run_json(results: Path) -> str:
    """The first request flagged mamba_overrun in ``results``, as JSON text."""
    import polars as pl

    frame = pl.read_parquet(results).filter(pl.col("flags").list.contains("mamba_overrun"))
    return json.dumps(frame["request_id"][0])


@pytest.mark.slow
def test_quiet_draws_nothing_even_on_a_terminal(tmp_path: Path) -> None:
    status, out, terminal = _on_a_terminal(["run", str(DEMO), "-q", "-o", str(tmp_path / "r.parquet")])  # fmt: skip
    assert (status, out, terminal) == (0, "", "")
