"""vLLM's side of the project, in one home.

- ``backend``: ``VllmCoordinator``, the installed vLLM's own lookup path
  behind the reference coordinator's interface (``--coordinator vllm``);
- ``plugin``: the recorder that runs inside vLLM (entry point
  ``vllm.general_plugins``);
- ``wire``: the constants the plugin and the recorder share.

Importing this package imports neither vLLM nor the backend: the plugin is
loaded in every vLLM process, so the names below resolve on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from replay.adapters.vllm.backend import VllmCoordinator, VllmStoreMirror, VllmUnavailable

__all__ = ["VllmCoordinator", "VllmStoreMirror", "VllmUnavailable"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from replay.adapters.vllm import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
