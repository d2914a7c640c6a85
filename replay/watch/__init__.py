"""Layer watch: ``replay watch``, the live check of a running fleet (issue 33).
Composes the sources (the engines heard live), the engine (the live fold) and
the analyses (the flags); only the faces import it (docs/architecture.md)."""

from replay.watch._metrics import Metrics
from replay.watch._service import Watch, WatchOptions, WatchSummary, watch

__all__ = ["Metrics", "Watch", "WatchOptions", "WatchSummary", "watch"]
