"""Salvage the complete row groups of a trace file cut short (issue 32).

A Parquet file is readable only through its footer, written last: a writer
killed mid-way (a recording made before segmented traces, the open segment
of a killed ``replay record -o DIR``) or a copy cut short leaves row groups
no reader can find. Their pages are all there, each behind a self-describing
page header, so :func:`repair_trace` walks the page headers from the start
of the file, groups the pages into column chunks (a chunk starts with its
dictionary page; a flat column's chunk ends at the row group's row count)
and the chunks into row groups (one chunk per column of the trace schema, in
order), writes a new footer for the complete ones, and reads them back
through the trace format's validation: every row group that decodes and
validates, up to the first that does not, goes into a new trace file.

The footer also held the trace's configuration (``replay.trace``), so it is
taken from ``config`` (``--config`` / ``--block-size``), or else from a
complete trace file beside the damaged one (the closed segments of the same
recording).

The footer is written with the Thrift compact protocol Parquet uses; only
what is needed here is implemented (a generic reader and writer of
structs, lists and scalars).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from replay.base.errors import ReplayError, TraceError
from replay.base.spec import TraceConfig
from replay.format.paths import PARQUET, check_input, check_outputs
from replay.format.schema import TRACE_COLUMNS, TRACE_META_KEY, TRACE_SCHEMA, one_line
from replay.format.writer import TraceWriter

# ------------------------------------------------------------ thrift compact

_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(
    13
)


class _Truncated(Exception):
    """The bytes end inside a structure."""


class _Reader:
    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data, self.pos = data, pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Truncated
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 70:
                raise ValueError("varint too long")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def raw(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise _Truncated
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def value(self, typ: int) -> Any:
        if typ in (_TRUE, _FALSE):
            return self.byte() == _TRUE  # inside a container: one byte
        if typ == _BYTE:
            return self.byte()
        if typ in (_I16, _I32, _I64):
            return self.zigzag()
        if typ == _DOUBLE:
            return self.raw(8)
        if typ == _BINARY:
            return self.raw(self.varint())
        if typ in (_LIST, _SET):
            head = self.byte()
            size, elem = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            return (elem, [self.value(elem) for _ in range(size)])
        if typ == _MAP:
            size = self.varint()
            kinds = self.byte() if size else 0
            pairs = [(self.value(kinds >> 4), self.value(kinds & 0x0F)) for _ in range(size)]
            return (kinds, pairs)
        if typ == _STRUCT:
            return self.struct()
        raise ValueError(f"unknown thrift type {typ}")

    def struct(self) -> dict[int, tuple[int, Any]]:
        fields: dict[int, tuple[int, Any]] = {}
        last = 0
        while True:
            head = self.byte()
            if head == _STOP:
                return fields
            delta, typ = head >> 4, head & 0x0F
            fid = last + delta if delta else self.zigzag()
            last = fid
            if typ in (_TRUE, _FALSE):
                fields[fid] = (typ, typ == _TRUE)
            else:
                fields[fid] = (typ, self.value(typ))


class _Writer:
    def __init__(self) -> None:
        self.out = bytearray()

    def varint(self, n: int) -> None:
        while True:
            b = n & 0x7F
            n >>= 7
            if n:
                self.out.append(b | 0x80)
            else:
                self.out.append(b)
                return

    def zigzag(self, n: int) -> None:
        self.varint((n << 1) ^ (n >> 63))

    def value(self, typ: int, v: Any) -> None:
        if typ in (_TRUE, _FALSE):
            self.out.append(_TRUE if v else _FALSE)
        elif typ == _BYTE:
            self.out.append(v & 0xFF)
        elif typ in (_I16, _I32, _I64):
            self.zigzag(v)
        elif typ == _DOUBLE:
            self.out += v
        elif typ == _BINARY:
            data = v.encode() if isinstance(v, str) else v
            self.varint(len(data))
            self.out += data
        elif typ in (_LIST, _SET):
            elem, items = v
            if len(items) < 15:
                self.out.append((len(items) << 4) | elem)
            else:
                self.out.append(0xF0 | elem)
                self.varint(len(items))
            for item in items:
                self.value(elem, item)
        elif typ == _MAP:
            kinds, pairs = v
            self.varint(len(pairs))
            if pairs:
                self.out.append(kinds)
            for k, val in pairs:
                self.value(kinds >> 4, k)
                self.value(kinds & 0x0F, val)
        elif typ == _STRUCT:
            self.struct(v)
        else:
            raise ValueError(f"unknown thrift type {typ}")

    def struct(self, fields: dict[int, tuple[int, Any]]) -> None:
        last = 0
        for fid in sorted(fields):
            typ, v = fields[fid]
            if typ in (_TRUE, _FALSE):
                typ = _TRUE if v else _FALSE
            if 0 < fid - last <= 15:
                self.out.append(((fid - last) << 4) | typ)
            else:
                self.out.append(typ)
                self.zigzag(fid)
            last = fid
            if typ not in (_TRUE, _FALSE):
                self.value(typ, v)
        self.out.append(_STOP)


# ------------------------------------------------------------ pages and chunks

_DATA_PAGE, _INDEX_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 1, 2, 3
#: Codecs tried in turn (pages do not name theirs): the project writes zstd.
_CODECS = (6, 1, 0, 2, 7, 4)  # ZSTD, SNAPPY, UNCOMPRESSED, GZIP, LZ4_RAW, BROTLI


@dataclass(slots=True)
class _Page:
    offset: int
    header_size: int
    kind: int
    uncompressed: int
    compressed: int
    values: int  # data pages: level count; dictionary pages: 0
    encodings: tuple[int, ...]


@dataclass(slots=True)
class _Chunk:
    pages: list[_Page]

    @property
    def start(self) -> int:
        return self.pages[0].offset

    @property
    def end(self) -> int:
        last = self.pages[-1]
        return last.offset + last.header_size + last.compressed

    @property
    def values(self) -> int:
        return sum(p.values for p in self.pages)


#: A page header is small; one larger than this is not a page header.
_HEADER_BYTES = 1 << 16


def _pages(fh: Any, size: int) -> list[_Page]:
    """Every page whose header and body lie inside the file, from the start
    until the first that does not (or that is not a page header)."""
    pages: list[_Page] = []
    pos = 4
    while pos < size:
        fh.seek(pos)
        head = fh.read(min(_HEADER_BYTES, size - pos))
        reader = _Reader(head)
        try:
            header = reader.struct()
        except (_Truncated, ValueError):
            break
        try:
            kind = int(header[1][1])
            uncompressed = int(header[2][1])
            compressed = int(header[3][1])
        except (KeyError, TypeError, ValueError):
            break
        if kind not in (_DATA_PAGE, _INDEX_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2):
            break
        values = 0
        encodings: tuple[int, ...] = ()
        sub = header.get({_DATA_PAGE: 5, _DICTIONARY_PAGE: 7, _DATA_PAGE_V2: 8}.get(kind, -1))
        if sub is not None:
            fields = sub[1]
            if kind in (_DATA_PAGE, _DATA_PAGE_V2):
                values = int(fields.get(1, (0, 0))[1])
            enc_fields = {_DATA_PAGE: (2, 3, 4), _DICTIONARY_PAGE: (2,)}.get(kind, (4,))
            encodings = tuple(int(fields[f][1]) for f in enc_fields if f in fields)
            if not all(isinstance(v, tuple) for v in fields.values()):
                break
        end = pos + reader.pos + compressed
        if compressed < 0 or uncompressed < 0 or end > size:
            break  # the body is cut short
        pages.append(_Page(pos, reader.pos, kind, uncompressed, compressed, values, encodings))
        pos = end
    return pages


@dataclass(frozen=True, slots=True)
class _Leaf:
    path: tuple[str, ...]
    physical: int
    repeated: bool  # under a list: its values count list entries, not rows


def _leaves(schema: list[dict[int, tuple[int, Any]]]) -> list[_Leaf]:
    """The leaf columns of a footer's schema list, in order."""
    out: list[_Leaf] = []

    def walk(i: int, path: tuple[str, ...], repeated: bool) -> int:
        el = schema[i]
        name = el[4][1].decode() if isinstance(el[4][1], bytes) else el[4][1]
        rep = int(el.get(3, (0, 0))[1]) == 2
        children = int(el.get(5, (0, 0))[1])
        here = (*path, name) if i else ()
        i += 1
        if i > 1 and children == 0:
            out.append(_Leaf(here, int(el[1][1]), repeated or rep))
            return i
        for _ in range(children):
            i = walk(i, here, repeated or rep)
        return i

    walk(0, (), False)
    return out


def _row_groups(pages: list[_Page], leaves: list[_Leaf]) -> list[list[_Chunk]]:
    """The complete row groups, from the first (one chunk per leaf, every
    flat column holding the rows of the first), up to the first that is not."""
    n = len(leaves)
    chunks: list[_Chunk] = []
    rows = 0  # the current row group's rows, once its first column ended
    for page in pages:
        column = (len(chunks) - 1) % n
        current = chunks[-1] if chunks else None
        full = (
            current is not None
            and column != 0
            and not leaves[column].repeated
            and current.values >= rows
        )
        if current is None or page.kind == _DICTIONARY_PAGE or full:
            if current is not None and column == 0:
                rows = current.values
            chunks.append(_Chunk([page]))
        else:
            current.pages.append(page)
    groups = []
    for k in range(0, len(chunks) - n + 1, n):
        group = chunks[k : k + n]
        if not _complete(group, leaves):
            break
        groups.append(group)
    return groups


def _complete(group: list[_Chunk], leaves: list[_Leaf]) -> bool:
    rows = group[0].values
    return len(group) == len(leaves) and all(
        leaf.repeated or chunk.values == rows for chunk, leaf in zip(group, leaves, strict=True)
    )


def _footer(
    template: dict[int, tuple[int, Any]],
    groups: list[list[_Chunk]],
    leaves: list[_Leaf],
    codec: int,
    metadata: dict[bytes, bytes],
) -> bytes:
    row_groups = []
    for group in groups:
        columns = []
        total = 0
        for chunk, leaf in zip(group, leaves, strict=True):
            data = [p for p in chunk.pages if p.kind in (_DATA_PAGE, _DATA_PAGE_V2)]
            dictionary = [p for p in chunk.pages if p.kind == _DICTIONARY_PAGE]
            size_u = sum(p.header_size + p.uncompressed for p in chunk.pages)
            size_c = sum(p.header_size + p.compressed for p in chunk.pages)
            total += size_u
            encodings = sorted({e for p in chunk.pages for e in p.encodings} or {0})
            meta: dict[int, tuple[int, Any]] = {
                1: (_I32, leaf.physical),
                2: (_LIST, (_I32, encodings)),
                3: (_LIST, (_BINARY, [n.encode() for n in leaf.path])),
                4: (_I32, codec),
                5: (_I64, sum(p.values for p in data)),
                6: (_I64, size_u),
                7: (_I64, size_c),
                9: (_I64, data[0].offset if data else chunk.start),
            }
            if dictionary:
                meta[11] = (_I64, dictionary[0].offset)
            columns.append({2: (_I64, chunk.start), 3: (_STRUCT, meta)})
        row_groups.append(
            {
                1: (_LIST, (_STRUCT, columns)),
                2: (_I64, total),
                3: (_I64, group[0].values),
                5: (_I64, group[0].start),
                6: (_I64, group[-1].end - group[0].start),
            }
        )
    fields = dict(template)
    fields[3] = (_I64, sum(g[0].values for g in groups))
    fields[4] = (_LIST, (_STRUCT, row_groups))
    fields[5] = (
        _LIST,
        (_STRUCT, [{1: (_BINARY, k), 2: (_BINARY, v)} for k, v in metadata.items()]),
    )
    w = _Writer()
    w.struct(fields)
    return bytes(w.out)


class _Patched(io.RawIOBase):
    """The damaged file's first ``end`` bytes, then a new footer: what a
    reader sees, without copying the data."""

    def __init__(self, fh: Any, end: int, footer: bytes) -> None:
        self._fh, self._end = fh, end
        self._tail = footer + len(footer).to_bytes(4, "little") + b"PAR1"
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        size = self._end + len(self._tail)
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = 0
        while n < len(view):
            if self._pos < self._end:
                self._fh.seek(self._pos)
                got = self._fh.read(min(len(view) - n, self._end - self._pos))
            else:
                at = self._pos - self._end
                got = self._tail[at : at + len(view) - n]
            if not got:
                break
            view[n : n + len(got)] = got
            n += len(got)
            self._pos += len(got)
        return n


def _template() -> tuple[dict[int, tuple[int, Any]], list[_Leaf]]:
    """The footer of an empty trace file written now: its schema is the one
    the damaged file was written with (the trace format's)."""
    sink = pa.BufferOutputStream()
    pq.ParquetWriter(sink, TRACE_SCHEMA, compression="zstd", store_schema=False).close()
    data = sink.getvalue().to_pybytes()
    length = int.from_bytes(data[-8:-4], "little")
    fields = _Reader(data[-8 - length : -8]).struct()
    schema = list(fields[2][1][1])
    kept = {k: v for k, v in fields.items() if k in (1, 2, 6, 7)}
    return kept, _leaves(schema)


# ------------------------------------------------------------ the command


@dataclass(frozen=True, slots=True)
class Repaired:
    rows: int
    row_groups: int
    kept_bytes: int
    file_bytes: int


def _sibling_config(path: Path) -> TraceConfig | None:
    """The config of a complete trace file beside ``path`` (the closed
    segments of the recording whose open segment it was)."""
    from replay.format.trace import TraceReader

    try:
        names = sorted(os.listdir(path.parent))
    except OSError:
        return None
    for name in names:
        other = path.parent / name
        if name.endswith(".parquet") and not name.startswith(".") and other != path:
            try:
                return TraceReader(other).config
            except ReplayError:
                continue
    return None


def repair_trace(
    path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    config: TraceConfig | None = None,
) -> Repaired:
    """Write the complete row groups of the cut-short trace file ``path``
    into the new trace ``output`` (see the module docstring). A file with
    nothing to salvage, or whose footer is intact, is a one-line error and
    no output."""
    from replay.format.validate import validate_rows

    src = check_input(path, "a trace file cut short")
    check_outputs({"-o": output}, [path], formats={"-o": PARQUET})
    with open(src, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(0)
        head = fh.read(4)
        fh.seek(max(0, size - 4))
        tail = fh.read(4)
        if head != b"PAR1":
            raise TraceError(f"{src}: not a Parquet file (no PAR1 magic at the start)")
        if tail == b"PAR1" and size > 8:
            raise TraceError(
                f"{src}: its footer is intact, nothing to repair (`replay validate` checks it)"
            )
        if config is None:
            config = _sibling_config(src)
        if config is None:
            raise ReplayError(
                f"{src}: the footer that held the trace's config is lost; pass `config` "
                "(a kv-config JSON or a trace recorded with the same config) or `block_size` N"
            )
        template, leaves = _template()
        groups = _row_groups(_pages(fh, size), leaves)
        while groups:
            good, reason = _readable(fh, groups, template, leaves, config, src, validate_rows)
            if good == len(groups):
                break
            groups = groups[:good]
            if not groups:
                raise TraceError(f"{src}: no complete row group could be read ({reason})")
        if not groups:
            raise TraceError(
                f"{src}: no complete row group before the cut ({size:,} bytes); nothing to salvage"
            )
        codec = _codec(fh, groups, template, leaves)
        footer = _footer(template, groups, leaves, codec, {})
        patched = _Patched(fh, groups[-1][-1].end, footer)
        rows = 0
        pf = pq.ParquetFile(patched)
        with TraceWriter(output, config) as writer:
            for i in range(pf.metadata.num_row_groups):
                table = pf.read_row_group(i, columns=list(TRACE_COLUMNS))
                writer.write_table(table)
                rows += table.num_rows
        return Repaired(rows, len(groups), groups[-1][-1].end, size)


def _codec(fh: Any, groups: list[list[_Chunk]], template: Any, leaves: list[_Leaf]) -> int:
    """The codec the pages were written with: the first that reads the
    first row group."""
    for codec in _CODECS:
        footer = _footer(template, groups[:1], leaves, codec, {})
        try:
            pq.ParquetFile(_Patched(fh, groups[0][-1].end, footer)).read_row_group(0)
        except (pa.ArrowException, OSError, ValueError):
            continue
        return codec
    return _CODECS[0]


def _readable(
    fh: Any,
    groups: list[list[_Chunk]],
    template: Any,
    leaves: list[_Leaf],
    config: TraceConfig,
    src: Path,
    validate_rows: Any,
) -> tuple[int, str]:
    """How many of ``groups``, from the first, decode and pass the trace
    format's checks (and why the next one does not)."""
    codec = _codec(fh, groups, template, leaves)
    footer = _footer(template, groups, leaves, codec, {TRACE_META_KEY: config.dumps().encode()})
    try:
        pf = pq.ParquetFile(_Patched(fh, groups[-1][-1].end, footer))
    except (pa.ArrowException, OSError, ValueError) as exc:
        return 0, one_line(exc)
    last: int | None = None
    for i in range(len(groups)):
        try:
            table = pf.read_row_group(i, columns=list(TRACE_COLUMNS))
            _, last = validate_rows(str(src), config, table, last)
        except (pa.ArrowException, OSError, ValueError, ReplayError) as exc:
            return i, one_line(exc)
    return len(groups), ""
