"""The eviction orders, one module each (``lru``, ``fifo``, ``lfu``,
``belady``), their compiled containers (``queue``) and the Python models'
class over them all (``order.EvictionOrder``)."""

from replay.rules.eviction.codes import BELADY, EVICTION_CODES, EVICTIONS, FIFO, LFU, LRU, NEVER
from replay.rules.eviction.order import EvictionOrder

__all__ = ["BELADY", "EVICTIONS", "EVICTION_CODES", "FIFO", "LFU", "LRU", "NEVER", "EvictionOrder"]
