"""Importers for public prefix-sharing traces (Mooncake FAST'25, Qwen "bailian";
their formats: ``replay.sources.mooncake_jsonl``) into replay traces.

Each row becomes, in file order, a ``lookup`` (``request_id`` = the
``chat_id``, or ``line-N`` for Mooncake; ``max_length = input_length - 1``)
followed by the stores its prefill leaves behind for the chosen archetype,
through the same store logic as the generator (``replay.sources.workload``,
``replay.rules.store_rules``).
Timestamps are kept relative: the trace's time zero is written as the Unix
epoch.

Trace hashes, one per ``block_size`` tokens (the trace's ``hash_block_size``):

* ``block_size == S`` (or a multiple of it): the id of the last source
  block inside the trace block, as 8-byte big-endian (the format's rule for
  integer ids; it names the whole prefix since ids are chained);
* ``S`` a multiple of ``block_size``: each source block becomes
  ``S / block_size`` trace blocks, hashed as a 16-byte digest of
  ``(hash_id, sub-index)`` (a bijective mix; distinct pairs never
  collide). Prefixes still match: the id names everything up to its block's
  end, the sub-index the position inside it. Tokens past the last id (a
  file that omits the partial block) are fresh content, hashed from the
  line number in a separate domain, so they never match.

The summary holds the trace's own prefix-reuse ratio (``replay.sources.prefix_reuse``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from replay.base.deprecation import renamed_keyword
from replay.base.limits import ROW_HASHES
from replay.format.writer import TraceWriter
from replay.rules.store_rules import StoreSettings, with_lookahead
from replay.sources.archetypes import archetype_config
from replay.sources.hashing import (
    Digests,
    DigestTable,
    Keys,
    big_endian_ids,
    digest_pairs,
    lane_salts,
)
from replay.sources.mooncake_jsonl import FORMATS, SourceRow, granularity, read_rows
from replay.sources.prefix_reuse import ReuseCounter
from replay.sources.workload import WorkloadWriter


class _KeyMap:
    """Source ids -> dense unit keys, and the digests of those keys."""

    def __init__(self, fine: int, coarse: int) -> None:
        self.fine = fine
        self.coarse = coarse
        self._dense: dict[int, int] = {}
        self._orig: list[int] = []
        self._fresh: list[bool] = []
        self._salts = lane_salts(0, 2)
        self.digest = DigestTable(self._digest)

    @property
    def width(self) -> int:
        """Every digest's byte width: the source ids themselves (8 bytes)
        when a block is one source block, else a 16-byte digest of the id
        and the block's place in it."""
        return 8 if self.fine == 1 else 16

    def _index(self, source_id: int, fresh: bool = False) -> int:
        if fresh:
            self._orig.append(source_id)
            self._fresh.append(True)
            return len(self._orig) - 1
        d = self._dense.get(source_id)
        if d is None:
            d = self._dense[source_id] = len(self._orig)
            self._orig.append(source_id)
            self._fresh.append(False)
        return d

    def keys(self, row: SourceRow, block_size: int, lookahead: int = 0) -> Keys:
        """A row's unit keys. The source's ids are chained over the prefix, so
        a unit's key is that of the source block holding the last token its
        hash covers (its own last token, or the last of its ``lookahead``
        tokens), with the unit's place inside a source block when a block
        holds several units; tokens past the last id are the row's own."""
        units = max(row.input_length - lookahead, 0) // block_size
        f, step = self.fine, self.coarse
        source_tokens = block_size * f // step
        if not units:
            return np.zeros(0, dtype=np.int64)
        # Unit j's source block: the one holding token (j + 1) * block_size
        # + lookahead - 1. They rise by ``step`` (1 when a block holds several
        # units, ``coarse`` when a unit spans several blocks): each once, in
        # order, so the dense ids follow first use.
        j = np.arange(units, dtype=np.int64)
        lo = (block_size + lookahead - 1) // source_tokens
        hi = (units * block_size + lookahead - 1) // source_tokens
        ids, index = row.hash_ids, self._index
        of_block = np.array(
            [
                index(ids[b]) if b < len(ids) else index(row.line, fresh=True)
                for b in range(lo, hi + 1, step)
            ],
            dtype=np.int64,
        )
        if step > 1:  # a unit spans ``step`` blocks: one block each
            return of_block
        which = (j * block_size + (block_size + lookahead - 1)) // source_tokens - lo
        return of_block[which] * f + j % f if f > 1 else of_block[which]

    def _digest(self, keys: Keys) -> Digests:
        if len(keys) == 0:
            return np.zeros((0, self.width), dtype=np.uint8)
        dense = keys // self.fine
        lo = int(dense.min())
        orig = np.array(self._orig[lo : int(dense.max()) + 1], dtype=np.uint64)[dense - lo]
        if self.fine == 1:
            return big_endian_ids(orig)
        fresh = np.array(self._fresh[lo : int(dense.max()) + 1], dtype=np.uint64)[dense - lo]
        subs = (keys % self.fine).astype(np.uint64) * np.uint64(2) + fresh
        return digest_pairs(orig, subs, self._salts)


@renamed_keyword("policy", "store_settings")
def ingest(
    format_name: str,
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    model: str = "full",
    block_size: int = 16,
    eagle: bool = False,
    lookahead_tokens: int = 0,
    capacity_blocks: int | None = None,
    store_settings: StoreSettings | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Import a JSONL trace in ``format_name`` (``mooncake`` or ``bailian``);
    return a summary with the trace's own prefix-reuse ratio.
    ``store_settings`` are the deployment's (default: vLLM's defaults, the
    Mooncake store; the release they follow is theirs); ``lookahead_tokens``
    is vLLM's ``num_hash_lookahead_tokens`` (with EAGLE)."""
    fmt = FORMATS[format_name]
    path = Path(src)
    fine, coarse = granularity(fmt, block_size)
    settings = store_settings or StoreSettings()
    config = with_lookahead(
        archetype_config(model, block_size, None, eagle), lookahead_tokens, settings
    )
    keymap = _KeyMap(fine, coarse)
    counter = ReuseCounter(fine, coarse, block_size)
    with (
        # One width for every hash: written fixed-size (no length stored
        # or decoded per hash, as `replay synth` writes them).
        TraceWriter(out, config, hash_width=keymap.width) as trace,
        WorkloadWriter(
            config,
            trace.write_table,
            keymap.digest,
            capacity_blocks=capacity_blocks,
            settings=settings,
        ) as writer,
    ):
        done = 0
        most = ROW_HASHES.value()
        for row in read_rows(fmt, path):
            if row.input_length // block_size > most:
                raise ROW_HASHES.refuse(
                    f"{path}: line {row.line}: input_length {row.input_length} makes",
                    row.input_length // block_size,
                )
            counter.add(row)
            writer.add(
                ts_us=row.ts_us,
                request_id=row.request_id,
                num_tokens=row.input_length,
                unit_keys=keymap.keys(row, block_size, lookahead_tokens),
            )
            done += 1
            if progress is not None and done == 1000:
                progress(done)
                done = 0
        stats = writer.close()
        reuse = counter.result()
        trace.set_source(
            {
                "importer": f"replay.sources.mooncake ({fmt.name})",
                "format": fmt.name,
                "file": path.name,
                "rows": reuse.rows,
                "source_block_tokens": fmt.block_tokens,
                "model": model,
                "capacity_blocks": capacity_blocks,
                **settings.as_source(),
                "reuse_ratio": reuse.ratio,
                "reused_tokens": reuse.reused_tokens,
                "input_tokens": reuse.input_tokens,
            }
        )
        if progress is not None and done:
            progress(done)
    return {
        "path": str(out),
        "source": str(path),
        "format": fmt.name,
        "model": model,
        "eagle": eagle,
        "lookahead_tokens": lookahead_tokens,
        "block_size": block_size,
        "capacity_blocks": capacity_blocks,
        **settings.as_source(),
        "rows": reuse.rows,
        **stats.as_dict(),
        "bytes": Path(out).stat().st_size,
        "reuse_ratio": reuse.ratio,
        "reused_tokens": reuse.reused_tokens,
        "input_tokens": reuse.input_tokens,
    }


#: Mooncake FAST'25 JSONL (``timestamp`` in ms, one ``hash_ids`` entry per 512 tokens).
ingest_mooncake = functools.partial(ingest, "mooncake")
#: Qwen bailian JSONL (``timestamp`` in s, one ``hash_ids`` entry per 16 tokens).
ingest_bailian = functools.partial(ingest, "bailian")
