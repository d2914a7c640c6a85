"""cache-trace-replay: replay KV-cache block events through vLLM's hybrid
prefix-cache coordinator and flag every lookup whose hit is wrong."""

__version__ = "0.1.0"
