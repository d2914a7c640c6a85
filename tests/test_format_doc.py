"""docs/format.md against the code: every column the schemas define is
documented with its type, every documented column exists, and the metadata
fields listed are the ones written (so the page cannot drift)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pyarrow as pa

from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.format.schema import RESULTS_SCHEMA, TRACE_SCHEMA, UNIT_PRESENT_FIELD
from tests.builders import replay_trace

DOC = Path(__file__).resolve().parents[1] / "docs" / "format.md"


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

    trace = Path(__file__).resolve().parents[1] / "traces" / "demo-full-mamba-eagle.parquet"
    out = save_results(replay_trace(trace), tmp_path / "r.results.parquet")
    written = json.loads(pq.read_schema(out).metadata[b"replay.results"])
    assert set(doc_table("Key `replay.results`: a JSON object.")) == set(written)


def test_flag_names_listed_are_the_flags() -> None:
    from replay.analysis.flags import FLAG_KINDS

    meaning = doc_table("### Results columns")["flags"][2]
    assert re.findall(r"`([a-z_]+)`", meaning)[: len(FLAG_KINDS)] == list(FLAG_KINDS)
