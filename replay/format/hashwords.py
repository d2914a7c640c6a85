"""The fold kernel's view of block_hashes: each hash as fixed-width words, in place
(no copy of the Arrow buffers); replay.engine.kernels folds over it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa


@dataclass(frozen=True, slots=True)
class HashWords:
    """A batch's ``block_hashes`` as fixed-width words, for compiled code,
    without an array per hash where the Arrow buffers allow it.

    Row ``r`` owns hashes ``row_offsets[r]:row_offsets[r + 1]``. Hash ``h``
    is ``nbytes[h]`` bytes long: ``value_offsets[h + 1] - value_offsets[h]``
    (the Arrow offsets themselves, int32 or int64), or ``width`` for every
    hash when ``value_offsets`` is empty (fixed-size binary). Its words,
    zero-padded, start at ``words[h * stride]`` when ``stride`` is set (a
    padded copy), else at ``words[(value_offsets[h] - base) // 8]`` (the
    Arrow values buffer viewed in place). Every array is read-only.
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
    def nbytes(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Each hash's length in bytes."""
        if self.value_offsets.shape[0] == 0:
            return _readonly(np.full(self.num_hashes, self.width, dtype=np.int64))
        return _readonly(np.diff(self.value_offsets.astype(np.int64)))

    @property
    def word_offsets(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Hash ``h`` is ``words[word_offsets[h]:word_offsets[h + 1]]``, its
        zero padding included."""
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
        return int(np.diff(self.value_offsets).max())


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
        return HashWords(row_offsets, words, voff, base=base)
    data = np.frombuffer(data_buf, dtype=np.uint8)
    lens = np.diff(voff.astype(np.int64))
    stride = (int(lens.max()) + 7) >> 3
    padded = np.zeros(n * stride * 8, dtype=np.uint8)
    starts = np.arange(n, dtype=np.int64) * (stride * 8)
    for width in np.unique(lens).tolist():
        rows = np.flatnonzero(lens == width)
        span = np.arange(width, dtype=np.int64)
        padded[starts[rows][:, None] + span] = data[voff[rows].astype(np.int64)[:, None] + span]
    return HashWords(row_offsets, _readonly(padded.view(np.uint64)), voff, stride=stride)
