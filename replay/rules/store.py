"""The event-sourced store: a fold of store / remove / clear events.

The state is the set of present ``(group_id, hash)`` keys, kept as one set of
hashes per group. ``apply`` is the projection step; ``fold`` runs it over an
event log up to a point. This is the plain definition, used where one
lookup's state is shown (``replay explain``, ``replay state``); the replay
itself folds the same events in compiled code (``replay.engine.kernels``), and the
tests hold the two to identical answers.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from replay.base.errors import TraceError

H = TypeVar("H", bound=Hashable)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreEvent(Generic[H]):
    seq: int
    group_id: int
    hashes: Sequence[H]


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoveEvent(Generic[H]):
    seq: int
    group_id: int
    hashes: Sequence[H]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClearEvent:
    seq: int
    group_id: int | None  # None: every group


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupEvent(Generic[H]):
    seq: int
    request_id: str
    hashes: Sequence[H]
    max_length: int
    num_tokens: int | None = None
    observed_hit_tokens: int | None = None


class Store(Generic[H]):
    """Present keys per group, folded from the event log in ``seq`` order."""

    __slots__ = ("last_seq", "present")

    def __init__(self, num_groups: int) -> None:
        self.present: list[set[H]] = [set() for _ in range(num_groups)]
        self.last_seq: int | None = None

    def _advance(self, seq: int) -> None:
        if self.last_seq is not None and seq <= self.last_seq:
            raise TraceError(
                f"seq {seq}: out of order, expected a seq greater than {self.last_seq}"
            )
        self.last_seq = seq

    def apply(self, event: StoreEvent[H] | RemoveEvent[H] | ClearEvent) -> None:
        """Fold one event into the state. Storing a present key, or removing an
        absent one, is not an error (the format says so)."""
        self._advance(event.seq)
        if isinstance(event, StoreEvent):
            self.store(event.group_id, event.hashes)
        elif isinstance(event, RemoveEvent):
            self.remove(event.group_id, event.hashes)
        else:
            self.clear(event.group_id)

    # The state changes themselves, for callers that have already checked the
    # order (the engine's hot loop, which builds no event objects).
    def store(self, group_id: int, hashes: Iterable[H]) -> None:
        self.present[group_id].update(hashes)

    def remove(self, group_id: int, hashes: Iterable[H]) -> None:
        self.present[group_id].difference_update(hashes)

    def clear(self, group_id: int | None) -> None:
        for g, keys in enumerate(self.present):
            if group_id is None or g == group_id:
                keys.clear()

    def observe(self, seq: int) -> None:
        """Advance past an event that does not change the state (a lookup)."""
        self._advance(seq)

    def contains(self, group_id: int, block_hash: H) -> bool:
        return block_hash in self.present[group_id]

    def keys(self, group_id: int) -> frozenset[H]:
        return frozenset(self.present[group_id])

    def num_keys(self) -> list[int]:
        return [len(keys) for keys in self.present]


def fold(
    num_groups: int,
    events: Iterable[StoreEvent[H] | RemoveEvent[H] | ClearEvent | LookupEvent[H]],
    *,
    before: int | None = None,
) -> Store[H]:
    """The state after every cache event whose ``seq`` is below ``before``
    (all of them when ``before`` is None). Lookups advance the log but change
    nothing."""
    store: Store[H] = Store(num_groups)
    for event in events:
        if before is not None and event.seq >= before:
            break
        if isinstance(event, LookupEvent):
            store.observe(event.seq)
        else:
            store.apply(event)
    return store
