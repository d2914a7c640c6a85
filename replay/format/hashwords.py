"""The fold kernel's view of block_hashes: each hash as fixed-width words, in place
(no copy of the Arrow buffers); replay.engine.kernels folds over it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import pyarrow as pa


class PackedHashes(Sequence[bytes]):
    """A row's ``block_hashes`` of one width in one bytes object, as a live
    source makes them (``replay watch``: vLLM's integer hashes packed in one
    call, the plugin's hex in one ``fromhex``) without a bytes object per
    hash. To everything else it is a sequence of bytes (equal to the list
    of them); ``replay.format.writer.events_table`` builds the Arrow column
    from ``data`` in one copy."""

    __slots__ = ("data", "length", "width")

    def __init__(self, data: bytes, width: int) -> None:
        if width <= 0 or len(data) % width:
            raise ValueError(f"{len(data)} bytes are not a whole number of {width}-byte hashes")
        self.data = data
        self.width = width
        #: ``len(self)``, as an attribute: the live columns read it for
        #: every row (a ``__len__`` call was a Python frame each).
        self.length = len(data) // width

    def __len__(self) -> int:
        return self.length

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...
    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        if isinstance(index, slice):
            return list(self)[index]
        n, w = len(self), self.width
        if not -n <= index < n:
            raise IndexError(index)
        index %= n
        return self.data[index * w : (index + 1) * w]

    def __iter__(self) -> Iterator[bytes]:
        w, data = self.width, self.data
        return (data[i : i + w] for i in range(0, len(data), w))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedHashes):
            return self.width == other.width and self.data == other.data
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PackedHashes({list(self)!r})"


@dataclass(frozen=True, slots=True)
class HashWords:
    """A batch's ``block_hashes`` as fixed-width words, for compiled code,
    without an array per hash where the Arrow buffers allow it.

    Row ``r`` owns hashes ``row_offsets[r]:row_offsets[r + 1]``. Hash ``h``
    is ``nbytes[h]`` bytes long: ``value_offsets[h + 1] - value_offsets[h]``
    (the Arrow offsets themselves, int32 or int64), or ``width`` for every
    hash when ``value_offsets`` is empty (fixed-size binary, or binary
    hashes of one width back to back). Its words,
    zero-padded, start at ``words[h * stride]`` when ``stride`` is positive
    (a padded copy of hashes of one width), at ``words[value_offsets[n + 1
    + h]]`` when ``stride`` is -1 (a packed copy of mixed widths, each
    padded to its own words only: ``value_offsets`` is then the byte
    offsets followed by each hash's first word), else at
    ``words[(value_offsets[h] - base) // 8]`` (the Arrow values buffer
    viewed in place). Every array is read-only.
    """

    row_offsets: np.ndarray[Any, np.dtype[np.int64]]
    words: np.ndarray[Any, np.dtype[np.uint64]]
    value_offsets: np.ndarray[Any, Any]
    base: int = 0
    stride: int = 0
    width: int = 0

    @property
    def num_hashes(self) -> int:
        return int(self.row_offsets[-1])

    @property
    def _byte_offsets(self) -> np.ndarray[Any, Any]:
        if self.stride < 0:
            return self.value_offsets[: self.value_offsets.shape[0] // 2]
        return self.value_offsets

    @property
    def nbytes(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Each hash's length in bytes."""
        if self.value_offsets.shape[0] == 0:
            return _readonly(np.full(self.num_hashes, self.width, dtype=np.int64))
        return _readonly(np.diff(self._byte_offsets.astype(np.int64)))

    @property
    def word_offsets(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Hash ``h`` is ``words[word_offsets[h]:word_offsets[h + 1]]``, its
        zero padding included."""
        if self.stride < 0:
            return _readonly(self.value_offsets[self.value_offsets.shape[0] // 2 :].copy())
        if self.stride:
            return _readonly(np.arange(self.num_hashes + 1, dtype=np.int64) * self.stride)
        return _readonly((self.value_offsets.astype(np.int64) - self.base) >> 3)

    @property
    def max_bytes(self) -> int:
        """The longest hash's bytes (0 without hashes)."""
        if self.num_hashes == 0:
            return 0
        if self.value_offsets.shape[0] == 0:
            return self.width
        return int(np.diff(self._byte_offsets).max())


def _readonly(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    a.flags.writeable = False
    return a


_NO_OFFSETS = _readonly(np.zeros(0, dtype=np.int32))


def hash_words(hashes: pa.Array) -> HashWords:
    """View ``hashes`` (list of binary / large_binary / fixed_size_binary) as
    words: zero-copy over the Arrow values buffer when every hash is a whole
    number of 8-byte words and the buffer is aligned (vLLM's 32-byte digests,
    the importers' 8- and 16-byte hashes); otherwise copied, each padded to
    the longest hash's words. The checks reduce the offsets in place: no
    array per hash is made on the zero-copy path."""
    list_off = np.asarray(hashes.offsets, dtype=np.int64)
    lo, hi = int(list_off[0]), int(list_off[-1])
    row_offsets = _readonly(list_off - lo)
    values = hashes.values
    n = hi - lo
    if pa.types.is_fixed_size_binary(values.type):
        width = values.type.byte_width
        data_buf = values.buffers()[1]
        start = (lo + values.offset) * width
        if n and width % 8 == 0 and (data_buf.address + start) % 8 == 0:
            words = np.frombuffer(data_buf, dtype=np.uint64, count=n * width // 8, offset=start)
            return HashWords(row_offsets, words, _NO_OFFSETS, stride=width // 8, width=width)
        voff = np.arange(lo + values.offset, hi + values.offset + 1, dtype=np.int64) * width
    else:
        wide = pa.types.is_large_binary(values.type)
        offs = np.frombuffer(values.buffers()[1], dtype=np.int64 if wide else np.int32)
        voff = offs[values.offset + lo : values.offset + hi + 1]
        data_buf = values.buffers()[2]
    voff = _readonly(voff)
    if n == 0 or data_buf is None or voff[-1] == voff[0]:
        return HashWords(row_offsets, _readonly(np.zeros(0, dtype=np.uint64)), voff, stride=1)
    base = int(voff[0])
    # Every offset a multiple of 8 into an aligned buffer: whole words, in place.
    if data_buf.address % 8 == 0 and not int(np.bitwise_or.reduce(voff)) & 7:
        words = np.frombuffer(
            data_buf, dtype=np.uint64, count=(int(voff[-1]) - base) // 8, offset=base
        )
        lens = np.diff(voff)
        width = int(lens[0])
        if int(lens.min()) == width == int(lens.max()):
            # One width, back to back (a binary column of equal digests, as
            # Parquet gives them back): the fixed-size layout, so the
            # kernels read no offset per hash and key a known word count.
            return HashWords(row_offsets, words, _NO_OFFSETS, stride=width // 8, width=width)
        return HashWords(row_offsets, words, voff, base=base)
    data = np.frombuffer(data_buf, dtype=np.uint8)
    lens = np.diff(voff.astype(np.int64))
    widths = np.unique(lens)
    if widths.shape[0] == 1:  # one width: a copy at a fixed stride
        stride = (int(widths[0]) + 7) >> 3
        first = np.arange(n + 1, dtype=np.int64) * stride
    else:
        # Mixed widths: each hash padded to its own words, never to the
        # widest (one long hash among short ones would pad them all).
        stride = -1
        first = np.zeros(n + 1, dtype=np.int64)
        np.cumsum((lens + 7) >> 3, out=first[1:])
    padded = np.zeros(int(first[-1]) * 8, dtype=np.uint8)
    starts = first[:-1] * 8
    src = voff[:-1].astype(np.int64)
    for width in widths.tolist():
        rows = np.flatnonzero(lens == width)
        # In slices of rows: the index arrays stay near 64 MB whatever the width.
        step = max(1, (8 << 20) // max(1, width))
        span = np.arange(width, dtype=np.int64)
        for lo in range(0, rows.shape[0], step):
            part = rows[lo : lo + step]
            padded[starts[part][:, None] + span] = data[src[part][:, None] + span]
    if stride < 0:
        voff = _readonly(np.concatenate([voff.astype(np.int64), first]))
    return HashWords(row_offsets, _readonly(padded.view(np.uint64)), voff, stride=stride)
