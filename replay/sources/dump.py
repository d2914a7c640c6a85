"""The raw KV-event dump: every message the recorder took, to rebuild the trace.

``--dump FILE`` writes every message the recorder took, in the order it
took them, so ``replay ingest kv-events FILE`` rebuilds the same trace
(under any KV-cache config). Layout: the 8 magic bytes ``RKVDUMP1``, then
records, each a 4-byte big-endian length followed by that many bytes of
msgpack ``[recv_ts, origin, frames]``: ``recv_ts`` the receive time in
seconds (float), ``origin`` ``"live"`` or ``"replay"``, ``frames`` the
message's frames as binaries (``[topic, seq, payload]`` when well formed).
"""

from __future__ import annotations

import math
import os
import struct
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import msgspec

from replay.base.errors import ReplayError
from replay.base.limits import RECORD_BYTES
from replay.format.paths import check_input, output_target, signals_held
from replay.sources.values import Report, to_stderr

DUMP_MAGIC = b"RKVDUMP1"
ORIGINS = ("live", "replay")


class DumpWriter:
    """The raw-frame dump (layout in the module docstring): an append-only log
    that is valid after every record. The magic is written to a temporary
    file that replaces ``path`` at once, then records are appended and
    flushed as they come, so whatever stops the recorder (an error, a
    signal, even SIGKILL) leaves a dump that reads back up to its last
    complete record (:func:`read_dump` drops a torn last one)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        target = output_target(self.path, text=False, what="a KV-event dump")
        self.records = 0
        self._encoder = msgspec.msgpack.Encoder()
        # The file written (None: /dev/null), removed if nothing came.
        self._real: Path | None = None
        if target.kind == "null":
            self._fh = open(os.devnull, "wb")  # noqa: SIM115 (closed by close())
            return
        with signals_held():
            fd, tmp = tempfile.mkstemp(
                prefix=f".{target.real.name}.", suffix=".tmp", dir=target.real.parent
            )
            try:
                os.write(fd, DUMP_MAGIC)
                os.fchmod(fd, 0o666 & ~_umask())
                os.replace(tmp, target.real)
            except BaseException:
                os.close(fd)
                Path(tmp).unlink(missing_ok=True)
                raise
        self._fh = os.fdopen(fd, "ab")
        self._real = target.real

    def write(self, frames: Sequence[bytes], origin: str, recv_ts: float) -> None:
        data = self._encoder.encode([recv_ts, origin, [bytes(f) for f in frames]])
        self._fh.write(struct.pack(">I", len(data)) + data)
        self.records += 1

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close()
        if exc_type is not None and self.records == 0 and self._real is not None:
            # An error or a signal before any message: the dump would hold
            # nothing but its magic, so none is left.
            with signals_held():
                self._real.unlink(missing_ok=True)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


@dataclass(frozen=True, slots=True, kw_only=True)
class DumpRecord:
    index: int
    offset: int
    recv_ts: float
    origin: str
    frames: list[bytes]


def check_dump(path: Path) -> None:
    check_input(path, "a KV-event dump")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(len(DUMP_MAGIC))
    except OSError as exc:  # a file that is no file (/proc/self/mem) names itself
        raise ReplayError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if magic != DUMP_MAGIC:
        if magic[:7] == DUMP_MAGIC[:7] and len(magic) == 8:
            raise ReplayError(
                f"{path}: dump layout version {magic[7:].decode(errors='replace')!r} is not "
                f"supported (expected {DUMP_MAGIC.decode()})"
            )
        raise ReplayError(
            f"{path}: not a KV-event dump (expected the magic bytes {DUMP_MAGIC.decode()} "
            "at the start; `replay record --dump FILE` writes one)"
        )


def read_dump(path: str | os.PathLike[str], report: Report = to_stderr) -> Iterator[DumpRecord]:
    """The records of a dump, validated one by one (errors name the record).
    A torn last record (a recorder killed mid-write) is dropped, saying so
    in one line through ``report``."""
    p = Path(path)
    check_dump(p)
    decoder = msgspec.msgpack.Decoder()
    most = RECORD_BYTES.value()
    with open(p, "rb") as fh:
        fh.seek(len(DUMP_MAGIC))
        offset = len(DUMP_MAGIC)
        index = 0
        while True:
            head = fh.read(4)
            if not head:
                return
            where = f"{p}: record {index} at byte {offset}"
            data = b""
            if len(head) == 4:
                (length,) = struct.unpack(">I", head)
                if length > most:  # refused before it is read
                    raise RECORD_BYTES.refuse(f"{where}: its length prefix declares", length)
                data = fh.read(length)
            if len(head) < 4 or len(data) < length:
                torn = len(head) + len(data)
                report(
                    f"{where}: truncated (the file ends {torn} bytes into it, as when the "
                    f"recorder was killed): read {index} complete records, dropped the last "
                    f"{torn} bytes"
                )
                return
            try:
                obj = decoder.decode(data)
            except msgspec.DecodeError as exc:
                raise ReplayError(f"{where}: not msgpack ({exc})") from None
            except RecursionError:
                raise ReplayError(f"{where}: not a dump record (nested too deeply)") from None
            expected = "expected a msgpack array [recv_ts, origin, frames]"
            if not isinstance(obj, list) or len(obj) != 3:
                raise ReplayError(f"{where}: {expected}")
            recv_ts, origin, frames = obj
            if (
                not isinstance(recv_ts, int | float)
                or isinstance(recv_ts, bool)
                or not math.isfinite(recv_ts)
                or origin not in ORIGINS
                or not isinstance(frames, list)
                or not all(isinstance(f, bytes) for f in frames)
            ):
                raise ReplayError(f"{where}: {expected} (origin 'live' or 'replay', frames binary)")
            yield DumpRecord(
                index=index, offset=offset, recv_ts=float(recv_ts), origin=origin, frames=frames
            )
            offset += 4 + length
            index += 1
