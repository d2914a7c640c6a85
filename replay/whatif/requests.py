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
from replay.base.spec import TraceConfig, lookahead_plus
from replay.format.tracedir import open_trace
from replay.rules.eviction import NEVER
from replay.whatif import kernel as whatif_kernel


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
    _arrays: (
        tuple[
            npt.NDArray[np.int64],
            npt.NDArray[np.int64],
            npt.NDArray[np.int64],
            npt.NDArray[np.int64],
        ]
        | None
    ) = field(default=None, repr=False)
    #: distinct hashes the lookups name (None: every id of ``digests``)
    distinct: int | None = None

    def __len__(self) -> int:
        return len(self.seq)

    def useful_blocks(self) -> int:
        """More blocks than every request of the trace allocates in every
        group together: a block pool this large never evicts, so any larger
        capacity gives the same run (and is simulated at this size)."""
        sizes = [g.block_size for g in self.config.groups]
        return 1 + sum((n + b - 1) // b + 1 for n in self.num_tokens for b in sizes)

    def arrays(
        self,
    ) -> tuple[
        npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]
    ]:
        """The kernel's view: ids, offsets, num_tokens, max_length (int64)."""
        if self._arrays is None:
            self._arrays = (
                np.ascontiguousarray(self.ids, dtype=np.int64),
                np.ascontiguousarray(self.offsets, dtype=np.int64),
                np.asarray(self.num_tokens, dtype=np.int64),
                np.asarray(self.max_length, dtype=np.int64),
            )
        return self._arrays

    def working_set_blocks(self) -> int:
        """The blocks an unbounded cache could hold: every distinct hash the
        lookups name, once per KV-cache group (what ``10%`` is a tenth of)."""
        distinct = len(self.digests) if self.distinct is None else self.distinct
        return distinct * self.config.num_groups

    def max_request_blocks(self) -> int:
        """The blocks the longest prompt needs in every group."""
        tokens = int(self.arrays()[2].max()) if len(self) else 0
        bs = min(g.block_size for g in self.config.groups)
        return -(-tokens // bs) * self.config.num_groups

    def sample(self, fraction: float) -> tuple[Requests, dict[str, Any]]:
        """A deterministic sample of the sessions: a request's session is the
        first hash past the prefix every lookup shares (a conversation's first
        own block; its later turns extend it), kept when a digest of that
        hash's bytes falls below ``fraction``: the same sessions on every run
        and machine, whatever the trace's order. (Requests with no hash of
        their own past that prefix share one session.) Returns the sample and what
        it holds."""
        import hashlib

        ids, offsets = self.ids, self.offsets
        lengths = np.diff(offsets)
        first = ids[offsets[0] : offsets[1]] if len(self) else ids[:0]
        common = int(first.size)
        for i in range(len(self)):
            u = int(lengths[i])
            row = ids[offsets[i] : offsets[i] + min(u, common)]
            differ = np.flatnonzero(row != first[: row.size])
            if differ.size:
                common = int(differ[0])
        limit = int(fraction * 2**64)
        keep: list[int] = []
        sessions: dict[bytes, bool] = {}
        for i in range(len(self)):
            u = int(lengths[i])
            if u == 0:
                key = self.request_id[i].encode()
            else:
                key = self.digests[int(ids[offsets[i] + min(common, u - 1)])].as_py()
            kept = sessions.get(key)
            if kept is None:
                digest = hashlib.blake2b(key, digest_size=8).digest()
                kept = sessions[key] = int.from_bytes(digest, "big") < limit
            if kept:
                keep.append(i)
        if not keep:
            raise ReplayError(
                f"`sample` {fraction:g} keeps none of the {len(sessions):,} sessions: sample more"
            )
        idx = np.asarray(keep, dtype=np.int64)
        parts = [ids[offsets[i] : offsets[i + 1]] for i in keep]
        new_ids = np.concatenate(parts) if parts else ids[:0]
        new_offsets = np.concatenate([[0], np.cumsum(lengths[idx])]).astype(np.int64)
        sub = Requests(
            config=self.config,
            path=self.path,
            seq=[self.seq[i] for i in keep],
            request_id=[self.request_id[i] for i in keep],
            max_length=[self.max_length[i] for i in keep],
            num_tokens=[self.num_tokens[i] for i in keep],
            ts=[self.ts[i] for i in keep],
            offsets=new_offsets,
            ids=new_ids,
            digests=self.digests,
            distinct=int(np.unique(new_ids).size),
        )
        info = {
            "fraction": fraction,
            "sessions": sum(sessions.values()),
            "sessions_total": len(sessions),
            "requests": len(keep),
            "requests_total": len(self),
            "session_key": f"the first hash past the {common} shared by every lookup",
        }
        return sub, info

    def unit_ids(self, i: int) -> list[int]:
        ids: list[int] = self.ids[self.offsets[i] : self.offsets[i + 1]].tolist()
        return ids

    def uses(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Every request that holds each hash id, in order: ``uses[starts[k]:
        starts[k + 1]]`` for id ``k`` (Belady's future, computed once)."""
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

    def next_uses(self) -> npt.NDArray[np.int64]:
        """Per unit of ``ids``, the next request whose prompt holds its hash
        (``NEVER``: none): Belady's future, computed once per trace."""
        self.uses()
        return self._after

    def next_use(self, key: Hashable, now: int) -> int:
        """The first request after ``now`` whose prompt holds ``key``."""
        uses, starts = self.uses()
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
    hashes = frame.get_column("block_hashes").rechunk().to_arrow()
    if isinstance(hashes, pa.ChunkedArray):
        hashes = hashes.combine_chunks()
    lengths = np.diff(np.asarray(hashes.offsets, dtype=np.int64))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # Dense ids in order of first appearance, by the exact bytes (compiled).
    ids, digests = whatif_kernel.intern_hashes(hashes)
    max_length = frame.get_column("max_length").to_list()
    num_tokens = [
        n if n is not None else m + 1
        for n, m in zip(frame.get_column("num_tokens").to_list(), max_length, strict=True)
    ]
    seqs = frame.get_column("seq").to_list()
    hbs = reader.config.hash_block_size
    for seq, n, m, k in zip(seqs, num_tokens, max_length, lengths.tolist(), strict=True):
        if not 0 <= m < n:
            raise ReplayError(
                f"{path}: seq {seq}: max_length {m} must be in [0, num_tokens {n}) for the "
                "what-if (vLLM recomputes a prompt's last token)"
            )
        # The what-if stores the prompt's blocks: its hashes must cover it.
        if n > reader.config.max_length_bound(k):
            raise ReplayError(
                f"{path}: seq {seq}: num_tokens {n} exceeds what its {k} block_hashes cover "
                f"(the what-if needs num_tokens <= (len(block_hashes) + 1) * hash_block_size "
                f"{hbs}{lookahead_plus(reader.config)})"
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
        digests=digests,
    )
