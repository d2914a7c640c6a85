"""cache-trace-replay: replay KV-cache block events through vLLM's hybrid
prefix-cache coordinator and flag every lookup whose hit is wrong."""

from importlib.metadata import PackageNotFoundError, version

try:
    # pyproject.toml is the one place the version is written.
    __version__ = version("cache-trace-replay")
except PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
    __version__ = "0+unknown"
