"""The contract every source passes: the importers (``replay ingest ...``),
the generators (``replay synth``) and the recorder (``replay record``), each
run as a user runs it, through the CLI.

- **Round trip**: the trace it writes reads back valid (``replay validate``
  says ok), holds exactly the events the source was given (the subclass's
  ``expected_counts``), names where it came from (``source`` metadata),
  replays to one result per lookup, and writes back through the format
  unchanged.
- **Deterministic** (``DeterministicSourceContract``: every source but the
  live recorder, whose trace says when it recorded): the same input gives a
  byte-identical trace.
- **Atomic output**: a trace already at the output path is replaced whole
  on success and left byte-for-byte alone on any refusal; no temporary file
  is ever left beside it.
- **Bad input refused**: every case of ``bad_inputs`` exits 2 with exactly
  one ``error: ...`` line that names the file (or the option) at fault, and
  writes nothing; a missing output directory is named and not created.

A source subclasses ``SourceContract`` with a module-level class named
``Test...`` in its own test file and supplies ``command`` (build the inputs
under a folder, return the command line writing ``out``), ``expected_counts``
and ``bad_inputs``; a source that needs a live peer overrides ``run``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import polars as pl
from click.testing import Result

from replay.format.tracedir import open_trace
from replay.format.writer import write_trace
from tests.conftest import run_cli

PREVIOUS = b"a trace the user already had\n"


class SourceContract:
    """What every source does with its input and its output path."""

    def command(self, folder: Path, out: Path) -> list[str]:
        """Write the source's inputs under ``folder``; the command line (without
        ``replay``) that writes the trace to ``out``."""
        raise NotImplementedError

    def expected_counts(self) -> dict[str, int]:
        """The trace's event counts by kind, exactly."""
        raise NotImplementedError

    def bad_inputs(self, folder: Path, out: Path) -> list[tuple[list[str], str]]:
        """(command line writing ``out``, the one error line without ``error: ``)
        for inputs the source must refuse; each message names the file or option."""
        raise NotImplementedError

    def run(self, args: Sequence[str | os.PathLike[str]]) -> Result:
        return run_cli(args)

    # --- helpers ------------------------------------------------------------------

    def _write(self, tmp_path: Path, name: str = "t.parquet") -> Path:
        folder = tmp_path / "in"
        folder.mkdir(exist_ok=True)
        out = tmp_path / name
        result = self.run(self.command(folder, out))
        assert result.exit_code == 0, result.output
        return out

    # --- round trip -----------------------------------------------------------------

    def test_round_trip(self, tmp_path: Path) -> None:
        out = self._write(tmp_path)
        validated = run_cli(["validate", out])
        assert validated.exit_code == 0, validated.output
        assert validated.output.startswith("ok"), validated.output
        trace = open_trace(out)
        frame = trace.read_frame()
        counts = dict(frame.group_by("kind").len().iter_rows())
        assert counts == self.expected_counts()
        assert trace.config.source, "the trace names where it came from"
        # Replayed: one result per lookup, in the trace's order.
        results = tmp_path / "t.results.parquet"
        replayed = run_cli(["run", out, "-o", results, "-q"])
        assert replayed.exit_code == 0, replayed.output
        lookups = frame.filter(pl.col("kind") == "lookup")
        assert pl.read_parquet(results)["seq"].to_list() == lookups["seq"].to_list()
        # Written back through the format, it reads back the same.
        again = write_trace(tmp_path / "again.parquet", trace.config, frame.to_dicts())
        assert open_trace(again).read_frame().equals(frame)

    # --- atomic output --------------------------------------------------------------

    def test_an_existing_output_is_replaced_whole(self, tmp_path: Path) -> None:
        out = tmp_path / "t.parquet"
        out.write_bytes(PREVIOUS)
        self._write(tmp_path)
        assert open_trace(out).num_rows == sum(self.expected_counts().values())
        assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "t.parquet"]

    # --- bad input ------------------------------------------------------------------

    def test_bad_input_is_one_line_and_leaves_the_output_alone(self, tmp_path: Path) -> None:
        folder = tmp_path / "in"
        folder.mkdir()
        out = tmp_path / "t.parquet"
        cases = self.bad_inputs(folder, out)
        assert cases, "a source refuses some input"
        for args, message in cases:
            out.write_bytes(PREVIOUS)
            before = sorted(p.name for p in tmp_path.iterdir())
            result = self.run(args)
            assert (result.exit_code, result.stderr) == (2, f"error: {message}\n"), args
            assert "Traceback" not in result.output
            assert out.read_bytes() == PREVIOUS, args
            assert sorted(p.name for p in tmp_path.iterdir()) == before, args

    def test_a_missing_output_directory_is_named_and_not_created(self, tmp_path: Path) -> None:
        folder = tmp_path / "in"
        folder.mkdir()
        out = tmp_path / "nope" / "t.parquet"
        result = self.run(self.command(folder, out))
        assert (result.exit_code, result.stderr) == (
            2,
            f"error: {out}: no such directory {out.parent} (it is not created)\n",
        )
        assert not out.parent.exists()


class DeterministicSourceContract(SourceContract):
    """A source whose output depends on its input only (importers, generators)."""

    def test_same_input_same_bytes(self, tmp_path: Path) -> None:
        one = self._write(tmp_path, "one.parquet")
        two = self._write(tmp_path, "two.parquet")
        assert one.read_bytes() == two.read_bytes()
