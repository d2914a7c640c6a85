"""Every bad input a user can give: one line naming the file and the row
(seq) or column, exit status 2, no traceback, no output file."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.format.schema import TRACE_META_KEY
from replay.format.writer import events_table
from tests.builders import chain, full_mamba, issue_43559_rows
from tests.conftest import run_cli

GOOD_META: dict[str, Any] = full_mamba().to_json()


def _write(path: Path, table: pa.Table, meta: bytes | None) -> Path:
    schema = table.schema.with_metadata({TRACE_META_KEY: meta} if meta is not None else {})
    pq.write_table(table.cast(schema), str(path))
    return path


def _table(rows: list[dict[str, Any]] | None = None) -> pa.Table:
    return events_table(
        rows if rows is not None else issue_43559_rows(), full_mamba()
    ).replace_schema_metadata(None)


def _with_meta(tmp: Path, **changes: Any) -> Path:
    meta = dict(GOOD_META)
    meta.update(changes)
    meta = {k: v for k, v in meta.items() if v is not ...}
    return _write(tmp / "t.parquet", _table(), json.dumps(meta).encode())


def _with_group(tmp: Path, group: dict[str, Any], **changes: Any) -> Path:
    return _with_meta(tmp, kv_cache_groups=[group], **changes)


def _rows(tmp: Path, rows: list[dict[str, Any]]) -> Path:
    return _write(tmp / "t.parquet", _table(rows), json.dumps(GOOD_META).encode())


def _csv(tmp: Path) -> Path:
    p = tmp / "t.parquet"
    p.write_text("seq,kind\n0,store\n")
    return p


def _truncated(tmp: Path) -> Path:
    good = _write(tmp / "good.parquet", _table(), json.dumps(GOOD_META).encode())
    data = good.read_bytes()
    p = tmp / "t.parquet"
    p.write_bytes(data[: len(data) // 2])
    return p


def _empty(tmp: Path) -> Path:
    p = tmp / "t.parquet"
    p.write_bytes(b"")
    return p


def _drop_column(tmp: Path, name: str) -> Path:
    t = _table()
    return _write(tmp / "t.parquet", t.drop_columns([name]), json.dumps(GOOD_META).encode())


def _retype_column(tmp: Path, name: str, values: pa.Array) -> Path:
    t = _table()
    i = t.schema.get_field_index(name)
    t = t.set_column(i, name, values)
    return _write(tmp / "t.parquet", t, json.dumps(GOOD_META).encode())


HS = chain(2)
CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "missing_path": (lambda tmp: tmp / "t.parquet", "{p}: no such file"),
    "empty_file": (_empty, "{p}: empty file, expected a Parquet file"),
    "csv_not_parquet": (_csv, "{p}: not a Parquet file (no PAR1 magic at the start)"),
    "truncated_parquet": (_truncated, "{p}: truncated Parquet file (no PAR1 magic at the end)"),
    "no_metadata": (
        lambda tmp: _write(tmp / "t.parquet", _table(), None),
        "{p}: missing 'replay.trace' metadata (not a replay trace v1)",
    ),
    "metadata_not_json": (
        lambda tmp: _write(tmp / "t.parquet", _table(), b"{not json"),
        "{p}: 'replay.trace' metadata is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
    ),
    "metadata_missing_field": (
        lambda tmp: _with_meta(tmp, hash_block_size=...),
        "{p}: replay.trace metadata: missing field 'hash_block_size'",
    ),
    "metadata_wrong_type": (
        lambda tmp: _with_meta(tmp, use_eagle="yes"),
        "{p}: replay.trace metadata: use_eagle must be a boolean, got 'yes'",
    ),
    "metadata_wrong_version": (
        lambda tmp: _with_meta(tmp, version=2),
        "{p}: replay.trace metadata: field 'version': expected 1, got 2",
    ),
    "unknown_group_kind": (
        lambda tmp: _with_group(tmp, {"kind": "linear_attention", "block_size": 16}),
        "{p}: replay.trace metadata: kv_cache_groups[0]: unknown kind 'linear_attention', "
        "expected one of full_attention, sliding_window, chunked_local_attention, mamba",
    ),
    "zero_block_size": (
        lambda tmp: _with_group(tmp, {"kind": "full_attention", "block_size": 0}),
        "{p}: replay.trace metadata: kv_cache_groups[0]: block_size must be a positive integer, got 0",
    ),
    "negative_block_size": (
        lambda tmp: _with_group(tmp, {"kind": "full_attention", "block_size": -16}),
        "{p}: replay.trace metadata: kv_cache_groups[0]: block_size must be a positive integer, got -16",
    ),
    "block_not_multiple_of_hash_block": (
        lambda tmp: _with_group(
            tmp, {"kind": "full_attention", "block_size": 24}, scheduler_block_size=48
        ),
        "{p}: replay.trace metadata: kv_cache_groups[0]: block_size 24 must be a multiple of hash_block_size 16",
    ),
    "scheduler_not_multiple_of_block": (
        lambda tmp: _with_group(tmp, {"kind": "full_attention", "block_size": 32}),
        "{p}: replay.trace metadata: kv_cache_groups[0]: scheduler_block_size 16 must be a multiple of block_size 32",
    ),
    "sliding_window_without_window": (
        lambda tmp: _with_group(tmp, {"kind": "sliding_window", "block_size": 16}),
        "{p}: replay.trace metadata: kv_cache_groups[0]: sliding_window group needs a positive integer sliding_window, got None",
    ),
    "chunked_with_eagle": (
        lambda tmp: _with_group(
            tmp, {"kind": "chunked_local_attention", "block_size": 16, "attention_chunk_size": 64}
        ),
        "{p}: replay.trace metadata: kv_cache_groups[0]: chunked_local_attention does not combine with EAGLE (vLLM rejects this hybrid in the mooncake cache)",
    ),
    "no_groups": (
        lambda tmp: _with_meta(tmp, kv_cache_groups=[]),
        "{p}: replay.trace metadata: kv_cache_groups: at least one KV-cache group is required",
    ),
    "missing_column": (
        lambda tmp: _drop_column(tmp, "max_length"),
        "{p}: missing column 'max_length' (expected int64)",
    ),
    "wrongly_typed_column": (
        lambda tmp: _retype_column(tmp, "seq", pa.array(["0", "1", "2"])),
        "{p}: column 'seq' has type string, expected int64",
    ),
    "seq_not_increasing": (
        lambda tmp: _rows(
            tmp,
            [
                {"seq": 5, "kind": "store", "group_id": 0, "block_hashes": HS},
                {"seq": 5, "kind": "store", "group_id": 1, "block_hashes": HS},
            ],
        ),
        "{p}: seq 5: seq not strictly increasing (comes after seq 5)",
    ),
    "seq_decreasing": (
        lambda tmp: _rows(
            tmp,
            [
                {"seq": 7, "kind": "store", "group_id": 0, "block_hashes": HS},
                {"seq": 3, "kind": "store", "group_id": 1, "block_hashes": HS},
            ],
        ),
        "{p}: seq 3: seq not strictly increasing (comes after seq 7)",
    ),
    "unknown_event_kind": (
        lambda tmp: _rows(tmp, [{"kind": "evict", "group_id": 0, "block_hashes": HS}]),
        "{p}: seq 0: unknown event kind 'evict', expected one of store, remove, clear, lookup",
    ),
    "lookup_without_max_length": (
        lambda tmp: _rows(tmp, [{"kind": "lookup", "request_id": "a", "block_hashes": HS}]),
        "{p}: seq 0: lookup has no max_length",
    ),
    "lookup_without_request_id": (
        lambda tmp: _rows(tmp, [{"kind": "lookup", "max_length": 16, "block_hashes": HS}]),
        "{p}: seq 0: lookup has no request_id",
    ),
    "negative_max_length": (
        lambda tmp: _rows(
            tmp, [{"kind": "lookup", "request_id": "a", "max_length": -1, "block_hashes": HS}]
        ),
        "{p}: seq 0: lookup has a negative max_length -1",
    ),
    "max_length_beyond_hashes": (
        lambda tmp: _rows(
            tmp, [{"kind": "lookup", "request_id": "a", "max_length": 48, "block_hashes": HS}]
        ),
        "{p}: seq 0: lookup max_length 48 exceeds what its 2 block_hashes cover "
        "(expected below (len(block_hashes) + 1) * hash_block_size 16)",
    ),
    "store_without_group_id": (
        lambda tmp: _rows(tmp, [{"kind": "store", "block_hashes": HS}]),
        "{p}: seq 0: store has no group_id (store and remove name the group whose keys change)",
    ),
    "request_id_not_utf8": (
        lambda tmp: _retype_column(
            tmp, "request_id", pa.array([None, None, b"r\xff"], pa.binary()).view(pa.string())
        ),
        "{p}: seq 2: column 'request_id' is not valid UTF-8 text",
    ),
    "kind_not_utf8": (
        lambda tmp: _retype_column(
            tmp,
            "kind",
            pa.DictionaryArray.from_arrays(
                pa.array([0, 0, 1], pa.int8()),
                pa.array([b"store", b"look\xc0up"], pa.binary()).view(pa.string()),
            ),
        ),
        # Arrow checks a dictionary's strings as it reads them: no row to name.
        "{p}: column 'kind' is not valid UTF-8 text: unreadable Parquet data (Invalid UTF8 payload)",
    ),
    "ts_beyond_year_9999": (
        lambda tmp: _retype_column(
            tmp, "ts", pa.array([0, 10**15, 1], pa.timestamp("s", tz="UTC"))
        ),
        # Parquet stores seconds as milliseconds.
        "{p}: seq 1: ts 1000000000000000000 ms since the epoch is outside the representable range (expected a time between 0001-01-01 and 9999-12-31)",
    ),
    "unsigned_64_bit_seq": (
        lambda tmp: _retype_column(tmp, "seq", pa.array([0, 1, 2**63], pa.uint64())),
        "{p}: column 'seq' has type uint64, expected int64",
    ),
    "group_id_beyond_int32": (
        lambda tmp: _retype_column(tmp, "group_id", pa.array([0, 2**40, None], pa.int64())),
        "{p}: seq 1: group_id 1099511627776 names no group (the trace has 2: 0..1)",
    ),
    "null_hash_element": (
        lambda tmp: _retype_column(
            tmp, "block_hashes", pa.array([HS, [HS[0], None], HS], pa.list_(pa.binary()))
        ),
        "{p}: seq 1: block_hashes[1] is null (expected a hash: non-empty bytes)",
    ),
    "empty_hash": (
        lambda tmp: _retype_column(
            tmp, "block_hashes", pa.array([[b""], HS, HS], pa.list_(pa.binary()))
        ),
        "{p}: seq 0: block_hashes[0] is empty (expected a hash: non-empty bytes)",
    ),
    "duplicate_column": (
        lambda tmp: _write(
            tmp / "t.parquet",
            _table().append_column("seq", pa.array([0, 1, 2])),
            json.dumps(GOOD_META).encode(),
        ),
        "{p}: column 'seq' appears more than once",
    ),
    "num_tokens_below_max_length": (
        lambda tmp: _rows(
            tmp,
            [
                {
                    "kind": "lookup",
                    "request_id": "a",
                    "max_length": 16,
                    "num_tokens": 15,
                    "block_hashes": HS,
                }
            ],
        ),
        "{p}: seq 0: num_tokens 15 cannot hold max_length 16 (expected num_tokens >= max_length)",
    ),
    "negative_num_tokens": (
        lambda tmp: _rows(
            tmp,
            [
                {
                    "kind": "lookup",
                    "request_id": "a",
                    "max_length": 0,
                    "num_tokens": -3,
                    "block_hashes": HS,
                }
            ],
        ),
        "{p}: seq 0: num_tokens -3 is negative",
    ),
    "negative_observed_hit_tokens": (
        lambda tmp: _rows(
            tmp,
            [
                {
                    "kind": "lookup",
                    "request_id": "a",
                    "max_length": 16,
                    "observed_hit_tokens": -1,
                    "block_hashes": HS,
                }
            ],
        ),
        "{p}: seq 0: observed_hit_tokens -1 is negative",
    ),
    "num_tokens_beyond_what_sums_hold": (
        lambda tmp: _rows(
            tmp,
            [
                {
                    "kind": "lookup",
                    "request_id": "a",
                    "max_length": 16,
                    "num_tokens": 2**62,
                    "block_hashes": HS,
                }
            ],
        ),
        "{p}: seq 0: num_tokens 4611686018427387904 is above 2**48 tokens",
    ),
    "block_size_beyond_int32": (
        lambda tmp: _with_meta(
            tmp,
            hash_block_size=2**32,
            scheduler_block_size=2**32,
            kv_cache_groups=[{"kind": "full_attention", "block_size": 2**32}],
        ),
        "{p}: replay.trace metadata: hash_block_size 4294967296 is above 2147483647 tokens",
    ),
    "metadata_lone_surrogate": (
        lambda tmp: _write(
            tmp / "t.parquet",
            _table(),
            json.dumps({**GOOD_META, "source": {"x": "\ud800"}}).encode(),
        ),
        "{p}: 'replay.trace' metadata holds a lone surrogate escape (not text)",
    ),
    "metadata_integer_of_5000_digits": (
        lambda tmp: _write(tmp / "t.parquet", _table(), b'{"version": ' + b"1" * 5000 + b"}"),
        "{p}: 'replay.trace' metadata is not valid JSON (Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits; use sys.set_int_max_str_digits() to increase the limit)",
    ),
    "group_id_names_no_group": (
        lambda tmp: _rows(tmp, [{"kind": "remove", "group_id": 2, "block_hashes": HS}]),
        "{p}: seq 0: group_id 2 names no group (the trace has 2: 0..1)",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["validate", "run", "state"])
def test_bad_input_is_one_line_exit_2_no_output(tmp_path: Path, case: str, command: str) -> None:
    build, message = CASES[case]
    path = build(tmp_path)
    out = tmp_path / "out.parquet"
    args = {
        "validate": ["validate", str(path)],
        "run": ["run", str(path), "-o", str(out), "--quiet"],
        "state": ["state", str(path), "-o", str(out)],
    }[command]
    result = run_cli(args)
    assert result.exit_code == 2
    assert result.stdout == "" or command == "state"
    assert result.stderr == "error: " + message.format(p=path) + "\n"
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_unknown_request_in_explain(trace_43559: Path) -> None:
    result = run_cli(["explain", str(trace_43559), "--request", "nope"])
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: {trace_43559}: no lookup with request_id 'nope'; nearest: 'req-43559' "
        f"(replay info {trace_43559} --requests lists them all)\n"
    )


def test_state_group_out_of_range(trace_43559: Path) -> None:
    result = run_cli(["state", str(trace_43559), "--group", "5"])
    assert result.exit_code == 2
    assert result.stderr == "error: --group 5: the trace has groups 0..1\n"


@pytest.mark.parametrize(
    "args",
    [
        ["state", "{t}", "--show", "-1"],
        ["run", "{t}", "--examples", "-1", "-q"],
        ["check", "{t}", "--examples", "-2"],
    ],
)
def test_negative_counts_are_refused(trace_43559: Path, args: list[str]) -> None:
    result = run_cli([a.format(t=trace_43559) for a in args])
    option, value = args[-2:] if args[-1] != "-q" else args[-3:-1]
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {option} '{value}': expected a whole number from 0 to "
        "9,223,372,036,854,775,807, k/M/G/T suffixes allowed\n",
    )


def test_hashes_of_different_widths_in_one_trace_are_valid_everywhere(tmp_path: Path) -> None:
    from replay.format.writer import write_trace
    from tests.builders import replay_trace

    wide, narrow, odd = chain(3, "w"), [(i + 1).to_bytes(8, "big") for i in range(3)], [b"\x01", b"\x02" * 100]  # fmt: skip
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": [wide[0], narrow[1], *odd]},
        {"kind": "store", "group_id": 1, "block_hashes": [wide[0], narrow[1], *odd]},
        {"kind": "lookup", "request_id": "mixed", "block_hashes": [wide[0], narrow[1], odd[0]], "max_length": 47, "num_tokens": 48},
        {"kind": "lookup", "request_id": "other", "block_hashes": [*odd, wide[2]], "max_length": 40},
    ]  # fmt: skip
    trace = write_trace(tmp_path / "t.parquet", full_mamba(), rows)
    # The store keys on the whole hash, whatever its width.
    assert replay_trace(trace).results["hit_tokens"].to_list() == [32, 16]
    results = tmp_path / "r.parquet"
    for args, code in [
        (["validate", str(trace)], 0),
        (["info", str(trace), "--json"], 0),
        (["run", str(trace), "-o", str(results), "-q"], 0),
        (["run", str(trace), "-o", "/dev/null", "-q", "--unit-present"], 0),
        (["check", str(trace)], 0),
        (["check", str(results)], 0),
        (["check", str(trace), "--policy", "pre-49502"], 1),
        (["explain", str(trace), "--request", "mixed"], 0),
        (["state", str(trace), "--at", "2", "-o", str(tmp_path / "k.parquet")], 0),
        (["diff", str(trace), "--policy", "vllm-0.33", "--policy", "pre-49502"], 0),
        (["report", str(results), "--trace", str(trace), "-o", str(tmp_path / "r.md")], 0),
    ]:
        result = run_cli(args)
        assert result.exit_code == code, (args, result.output)
    keys = pq.read_table(tmp_path / "k.parquet").column("hash").to_pylist()
    assert sorted(keys) == sorted([wide[0], narrow[1], *odd] * 2)


# ------------------------------------------------------------------ results


def _bad_results(tmp: Path, source: Path, change: Callable[[pa.Table], pa.Table]) -> Path:
    table = pq.read_table(source)
    out = tmp / "bad.results.parquet"
    pq.write_table(change(table).replace_schema_metadata(table.schema.metadata), out)
    return out


def _set(
    name: str, values: list[Any], typ: pa.DataType | None = None
) -> Callable[[pa.Table], pa.Table]:
    def change(t: pa.Table) -> pa.Table:
        i = t.schema.get_field_index(name)
        return t.set_column(i, name, pa.array(values, typ or t.schema.field(name).type))

    return change


RESULTS_CASES = {
    "mask_blocks_per_group": (_set("mask_blocks", [[4]]), "seq 2: mask_blocks needs one entry per KV-cache group (2)"),
    "duplicate_seq": (lambda t: pa.concat_tables([t, t]), "seq 2: seq not strictly increasing (comes after seq 2)"),
    "hit_tokens_as_text": (_set("hit_tokens", ["64"], pa.string()), "column 'hit_tokens' has type string, expected int64"),
    "null_request_id": (_set("request_id", [None]), "seq 2: request_id is null"),
    "loaded_beyond_mask": (_set("loaded_blocks", [[4, 5]]), "seq 2: loaded_blocks exceeds mask_blocks (a group loads at most the blocks of its mask)"),
    "unit_present_per_group": (_set("unit_present", [[[True]]]), "seq 2: unit_present needs one list per KV-cache group (2)"),
    "negative_hit": (_set("hit_tokens", [-16]), "seq 2: hit_tokens is negative"),
    "request_id_not_utf8": (_set("request_id", [b"\xff"], pa.binary()), "column 'request_id' has type binary, expected string"),
    "unsigned_64_bit_seq": (_set("seq", [2], pa.uint64()), "column 'seq' has type uint64, expected int64"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(RESULTS_CASES))
def test_bad_results_files_are_refused_by_check_report_and_diff(
    tmp_path: Path, inputs: dict[str, Path], case: str
) -> None:
    change, message = RESULTS_CASES[case]
    bad = _bad_results(tmp_path, inputs["results"], change)
    out = tmp_path / "out.html"  # a name both report and diff write
    for args in (
        ["check", str(bad)],
        ["report", str(bad), "-o", str(out)],
        ["diff", str(inputs["results"]), str(bad), "-o", str(out)],
    ):
        result = run_cli(args)
        assert (result.exit_code, result.stderr) == (2, f"error: {bad}: {message}\n"), args
        assert not out.exists()


# ---------------------------------------------------------------- importers


def test_a_config_written_by_hand_may_leave_out_the_version(
    inputs: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "o.parquet"
    result = run_cli(["ingest", "kv-events", str(inputs["dump"]), "-o", str(out), "--config", str(inputs["config"])])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "version" not in json.loads(inputs["config"].read_text())


def test_an_empty_hash_in_a_dump_is_a_skipped_batch_not_a_bad_trace(tmp_path: Path) -> None:
    from replay.sources.dump import DumpWriter
    from tests.kvpayloads import T0, payload, stored

    dump = tmp_path / "d.kvdump"
    with DumpWriter(dump) as w:
        w.write([b"", (0).to_bytes(8, "big"), payload(T0, stored([b""]))], "live", T0)
        w.write([b"", (1).to_bytes(8, "big"), payload(T0, stored([7]))], "live", T0)
    out = tmp_path / "o.parquet"
    result = run_cli(["ingest", "kv-events", str(dump), "-o", str(out), "--block-size", "16"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == (
        f"skipped: {dump} record 0: seq 0: event 0 (BlockStored): field 'block_hashes'[0]: "
        "hash is empty (expected non-empty bytes)"
    )
    assert run_cli(["validate", str(out)]).exit_code == 0


# ---------------------------------------------------------- one behaviour


def test_check_with_no_lookups_has_nothing_to_check(tmp_path: Path) -> None:
    from replay.format.link import save_results
    from replay.format.writer import write_trace
    from tests.builders import replay_trace

    trace = write_trace(tmp_path / "t.parquet", full_mamba(), issue_43559_rows()[:2])
    result = run_cli(["check", str(trace)])
    assert (result.exit_code, result.stderr) == (2, f"error: {trace}: the trace has no lookups, nothing to check\n")  # fmt: skip
    results = tmp_path / "r.parquet"
    save_results(replay_trace(trace), results)
    result = run_cli(["check", str(results)])
    assert (result.exit_code, result.stderr) == (2, f"error: {results}: no lookups, nothing to check\n")  # fmt: skip


def test_check_results_under_another_policy_names_both(inputs: dict[str, Path]) -> None:
    r = inputs["results"]
    result = run_cli(["check", str(r), "--policy", "vllm-0.33"])
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {r}: these results were made under policy pre-49502, not --policy vllm-0.33 "
        "(check the trace to replay it under vllm-0.33, or drop --policy)\n",
    )
    assert run_cli(["check", str(r), "--policy", "pre-49502"]).exit_code == 1
    assert run_cli(["check", str(r)]).exit_code == 1


def test_a_request_id_in_several_lookups_needs_seq(tmp_path: Path) -> None:
    from replay.format.writer import write_trace

    rows = issue_43559_rows()
    trace = write_trace(
        tmp_path / "t.parquet", full_mamba(), [*rows, {**rows[2], "max_length": 63}]
    )
    out = tmp_path / "m.parquet"
    for command in (["explain"], ["minimize", "-o", str(out)]):
        result = run_cli([*command, str(trace), "--request", "req-43559"])
        assert (result.exit_code, result.stderr) == (
            2,
            f"error: {trace}: request_id 'req-43559' occurs in 2 lookups (seq 2, 3); pick one with --seq\n",
        ), command
        result = run_cli([*command, str(trace), "--request", "req-43559", "--seq", "1"])
        assert (result.exit_code, result.stderr) == (
            2,
            f"error: {trace}: no lookup with request_id 'req-43559' at seq 1 (its lookups: seq 2, 3)\n",
        ), command
        assert not out.exists()
    result = run_cli(["explain", str(trace), "--request", "req-43559", "--seq", "3"])
    assert result.exit_code == 0 and result.stdout.startswith(
        "request req-43559 (seq 3): max_length 63"
    )
    assert run_cli(["minimize", str(trace), "--request", "req-43559", "--seq", "2", "--policy", "pre-49502", "-o", str(out)]).exit_code == 0  # fmt: skip


def test_python_dash_m_replay_is_the_same_command_line() -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "replay", "--version"],
        capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (0, "replay, version 0.1.0\n")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_coordinator_vllm_without_vllm_says_where_to_run(trace_43559: Path) -> None:
    result = run_cli(["run", str(trace_43559), "--coordinator", "vllm", "-o", "/dev/null", "-q"])
    assert result.exit_code == 2
    line = result.stderr
    assert line.count("\n") == 1 and line.startswith("error: --coordinator vllm: vLLM does not import in this Python")  # fmt: skip
    assert "-m replay ..." in line


def test_foreign_metadata_that_is_not_utf8_is_left_alone(
    tmp_path: Path, inputs: dict[str, Path]
) -> None:
    """polars panicked converting a batch whose schema metadata held such bytes."""
    for name in ("trace", "results"):
        table = pq.read_table(inputs[name])
        damaged = tmp_path / f"{name}.parquet"
        meta = {**(table.schema.metadata or {}), b"another.tool": b"\xff\xfe"}
        pq.write_table(table.replace_schema_metadata(meta), damaged)
        inputs[name] = damaged
    assert run_cli(["validate", str(inputs["trace"])]).exit_code == 0
    assert run_cli(["run", str(inputs["trace"]), "-o", "/dev/null", "-q"]).exit_code == 0
    assert run_cli(["check", str(inputs["results"])]).exit_code == 1
