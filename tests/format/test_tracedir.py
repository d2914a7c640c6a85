"""A trace as a directory of files: every command reads one as it reads the
file, the footers are checked before any row, and split / cat convert."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.analysis.flags import result_flags
from replay.format.schema import TRACE_META_KEY
from replay.format.tracedir import TraceDir, open_trace
from replay.format.writer import events_table, write_trace
from tests.builders import full_mamba, random_config, random_rows, replay_trace
from tests.conftest import run_cli

DEMO = Path(__file__).resolve().parent.parent.parent / "traces" / "demo-full-mamba-eagle.parquet"


@pytest.fixture
def demo_dir(tmp_path: Path) -> Path:
    out = tmp_path / "demo"
    result = run_cli(["split", str(DEMO), "-o", str(out), "--files", "4"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{DEMO} -> {out}: 4 files\n"
    return out


def _rows(reader_path: Path) -> pl.DataFrame:
    return open_trace(reader_path).read_frame()


def test_split_writes_seq_ordered_files_of_equal_rows(demo_dir: Path) -> None:
    names = sorted(p.name for p in demo_dir.iterdir())
    assert names == [f"part-{i:06d}.parquet" for i in range(4)]
    total = open_trace(DEMO).num_rows
    sizes = [pq.ParquetFile(demo_dir / n).metadata.num_rows for n in names]
    assert sum(sizes) == total
    assert sizes == [(i + 1) * total // 4 - i * total // 4 for i in range(4)]
    reader = open_trace(demo_dir)
    assert isinstance(reader, TraceDir)
    assert reader.num_rows == total
    assert reader.config == open_trace(DEMO).config
    assert _rows(demo_dir).equals(_rows(DEMO))


def test_cat_gives_back_the_same_events(tmp_path: Path, demo_dir: Path) -> None:
    out = tmp_path / "again.parquet"
    result = run_cli(["cat", str(demo_dir), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{demo_dir} -> {out}: {open_trace(DEMO).num_rows:,} events\n"
    assert _rows(out).equals(_rows(DEMO))
    assert open_trace(out).config.to_json() == open_trace(DEMO).config.to_json()


@pytest.mark.parametrize("policy", ["vllm-0.33", "pre-49502"])
def test_run_on_a_directory_is_the_run_on_the_file(
    tmp_path: Path, demo_dir: Path, policy: str
) -> None:
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    for trace, out in ((DEMO, a), (demo_dir, b)):
        result = run_cli(["run", str(trace), "-o", str(out), "--policy", policy, "-q"])
        assert result.exit_code == 0, result.stderr
    assert pl.read_parquet(a).equals(pl.read_parquet(b))
    assert (demo_dir.parent / "demo.results.parquet").exists() is False


def _named(text: str, path: Path) -> str:
    return text.replace(str(path), "T").replace(path.name, "T")


def test_every_reading_command_accepts_a_directory(tmp_path: Path, demo_dir: Path) -> None:
    for args in (
        ["validate"],
        ["info", "--json"],
        ["check", "--policy", "pre-49502", "--json"],
        ["state", "--at", "700", "--show", "3"],
        ["diff", "--policy", "vllm-0.33", "--policy", "pre-49502", "--limit", "2"],
    ):
        on_file = run_cli([args[0], str(DEMO), *args[1:]])
        on_dir = run_cli([args[0], str(demo_dir), *args[1:]])
        assert on_dir.exit_code == on_file.exit_code, (args, on_dir.stderr)
        assert _named(on_dir.stdout, demo_dir) == _named(on_file.stdout, DEMO)
    flagged = result_flags(replay_trace(DEMO, policy="pre-49502"))["request_id"][0]
    explain = ["explain", "--request", flagged, "--policy", "pre-49502"]
    on_file = run_cli([explain[0], str(DEMO), *explain[1:]])
    on_dir = run_cli([explain[0], str(demo_dir), *explain[1:]])
    assert on_file.exit_code == on_dir.exit_code == 0
    assert on_dir.stdout == on_file.stdout
    assert "mamba_overrun" in on_dir.stdout


def test_default_results_path_is_beside_the_directory(demo_dir: Path) -> None:
    result = run_cli(["run", str(demo_dir), "-q"])
    assert result.exit_code == 0, result.stderr
    assert (demo_dir.parent / "demo.results.parquet").is_file()


@pytest.mark.parametrize("seed", range(10))
def test_random_traces_in_random_files(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    config = random_config(rng)
    rows = random_rows(rng, config, n_requests=25)
    single = write_trace(tmp_path / "one.parquet", config, rows)
    d = tmp_path / "d"
    files = rng.randint(1, 8)
    result = run_cli(["split", str(single), "-o", str(d), "--files", str(files)])
    assert result.exit_code == 0, result.stderr
    sizes = [pq.ParquetFile(p).metadata.num_rows for p in sorted(d.iterdir())]
    assert len(sizes) == min(files, len(rows))
    assert max(sizes) - min(sizes) <= 1
    for policy in ("vllm-0.33", "pre-49502"):
        assert replay_trace(d, policy=policy).results.equals(
            replay_trace(single, policy=policy).results
        )


# ---------------------------------------------------------------- bad directories


def _bad_dir(tmp_path: Path) -> Path:
    d = tmp_path / "bad"
    d.mkdir()
    return d


def _two_files(tmp_path: Path, second: list[dict[str, Any]], **write: Any) -> Path:
    d = _bad_dir(tmp_path)
    config = full_mamba()
    first = [
        {"seq": 0, "kind": "store", "group_id": 0, "block_hashes": [b"a" * 32]},
        {"seq": 5, "kind": "store", "group_id": 1, "block_hashes": [b"a" * 32]},
    ]
    write_trace(d / "a.parquet", config, first)
    table = events_table(second, config)
    pq.write_table(table, str(d / "b.parquet"), **write)
    return d


def _error(args: list[str]) -> str:
    result = run_cli(args)
    assert result.exit_code == 2
    assert result.stdout == ""
    return result.stderr


@pytest.mark.parametrize("command", ["validate", "run", "info"])
def test_overlapping_files_fail_from_the_footers(tmp_path: Path, command: str) -> None:
    d = _two_files(tmp_path, [{"seq": 3, "kind": "clear"}, {"seq": 9, "kind": "clear"}])
    args = [command, str(d)] + (
        ["-q", "-o", str(tmp_path / "r.parquet")] if command == "run" else []
    )
    assert _error(args) == (
        f"error: {d / 'b.parquet'}: seq 3..9 does not come after a.parquet's seq 0..5 "
        "(file-name order must be seq order, the ranges disjoint)\n"
    )
    assert not (tmp_path / "r.parquet").exists()


def test_files_without_statistics_are_checked_as_they_stream(tmp_path: Path) -> None:
    d = _two_files(tmp_path, [{"seq": 5, "kind": "clear"}], write_statistics=False)
    assert _error(["validate", str(d)]) == (
        f"error: {d / 'b.parquet'}: seq 5: seq not strictly increasing "
        "(comes after seq 5 of a.parquet)\n"
    )


def test_footers_are_checked_before_any_row(tmp_path: Path) -> None:
    # A bad row in the first file: the second file's footer fails first.
    d = _bad_dir(tmp_path)
    config = full_mamba()
    write_trace(d / "b.parquet", config, [{"seq": 1, "kind": "clear"}])
    table = events_table([{"seq": 0, "kind": "clear"}, {"seq": 4, "kind": "store"}], config)
    pq.write_table(table, str(d / "a.parquet"))
    assert "a.parquet's seq 0..4" in _error(["validate", str(d)])
    shutil.move(d / "b.parquet", tmp_path / "b.parquet")
    assert _error(["validate", str(d)]) == (
        f"error: {d / 'a.parquet'}: seq 4: store has no group_id "
        "(store and remove name the group whose keys change)\n"
    )


def test_a_different_config_names_the_file(tmp_path: Path) -> None:
    d = _bad_dir(tmp_path)
    write_trace(d / "a.parquet", full_mamba(), [{"seq": 0, "kind": "clear"}])
    write_trace(d / "b.parquet", full_mamba(block=32), [{"seq": 1, "kind": "clear"}])
    assert _error(["run", str(d), "-q"]) == (
        f"error: {d / 'b.parquet'}: replay.trace config differs from a.parquet's "
        "(every file of a trace directory is recorded under the same config)\n"
    )


def test_a_different_cache_names_the_file(tmp_path: Path) -> None:
    d = _bad_dir(tmp_path)
    base = full_mamba().to_json()
    for name, cache, seq in (("a", "gpu", 0), ("b", "mooncake", 1)):
        table = events_table([{"seq": seq, "kind": "clear"}], full_mamba())
        meta = json.dumps({**base, "source": {"cache": cache}}).encode()
        pq.write_table(
            table.replace_schema_metadata({TRACE_META_KEY: meta}), str(d / f"{name}.parquet")
        )
    assert _error(["validate", str(d)]) == (
        f"error: {d / 'b.parquet'}: source.cache 'mooncake' differs from a.parquet's 'gpu'\n"
    )


def test_a_broken_file_is_named(tmp_path: Path) -> None:
    d = _bad_dir(tmp_path)
    write_trace(d / "a.parquet", full_mamba(), [{"seq": 0, "kind": "clear"}])
    (d / "b.parquet").write_text("seq,kind\n")
    assert _error(["validate", str(d)]) == (
        f"error: {d / 'b.parquet'}: not a Parquet file (no PAR1 magic at the start)\n"
    )


def test_an_empty_directory(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    (d / "notes.txt").write_text("not a trace")
    assert _error(["validate", str(d)]) == (
        f"error: {d}: no .parquet files in the directory (expected a trace's files)\n"
    )


def test_hidden_and_other_files_are_not_part_of_the_trace(tmp_path: Path, demo_dir: Path) -> None:
    # What an interrupted writer leaves (a dot file), and notes beside the data.
    (demo_dir / ".part-000009.parquet.abc.tmp").write_bytes(b"PAR1")
    (demo_dir / "README.txt").write_text("a day of events")
    assert _rows(demo_dir).equals(_rows(DEMO))


# ---------------------------------------------------------------- split / cat refuse


def test_split_refuses_a_non_empty_directory_and_leaves_it(tmp_path: Path, demo_dir: Path) -> None:
    before = sorted(p.name for p in demo_dir.iterdir())
    assert _error(["split", str(DEMO), "-o", str(demo_dir), "--files", "2"]) == (
        f"error: {demo_dir}: directory is not empty, expected a new or empty directory\n"
    )
    assert sorted(p.name for p in demo_dir.iterdir()) == before


def test_split_into_an_empty_directory(tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert run_cli(["split", str(DEMO), "-o", str(out), "--files", "2"]).exit_code == 0
    assert len(list(out.iterdir())) == 2


def test_split_of_a_bad_trace_leaves_nothing(tmp_path: Path) -> None:
    config = full_mamba()
    rows: list[dict[str, Any]] = [
        {"seq": i, "kind": "store", "group_id": 0, "block_hashes": [bytes([i]) * 32]}
        for i in range(20)
    ]
    rows.append({"seq": 20, "kind": "store", "block_hashes": [b"x" * 32]})
    path = tmp_path / "t.parquet"
    # Written raw: the project's own writers refuse to make a bad trace.
    pq.write_table(events_table(rows, config), str(path), row_group_size=7)
    out = tmp_path / "parts"
    assert _error(["split", str(path), "-o", str(out), "--files", "3"]) == (
        f"error: {path}: seq 20: store has no group_id "
        "(store and remove name the group whose keys change)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]


def test_cat_never_writes_over_or_into_its_input(tmp_path: Path, demo_dir: Path) -> None:
    # The one output guard of replay.format.paths (issue 25): its words, for every command.
    inside = demo_dir / "all.parquet"
    assert _error(["cat", str(demo_dir), "-o", str(inside)]) == (
        f"error: -o {inside}: lies inside the input directory {demo_dir}; refusing to write "
        "there (give another output path)\n"
    )
    part = demo_dir / "part-000001.parquet"
    assert _error(["cat", str(DEMO), "-o", str(DEMO)]) == (
        f"error: -o {DEMO}: is the input {DEMO}; refusing to overwrite it (give another output path)\n"
    )
    size = part.stat().st_size
    assert _error(["split", str(demo_dir), "-o", str(part), "--files", "2"]) == (
        f"error: -o {part}: lies inside the input directory {demo_dir}; refusing to write "
        "there (give another output path)\n"
    )
    other = tmp_path / "f.parquet"
    other.write_bytes(b"x")
    assert _error(["split", str(demo_dir), "-o", str(other), "--files", "2"]) == (
        f"error: {other}: exists and is not a directory, expected a new directory\n"
    )
    assert part.stat().st_size == size
    assert sorted(p.name for p in demo_dir.iterdir()) == [f"part-{i:06d}.parquet" for i in range(4)]


def test_report_finds_a_directory_trace_beside_its_results(demo_dir: Path) -> None:
    assert run_cli(["run", str(demo_dir), "--policy", "pre-49502", "-q"]).exit_code == 0
    results = demo_dir.parent / "demo.results.parquet"
    out = demo_dir.parent / "report.md"
    result = run_cli(["report", str(results), "-o", str(out), "--format", "md"])
    assert result.exit_code == 0, result.stderr
    text = out.read_text()
    assert "not found: looked for" not in text
    flagged = result_flags(replay_trace(DEMO, policy="pre-49502"))["request_id"][0]
    assert "replay explain" in text and flagged in text


# ------------------------------------------- every part read, or refused (issue 25)

PART_OF = "every .parquet file of a trace directory is a part of it"


@pytest.mark.parametrize("kind", ["dangling symlink", "symlink loop", "fifo", "directory"])
@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_part_that_is_not_a_regular_file_is_an_error_naming_it(
    tmp_path: Path, demo_dir: Path, kind: str, command: str
) -> None:
    part = demo_dir / "part-000009.parquet"
    if kind == "dangling symlink":
        part.symlink_to("gone.parquet")
        message = f"{part}: is a dangling symlink (to gone.parquet); {PART_OF}"
    elif kind == "symlink loop":
        part.symlink_to(part.name)
        message = f"{part}: is a symlink loop; {PART_OF}"
    elif kind == "fifo":
        os.mkfifo(part)
        message = f"{part}: is a FIFO, expected a Parquet file ({PART_OF})"
    else:
        part.mkdir()
        message = f"{part}: is a directory, expected a Parquet file ({PART_OF})"
    before = sorted(p.name for p in tmp_path.iterdir())
    args = ["validate", str(demo_dir)] if command == "validate" else ["run", str(demo_dir), "-q"]
    assert _error(args) == f"error: {message}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_split_and_cat_keep_fixed_size_hashes(tmp_path: Path) -> None:
    # `replay synth` writes fixed-size hashes (cheaper to decode): the
    # files of a split, and a cat of them, keep that layout.
    from replay.sources.synth import synth_trace

    src = tmp_path / "synth.parquet"
    synth_trace(src, model="full+mamba", requests=200, seed=3, eagle=True)
    fixed = pq.ParquetFile(src).schema_arrow.field("block_hashes").type
    assert fixed.value_type.byte_width == 16
    assert (
        run_cli(["split", str(src), "-o", str(tmp_path / "parts"), "--files", "3"]).exit_code == 0
    )
    for part in sorted((tmp_path / "parts").iterdir()):
        assert pq.ParquetFile(part).schema_arrow.field("block_hashes").type == fixed
    out = tmp_path / "again.parquet"
    assert run_cli(["cat", str(tmp_path / "parts"), "-o", str(out)]).exit_code == 0
    assert pq.ParquetFile(out).schema_arrow.field("block_hashes").type == fixed
    assert _rows(out).equals(_rows(src))


def test_cat_of_parts_of_mixed_hash_layouts_writes_variable_width_hashes(
    tmp_path: Path,
) -> None:
    # A directory whose parts disagree on the layout (one of fixed-size
    # hashes, one written before `replay synth` wrote them so): the copy
    # takes the layout every width fits, and holds the same rows.
    from replay.sources.synth import synth_trace

    src = tmp_path / "synth.parquet"
    synth_trace(src, model="full+mamba", requests=200, seed=3, eagle=True)
    parts = tmp_path / "parts"
    assert run_cli(["split", str(src), "-o", str(parts), "--files", "2"]).exit_code == 0
    first = sorted(parts.iterdir())[0]
    table = pq.read_table(first)
    i = table.schema.get_field_index("block_hashes")
    schema = table.schema.set(i, table.schema.field(i).with_type(pa.list_(pa.binary())))
    pq.write_table(table.cast(schema), first)
    out = tmp_path / "again.parquet"
    assert run_cli(["cat", str(parts), "-o", str(out)]).exit_code == 0
    assert pq.ParquetFile(out).schema_arrow.field("block_hashes").type == pa.list_(pa.binary())
    assert _rows(out).equals(_rows(src))
