"""cache-trace-replay: replay KV-cache block events through vLLM's hybrid
prefix-cache coordinator and flag every lookup whose hit is wrong."""

from __future__ import annotations

from functools import cache


@cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        # pyproject.toml is the one place the version is written.
        return version("cache-trace-replay")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
        return "0+unknown"


def __getattr__(name: str) -> str:
    # ``__version__`` is read from the installed metadata when first asked
    # for: `replay --help` does not pay for importlib.metadata.
    if name == "__version__":
        return _version()
    raise AttributeError(f"module 'replay' has no attribute {name!r}")
