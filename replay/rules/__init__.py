"""Layer rules (pure): the lookup coordinator (finders, fixed point, cache
rules, vLLM release policies), the store rules, the block pool, the store's
key state. Imports base only; never pyarrow, polars or click
(docs/architecture.md)."""
