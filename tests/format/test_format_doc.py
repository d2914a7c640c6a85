"""docs/format.md against the code: every column the schemas define is
documented with its type, every documented column exists, and the metadata
fields listed are the ones written (so the page cannot drift)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.format.schema import RESULTS_SCHEMA, TRACE_SCHEMA, UNIT_PRESENT_FIELD
from tests.builders import replay_trace
from tests.conftest import run_cli

DOC = Path(__file__).resolve().parents[2] / "docs" / "format.md"


def doc_table(marker: str) -> dict[str, list[str]]:
    """The first table after the line ``marker``: its first cells (a `name`)
    -> the row's other cells."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    at = lines.index(marker)
    while not lines[at].startswith("|"):
        at += 1
    rows: dict[str, list[str]] = {}
    while at < len(lines) and lines[at].startswith("|"):
        cells = [c.strip() for c in lines[at].strip().strip("|").split("|")]
        match = re.fullmatch(r"`([a-z_]+)`", cells[0])
        if match:
            assert match[1] not in rows, f"{marker}: {match[1]} documented twice"
            rows[match[1]] = cells[1:]
        at += 1
    assert rows, f"no table after {marker!r}"
    return rows


def doc_type(t: pa.DataType) -> str:
    """The notation docs/format.md writes an Arrow type in."""
    if pa.types.is_dictionary(t):
        return f"`{doc_type(t.value_type).strip('`')}` (dictionary)"
    if pa.types.is_list(t):
        return f"`list<{doc_type(t.value_type).strip('`')}>`"
    if pa.types.is_struct(t):
        return "`struct`"
    if pa.types.is_timestamp(t):
        return f"`timestamp[{t.unit}, {t.tz}]`"
    if pa.types.is_boolean(t):
        return "`bool`"
    return f"`{t}`"


def nulls(field: pa.Field) -> str:
    return "allowed" if field.nullable else "never"


def test_every_trace_column_is_documented_with_its_type() -> None:
    documented = doc_table("### Trace columns")
    assert list(documented) == TRACE_SCHEMA.names
    for field in TRACE_SCHEMA:
        typ, null, _meaning = documented[field.name]
        assert (typ, null) == (doc_type(field.type), nulls(field)), field.name


def test_every_results_column_is_documented_with_its_type() -> None:
    documented = doc_table("### Results columns")
    fields = [*RESULTS_SCHEMA, UNIT_PRESENT_FIELD]
    assert list(documented) == [f.name for f in fields]
    for field in fields:
        typ, null, _meaning = documented[field.name]
        # The writer declares only seq non-null; the validity rules (and the
        # table) also promise the answer columns are never null.
        want_null = "never" if field.name in _RESULTS_NEVER_NULL else nulls(field)
        assert (typ, null) == (doc_type(field.type), want_null), field.name


#: The answer columns: never null in a valid results file (``_check_results``).
_RESULTS_NEVER_NULL = frozenset(
    ("seq", "request_id", "max_length", "hit_tokens", "mask_blocks", "loaded_blocks")
)


def test_flag_details_fields_are_documented() -> None:
    documented = doc_table("Each `flag_details` entry:")
    struct = RESULTS_SCHEMA.field("flag_details").type.value_type
    assert list(documented) == [f.name for f in struct]
    for field in struct:
        assert documented[field.name][0] == doc_type(field.type), field.name


def test_trace_metadata_fields_are_the_written_ones() -> None:
    config = TraceConfig(
        groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),),
        hash_block_size=16,
        scheduler_block_size=16,
        num_hash_lookahead_tokens=3,  # optional: written when set
        source={"cache": "gpu"},
    )
    marker = "Key `replay.trace`: a JSON object (UTF-8) describing the KV-cache"
    assert set(doc_table(marker)) == set(config.to_json())
    group_fields = {f.name for f in dataclasses.fields(GroupSpec)}
    assert set(doc_table("Each object of `kv_cache_groups`:")) == group_fields


def test_results_metadata_fields_are_the_written_ones(tmp_path: Path) -> None:
    """The fields of a results file as `replay run` writes it (with the
    link back to its trace)."""
    import json

    import pyarrow.parquet as pq

    from replay.format.link import save_results

    trace = Path(__file__).resolve().parents[2] / "traces" / "demo-full-mamba-eagle.parquet"
    out = save_results(replay_trace(trace), tmp_path / "r.results.parquet")
    written = json.loads(pq.read_schema(out).metadata[b"replay.results"])
    assert set(doc_table("Key `replay.results`: a JSON object.")) == set(written)


def test_flag_names_listed_are_the_flags() -> None:
    from replay.analysis.flags import FLAG_KINDS

    meaning = doc_table("### Results columns")["flags"][2]
    assert re.findall(r"`([a-z_]+)`", meaning)[: len(FLAG_KINDS)] == list(FLAG_KINDS)


# ---------------------------------------------------------------- every rule, broken (issue 32)


def _rule_bullets() -> list[str]:
    """The bullets of "What makes a trace valid", each as one line."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    at = lines.index("### What makes a trace valid") + 1
    bullets: list[str] = []
    while not lines[at].startswith("###"):
        line = lines[at]
        if line.startswith("- "):
            bullets.append(line[2:])
        elif line.startswith("  ") and bullets:
            bullets[-1] += " " + line.strip()
        at += 1
    return bullets


def _two_row_groups(tmp: Path) -> Path:
    from tests.faces.test_cli_errors import GOOD_META, HS, _table

    rows = [
        {"seq": 4, "kind": "store", "group_id": 0, "block_hashes": HS},
        {"seq": 2, "kind": "store", "group_id": 1, "block_hashes": HS},
    ]
    table = _table(rows)
    p = tmp / "t.parquet"
    meta = table.schema.with_metadata({b"replay.trace": json.dumps(GOOD_META).encode()})
    pq.write_table(table.cast(meta), str(p), row_group_size=1)
    return p


def _overlapping_files(tmp: Path) -> Path:
    from tests.faces.test_cli_errors import HS, _rows

    d = tmp / "dir"
    d.mkdir()
    for name, seq in (("a", 5), ("b", 5)):
        f = _rows(tmp, [{"seq": seq, "kind": "store", "group_id": 0, "block_hashes": HS}])
        f.rename(d / f"{name}.parquet")
    return d


def _ts(zone: str | None) -> Any:
    from tests.faces.test_cli_errors import _retype_column

    return lambda tmp: _retype_column(
        tmp, "ts", pa.array([0, 1, 2], pa.int64()).cast(pa.timestamp("us", tz=zone))
    )


def _extra_cases() -> dict[str, tuple[Any, str]]:
    from tests.faces.test_cli_errors import _retype_column, _rows, _with_meta

    return {
        "chunked_block_not_the_alignment": (
            lambda tmp: _with_meta(
                tmp,
                use_eagle=False,
                scheduler_block_size=32,
                kv_cache_groups=[
                    {"kind": "chunked_local_attention", "block_size": 16, "attention_chunk_size": 64},
                    {"kind": "full_attention", "block_size": 32},
                ],
            ),
            "{p}: replay.trace metadata: kv_cache_groups[0]: chunked_local_attention needs block_size equal to the hit alignment 32, got 16",
        ),
        "gpu_single_group_hash_block": (
            lambda tmp: _with_meta(
                tmp,
                scheduler_block_size=32,
                kv_cache_groups=[{"kind": "full_attention", "block_size": 32}],
                source={"cache": "gpu"},
            ),
            "{p}: replay.trace metadata: the gpu cache answers a single KV-cache group with vLLM's UnitaryKVCacheCoordinator, which needs hash_block_size equal to block_size 32, got 16",
        ),
        "seq_null": (
            lambda tmp: _retype_column(tmp, "seq", pa.array([0, None, 2], pa.int64())),
            "{p}: column 'seq': null value (every row needs a seq)",
        ),
        "seq_back_across_row_groups": (
            _two_row_groups,
            "{p}: seq 2: seq not strictly increasing (comes after seq 4)",
        ),
        "seq_overlapping_files": (
            _overlapping_files,
            "{p}/b.parquet: seq 5..5 does not come after a.parquet's seq 5..5 (file-name order must be seq order, the ranges disjoint)",
        ),
        "store_without_block_hashes": (
            lambda tmp: _rows(tmp, [{"kind": "store", "group_id": 0}]),
            "{p}: seq 0: store has no block_hashes",
        ),
        "ts_without_zone": (
            _ts(None),
            "{p}: column 'ts' has no time zone (a wall-clock time of unknown zone), expected timestamp[us, UTC]",
        ),
        "ts_zone_that_is_none": (
            _ts("Mars/Olympus"),
            "{p}: column 'ts' has time zone 'Mars/Olympus', which is not a time zone, expected timestamp[us, UTC]",
        ),
    }  # fmt: skip


#: Each rule of "What makes a trace valid" (by how its bullet begins) and
#: the files that break it: ``CASES`` of tests/faces/test_cli_errors.py, or above.
RULE_CASES = {
    "every `block_size` and the `scheduler_block_size` are multiples": [
        "block_not_multiple_of_hash_block",
        "scheduler_not_multiple_of_block",
    ],
    "a `chunked_local_attention` group never takes the EAGLE drop": [
        "chunked_with_eagle",
        "chunked_block_not_the_alignment",
    ],
    "answered by the `gpu` cache, a trace with a single group": ["gpu_single_group_hash_block"],
    "no size exceeds 2^31 - 1 tokens": ["block_size_beyond_int32"],
    "`seq` is never null and strictly increases": [
        "seq_null",
        "seq_not_increasing",
        "seq_decreasing",
        "seq_back_across_row_groups",
        "seq_overlapping_files",
    ],
    "`kind` is one of the four kinds": [
        "unknown_event_kind",
        "store_without_group_id",
        "store_without_block_hashes",
        "group_id_names_no_group",
    ],
    "a `lookup` has a `request_id`, `block_hashes` and a `max_length`": [
        "lookup_without_request_id",
        "lookup_without_max_length",
        "negative_max_length",
        "max_length_beyond_hashes",
    ],
    "every hash is non-null and non-empty": [
        "null_hash_element",
        "empty_hash",
        "request_id_not_utf8",
        "kind_not_utf8",
        "ts_beyond_year_9999",
    ],
    "`num_tokens` and `observed_hit_tokens` are not negative": [
        "negative_num_tokens",
        "negative_observed_hit_tokens",
        "num_tokens_below_max_length",
        "num_tokens_beyond_what_sums_hold",
    ],
    "`ts` is in UTC": ["ts_without_zone", "ts_zone_that_is_none"],
}


def _broken(name: str) -> tuple[Any, str]:
    from tests.faces.test_cli_errors import CASES

    return CASES[name] if name in CASES else _extra_cases()[name]


def test_every_rule_of_the_page_has_files_that_break_it() -> None:
    bullets = _rule_bullets()
    assert len(bullets) == len(RULE_CASES)
    for bullet, start in zip(bullets, RULE_CASES, strict=True):
        assert bullet.startswith(start), (bullet, start)


@pytest.mark.parametrize(
    "case", [c for cases in RULE_CASES.values() for c in cases], ids=lambda c: str(c)
)
def test_a_file_breaking_a_rule_is_refused(tmp_path: Path, case: str) -> None:
    build, line = _broken(case)
    path = build(tmp_path)
    result = run_cli(["validate", str(path)])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == "error: " + line.format(p=path) + "\n"


@pytest.mark.parametrize("column", TRACE_SCHEMA.names)
def test_a_column_of_another_type_is_refused(tmp_path: Path, column: str) -> None:
    """The type column of the trace columns table, each broken."""
    from tests.faces.test_cli_errors import _retype_column

    documented = doc_table("### Trace columns")[column][0].strip("`").split("`")[0]
    path = _retype_column(tmp_path, column, pa.array([1.5, 2.5, 3.5], pa.float64()))
    result = run_cli(["validate", str(path)])
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: {path}: column {column!r} has type double, expected {documented}\n"
    )


def test_a_required_column_missing_is_refused(tmp_path: Path) -> None:
    """ "A column may be missing from a file except ..." the ones named."""
    from tests.faces.test_cli_errors import _drop_column

    text = DOC.read_text(encoding="utf-8")
    sentence = text[text.index("A column may be missing from a file except") :].split(";")[0]
    required = re.findall(r"`([a-z_]+)`", sentence)
    assert required == ["seq", "kind", "group_id", "block_hashes", "request_id", "max_length"]
    for column in TRACE_SCHEMA.names:
        path = _drop_column(tmp_path, column)
        result = run_cli(["validate", str(path)])
        assert result.exit_code == (2 if column in required else 0), column
        path.unlink()


def test_a_required_metadata_field_missing_is_refused(tmp_path: Path) -> None:
    from tests.faces.test_cli_errors import _with_meta

    fields = doc_table("Key `replay.trace`: a JSON object (UTF-8) describing the KV-cache")
    for field, (_typ, required, _meaning) in fields.items():
        path = _with_meta(tmp_path, **{field: ...})
        result = run_cli(["validate", str(path)])
        if required == "yes":
            assert result.exit_code == 2, field
            assert result.stderr == (
                f"error: {path}: replay.trace metadata: missing field {field!r}\n"
            ), field
        else:
            assert result.exit_code == 0, (field, result.stderr)
        path.unlink()
