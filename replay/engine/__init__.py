"""Layer engine: the replay of a trace (answers, shards, the compiled store
fold, the Ray cluster). Imports format, rules and base; never the what-if or
the sources (docs/architecture.md)."""
