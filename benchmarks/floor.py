"""What the day's figures cannot go below on this machine (issue 34).

``python -m benchmarks.floor TRACE [ENTRIES]`` measures, each on one thread:

- decoding the trace's batches with pyarrow (``use_threads=False``, as
  the replay's reader does), the thread's CPU;
- a compiled loop that does nothing per hash entry but one probe (a read
  of one random 8-byte word, prefetched 16 entries ahead as the fold
  does) into a table of 8 to 64 MB, for as many entries as the trace
  holds (``ENTRIES``, default the trace's own count): the least any exact
  table of that size costs, before comparing a key or writing a slot.

The fold's table on the 300k-request day is 2M slots of 24 bytes (50 MB,
more than this machine's 32 MB L3); a compact one keyed on the whole hash
needs at least the keys' 16 bytes each for ~1M live keys, 16 MB at 50%
load, plus the holders' bits.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from replay.base.intrinsics import prefetch
from replay.base.jit import jit
from replay.engine.kernels import mix


def decode_cpu(path: str) -> tuple[float, int]:
    """The thread's CPU seconds to stream ``path``'s batches, and its hash entries."""
    pf = pq.ParquetFile(path)
    entries = 0
    c0 = time.thread_time()
    for i in range(pf.num_row_groups):
        for batch in pf.iter_batches(batch_size=1 << 20, row_groups=[i], use_threads=False):
            entries += int(pc.sum(pc.list_value_length(batch.column("block_hashes"))).as_py() or 0)
    return time.thread_time() - c0, entries


@jit(nogil=True)
def _probes(table: Any, n: int, ahead: int) -> Any:
    mask = np.uint64(table.shape[0] - 1)
    acc = np.uint64(0)
    for h in range(ahead):
        prefetch(table, np.int64(mix(np.uint64(h)) & mask))
    for h in range(n):
        prefetch(table, np.int64(mix(np.uint64(h + ahead)) & mask))
        acc ^= table[np.int64(mix(np.uint64(h)) & mask)]
    return acc


def probe_cpu(entries: int, table_bytes: int) -> float:
    """The thread's CPU seconds for ``entries`` random probes into a table of
    ``table_bytes`` (a power of two), page faults excluded."""
    table = np.ones(table_bytes // 8, dtype=np.uint64)
    _probes(table, 1000, 16)  # compiled (or loaded) before the clock starts
    c0 = time.thread_time()
    _probes(table, entries, 16)
    return time.thread_time() - c0


def main() -> None:
    path = sys.argv[1]
    seconds, entries = decode_cpu(path)
    if len(sys.argv) > 2:
        entries = int(sys.argv[2])
    print(f"{path}: {entries:,} hash entries; pyarrow decode on one thread {seconds:.2f} s CPU")
    for mb in (8, 16, 32, 64):
        s = probe_cpu(entries, mb << 20)
        print(
            f"one probe an entry into {mb:2d} MB: {s:.2f} s CPU, {s / entries * 1e9:.1f} ns an "
            f"entry, {entries / s / 1e6:.0f}M entries a CPU second"
        )


if __name__ == "__main__":
    main()
