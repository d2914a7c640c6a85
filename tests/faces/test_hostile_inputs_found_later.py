"""Issue 25, a third set of hostile inputs, each fed as found: the one line,
the exit status, and nothing left or changed."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from replay.format.writer import events_table
from tests.base.test_limits import refused as _only
from tests.conftest import run_cli

MEM = "/proc/self/mem"  # a regular file by stat that cannot seek or read


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_staged_directory_can_be_entered(tmp_path: Path, trace_43559: Path) -> None:
    """split and --emit-traces made their directories 0644: only root
    could read the parts written into them."""
    parts = tmp_path / "parts"
    assert run_cli(["split", str(trace_43559), "-o", str(parts), "--files", "2"]).exit_code == 0
    emitted = tmp_path / "emitted"
    args = ["whatif", str(trace_43559), "--capacity", "10", "--emit-traces", str(emitted), "-o", str(tmp_path / "w.parquet"), "-q", "--jobs", "1"]  # fmt: skip
    assert run_cli(args).exit_code == 0
    for d in (parts, emitted):
        assert d.stat().st_mode & 0o777 == 0o777 & ~_umask()
    assert sorted(p.stat().st_mode & 0o777 for p in parts.iterdir()) == [0o666 & ~_umask()] * 2


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["info", MEM], f"{MEM}: cannot read (Invalid argument)"),
        (["run", MEM, "-o", "{o}/r.parquet"], f"{MEM}: cannot read (Invalid argument)"),
        (["ingest", "mooncake", MEM, "-o", "{o}/m.parquet"], f"{MEM}: cannot read (Input/output error)"),
        (["ingest", "kv-events", MEM, "--block-size", "16", "-o", "{o}/k.parquet"], f"{MEM}: cannot read (Input/output error)"),
        (["ingest", "kv-events", "{o}/d.dump", "--config", MEM, "-o", "{o}/k.parquet"], f"{MEM}: cannot read (Input/output error)"),
        (["ingest", "kv-events", "{o}/d.dump", "--block-size", "16", "--lookups", MEM, "-o", "{o}/k.parquet"], f"{MEM}: cannot read (Input/output error)"),
        (["whatif", "{t}", "--capacity", "10", "--model-config", MEM, "-o", "{o}/w.parquet"], f"--model-config {MEM}: cannot read (Input/output error)"),
    ],
    ids=["info", "run", "mooncake", "kv-events", "config", "lookups", "model-config"],
)  # fmt: skip
def test_a_file_that_cannot_be_read_is_named(
    tmp_path: Path, trace_43559: Path, args: list[str], line: str
) -> None:
    """Each said only 'Invalid argument' or 'Input/output error'."""
    if not os.path.exists(MEM):
        pytest.skip("no /proc here")
    (tmp_path / "d.dump").write_bytes(b"RKVDUMP1")
    _only([a.format(o=tmp_path, t=trace_43559) for a in args], line, tmp_path)


def test_a_config_file_is_read_no_further_than_16_mib(tmp_path: Path, trace_43559: Path) -> None:
    """A --config or --model-config was read whole (a sparse 20 GiB file)."""
    (tmp_path / "d.dump").write_bytes(b"RKVDUMP1")
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as fh:
        fh.truncate(20 << 30)
    out = str(tmp_path / "o.parquet")
    _only(
        ["ingest", "kv-events", str(tmp_path / "d.dump"), "--config", str(huge), "-o", out],
        f"{huge}: larger than 16,777,216 bytes, not a KV-cache config JSON",
        tmp_path,
    )
    _only(
        ["whatif", str(trace_43559), "--capacity", "10", "--model-config", str(huge), "-o", out],
        f"--model-config {huge}: larger than 16,777,216 bytes, not a config.json",
        tmp_path,
    )
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    args = ["whatif", str(trace_43559), "--capacity-bytes", "1GiB", "--model-config", str(deep), "-o", out]  # fmt: skip
    result = run_cli(args)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: --model-config {deep}: not JSON (")
    assert result.stderr.count("\n") == 1


def test_a_recording_that_hears_nothing_leaves_no_dump(tmp_path: Path) -> None:
    pytest.importorskip("zmq")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dump = tmp_path / "rec.kvdump"
    args = ["record", "--endpoint", f"tcp://127.0.0.1:{port}", "--block-size", "16", "--duration", "0.5", "-o", str(tmp_path / "rec.parquet"), "--dump", str(dump)]  # fmt: skip
    result = run_cli(args)
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1].endswith("no trace written")
    assert list(tmp_path.iterdir()) == []


def test_a_config_of_too_many_groups_is_refused_before_they_are_built(tmp_path: Path) -> None:
    """5,000 groups took 2.5 GB and 33 s to replay one lookup; 400,000 in
    the metadata 50 s for `info`."""
    from replay.base.spec import GroupKind, GroupSpec, TraceConfig

    config = TraceConfig(
        groups=tuple(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16) for _ in range(1025)),
        hash_block_size=16,
        scheduler_block_size=16,
    )
    rows = [{"kind": "store", "group_id": 3, "block_hashes": [b"a" * 16]}]
    path = tmp_path / "g.parquet"
    pq.write_table(events_table(rows, config), str(path))
    _only(
        ["run", str(path), "-o", str(tmp_path / "r.parquet"), "-q"],
        f"{path}: replay.trace metadata: kv_cache_groups holds 1,025 KV-cache groups, above "
        "the limit of 1,024 (`replay --max-groups N ...` raises it)",
        tmp_path,
    )
    assert run_cli(["--max-groups", "2k", "validate", str(path)]).exit_code == 0
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(config.to_json()))
    (tmp_path / "d.dump").write_bytes(b"RKVDUMP1")
    _only(
        ["ingest", "kv-events", str(tmp_path / "d.dump"), "--config", str(cfg), "-o", str(tmp_path / "k.parquet")],
        f"{cfg}: kv_cache_groups holds 1,025 KV-cache groups, above the limit of 1,024 "
        "(`replay --max-groups N ...` raises it)",
        tmp_path,
    )  # fmt: skip


def test_a_request_id_of_65_mib_is_refused_from_the_footer(tmp_path: Path) -> None:
    """A few KB compressed; 256 MiB of it took 2.2 GB to validate and 2.8 GB
    to replay. The footer's uncompressed size of the column is checked
    before any row is decoded; the command's peak memory stays small."""
    import pyarrow as pa

    from tests.base.test_limits_of_record_readers import refused_within
    from tests.builders import full_mamba

    rows = [{"kind": "lookup", "request_id": "r", "block_hashes": [b"a" * 16], "max_length": 15}]
    table = events_table(rows, full_mamba())
    i = table.schema.get_field_index("request_id")
    table = table.set_column(i, table.schema.field(i), pa.array(["a" * (65 << 20)]))
    path = tmp_path / "bomb.parquet"
    pq.write_table(table, str(path), compression="zstd")
    del table
    assert path.stat().st_size < 20_000
    declared = pq.ParquetFile(str(path)).metadata.row_group(0).column(i).total_uncompressed_size
    refused_within(
        ["run", str(path), "-o", str(tmp_path / "r.parquet"), "-q"],
        f"{path}: row group 0 column 'request_id' declares {declared:,} bytes of text in one "
        "row group, above the limit of 67,108,864 (`replay --max-text-bytes N ...` raises it)",
        tmp_path,
        peak_mib=400,
    )


def test_a_results_file_with_a_65_mib_request_id_is_refused_from_the_footer(
    tmp_path: Path, trace_43559: Path
) -> None:
    """The text limit holds for results files too (check, report, explain of
    results): the footer is read, no row is decoded."""
    import pyarrow as pa

    from tests.base.test_limits_of_record_readers import refused_within

    good = tmp_path / "r.results.parquet"
    assert run_cli(["run", str(trace_43559), "-o", str(good), "-q"]).exit_code == 0
    table = pq.read_table(str(good))
    i = table.schema.get_field_index("request_id")
    big = ["a" * (65 << 20), *table.column(i).to_pylist()[1:]]
    table = table.set_column(i, table.schema.field(i), pa.array(big))
    path = tmp_path / "bomb.results.parquet"
    pq.write_table(table, str(path), compression="zstd")
    del table, big
    assert path.stat().st_size < 200_000
    declared = pq.ParquetFile(str(path)).metadata.row_group(0).column(i).total_uncompressed_size
    refused_within(
        ["check", str(path)],
        f"{path}: row group 0 column 'request_id' declares {declared:,} bytes of text in one "
        "row group, above the limit of 67,108,864 (`replay --max-text-bytes N ...` raises it)",
        tmp_path,
        peak_mib=400,
    )


def test_a_footer_over_16_mib_is_refused_before_pyarrow_parses_it(
    tmp_path: Path, trace_43559: Path
) -> None:
    """The footer's length is the file's last eight bytes: a trace whose
    metadata is 17 MiB (a config of hundreds of thousands of groups, or any
    junk key) is refused from them; --max-footer-bytes raises the limit."""
    table = pq.read_table(str(trace_43559))
    meta = dict(table.schema.metadata or {})
    meta[b"junk"] = b"x" * (17 << 20)
    path = tmp_path / "fat.parquet"
    pq.write_table(table.replace_schema_metadata(meta), str(path), compression="zstd")
    footer = int.from_bytes(path.read_bytes()[-8:-4], "little")
    _only(
        ["validate", str(path)],
        f"{path}: its footer declares {footer:,} bytes of Parquet footer, above the limit "
        "of 16,777,216 (`replay --max-footer-bytes N ...` raises it)",
        tmp_path,
    )
    assert run_cli(["--max-footer-bytes", "64M", "validate", str(path)]).exit_code == 0
