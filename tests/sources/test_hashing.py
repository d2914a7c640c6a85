"""Unit keys -> digests (``replay.sources.hashing``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from replay.sources.hashing import DigestTable, digest_keys, lane_salts


@pytest.mark.parametrize("window", [1 << 16, 100_000])
def test_digest_table_matches_the_digester(window: int) -> None:
    salts = lane_salts(3, 2)

    def digest(keys: Any) -> Any:
        return digest_keys(keys, salts)

    table = DigestTable(digest, window)
    rng = np.random.default_rng(0)
    top = 0
    for step in range(200):
        top += int(rng.integers(0, 50_000))
        keys = rng.integers(0, top + 1, int(rng.integers(0, 3000))).astype(np.int64)
        if step % 2:
            keys = np.append(keys, top)
        assert np.array_equal(table(keys), digest(keys))


def test_digests_are_distinct_and_seeded() -> None:
    keys = np.arange(100_000, dtype=np.int64)
    a = digest_keys(keys, lane_salts(0, 2))
    assert a.shape == (100_000, 16)
    assert len({bytes(row) for row in a}) == 100_000
    assert not np.array_equal(a, digest_keys(keys, lane_salts(1, 2)))
    assert np.array_equal(a, digest_keys(keys, lane_salts(0, 2)))
