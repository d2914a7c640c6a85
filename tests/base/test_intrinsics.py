"""The intrinsics of ``replay.base.intrinsics`` compiled into kernels of
their own here, as the fold and the copy counts use them."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from replay.base.intrinsics import LITTLE_ENDIAN, load_u64, prefetch


@njit(cache=False)
def _sum_with_hints(keys: Any, counts: Any, ahead: int) -> Any:
    """The copy counts' loop: both of a slot's arrays (8- and 4-byte
    elements) hinted ``ahead`` elements on, in one function."""
    total = 0
    for i in range(keys.shape[0]):
        if i + ahead < keys.shape[0]:
            prefetch(keys, i + ahead)
            prefetch(counts, i + ahead)
        total += int(keys[i]) * int(counts[i])
    return total


def test_prefetch_takes_arrays_of_several_dtypes_in_one_kernel() -> None:
    # One declaration of LLVM's prefetch for every dtype: a second array of
    # another element type in the same function failed to compile.
    keys = np.arange(1, 101, dtype=np.uint64)
    counts = np.arange(100, dtype=np.int32) % 3
    assert _sum_with_hints(keys, counts, 8) == int((keys.astype(np.int64) * counts).sum())
    # The hints change no value: the same answer with none issued (every
    # one would be past the end).
    assert _sum_with_hints(keys, counts, 1_000) == _sum_with_hints(keys, counts, 8)


@njit(cache=False)
def _word_at(buf: Any, at: int) -> Any:
    return load_u64(buf, at)


def test_load_u64_reads_a_word_at_any_byte() -> None:
    buf = np.arange(16, dtype=np.uint8)
    for at in (0, 1, 7, 8):
        expected = int.from_bytes(bytes(buf[at : at + 8]), "little" if LITTLE_ENDIAN else "big")
        assert int(_word_at(buf, at)) == expected
