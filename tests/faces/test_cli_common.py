"""replay.cli.common and the group: the one rule that turns what a command
raises into a message and an exit status, alike for a command run alone and
under ``replay``; and ``replay --help`` naming every command."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from replay.base.errors import Interrupted, ReplayError
from replay.cli import cli
from replay.cli.common import Command, command, fail


def _leaves(
    group: click.Group, prefix: tuple[str, ...] = ()
) -> dict[tuple[str, ...], click.Command]:
    out: dict[tuple[str, ...], click.Command] = {}
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            out.update(_leaves(cmd, (*prefix, name)))
        else:
            out[(*prefix, name)] = cmd
    return out


LEAVES = _leaves(cli)


def test_every_command_runs_under_the_guard() -> None:
    assert [" ".join(p) for p, c in LEAVES.items() if not isinstance(c, Command)] == []


RAISED: dict[str, tuple[BaseException, int, str]] = {
    "library error": (ReplayError("t.parquet: seq 3: bad\n   value"), 2, "error: t.parquet: seq 3: bad value\n"),
    "refused by the system": (PermissionError(errno.EACCES, "Permission denied", "out.parquet"), 2, "error: out.parquet: Permission denied\n"),
    "no file name": (OSError(errno.ENOSPC, "No space left on device"), 2, "error: No space left on device\n"),
    "the CLI's own check": (fail("--x: expected 1,\n got 2"), 2, "error: --x: expected 1, got 2\n"),
    "SIGINT": (KeyboardInterrupt(), 130, "interrupted by SIGINT\n"),
    "SIGTERM": (Interrupted(signal.SIGTERM), 143, "interrupted by SIGTERM\n"),
    "SIGHUP": (Interrupted(signal.SIGHUP), 129, "interrupted by SIGHUP\n"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(RAISED))
def test_what_a_command_raises_is_one_line_and_a_status(case: str) -> None:
    raised, status, line = RAISED[case]

    @command()
    def task() -> None:
        click.echo("started")
        raise raised

    result = CliRunner().invoke(task, [], catch_exceptions=False)
    assert (result.exit_code, result.stdout, result.stderr) == (status, "started\n", line)


# A command line per command that fails on its missing input ({m}); {o} is
# an output file and {d} an output directory that must not appear.
BAD: dict[tuple[str, ...], list[str]] = {
    ("validate",): ["{m}"],
    ("info",): ["{m}"],
    ("state",): ["{m}"],
    ("run",): ["{m}", "-q", "-o", "{o}"],
    ("check",): ["{m}"],
    ("explain",): ["{m}", "--request", "r"],
    ("minimize",): ["{m}", "--request", "r", "-o", "{o}"],
    ("diff",): ["{m}", "{m}"],
    ("bisect",): ["{m}"],
    ("test",): ["{m}"],
    ("report",): ["{m}", "-o", "{o}"],
    ("whatif",): ["{m}", "--capacity-blocks", "10", "-o", "{o}"],
    ("record",): ["--endpoint", "tcp://127.0.0.1:1", "-o", "{o}", "--config", "{m}"],
    ("ingest", "kv-events"): ["{m}", "-o", "{o}", "--block-size", "16"],
    ("ingest", "merge"): ["{m}", "{m}", "-o", "{o}"],
    ("ingest", "mooncake"): ["{m}", "-o", "{o}"],
    ("ingest", "bailian"): ["{m}", "-o", "{o}"],
    ("synth",): ["-o", "{o}", "--model", "full", "--cache", "{m}"],
    ("split",): ["{m}", "-o", "{d}", "--files", "2"],
    ("cat",): ["{m}", "-o", "{o}"],
    ("watch",): [
        "--engine",
        "kv=tcp://127.0.0.1:1,lookups=tcp://127.0.0.1:2",
        "-o",
        "{d}",
        "--flags-out",
        "{m}/flags.jsonl",
    ],
    ("repair",): ["{m}", "-o", "{o}"],
}


def test_the_table_holds_every_command() -> None:
    assert sorted(BAD) == sorted(LEAVES)


@pytest.mark.parametrize("path", sorted(BAD), ids=" ".join)
def test_a_command_alone_says_what_it_says_under_the_group(
    tmp_path: Path, path: tuple[str, ...]
) -> None:
    missing, out, parts = tmp_path / "missing.parquet", tmp_path / "out.parquet", tmp_path / "parts"
    args = [a.format(m=missing, o=out, d=parts) for a in BAD[path]]
    grouped = CliRunner().invoke(cli, [*path, *args], catch_exceptions=False)
    alone = CliRunner().invoke(LEAVES[path], args, catch_exceptions=False)
    assert grouped.exit_code == 2 and grouped.stdout == ""
    assert grouped.stderr.startswith("error: ") and grouped.stderr.count("\n") == 1
    assert str(missing) in grouped.stderr
    assert (alone.exit_code, alone.stdout, alone.stderr) == (2, "", grouped.stderr)
    assert not out.exists() and not parts.exists()


def test_help_explains_every_command_in_a_whole_sentence() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    for path, cmd in LEAVES.items():
        sentence = cmd.get_short_help_str(limit=1000)
        assert sentence.endswith(".") and not sentence.endswith("..."), path
        assert f" {' '.join(path)} {sentence}" in text, path


@pytest.mark.parametrize(("given", "seen"), [(None, "1"), ("4", "4")])
def test_the_console_script_starts_no_blas_threads(
    monkeypatch: pytest.MonkeyPatch, given: str | None, seen: str
) -> None:
    """The console script asks numpy's OpenBLAS for one thread before
    anything imports numpy (its other threads only spun: no command calls
    BLAS), keeping a setting of the user's own."""
    import replay.cli
    from replay import entry

    if given is None:
        monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", given)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # pytest keeps its handlers
    found: list[str | None] = []
    monkeypatch.setattr(
        replay.cli,
        "main",
        lambda: found.append(os.environ.get("OPENBLAS_NUM_THREADS")),
    )
    entry.main()
    assert found == [seen]


#: The console script's process, saying at its exit how many threads
#: numpy's OpenBLAS runs (asked of the library itself).
BLAS_THREADS = """
import atexit, ctypes, glob, os, sys
def threads():
    import numpy
    (lib,) = glob.glob(os.path.join(
        os.path.dirname(numpy.__file__), os.pardir, "numpy.libs", "libscipy_openblas*"))
    sys.stderr.write("blas threads %d\\n" % ctypes.CDLL(lib).scipy_openblas_get_num_threads64_())
atexit.register(threads)
from replay.entry import main
main()
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts one thread on one core")
def test_numpy_runs_one_blas_thread_under_the_console_script(tmp_path: Path) -> None:
    """The setting reaches OpenBLAS: nothing the console script imports
    loads numpy before it is made (numpy alone starts a thread a core)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    env["PYTHONPATH"] = str(root)
    plain = subprocess.run(
        [sys.executable, "-c", BLAS_THREADS.replace("from replay.entry import main\nmain()", "")],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    # numpy on its own: a thread a core (so the check below can fail).
    assert int(plain.stderr.removeprefix("blas threads ")) > 1, plain.stderr
    trace = root / "traces" / "archetype-full-mamba.parquet"
    got = subprocess.run(
        [sys.executable, "-c", BLAS_THREADS, "run", str(trace), "-o", str(tmp_path / "r.parquet"), "-q"],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert (got.returncode, got.stderr) == (0, "blas threads 1\n")
