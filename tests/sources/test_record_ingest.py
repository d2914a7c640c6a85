"""``replay ingest kv-events``: dumps rebuilt into a trace (``replay.sources.record``)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from replay.format.tracedir import open_trace
from replay.sources.dump import DUMP_MAGIC
from tests.contracts.source import DeterministicSourceContract
from tests.kvpayloads import (
    T0,
    at,
    frames,
    keyed,
    one_group,
    payload,
    removed,
    run_ingest,
    stored,
    u64,
    write_dump,
)


def test_ingest_rebuilds_gaps_restarts_and_skips_from_a_dump(tmp_path: Path) -> None:
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps(one_group().to_json()))
    dump = write_dump(
        tmp_path / "d.kvdump",
        [
            (frames(0, payload(T0, stored([1]))), "replay"),
            (frames(1, payload(T0 + 1, stored([2], legacy=True))), "live"),
            (frames(1, payload(T0 + 1, stored([2], legacy=True))), "live"),  # a repeat
            (frames(3, b"\xc1"), "live"),  # seq 2 missing, seq 3 malformed
            ([b"", b"\x00"], "live"),  # two frames
            (frames(4, payload(T0 + 4, removed([1]))), "live"),
            (frames(1, payload(T0 + 9, stored([8]))), "live"),  # restart, seq 0 missing
            (frames(2, payload(T0 + 10, removed([8]))), "live"),
        ],
    )
    out = tmp_path / "t.parquet"
    result = run_ingest(["kv-events", str(dump), "-o", str(out), "--config", str(cfg)])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "gap: seq 2 missing (1 batch): missing from the dump",
        f"skipped: {dump} record 3: seq 3: payload is not msgpack (MessagePack data is malformed: invalid opcode '\\xc1' (byte 0))",
        f"skipped: {dump} record 4: message has 2 frames, expected 3 (topic, seq, payload)",
        "publisher restart: seq went back from 4 to 1; starting epoch 1 with a clear (a new engine has an empty cache)",
        "gap: seq 0 (epoch 1) missing (1 batch): missing from the dump",
        f"wrote {out}: 6 batches, 6 rows, 2 missing in 2 gaps, 1 publisher restart, 2 malformed skipped",
    ]  # fmt: skip
    trace = open_trace(out)
    rows = trace.read_frame().to_dicts()
    assert keyed(rows) == [
        (0, "store", 0, [u64(1)], "GPU"),
        (1, "store", 0, [u64(2)], "GPU"),
        (2, "remove", 0, [u64(1)], "GPU"),
        (3, "clear", None, None, None),
        (4, "store", 0, [u64(8)], "GPU"),
        (5, "remove", 0, [u64(8)], "GPU"),
    ]
    assert [r["ts"] for r in rows] == [at(T0 + t) for t in (0, 1, 4, 9, 9, 10)]
    source = dict(trace.config.source or {})
    assert source["tool"] == "replay ingest kv-events"
    assert source["files"] == ["d.kvdump"]
    assert source["gaps"] == [
        {"epoch": 0, "first": 2, "last": 2, "count": 1, "reason": "missing from the dump"},
        {"epoch": 1, "first": 0, "last": 0, "count": 1, "reason": "missing from the dump"},
    ]
    assert source["restarts"] == [{"epoch": 1, "previous_last_seq": 4}]
    assert source["epochs"] == [
        {"epoch": 0, "first_seq": 0, "last_seq": 4},
        {"epoch": 1, "first_seq": 1, "last_seq": 2},
    ]
    assert [(s["seq"], s["where"]) for s in source["skipped"]] == [
        (3, f"{dump} record 3"),
        (None, f"{dump} record 4"),
    ]
    assert (source["batches"], source["duplicates"], source["missing_batches"]) == (6, 1, 2)
    assert source["data_parallel_ranks"] == [0]


def test_ingest_several_dumps_as_one_stream(tmp_path: Path) -> None:
    a = write_dump(tmp_path / "a.kvdump", [(frames(0, payload(T0, stored([1]))), "live")])
    b = write_dump(
        tmp_path / "b.kvdump",
        [
            (frames(0, payload(T0, stored([1]))), "live"),  # overlap: a repeat, not a restart
            (frames(1, payload(T0 + 1, removed([1]))), "live"),
        ],
    )
    out = tmp_path / "t.parquet"
    result = run_ingest(["kv-events", str(a), str(b), "-o", str(out), "--block-size", "16"])
    assert result.exit_code == 0, result.output
    assert keyed(open_trace(out).read_frame().to_dicts()) == [
        (0, "store", 0, [u64(1)], "GPU"),
        (1, "remove", 0, [u64(1)], "GPU"),
    ]


def test_ingest_with_lookups_merges_them(tmp_path: Path) -> None:
    dump = write_dump(
        tmp_path / "d.kvdump",
        [
            (frames(0, payload(T0, stored([1]))), "live"),
            (frames(1, payload(T0 + 1, stored([2], parent=1))), "live"),
        ],
    )
    log = tmp_path / "l.jsonl"
    log.write_text(
        json.dumps({"request_id": "r", "ts": T0 + 0.5, "block_hashes": [1, 2], "max_length": 31})
    )
    out = tmp_path / "t.parquet"
    result = run_ingest(
        ["kv-events", str(dump), "-o", str(out), "--block-size", "16", "--lookups", str(log)]
    )
    assert result.exit_code == 0, result.output
    trace = open_trace(out)
    assert [(r["seq"], r["kind"], r["request_id"]) for r in trace.read_frame().to_dicts()] == [
        (0, "store", None),
        (1, "lookup", "r"),
        (2, "store", None),
    ]
    assert (trace.config.source or {})["lookups"]["count"] == 1


# ---------------------------------------------------------------- the sources' contract


class TestKvEventsImporter(DeterministicSourceContract):
    """``replay ingest kv-events``: the recorder's dumps, read back offline."""

    def command(self, folder: Path, out: Path) -> list[str]:
        dump = write_dump(
            folder / "d.kvdump",
            [
                (frames(0, payload(T0, stored([1, 2]))), "live"),
                (frames(1, payload(T0 + 1, stored([3], parent=2))), "live"),
                (frames(2, payload(T0 + 2, removed([3]))), "live"),
            ],
        )
        return ["ingest", "kv-events", str(dump), "-o", str(out), "--block-size", "16"]

    def expected_counts(self) -> dict[str, int]:
        return {"store": 2, "remove": 1}

    def bad_inputs(self, folder: Path, out: Path) -> list[tuple[list[str], str]]:
        good = write_dump(folder / "good.kvdump", [(frames(0, payload(T0, stored([1]))), "live")])
        notdump = folder / "notdump.bin"
        notdump.write_bytes(b"PAR1 something else")
        badrec = folder / "badrec.kvdump"
        badrec.write_bytes(DUMP_MAGIC + (3).to_bytes(4, "big") + msgspec.msgpack.encode([1, 2]))
        future = folder / "future.kvdump"
        future.write_bytes(b"RKVDUMP2")
        wrong_group = write_dump(
            folder / "g.kvdump", [(frames(0, payload(T0, stored([1], group=3))), "live")]
        )
        missing = folder / "missing.kvdump"
        return [
            (["ingest", "kv-events", str(good), "-o", str(out)], "no KV-cache config: pass --config kv-config.json (the replay.trace metadata object) or --block-size N (one full-attention group)"),
            (["ingest", "kv-events", str(missing), "-o", str(out), "--block-size", "16"], f"{missing}: no such file"),
            (["ingest", "kv-events", str(notdump), "-o", str(out), "--block-size", "16"], f"{notdump}: not a KV-event dump (expected the magic bytes RKVDUMP1 at the start; `replay record --dump FILE` writes one)"),
            (["ingest", "kv-events", str(future), "-o", str(out), "--block-size", "16"], f"{future}: dump layout version '2' is not supported (expected RKVDUMP1)"),
            (["ingest", "kv-events", str(badrec), "-o", str(out), "--block-size", "16"], f"{badrec}: record 0 at byte 8: expected a msgpack array [recv_ts, origin, frames]"),
            (["ingest", "kv-events", str(wrong_group), "-o", str(out), "--block-size", "16"], f"{wrong_group} record 0 (seq 0): BlockStored names group_idx 3, but the config has 1 KV-cache group (0..0)"),
        ]  # fmt: skip
