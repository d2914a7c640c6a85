"""Prefix reuse ratio, the trace's own, counted directly from the ids:

    reuse = sum over rows of B * h / sum over rows of input_length

where ``B = block_size`` and ``h`` is the number of leading trace blocks of
the row, among its first ``(input_length - 1) // B``, that an earlier row
(in file order) also had: block ``j`` lies in source block ``b`` at
sub-index ``s``, and an earlier row had it iff an earlier row's
``hash_ids[b]`` was the same id and covered at least ``s + 1`` trace
blocks of it (coarser trace blocks: iff an earlier row had the same id as
the last source block inside the trace block). Replaying the imported
trace with ``--model full --no-eagle`` and unbounded capacity gives exactly
this: full attention stores every full block of every earlier prompt and
hits the longest present prefix, at most ``max_length // B`` blocks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from replay.sources.mooncake_jsonl import FORMATS, SourceRow, granularity, read_rows


@dataclass(frozen=True, slots=True)
class ReuseCount:
    """The trace's own prefix reuse, counted from its ``hash_ids``."""

    reused_tokens: int
    input_tokens: int
    rows: int

    @property
    def ratio(self) -> float:
        return self.reused_tokens / self.input_tokens if self.input_tokens else 0.0


class ReuseCounter:
    """The direct count behind the reuse ratio (module docstring), row by row."""

    def __init__(self, fine: int, coarse: int, block_size: int) -> None:
        self.fine = fine
        self.coarse = coarse
        self.block_size = block_size
        self._covered: dict[int, int] = {}  # source id -> trace blocks of it some row had
        self.reused = self.total = self.rows = 0

    def add(self, row: SourceRow) -> None:
        bs, fine, coarse, covered = self.block_size, self.fine, self.coarse, self._covered
        self.rows += 1
        self.total += row.input_length
        units = row.input_length // bs
        limit = min(units, (row.input_length - 1) // bs)
        ids = row.hash_ids
        hit = 0
        while hit < limit:
            if coarse > 1:
                ok = covered.get(ids[(hit + 1) * coarse - 1], 0) > 0
            else:
                b, sub = divmod(hit, fine)
                ok = b < len(ids) and covered.get(ids[b], 0) > sub
            if not ok:
                break
            hit += 1
        self.reused += hit * bs
        if coarse > 1:
            for j in range(units):
                covered[ids[(j + 1) * coarse - 1]] = 1
        else:
            for b, h in enumerate(ids):
                n = min(fine, units - b * fine)
                if n > covered.get(h, 0):
                    covered[h] = n

    def result(self) -> ReuseCount:
        return ReuseCount(reused_tokens=self.reused, input_tokens=self.total, rows=self.rows)


def count_reuse(path: str | os.PathLike[str], fmt: str, block_size: int = 16) -> ReuseCount:
    """Validate every line of a ``mooncake`` or ``bailian`` trace and count its
    prefix reuse ratio (module docstring) without writing anything."""
    form = FORMATS[fmt]
    counter = ReuseCounter(*granularity(form, block_size), block_size)
    for row in read_rows(form, Path(path)):
        counter.add(row)
    return counter.result()
