"""Optional coordinators behind the reference ``Coordinator``'s interface.

``replay.format.backends.vllm.VllmCoordinator`` runs vLLM 0.33.0's own
``MooncakeStoreCoordinator``; vLLM is imported only when one is built, so
importing this package never needs vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from replay.format.backends.vllm import VllmCoordinator

__all__ = ["VllmCoordinator"]


def __getattr__(name: str) -> Any:
    if name == "VllmCoordinator":
        from replay.format.backends.vllm import VllmCoordinator

        return VllmCoordinator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
