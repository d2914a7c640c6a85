"""The edges of the command line a script meets: help without the engine's
imports, a quiet exit status 141 when the reader of the output goes away,
and the vllm extra that installs the vLLM the differential tests use."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "traces" / "demo-full-mamba-eagle.parquet"


def _python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env
    ).stdout


def test_the_command_line_imports_no_engine() -> None:
    """`replay --help` and every command's help load click and the option
    tables only: numba, polars, pyarrow and numpy come with the work."""
    out = _python(
        "import sys, replay.cli; "
        "print(sorted(m for m in ('numba', 'polars', 'pyarrow', 'numpy', 'jinja2', "
        "'importlib.metadata') if m in sys.modules))"
    )
    assert out == "[]\n"


def test_version_is_read_when_asked() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "replay", "--version"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    from replay import __version__

    assert (out.returncode, out.stdout, out.stderr) == (0, f"replay, version {__version__}\n", "")


def test_a_closed_pipe_ends_quietly_with_141() -> None:
    """`replay state TRACE --show 100000 | head -1`: far more than a pipe
    holds, so the write after the reader left fails; the status is 128 +
    SIGPIPE, as `pipefail` scripts expect of a filter, and stderr is empty."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "replay", "state", str(DEMO), "--show", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    assert (proc.wait(timeout=120), first, err) == (
        141,
        f"state at the end of the trace: {DEMO}\n".encode(),
        b"",
    )


def test_the_vllm_extra_names_one_release() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["vllm"] == ["vllm==0.33.0"]


@pytest.mark.vllm
def test_the_vllm_extra_is_the_vllm_the_differential_tests_use() -> None:
    from importlib.metadata import version

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["vllm"] == [f"vllm=={version('vllm')}"]
