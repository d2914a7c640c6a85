"""Layer base: group specs and trace config, the project's errors, signal
handling, and the stdlib-only vLLM plugin. Imports the stdlib and numpy only
(docs/architecture.md)."""
