"""The code that faces an outside system, one package per system.

``replay.adapters.vllm``: the coordinator backend over vLLM's own classes,
the plugin that runs inside vLLM, and the wire constants they share. An
adapter may import the files, rules and base floors, never the engine,
what-if, sources or anything above (the import-linter contract).
"""
