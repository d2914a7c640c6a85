"""The options of the one what-if call (``replay.whatif.run.whatif``), in one
frozen dataclass: a new what-if option is one field here and its use."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from replay.base.spec import TraceConfig
from replay.base.units import Capacity
from replay.rules.coordinator import DEFAULT_POLICY

if TYPE_CHECKING:
    from replay.whatif.sweep import Sweep

#: ``progress(requests_done, requests_total, runs_done, runs_total)``
SweepProgress = Callable[[int, int, int, int], None]
#: The analyses' judgement of a run: its rows with, in place of their
#: ``facts``, one count per flag kind (``replay.analysis.flags.sweep_flag_counts``).
CountFlags = Callable[[Sequence[dict[str, Any]], TraceConfig], list[dict[str, Any]]]


@dataclass(frozen=True, slots=True, kw_only=True)
class WhatifOptions:
    """Which caches to simulate a trace's requests against, and what to keep.

    One run per capacity and eviction order (capacity by capacity), each
    under the release ``policy`` in the cache ``cache`` (None: the trace's
    own, ``resolve_cache``), plus one unbounded run for the ceiling."""

    #: The cache sizes, all in one unit (blocks, bytes or a percentage of the
    #: trace's working set).
    capacities: tuple[Capacity, ...]
    #: Eviction orders (``replay.rules.eviction.EVICTIONS``), in order.
    evictions: tuple[str, ...] = ("lru",)
    cache: str | None = None
    #: The vLLM release whose hits and stores are simulated.
    policy: str = DEFAULT_POLICY
    #: The vLLM version the policy was chosen by, recorded in the metadata.
    vllm_version: str | None = None
    retention_interval: int | None = 0
    max_num_batched_tokens: int = 8192
    #: Bytes of one block of each group, as text (one size, or one per group,
    #: comma-separated); else sized from ``model_config`` (a Hugging Face
    #: config.json); else the trace's ``source.page_bytes``.
    page_bytes: str | None = None
    model_config: str | os.PathLike[str] | None = None
    #: Simulate this fraction of the sessions against the same fraction of
    #: each capacity (a deterministic sample); None: every request.
    sample: float | None = None
    #: Runs in parallel.
    jobs: int = 1
    #: Write the sweep file here (atomically; on a signal, the runs that
    #: finished, marked partial).
    output: str | os.PathLike[str] | None = None
    #: Also write each run as a trace in this new directory.
    emit_traces: str | os.PathLike[str] | None = None
    #: Judge each run's facts (the what-if never imports its judge); None:
    #: the rows keep their facts and the file has no flag counts.
    count_flags: CountFlags | None = field(default=None, compare=False)
    progress: SweepProgress | None = field(default=None, compare=False)
    #: Hears of the partial sweep written on a signal or an error.
    on_partial: Callable[[Sweep], None] | None = field(default=None, compare=False)
