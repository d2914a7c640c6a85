"""The live replay: one engine's store folded as its rows arrive, and each
lookup answered where it stands (``replay watch``, issue 33).

The same stages as the replay of a file (``replay.engine.shard``): the rows
are checked by the rules of the one validator every writer and reader uses
(a live source's plain rows as numpy columns, ``replay.format.columns``;
any other batch through ``validate_rows`` itself, which names a bad row),
folded by the compiled table (``KeyTable``) and answered by ``Answers``,
the one loop every replay shares; so a lookup answered live is answered
exactly as ``replay run`` answers it in the trace the rows make. The
results frame is made once for many engines (``live_results``). Nothing
is kept per lookup once it is answered (``Answers.take_parts``): the
memory is the store's, bounded by the engine's cache size, not by how
long it runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl
import pyarrow as pa

from replay.base.spec import TraceConfig
from replay.engine.answers import Answers, Outcomes, Variant, results_frame
from replay.engine.shard import ShardFold, scatter, scatter_columns
from replay.format.columns import row_columns
from replay.format.validate import validate_rows
from replay.format.writer import events_table
from replay.rules.coordinator import resolve_cache


class LiveFold:
    """One engine's store and its answers under one policy.

    ``feed`` takes the engine's rows in seq order (store / remove / clear /
    lookup, as the recorder makes them) and returns the answers of their
    lookups (the results columns without flags; ``replay.analysis.flags`` judges
    them). A clear row (an engine restart) empties the store as vLLM's new
    engine starts empty."""

    def __init__(
        self, config: TraceConfig, policy: str, *, cache: str | None = None, name: str = "<live>"
    ) -> None:
        self.config = config
        self.name = name
        self.variant = Variant(policy=policy, cache=resolve_cache(config, cache))
        self.answers = Answers(config, [self.variant], where=name)
        self._fold = ShardFold(config.num_groups)
        self._last_seq: int | None = None
        #: Rows folded, by kind (store, remove, clear, lookup).
        self.events: Counter[str] = Counter()

    @property
    def policy(self) -> str:
        return self.variant.policy

    @property
    def cache(self) -> str:
        return self.variant.cache

    @property
    def store_keys(self) -> int:
        """Distinct hashes some group of the store holds now."""
        return self._fold.table.num_keys

    @property
    def store_bytes(self) -> int:
        return self._fold.table.nbytes

    def _fold_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        needs_hashes = self.answers.needs_hashes
        cols = row_columns(rows, self.config, self._last_seq)
        if cols is not None:
            piece, lookups = scatter_columns(cols, lookup_hashes=needs_hashes)
            self._last_seq = cols.last_seq
        else:
            # Not of the plain form, or a rule broken: the table path, whose
            # validation names the row.
            table = events_table(rows, self.config)
            batch, self._last_seq = validate_rows(self.name, self.config, table, self._last_seq)
            (piece,), lookups = scatter(batch, 1, lookup_hashes=needs_hashes)
        self.answers.add(lookups, self._fold.fold(piece))
        self.events.update(lookups.counts)

    def feed(self, rows: Sequence[Mapping[str, Any]]) -> pl.DataFrame:
        """Fold ``rows`` in; the answers of their lookups, in seq order. Rows
        that break the format are a ``TraceError`` naming the seq."""
        return live_results([self.answer(rows)])

    def answer(self, rows: Sequence[Mapping[str, Any]]) -> LiveAnswers:
        """``feed`` without making the results frame: ``live_results`` makes
        one of many engines' answers (its cost is per frame)."""
        self._fold_rows(rows)
        (rows_taken, (outcomes,)) = self.answers.take_parts()
        return LiveAnswers(
            rows=rows_taken,
            outcomes=outcomes,
            variant=self.variant,
            alignment=self.answers.facts[0].alignment,
        )


@dataclass(frozen=True, slots=True)
class LiveAnswers:
    """One engine's answers of one batch, before their results frame."""

    rows: list[pl.DataFrame | pa.Table]
    outcomes: Outcomes
    variant: Variant
    alignment: int

    @property
    def lookups(self) -> int:
        return sum(len(r) for r in self.rows)


def live_results(answers: Sequence[LiveAnswers]) -> pl.DataFrame:
    """One results frame (the answers and facts, no flags) of ``answers``,
    in their order; they share one variant and alignment (one release's
    policy in one cache)."""
    first = answers[0]
    if any(a.variant != first.variant or a.alignment != first.alignment for a in answers):
        raise ValueError("live_results: answers of different variants make different frames")
    if len(answers) == 1:
        outcomes = first.outcomes
    else:
        outcomes = Outcomes(first.outcomes.num_groups)
        for a in answers:
            outcomes.add_rows(a.outcomes.table())
    rows = [r for a in answers for r in a.rows]
    return results_frame(rows, outcomes, first.variant, first.alignment)
