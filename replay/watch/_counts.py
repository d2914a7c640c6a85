"""What a watch counts per engine: plain numbers (the status line, the
summary, the tests) that the Prometheus exporter mirrors."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from replay.analysis.flags import by_severity, severity

#: Lags kept for the status line's and the summary's percentiles (the
#: Prometheus histogram keeps the whole distribution in buckets).
LAG_WINDOW = 100_000


class LagWindow:
    """One engine's latest lags in seconds, at most ``size`` of them: a ring
    of float64 (8 bytes a lag; a deque of Python floats took 32, 3.2 MB an
    engine once full, so a fleet's windows outgrew its stores), allocated at
    the first lag and touched only as it fills."""

    __slots__ = ("_len", "_next", "_ring", "size")

    def __init__(self, size: int = LAG_WINDOW) -> None:
        self.size = size
        self._ring: npt.NDArray[np.float64] | None = None
        self._next = 0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def extend(self, lags: Sequence[float] | npt.NDArray[np.float64]) -> None:
        new = np.asarray(lags, dtype=np.float64)[-self.size :]
        n = new.shape[0]
        if not n:
            return
        if self._ring is None:
            self._ring = np.empty(self.size, dtype=np.float64)
        ring, at = self._ring, self._next
        first = min(n, self.size - at)
        ring[at : at + first] = new[:first]
        ring[: n - first] = new[first:]
        self._next = (at + n) % self.size
        self._len = min(self.size, self._len + n)

    def latest(self, count: int) -> npt.NDArray[np.float64]:
        """The newest ``count`` lags (fewer when it holds fewer), oldest first."""
        count = min(count, self._len)
        if self._ring is None or count <= 0:
            return np.empty(0, dtype=np.float64)
        start = self._next - count
        if start >= 0:
            return self._ring[start : self._next].copy()
        return np.concatenate((self._ring[start:], self._ring[: self._next]))

    def values(self) -> npt.NDArray[np.float64]:
        """Every lag held, oldest first."""
        return self.latest(self._len)


@dataclass(slots=True)
class EngineCounts:
    """One engine's counters since the watch started."""

    lookups: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    observed_hit_tokens: int = 0
    #: Lookups whose observed hit (what vLLM served) differs from the
    #: policy's; ``observed_over``: of them, served past the policy's hit.
    observed_mismatch: int = 0
    observed_over: int = 0
    flagged_lookups: int = 0
    #: (flag, severity) -> occurrences (a lookup with two flags counts in both).
    flags: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: The worst severity of each flagged lookup -> lookups.
    flagged_by_severity: Counter[str] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)
    gaps: int = 0
    missing_batches: int = 0
    restarts: int = 0
    #: Messages dropped before they could be used (ZMQ high-water marks,
    #: lost plugin messages, KV messages that came before the engine facts).
    dropped: int = 0
    #: Connections dropped (a message above --max-record-bytes, or the
    #: publisher went away) and made again.
    dropped_connections: int = 0
    store_keys: int = 0
    lags: LagWindow = field(default_factory=LagWindow)

    def lag_percentiles(self) -> tuple[float | None, float | None]:
        if not len(self.lags):
            return None, None
        p50, p99 = np.percentile(self.lags.values(), [50, 99])
        return float(p50), float(p99)

    def to_json(self) -> dict[str, Any]:
        p50, p99 = self.lag_percentiles()
        return {
            "lookups": self.lookups,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "observed_hit_tokens": self.observed_hit_tokens,
            "observed_mismatch": self.observed_mismatch,
            "observed_over": self.observed_over,
            "flagged_lookups": self.flagged_lookups,
            # As every command's ``flags``: worst severity first (docs/json.md).
            "flags": [
                {"flag": f, "severity": severity(f), "lookups": self.flags[(f, severity(f))]}
                for f in by_severity([f for f, _ in self.flags])
            ],
            "flagged_by_severity": dict(self.flagged_by_severity),
            "events": dict(self.events),
            "gaps": self.gaps,
            "missing_batches": self.missing_batches,
            "restarts": self.restarts,
            "dropped": self.dropped,
            "dropped_connections": self.dropped_connections,
            "store_keys": self.store_keys,
            "lag_p50_seconds": p50,
            "lag_p99_seconds": p99,
        }
