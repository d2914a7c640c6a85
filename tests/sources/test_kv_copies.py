"""The copy counts of one group (``replay.sources.kv_copies``): the compiled
table of vLLM's integer hashes and the ``Counter`` of other widths, against
a plain count kept here one key at a time."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np

from replay.sources.kv_copies import CopyCounts, CopyKey


def _remove_one_by_one(counts: Counter[CopyKey], keys: list[CopyKey]) -> list[int] | None:
    gone = []
    for i, key in enumerate(keys):
        left = counts.get(key, 0) - 1
        if left > 0:
            counts[key] = left
        else:
            counts.pop(key, None)
            gone.append(i)
    return None if keys and len(gone) == len(keys) else gone


def test_a_copy_left_keeps_its_key_and_the_last_one_takes_it() -> None:
    c = CopyCounts()
    c.add([5, 5, 2**64 - 1, b"\x01\x02\x03"])
    assert sorted(c.items(), key=repr) == [(18446744073709551615, 1), (5, 2), (b"\x01\x02\x03", 1)]
    # 5 keeps a copy; the absent 7 and the last copy of 2**64 - 1 go.
    assert c.remove([5, 7, 2**64 - 1]) == [1, 2]
    assert c.remove([5, 5]) is None  # the second found none: gone as well
    assert c.remove([]) == []
    assert c.remove_ints(np.array([9], dtype=np.uint64)) is None
    assert list(c.items()) == [(b"\x01\x02\x03", 1)]
    c.clear()
    assert list(c.items()) == []


def test_random_streams_count_as_one_key_at_a_time() -> None:
    rng = random.Random(3)
    for _ in range(60):
        table, plain = CopyCounts(), Counter[CopyKey]()
        for _step in range(rng.randint(1, 300)):
            choices: list[list[CopyKey]] = [
                [rng.randrange(40), rng.randrange(2**64), bytes([rng.randrange(3)]) * 3]
                for _ in range(rng.randint(0, 40))
            ]
            keys = [rng.choice(c) for c in choices]
            if rng.random() < 0.5:
                table.add(keys)
                plain.update(keys)
            else:
                assert table.remove(keys) == _remove_one_by_one(plain, keys)
            if rng.random() < 0.01:
                table.clear()
                plain.clear()
        # Grown past its first size many times over, tombstones and all.
        assert dict(table.items()) == {k: n for k, n in plain.items() if n > 0}


def test_keys_of_one_kind_count_as_mixed_ones_do() -> None:
    rng = random.Random(8)
    for kind in ("ints", "bytes"):
        table, plain = CopyCounts(), Counter[CopyKey]()
        for _step in range(300):
            keys: list[CopyKey] = (
                [rng.randrange(30) for _ in range(rng.randint(1, 20))]
                if kind == "ints"
                else [bytes([rng.randrange(30)]) * 16 for _ in range(rng.randint(1, 20))]
            )
            if rng.random() < 0.5:
                table.add(keys, uniform=True)
                plain.update(keys)
            else:
                assert table.remove(keys, uniform=True) == _remove_one_by_one(plain, keys)
        assert dict(table.items()) == {k: n for k, n in plain.items() if n > 0}


def _homes_near_the_end(rng: random.Random, count: int) -> list[int]:
    """Keys whose probes start in the first table's (1,024 slots) last and
    first few slots: long runs of collisions that wrap around its end."""
    mix, keys = 0x9E3779B97F4A7C15, list[int]()
    while len(keys) < count:
        k = rng.randrange(2**64)
        if (((k * mix) % 2**64) >> 17) & 1023 in (1021, 1022, 1023, 0, 1):
            keys.append(k)
    return keys


def test_removals_in_colliding_runs_that_wrap_keep_every_key_found() -> None:
    """A removal leaves no tombstone (the keys after it on their probe paths
    move back): in runs of keys of a few neighbouring homes, wrapping past
    the table's end, every key is still found after every step, exactly
    once."""
    rng = random.Random(21)
    for _ in range(30):
        pool = _homes_near_the_end(rng, 40) + [rng.randrange(2**64) for _ in range(5)]
        table, plain = CopyCounts(), Counter[CopyKey]()
        for _step in range(200):
            keys: list[CopyKey] = [rng.choice(pool) for _ in range(rng.randint(1, 8))]
            if rng.random() < 0.5:
                table.add(keys, uniform=True)
                plain.update(keys)
            else:
                assert table.remove(keys, uniform=True) == _remove_one_by_one(plain, keys)
            assert sorted(table.items()) == sorted((k, n) for k, n in plain.items() if n > 0)
