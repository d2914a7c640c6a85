"""Layer what-if: the capacity simulation (requests, the sweep loop).
Imports format, rules and base; never the engine or the sources
(docs/architecture.md)."""
