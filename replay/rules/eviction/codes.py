"""The eviction orders' names and codes (the compiled kernels take the code)."""

from __future__ import annotations

#: The eviction orders, in the order the options list them.
EVICTIONS = ("lru", "fifo", "lfu", "belady")
LRU, FIFO, LFU, BELADY = 0, 1, 2, 3
EVICTION_CODES = {"lru": LRU, "fifo": FIFO, "lfu": LFU, "belady": BELADY}
#: A next use that never comes (Belady's future past the last request).
NEVER = 1 << 62
