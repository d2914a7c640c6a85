"""A watch's per-engine lag window (``replay.watch._counts.LagWindow``): the
newest lags in order across the ring's wrap, never more than its size, and
8 bytes a lag."""

from __future__ import annotations

import numpy as np

from replay.watch._counts import LAG_WINDOW, EngineCounts, LagWindow


def test_the_window_keeps_the_newest_lags_in_order_across_the_wrap() -> None:
    window = LagWindow(5)
    assert len(window) == 0 and window.latest(3).tolist() == []
    window.extend([1.0, 2.0, 3.0])
    assert window.values().tolist() == [1.0, 2.0, 3.0]
    window.extend(np.array([4.0, 5.0, 6.0, 7.0]))
    assert len(window) == 5
    assert window.values().tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert window.latest(2).tolist() == [6.0, 7.0]
    assert window.latest(9).tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]
    window.extend([float(x) for x in range(10, 22)])  # more than it holds, at once
    assert window.values().tolist() == [17.0, 18.0, 19.0, 20.0, 21.0]
    window.extend([])
    assert window.latest(1).tolist() == [21.0]


def test_a_full_window_is_eight_bytes_a_lag_and_its_percentiles_are_its_own() -> None:
    counts = EngineCounts()
    assert counts.lag_percentiles() == (None, None)
    counts.lags.extend(np.arange(LAG_WINDOW + 500, dtype=np.float64) / 1000)
    assert len(counts.lags) == LAG_WINDOW
    assert counts.lags.values().nbytes == 8 * LAG_WINDOW
    p50, p99 = counts.lag_percentiles()
    held = np.arange(500, LAG_WINDOW + 500) / 1000
    assert (p50, p99) == (float(np.percentile(held, 50)), float(np.percentile(held, 99)))
