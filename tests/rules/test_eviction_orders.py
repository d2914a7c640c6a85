"""One contract for every eviction order (``replay.rules.eviction``): the
Python models' ``EvictionOrder`` and the compiled steps the what-if's kernels
run (``lru``, and ``fifo``, ``lfu``, ``belady`` over the bucket ``queue``)
must evict exactly as one reference does, over random operation sequences.

The reference is the definition, written plainly: the queued items, each
with the key it was queued under; a pop takes the smallest key. The key is
(order value, add stamp) with the order value: ``lru`` none (the add order),
``fifo`` the arrival of the item's content, ``lfu`` its uses since then,
``belady`` minus its next use (never used again: before all); ties go
oldest first, or newest first where asked (Belady in the Mooncake store).
An item is re-filed when the use it was filed under comes.

The kernels themselves are checked against the Python models they port
(``tests/whatif/test_whatif_kernel.py``, ``tests/whatif/test_whatif_mooncake_kernel.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from replay.rules.eviction import EVICTIONS, NEVER, EvictionOrder, belady, fifo, lfu, lru, queue

ITEMS = 12
#: Requests of the random runs (Belady's horizon).
HORIZON = 40

NextUse = Callable[[int, int], int]


class Reference:
    """The definition (see the module docstring)."""

    def __init__(self, eviction: str, next_use: NextUse, newest_first: bool) -> None:
        self.eviction, self.next_use, self.newest_first = eviction, next_use, newest_first
        self.now = 0
        self.stamp = 0
        self.born: dict[int, int] = {}
        self.uses: dict[int, int] = {}
        self.queued: dict[int, tuple[int, int]] = {}

    def reset(self, item: int) -> None:
        self.stamp += 1
        self.born[item] = self.stamp
        self.uses[item] = 0

    def used(self, item: int) -> None:
        self.uses[item] += 1

    def add(self, item: int) -> None:
        self.stamp += 1
        value = {
            "lru": 0,
            "fifo": self.born[item],
            "lfu": self.uses[item],
            "belady": -self.next_use(item, self.now),
        }[self.eviction]
        self.queued[item] = (value, -self.stamp if self.newest_first else self.stamp)

    def discard(self, item: int) -> None:
        del self.queued[item]

    def refile(self, item: int) -> None:
        self.discard(item)
        self.add(item)

    def pop(self) -> int:
        item = min(self.queued, key=self.queued.__getitem__)
        del self.queued[item]
        return item


class Python:
    """``EvictionOrder``, as the block pool and the Mooncake store drive it
    (over the same compiled steps, called from Python, on arrays it grows)."""

    def __init__(self, eviction: str, next_use: NextUse, newest_first: bool) -> None:
        self.order = EvictionOrder(
            eviction, next_use if eviction == "belady" else None, newest_first=newest_first
        )

    @property
    def now(self) -> int:
        return self.order.now

    @now.setter
    def now(self, value: int) -> None:
        self.order.now = value

    def reset(self, item: int) -> None:
        self.order.reset(item)

    def used(self, item: int) -> None:
        self.order.used(item)

    def add(self, item: int) -> None:
        self.order.add(item)

    def discard(self, item: int) -> None:
        self.order.discard(item)

    def refile(self, item: int) -> None:
        self.order.refile(item)

    def pop(self) -> int:
        return self.order.pop()


class Grown:
    """``EvictionOrder`` over items and next uses past its first arrays
    (items spread apart, times stretched), so it grows them mid-run: more
    rows, more buckets, a later Belady horizon."""

    SPREAD, STRETCH = 700, 300

    def __init__(self, eviction: str, next_use: NextUse, newest_first: bool) -> None:
        def stretched(item: int, now: int) -> int:
            use = next_use(item // self.SPREAD, now // self.STRETCH)
            return use if use >= NEVER else use * self.STRETCH

        self.order = EvictionOrder(
            eviction, stretched if eviction == "belady" else None, newest_first=newest_first
        )

    @property
    def now(self) -> int:
        return self.order.now // self.STRETCH

    @now.setter
    def now(self, value: int) -> None:
        self.order.now = value * self.STRETCH

    def reset(self, item: int) -> None:
        self.order.reset(item * self.SPREAD)

    def used(self, item: int) -> None:
        self.order.used(item * self.SPREAD)

    def add(self, item: int) -> None:
        self.order.add(item * self.SPREAD)

    def discard(self, item: int) -> None:
        self.order.discard(item * self.SPREAD)

    def refile(self, item: int) -> None:
        self.order.refile(item * self.SPREAD)

    def pop(self) -> int:
        return self.order.pop() // self.SPREAD


class Compiled:
    """The compiled steps over the kernels' arrays, called one by one; items
    are queued as item + 1 (the bucket lists end at 0), as the Mooncake
    kernel queues them."""

    def __init__(self, eviction: str, next_use: NextUse, newest_first: bool) -> None:
        self.eviction, self.next_use, self.newest_first = eviction, next_use, newest_first
        self.now = 0
        self.st = queue.new_state(HORIZON)
        self.nodes = np.zeros((ITEMS + 1, queue.NODE_COLS), dtype=np.int64)
        self.side = np.zeros((ITEMS + 1, 2), dtype=np.int64)
        # every operation at most one arrival or one use
        self.universe = {
            "lru": 1,
            "fifo": fifo.universe(OPERATIONS),
            "lfu": OPERATIONS + 2,
            "belady": belady.universe(HORIZON),
        }[eviction]
        self.qh = np.zeros((self.universe, 2), dtype=np.int64)
        self.bits = queue.bits_init(self.st, self.universe)

    def reset(self, item: int) -> None:
        fifo.arrive(self.st, self.side, item + 1)
        lfu.arrive(self.side, item + 1)

    def used(self, item: int) -> None:
        lfu.used(self.side, item + 1)

    def add(self, item: int) -> None:
        q = item + 1
        if self.eviction == "lru":
            lru.append(self.st, self.nodes, q)
            return
        if self.eviction == "fifo":
            bucket = fifo.bucket(self.side, q)
        elif self.eviction == "lfu":
            bucket = lfu.bucket(self.side, q)
        else:
            bucket = belady.bucket(self.next_use(item, self.now), HORIZON)
        step = queue.add_first if self.newest_first else queue.add
        step(self.st, self.nodes, self.qh, self.bits, q, bucket)

    def discard(self, item: int) -> None:
        if self.eviction == "lru":
            lru.unlink(self.st, self.nodes, item + 1)
        else:
            queue.unlink(self.st, self.nodes, self.qh, self.bits, item + 1)

    def refile(self, item: int) -> None:
        self.discard(item)
        self.add(item)

    def pop(self) -> int:
        if self.eviction == "lru":
            return int(lru.pop(self.st, self.nodes)) - 1
        return int(queue.pop(self.st, self.nodes, self.qh, self.bits)) - 1

    def __len__(self) -> int:
        return int(self.st[queue.LEN])


OPERATIONS = 300
MODELS: dict[str, Any] = {"python": Python, "python-grown": Grown, "compiled": Compiled}
#: Every order oldest first among equals, and Belady newest first (the Mooncake store).
CASES = [(e, False) for e in EVICTIONS] + [("belady", True)]


def _future(rng: random.Random) -> NextUse:
    """Each item's uses: a few random requests of the horizon."""
    uses = {i: sorted(rng.sample(range(1, HORIZON), rng.randint(0, 6))) for i in range(ITEMS)}

    def next_use(item: int, now: int) -> int:
        return next((u for u in uses[item] if u > now), NEVER)

    return next_use


def _run(model: str, eviction: str, newest_first: bool, seed: int) -> tuple[list[int], list[int]]:
    """The victims of one random sequence, by the model and by the reference."""
    rng = random.Random(seed)
    next_use = _future(rng)
    mine = MODELS[model](eviction, next_use, newest_first)
    ref = Reference(eviction, next_use, newest_first)
    queued: set[int] = set()
    held: set[int] = set()  # items with content (reset)
    filed: dict[int, int] = {}  # belady: the use an item was filed under
    got: list[int] = []
    want: list[int] = []
    now = 0
    for _ in range(OPERATIONS):
        op = rng.choice(("reset", "used", "add", "add", "discard", "pop", "pop", "time"))
        item = rng.randrange(ITEMS)
        if op == "reset" and item not in queued:
            for order in (mine, ref):
                order.reset(item)
            held.add(item)
        elif op == "used" and item in held:
            # a use: the pool counts it while a request holds the block, the
            # Mooncake store while it is queued (then re-files it)
            for order in (mine, ref):
                order.used(item)
            if item in queued and eviction != "fifo":
                for order in (mine, ref):
                    order.discard(item)
                    order.add(item)
                filed[item] = next_use(item, now)
        elif op == "add" and item in held and item not in queued:
            for order in (mine, ref):
                order.add(item)
            queued.add(item)
            filed[item] = next_use(item, now)
        elif op == "discard" and item in queued:
            for order in (mine, ref):
                order.discard(item)
            queued.discard(item)
        elif op == "pop" and queued:
            got.append(mine.pop())
            want.append(ref.pop())
            queued.discard(want[-1])
            held.discard(want[-1])
        elif op == "time" and now < HORIZON - 1:
            # The next request: the items filed under its use are re-filed
            # under their next one (the kernels' and the models' step).
            now += 1
            for order in (mine, ref):
                order.now = now
            for it in sorted(queued):
                if eviction == "belady" and filed[it] == now:
                    for order in (mine, ref):
                        order.refile(it)
                    filed[it] = next_use(it, now)
    while queued:
        got.append(mine.pop())
        want.append(ref.pop())
        queued.discard(want[-1])
    if isinstance(mine, Compiled):
        assert len(mine) == 0
    return got, want


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("eviction", "newest_first"), CASES)
@pytest.mark.parametrize("seed", range(25))
def test_every_order_evicts_as_its_definition(
    model: str, eviction: str, newest_first: bool, seed: int
) -> None:
    got, want = _run(model, eviction, newest_first, seed)
    assert got == want
    assert len(want) >= 10  # the sequence evicts, not only fills


def test_the_reference_is_the_definition() -> None:
    """The reference's victims on a hand-made sequence, per order."""
    uses = {0: [5], 1: [], 2: [3], 3: [9]}

    def next_use(item: int, now: int) -> int:
        return next((u for u in uses[item] if u > now), NEVER)

    def victims(eviction: str, newest_first: bool = False) -> list[int]:
        ref = Reference(eviction, next_use, newest_first)
        for item in (0, 1, 2, 3):
            ref.reset(item)
        for item in (2, 2, 0):
            ref.used(item)
        for item in (3, 0, 1, 2):
            ref.add(item)
        return [ref.pop() for _ in range(4)]

    assert victims("lru") == [3, 0, 1, 2]
    assert victims("fifo") == [0, 1, 2, 3]
    assert victims("lfu") == [3, 1, 0, 2]
    assert victims("belady") == [1, 3, 0, 2]
    assert victims("belady", newest_first=True) == [1, 3, 0, 2]
