"""The synthetic generator (``replay.sources.synth``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from replay.base.errors import ReplayError, TraceError
from replay.base.spec import GroupKind
from replay.cli.synth import synth
from replay.format.schema import TRACE_SCHEMA
from replay.format.tracedir import open_trace
from replay.format.writer import TraceWriter, write_trace
from replay.rules.coordinator import Coordinator
from replay.sources.archetypes import archetype_config
from replay.sources.synth import synth_trace
from replay.tools.render import synth_summary_text
from tests.builders import hand_folded_lookups, replay_trace
from tests.conftest import check_store_options
from tests.contracts.source import DeterministicSourceContract

F, S, C, M = (
    GroupKind.FULL_ATTENTION,
    GroupKind.SLIDING_WINDOW,
    GroupKind.CHUNKED_LOCAL_ATTENTION,
    GroupKind.MAMBA,
)


def _rows(path: Path) -> list[dict[str, Any]]:
    return list(open_trace(path).read_frame().iter_rows(named=True))


# ---------------------------------------------------------------- generated traces


def _synth(path: Path, **kwargs: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"model": "full+mamba", "requests": 300, "seed": 7, "eagle": True}
    args.update(kwargs)
    return synth_trace(path, **args)


def test_same_seed_gives_a_byte_identical_trace(tmp_path: Path) -> None:
    kwargs: dict[str, Any] = {"capacity_blocks": 3000, "inject_overrun": 2, "clear_every": 100}
    a = _synth(tmp_path / "a.parquet", **kwargs)
    b = _synth(tmp_path / "b.parquet", **kwargs)
    c = _synth(tmp_path / "c.parquet", seed=8, **kwargs)
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    ta, tb, tc = (pq.read_table(tmp_path / f"{n}.parquet") for n in "abc")
    assert ta.equals(tb)
    assert not ta.equals(tc)
    assert {k: v for k, v in a.items() if k != "path"} == {
        k: v for k, v in b.items() if k != "path"
    }
    assert c["hash_entries"] != a["hash_entries"]


def test_lookup_rows(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    summary = _synth(path, hash_bytes=32)
    rows = _rows(path)
    lookups = [r for r in rows if r["kind"] == "lookup"]
    assert len(lookups) == summary["lookups"] == 300
    assert summary["events"] == len(rows)
    assert summary["hash_entries"] == sum(len(r["block_hashes"]) for r in rows)
    for r in lookups:
        assert r["max_length"] == r["num_tokens"] - 1
        assert len(r["block_hashes"]) == r["num_tokens"] // 16
        assert r["group_id"] is None
    widths = {len(h) for r in rows for h in r["block_hashes"]}
    assert widths == {32}
    # Every store row names blocks of the request that precedes it.
    last: dict[str, Any] = {}
    for r in rows:
        if r["kind"] == "lookup":
            last = r
        elif r["kind"] == "store":
            assert r["request_id"] == last["request_id"]
            assert set(r["block_hashes"]) <= set(last["block_hashes"])
    ts = [r["ts"] for r in lookups]
    assert ts == sorted(ts)


def test_followups_extend_the_previous_prompt(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    _synth(path, requests=600)
    lookups = {r["request_id"]: r for r in _rows(path) if r["kind"] == "lookup"}
    followups = 0
    for rid, r in lookups.items():
        session, turn = rid.split("-t")
        if turn == "1":
            continue
        prev = lookups[f"{session}-t{int(turn) - 1}"]
        n = len(prev["block_hashes"])
        assert n == prev["num_tokens"] // 16
        # The follow-up's hashes start with every hash of the previous prompt;
        # the block that straddled its end holds new tokens, so a new hash.
        assert r["block_hashes"][:n] == prev["block_hashes"]
        assert r["block_hashes"][n] not in prev["block_hashes"]
        followups += 1
    assert followups > 100
    # Shared system prompts: distinct sessions share leading hashes.
    firsts = [r["block_hashes"][0] for rid, r in lookups.items() if rid.endswith("-t1")]
    assert len(set(firsts)) < len(firsts)


def _fold_check(rows: list[dict[str, Any]], groups: int, capacity: int | None) -> int:
    """Fold the log, checking stores add absent keys, removes drop present ones
    and the store never exceeds ``capacity``; return the peak size."""
    present: list[set[bytes]] = [set() for _ in range(groups)]
    peak = 0
    for r in rows:
        keys = present[r["group_id"]] if r["group_id"] is not None else None
        if r["kind"] == "store":
            assert keys is not None and not keys & set(r["block_hashes"])
            keys.update(r["block_hashes"])
        elif r["kind"] == "remove":
            assert keys is not None and set(r["block_hashes"]) <= keys
            keys.difference_update(r["block_hashes"])
        elif r["kind"] == "clear":
            for s in present:
                s.clear()
        size = sum(map(len, present))
        if capacity is not None:
            assert size <= capacity
        peak = max(peak, size)
    return peak


@pytest.mark.parametrize("model", ["full+mamba", "full+swa+mamba"])
def test_lru_capacity_is_never_exceeded(tmp_path: Path, model: str) -> None:
    path = tmp_path / "t.parquet"
    summary = _synth(path, model=model, capacity_blocks=4000)
    rows = _rows(path)
    assert summary["removes"] > 0
    assert summary["removes"] == sum(r["kind"] == "remove" for r in rows)
    groups = len(archetype_config(model).groups)
    assert _fold_check(rows, groups, 4000) == 4000 == summary["max_present_keys"]


@pytest.mark.parametrize("model", ["full", "full+mamba", "full+swa+mamba"])
def test_a_request_larger_than_the_store_evicts_its_own_tail(tmp_path: Path, model: str) -> None:
    path = tmp_path / "t.parquet"
    summary = _synth(path, model=model, requests=50, capacity_blocks=40)
    groups = len(archetype_config(model).groups)
    assert _fold_check(_rows(path), groups, 40) == 40 == summary["max_present_keys"]


def test_unbounded_store_never_removes(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    summary = _synth(path)
    assert summary["removes"] == 0
    assert _fold_check(_rows(path), 2, None) == sum(summary["stored_keys"])


def test_clear_every(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    summary = _synth(path, requests=250, clear_every=100, capacity_blocks=5000)
    rows = _rows(path)
    clears = [i for i, r in enumerate(rows) if r["kind"] == "clear"]
    assert summary["clears"] == len(clears) == 2
    lookups_before = [sum(r["kind"] == "lookup" for r in rows[:i]) for i in clears]
    assert lookups_before == [100, 200]
    for i in clears:
        assert rows[i]["group_id"] is None and rows[i]["block_hashes"] is None
    _fold_check(rows, 2, 5000)


@pytest.mark.parametrize("model", ["full+mamba", "swa+mamba", "full+swa+mamba"])
def test_inject_overrun_43559(tmp_path: Path, model: str) -> None:
    path = tmp_path / "t.parquet"
    summary = _synth(path, model=model, capacity_blocks=6000, inject_overrun=3, clear_every=50)
    reader = open_trace(path)
    config = reader.config
    assert config.source is not None
    injected = {d["request_id"]: d for d in summary["injected_overruns"]}
    assert sorted(injected) == [f"overrun-{j:04d}-resend" for j in range(3)]
    assert config.source["injected_overruns"] == summary["injected_overruns"]
    policies = {p: Coordinator(config, p) for p in ("pre-49502", "vllm-0.33")}
    seen = 0
    for r, contains in hand_folded_lookups(reader):
        if r["request_id"] in injected:
            d = injected[r["request_id"]]
            assert r["seq"] == d["seq"]
            pre = policies["pre-49502"].lookup(r["block_hashes"], r["max_length"], contains)
            fixed = policies["vllm-0.33"].lookup(r["block_hashes"], r["max_length"], contains)
            # Attention verified one block less than the prompt; the peek margin
            # lets Mamba resume at the prompt's end anyway (#43559).
            assert pre.hit_tokens == d["hit_tokens_pre_49502"] == r["max_length"]
            assert fixed.hit_tokens == d["hit_tokens_vllm_033"] == r["max_length"] - 16
            assert pre.verified_tokens == r["max_length"] - 16
            assert pre.mamba_state_tokens == r["max_length"]
            assert fixed.mamba_state_tokens == r["max_length"] - 16
            seen += 1
    assert seen == 3


def test_inject_overrun_needs_eagle_and_mamba(tmp_path: Path) -> None:
    with pytest.raises(ReplayError) as err:
        _synth(tmp_path / "t.parquet", eagle=False, inject_overrun=1)
    assert str(err.value) == "--inject-overrun needs --eagle (#43559 is an EAGLE margin bug)"
    with pytest.raises(ReplayError) as err:
        _synth(tmp_path / "t.parquet", model="full+swa", inject_overrun=1)
    assert str(err.value) == (
        "--inject-overrun needs a model with a Mamba group (#43559), got 'full+swa'"
    )
    assert not (tmp_path / "t.parquet").exists()


# ---------------------------------------------------------------- CLI


def test_synth_command(tmp_path: Path) -> None:
    out = tmp_path / "cli.parquet"
    args = ["-o", str(out), "--model", "full+mamba", "--requests", "200", "--seed", "3"]
    args += ["--eagle", "--capacity-blocks", "3000", "--inject-overrun", "1"]
    result = CliRunner().invoke(synth, args)
    assert result.exit_code == 0, result.output
    summary = synth_trace(
        tmp_path / "lib.parquet",
        model="full+mamba",
        requests=200,
        seed=3,
        eagle=True,
        capacity_blocks=3000,
        inject_overrun=1,
    )
    assert result.output == synth_summary_text({**summary, "path": str(out)}) + "\n"
    assert out.read_bytes() == (tmp_path / "lib.parquet").read_bytes()


def test_synth_store_options(tmp_path: Path) -> None:
    out = tmp_path / "cli.parquet"
    args = ["-o", str(out), "--model", "full+swa+mamba", "--requests", "60", "--eagle"]
    check_store_options(synth, args, out, 512)
    lib = synth_trace(
        tmp_path / "lib.parquet",
        model="full+swa+mamba",
        requests=60,
        eagle=True,
        retention_interval=None,
        max_num_batched_tokens=512,
        cache="gpu",
    )
    assert out.read_bytes() == (tmp_path / "lib.parquet").read_bytes()
    # vLLM's default keeps fewer Mamba states than dense retention (the
    # 4096-token window covers these prompts' every block either way).
    sparse = synth_trace(
        tmp_path / "sparse.parquet", model="full+swa+mamba", requests=60, eagle=True
    )
    assert sparse["stored_keys"][1] == lib["stored_keys"][1]
    assert sparse["stored_keys"][2] < lib["stored_keys"][2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--retention-interval", "-16"],
            "--retention-interval '-16': expected a whole number from 0 to 2,147,483,647 or 'none'",
        ),
        (
            ["--retention-interval", "some"],
            "--retention-interval 'some': expected a whole number from 0 to 2,147,483,647 or 'none'",
        ),
        (
            ["--retention-interval", "40"],
            "retention interval 40 must be a multiple of the scheduler block size 16",
        ),
        (
            ["--max-num-batched-tokens", "0"],
            "--max-num-batched-tokens '0': expected a whole number from 1 to 2,147,483,647, k/M/G/T suffixes allowed",
        ),
        (
            ["--max-num-batched-tokens", "8"],
            "max_num_batched_tokens 8 must be at least the scheduler block size 16: a Mamba "
            "prefill chunk ends on a block",
        ),
        (["--cache", "cpu"], "--cache: no cache 'cpu', did you mean 'gpu'?"),
        (["--cache", "disk"], "--cache: expected one of mooncake, gpu, got 'disk'"),
    ],
)
def test_synth_store_option_errors(tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "t.parquet"
    result = CliRunner().invoke(
        synth, ["-o", str(out), "--model", "full+mamba", "--requests", "5", *args]
    )
    assert result.exit_code == 2
    assert result.stderr == f"error: {message}\n"
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the sources' contract


class TestSynthGenerator(DeterministicSourceContract):
    def command(self, folder: Path, out: Path) -> list[str]:
        return ["synth", "-o", str(out), "--model", "full+mamba", "--requests", "40", "--seed", "3", "--eagle", "--capacity-blocks", "300", "--inject-overrun", "1"]  # fmt: skip

    def expected_counts(self) -> dict[str, int]:
        # 40 requests and the injected scenario's two lookups.
        return {"lookup": 42, "store": 75, "remove": 57}

    def bad_inputs(self, folder: Path, out: Path) -> list[tuple[list[str], str]]:
        # A generator reads no file: what it refuses is named by its option.
        return [
            (["synth", "-o", str(out), "--model", "full+chunked", "--eagle"], "model 'full+chunked' has chunked local attention, which vLLM does not combine with EAGLE: use --no-eagle"),
            (["synth", "-o", str(out), "--model", "full+swa", "--eagle", "--inject-overrun", "1"], "--inject-overrun needs a model with a Mamba group (#43559), got 'full+swa'"),
        ]  # fmt: skip


@pytest.mark.parametrize("width", [16, 32])
def test_hashes_are_written_fixed_size_and_replay_as_variable_ones(
    tmp_path: Path, width: int
) -> None:
    # No length stored or decoded per hash (a third of the day's decoding);
    # the same events with the hashes as plain binary replay identically.
    fixed = tmp_path / "fixed.parquet"
    _synth(fixed, hash_bytes=width, capacity_blocks=2000)
    typ = pq.ParquetFile(fixed).schema_arrow.field("block_hashes").type
    assert typ == pa.list_(pa.binary(width))
    table = pq.read_table(fixed)
    variable = tmp_path / "variable.parquet"
    write_trace(variable, open_trace(fixed).config, table.cast(TRACE_SCHEMA))
    assert pq.read_table(variable).cast(table.schema).equals(table)
    a, b = replay_trace(fixed), replay_trace(variable)
    assert a.results.equals(b.results)
    assert a.results.height == 300


def test_a_hash_of_another_width_is_refused(tmp_path: Path) -> None:
    config = archetype_config("full", 16, None, False)
    rows = [{"kind": "store", "group_id": 0, "block_hashes": [b"x" * 16, b"y" * 15]}]
    with (
        pytest.raises(TraceError, match="rows do not fit the trace format"),
        TraceWriter(tmp_path / "t.parquet", config, hash_width=16) as writer,
    ):
        writer.write_rows(rows)
    assert not (tmp_path / "t.parquet").exists()
