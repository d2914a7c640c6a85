"""Layer format: the trace, results and sweep files, trace directories,
validation, atomic output paths, and the vLLM backend of the coordinator.
Imports rules and base (docs/architecture.md)."""
