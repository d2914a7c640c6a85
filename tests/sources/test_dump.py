"""The raw KV-event dump (``replay.sources.dump``): its layout, read back."""

from __future__ import annotations

from pathlib import Path

import msgspec

from replay.sources.dump import DUMP_MAGIC, read_dump
from tests.kvpayloads import T0, frames, u64, write_dump


def test_dump_layout_is_magic_then_length_prefixed_msgpack(tmp_path: Path) -> None:
    path = write_dump(tmp_path / "d.kvdump", [(frames(0, b"xy", b"kv"), "live")])
    data = path.read_bytes()
    assert data[:8] == DUMP_MAGIC == b"RKVDUMP1"
    length = int.from_bytes(data[8:12], "big")
    assert len(data) == 12 + length
    assert msgspec.msgpack.decode(data[12:]) == [T0 + 100, "live", [b"kv", u64(0), b"xy"]]
    (rec,) = read_dump(path)
    assert (rec.index, rec.offset, rec.origin, rec.frames) == (0, 8, "live", [b"kv", u64(0), b"xy"])
    assert not list(tmp_path.glob(".*.tmp"))
