"""Who answers the lookups: the registry of coordinators, chosen by name
(``--coordinator``, the pytest plugin's ``--replay-coordinator``). What a
face or the engine needs to know of one is a field here, never a comparison
with its name."""

from __future__ import annotations

from dataclasses import dataclass

from replay.base.errors import Entry, by_name, named


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorKind(Entry):
    #: Answers with the installed vLLM's own classes: the oracle the
    #: reference is held to (it needs vLLM installed and a release the
    #: policies model).
    installed_vllm: bool
    #: Can answer on Ray workers (vLLM's classes run in the one process).
    on_ray: bool
    #: Its rules compile to the fixed point's tables (``replay.rules.compiled``);
    #: otherwise each lookup is answered by its own Python code.
    compiled: bool


REFERENCE = CoordinatorKind(
    name="reference",
    description="this project's coordinator: each release policy's semantics, step by step",
    installed_vllm=False,
    on_ray=True,
    compiled=True,
)
VLLM = CoordinatorKind(
    name="vllm",
    description="the installed vLLM's own coordinator, over the same store",
    installed_vllm=True,
    on_ray=False,
    compiled=False,
)
COORDINATORS: dict[str, CoordinatorKind] = by_name(REFERENCE, VLLM)
DEFAULT_COORDINATOR = REFERENCE.name


def get_coordinator(name: str | CoordinatorKind) -> CoordinatorKind:
    return name if isinstance(name, CoordinatorKind) else named(COORDINATORS, name, "coordinator")
