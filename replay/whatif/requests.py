"""The what-if's requests: a trace's lookups in seq order, with each request's
hashes, loaded once."""

from __future__ import annotations

import bisect
import os
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl
import pyarrow as pa

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.format.tracedir import open_trace
from replay.rules.blockpool import NEVER


@dataclass(slots=True, kw_only=True)
class Requests:
    """A trace's lookups, keyed by dense integer ids of their hashes."""

    config: TraceConfig
    path: str
    seq: list[int]
    request_id: list[str]
    max_length: list[int]
    num_tokens: list[int]
    ts: list[Any]
    offsets: npt.NDArray[np.int64]
    ids: npt.NDArray[np.int64]
    #: id -> the hash bytes (for emitted traces)
    digests: pa.Array
    #: Belady's future: for each id, the requests holding it, ascending
    _uses: npt.NDArray[np.int64] | None = field(default=None, repr=False)
    _use_starts: npt.NDArray[np.int64] | None = field(default=None, repr=False)
    _after: npt.NDArray[np.int64] = field(default_factory=lambda: np.empty(0, np.int64), repr=False)
    _now: int = field(default=-1, repr=False)
    _soon: dict[int, int] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.seq)

    def unit_ids(self, i: int) -> list[int]:
        ids: list[int] = self.ids[self.offsets[i] : self.offsets[i + 1]].tolist()
        return ids

    def _future(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        if self._uses is None:
            owner = np.repeat(np.arange(len(self.seq), dtype=np.int64), np.diff(self.offsets))
            order = np.lexsort((owner, self.ids))
            ids, uses = self.ids[order], owner[order]
            self._uses = uses
            self._use_starts = np.searchsorted(
                ids, np.arange(len(self.digests) + 1, dtype=np.int64)
            )
            # Per unit, the next request holding its hash (a hash twice in one
            # prompt defers to its later copy's next request).
            after = np.full(len(ids), NEVER, dtype=np.int64)
            same = ids[1:] == ids[:-1]
            after[:-1][same] = uses[1:][same]
            for k in np.flatnonzero(after == uses)[::-1].tolist():
                after[k] = after[k + 1]
            self._after = np.empty_like(after)
            self._after[order] = after
        assert self._use_starts is not None
        return self._uses, self._use_starts

    def next_use(self, key: Hashable, now: int) -> int:
        """The first request after ``now`` whose prompt holds ``key``."""
        uses, starts = self._future()
        if now != self._now:
            # The keys asked about are mostly the running request's own.
            o, e = int(self.offsets[now]), int(self.offsets[now + 1])
            self._now = now
            self._soon = dict(zip(self.ids[o:e].tolist(), self._after[o:e].tolist(), strict=True))
        hit = self._soon.get(key)  # type: ignore[call-overload]
        if hit is not None:
            return int(hit)
        assert isinstance(key, int)
        lo, hi = int(starts[key]), int(starts[key + 1])
        j = bisect.bisect_right(uses, now, lo, hi)
        return int(uses[j]) if j < hi else NEVER


def load_requests(path: str | os.PathLike[str]) -> Requests:
    """The lookups of a trace (its cache events are ignored). A lookup
    without ``num_tokens`` is taken as ``max_length + 1`` tokens, vLLM's
    ``get_computed_blocks`` bound."""
    reader = open_trace(path)
    frame = reader.read_frame(
        ["seq", "ts", "kind", "block_hashes", "request_id", "max_length", "num_tokens"]
    ).filter(pl.col("kind") == "lookup")
    if frame.height == 0:
        raise ReplayError(f"{path}: no lookup rows, nothing to simulate")
    hashes = frame.get_column("block_hashes")
    lengths = hashes.list.len().to_numpy().astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = hashes.explode().drop_nulls()
    # Dense ids in order of first appearance, by the exact bytes.
    uniq = pl.DataFrame({"h": flat}).unique("h", keep="first", maintain_order=True)
    digests = uniq.get_column("h")
    ids = (
        pl.DataFrame({"h": flat})
        .join(uniq.with_row_index("id"), on="h", how="left", maintain_order="left")
        .get_column("id")
        .to_numpy()
        .astype(np.int64)
    )
    max_length = frame.get_column("max_length").to_list()
    num_tokens = [
        n if n is not None else m + 1
        for n, m in zip(frame.get_column("num_tokens").to_list(), max_length, strict=True)
    ]
    seqs = frame.get_column("seq").to_list()
    for seq, n, m in zip(seqs, num_tokens, max_length, strict=True):
        if not 0 <= m < n:
            raise ReplayError(
                f"{path}: seq {seq}: max_length {m} must be in [0, num_tokens {n}) for the "
                "what-if (vLLM recomputes a prompt's last token)"
            )
    return Requests(
        config=reader.config,
        path=str(path),
        seq=seqs,
        request_id=frame.get_column("request_id").to_list(),
        max_length=max_length,
        num_tokens=num_tokens,
        ts=frame.get_column("ts").to_list(),
        offsets=offsets,
        ids=ids,
        digests=digests.to_arrow(),
    )
