"""The options of the one replay call (``replay.engine.run.replay``), in one
frozen dataclass: a new replay option is one field here and its use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.engine.answers import Progress, Variant
from replay.rules.coordinator import DEFAULT_COORDINATOR, DEFAULT_POLICY, resolve_cache


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayOptions:
    """How to replay a trace: under which variants, where, and what to keep.

    The variants are every policy in every cache (policy by policy), each
    answered by ``coordinator``; ``variants`` names them one by one instead
    (``replay diff``'s two sides). A cache of None in ``caches`` is the
    trace's own (``resolve_cache``). Every variant comes from one fold of the trace."""

    policies: tuple[str, ...] = (DEFAULT_POLICY,)
    caches: tuple[str | None, ...] = (None,)
    coordinator: str = DEFAULT_COORDINATOR
    #: Explicit variants, each a policy in a named cache by a coordinator;
    #: replaces the above.
    variants: tuple[Variant, ...] = ()
    #: Also keep, per lookup and group, which hash units the store held.
    unit_present: bool = False
    #: Key shards of the store in this process (one: the serial replay).
    shards: int = 1
    #: Replay on Ray, with this many key shards (a local Ray of as many CPUs
    #: unless ``ray_address`` names a cluster).
    workers: int | None = None
    #: Replay on this Ray cluster (``auto``: the one ``ray start`` runs here).
    ray_address: str | None = None
    progress: Callable[[Progress], None] | None = field(default=None, compare=False)
    progress_every: float = 0.2
    #: On Ray, receives the bytes shipped (the benchmark's figures).
    stats: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def on_ray(self) -> bool:
        return self.workers is not None or self.ray_address is not None

    def variants_for(self, config: TraceConfig) -> list[Variant]:
        """The variants for a trace of ``config``, each cache resolved as the
        serial run does, duplicates dropped."""
        if self.variants:  # as named, even twice the same (``replay diff``)
            return [
                Variant(
                    policy=v.policy, cache=resolve_cache(config, v.cache), coordinator=v.coordinator
                )
                for v in self.variants
            ]
        if not self.policies or not self.caches:
            raise ReplayError("no policy or cache to replay under")
        used = [resolve_cache(config, c) for c in self.caches]
        pairs = dict.fromkeys((p, c) for p in self.policies for c in used)
        return [Variant(policy=p, cache=c, coordinator=self.coordinator) for p, c in pairs]
